#include "comm/quorum.hpp"

#include <algorithm>
#include <thread>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "comm/tcp_store.hpp"
#include "util/clock.hpp"
#include "util/error.hpp"

namespace dtrain {
namespace {

using json = nlohmann::json;

const char* kJoins = "ft/joins";  // a count: every request adds one
const char* kFinished = "ft/finished";  // the run is complete

std::string quorum_key(int64_t id) { return fmt::format("ft/quorum/{}", id); }

bool holds(const std::vector<int64_t>& v, int64_t x) {
  return std::find(v.begin(), v.end(), x) != v.end();
}
std::vector<int64_t> sorted_union(std::vector<int64_t> a, const std::vector<int64_t>& b) {
  a.insert(a.end(), b.begin(), b.end());
  std::sort(a.begin(), a.end());
  a.erase(std::unique(a.begin(), a.end()), a.end());
  return a;
}
std::string join_key(int64_t replica, int64_t place) {
  return fmt::format("ft/join/{}/{}", replica, place);
}
std::string vote_key(int64_t quorum, int64_t step, int64_t member, int64_t place) {
  return fmt::format("ft/vote/{}/{}/{}/{}", quorum, step, member, place);
}

std::vector<uint8_t> bytes(const std::string& s) { return {s.begin(), s.end()}; }
std::string text(const std::vector<uint8_t>& b) { return {b.begin(), b.end()}; }

const char* kVoteNames[] = {"ok", "ok+join", "leave", "leaving", "failed", "dead"};
Vote vote_named(const std::string& s) {
  for (int v = 0; v < 6; ++v)
    if (s == kVoteNames[v]) return Vote(v);
  throw DistError(fmt::format("fault tolerance: a vote reads '{}' in the store", s));
}

Quorum from_record(int64_t id, const json& j) {
  return Quorum{id, j.at("step").get<int64_t>(), j.at("members").get<std::vector<int64_t>>(),
                j.at("joining").get<std::vector<int64_t>>(), j.at("source").get<int64_t>(),
                j.at("writer").get<int64_t>()};
}

}  // namespace

ReplicaAgreement::ReplicaAgreement(c10d::Store& store, int64_t replica, int64_t replicas,
                                   DeadAmong dead,
                                   std::chrono::milliseconds timeout,
                                   std::chrono::milliseconds poll, Place place, int64_t starting)
    : store_(store), replica_(replica), replicas_(replicas),
      starting_(starting > 0 ? starting : replicas), place_(place), dead_(std::move(dead)),
      timeout_(timeout), poll_(poll) {}

Quorum ReplicaAgreement::first(int64_t starting, int64_t step) {
  Quorum q;
  q.step = step;
  for (int64_t r = 0; r < starting; ++r) q.members.push_back(r);
  return q;
}

bool ReplicaAgreement::stored(const std::string& key) { return store_.check({key}); }

int64_t ReplicaAgreement::newest_quorum(int64_t from) {
  while (stored(quorum_key(from + 1))) ++from;
  return from;
}

std::string ReplicaAgreement::get(const std::string& key) {
  try {
    store_.wait({key}, timeout_);
  } catch (const std::exception& e) {  // the store's timeout, or its host gone
    throw DistError(fmt::format("fault tolerance: replica {}: waiting up to {} s for '{}' in "
                                "the store: {}", replica_, timeout_.count() / 1000.0, key,
                                first_line(e.what())));
  }
  return text(store_.get(key));
}

// The request first, then the count: a proposer reads the count before the requests, so a
// request it counted is one it sees. Quorums stored before the request cannot hold it.
void ReplicaAgreement::ask_to_join() {
  join_after_ = newest_quorum(0);
  store_.set(join_key(replica_, place_.index), bytes("1"));
  store_.add(kJoins, 1);
}

void ReplicaAgreement::finished(const std::string& how) { store_.set(kFinished, bytes(how)); }

std::string ReplicaAgreement::ended() {
  return stored(kFinished) ? text(store_.get(kFinished)) : std::string();
}

bool ReplicaAgreement::wait_until_left_out(const std::function<bool()>& give_up) {
  int64_t newest = 0;  // quorum 0, the starting replicas, is the one nothing stores
  const auto until = Clock::now() + timeout_;
  for (;;) {
    newest = newest_quorum(newest);
    const auto members = newest > 0
                             ? from_record(newest, json::parse(get(quorum_key(newest)))).members
                             : starting_quorum(0).members;
    if (!holds(members, replica_)) return true;
    if (stored(kFinished) || (give_up && give_up())) return false;
    if (Clock::now() > until)
      throw DistError(fmt::format("fault tolerance: replica {} restarted, but its peers have not "
                                  "left its former self out of their quorum in {} s",
                                  replica_, timeout_.count() / 1000.0));
    std::this_thread::sleep_for(poll_);
  }
}

std::optional<Quorum> ReplicaAgreement::admitted(const std::function<bool()>& give_up) {
  for (int64_t id = join_after_ + 1;; ++id) {
    // Each quorum in turn, looking for the run's end (or a stop signal) between short waits.
    const auto until = Clock::now() + timeout_;
    while (!stored(quorum_key(id))) {
      if (stored(kFinished)) return std::nullopt;
      if (give_up && give_up()) {  // withdrawn, so that no quorum admits a replica that has gone
        store_.deleteKey(join_key(replica_, place_.index));
        return std::nullopt;
      }
      if (Clock::now() > until) get(quorum_key(id));  // the timeout's error
      std::this_thread::sleep_for(poll_);
    }
    const auto record = json::parse(get(quorum_key(id)));
    auto out = from_record(id, record);
    if (!holds(out.joining, replica_)) continue;
    joins_seen_ = record.at("joins").get<int64_t>();
    store_.deleteKey(join_key(replica_, place_.index));
    return out;
  }
}

namespace {

// What the members' `votes` decide. Commit: every member finished the reduction. Stop:
// every one was asked to. Else those asked before this vote leave (a discarded step is
// trained again by all), and a quorum forms for the rest, as for any vote but ok and a
// first ask, which changes nothing yet.
Decision decide(const Quorum& q, const std::vector<Vote>& votes) {
  Decision d{true, false, true, {}};
  for (size_t i = 0; i < votes.size(); ++i) {
    const Vote v = votes[i];
    const bool asked = v == Vote::kLeave || v == Vote::kLeaving;
    d.commit = d.commit && v <= Vote::kLeaving;
    d.stop = d.stop && asked;
    d.reform = d.reform || (v != Vote::kOk && v != Vote::kLeave);
    if (v == Vote::kLeaving) d.leaving.push_back(q.members[i]);
  }
  if (!d.commit) return {false, d.reform, false, {}};
  if (d.stop) return {true, false, true, {}};
  return d;
}

}  // namespace

Decision ReplicaAgreement::vote(const Quorum& q, int64_t step, bool ok, bool stop) {
  const bool joins = ok && store_.add(kJoins, 0) > joins_seen_;
  const Vote mine = !ok ? Vote::kFailed
                    : asked_to_stop_ ? Vote::kLeaving  // a notice given at an earlier vote
                    : stop ? Vote::kLeave
                    : joins ? Vote::kOkJoin : Vote::kOk;
  asked_to_stop_ = asked_to_stop_ || stop;
  store_.compareSet(vote_key(q.id, step, replica_, place_.index), {}, bytes(kVoteNames[int(mine)]));
  last_votes_ = votes_on(q, step);
  const Decision d = decide(q, last_votes_);
  // A vote two steps back is read by nobody now (every member has read it before voting on
  // the step after it): the store keeps a few keys per member, however long the run.
  if (step >= 2) store_.deleteKey(vote_key(q.id, step - 2, replica_, place_.index));
  return d;
}

// Every place's vote is read together (one request to dtrain's store, however many
// members), then those still missing, until each is stored or its replica has gone silent.
// A member's vote is the worst of its places' (the enum's order: ok, ok+join, failed, dead).
std::vector<Vote> ReplicaAgreement::votes_on(const Quorum& q, int64_t step) {
  std::vector<std::string> keys;  // place p of member i at i x places + p
  for (int64_t m : q.members)
    for (int64_t p = 0; p < place_.count; ++p) keys.push_back(vote_key(q.id, step, m, p));
  std::vector<std::optional<Vote>> got(keys.size());
  const auto until = Clock::now() + timeout_;
  // The members vote within a moment of each other (they have just reduced together):
  // look again soon, then less often, up to `poll_`.
  auto pause = std::min<std::chrono::microseconds>(std::chrono::microseconds(50), poll_);
  for (int64_t waiting; (waiting = look_at_votes(q, keys, got)) >= 0;) {
    if (Clock::now() > until)
      throw DistError(fmt::format(
          "fault tolerance: replica {} is alive but has not voted on step {} in {} s", waiting,
          step, timeout_.count() / 1000.0));
    std::this_thread::sleep_for(pause);
    pause = std::min<std::chrono::microseconds>(2 * pause, poll_);
  }
  std::vector<Vote> votes(q.members.size(), Vote::kOk);
  for (size_t i = 0; i < keys.size(); ++i) {
    auto& v = votes[i / size_t(place_.count)];
    v = std::max(v, *got[i]);
  }
  return votes;
}

// One look at the votes `got` still lacks: those stored are taken, and kDead is written for
// the places of members that have gone (compareSet makes the first of its own vote and
// ours the one everybody reads). The first live member still missing one, else -1.
int64_t ReplicaAgreement::look_at_votes(const Quorum& q, const std::vector<std::string>& keys,
                                        std::vector<std::optional<Vote>>& got) {
  const auto member = [&](size_t i) { return q.members[i / size_t(place_.count)]; };
  std::vector<size_t> missing;
  std::vector<std::string> asked;
  for (size_t i = 0; i < keys.size(); ++i)
    if (!got[i]) missing.push_back(i), asked.push_back(keys[i]);
  const auto values = values_now(store_, asked);
  std::vector<int64_t> silent;  // the members some of whose votes are missing, ascending
  for (size_t k = 0; k < missing.size(); ++k) {
    if (values[k]) got[missing[k]] = vote_named(text(*values[k]));
    else if (silent.empty() || silent.back() != member(missing[k])) silent.push_back(member(missing[k]));
  }
  if (silent.empty()) return -1;
  const auto dead = dead_(silent);
  for (size_t i : missing)
    if (!got[i] && holds(dead, member(i)))
      got[i] = vote_named(text(store_.compareSet(keys[i], {}, bytes("dead"))));
  for (int64_t m : silent)
    if (!holds(dead, m)) return m;
  return -1;
}

namespace {

// Who writes after quorum `q`, whose surviving `members` admit `joining`: its writer while
// it survives; else the lowest member with state that `q` did not admit, else any with
// state (-1: none). One just admitted never trained the steps before its join, so it
// cannot write the lines of those the failed writer had not written yet (it writes a
// step's line two steps on); a member from before has them all.
int64_t next_writer(const Quorum& q, const std::vector<int64_t>& members,
                    const std::vector<int64_t>& joining) {
  if (holds(members, q.writer) && !holds(joining, q.writer)) return q.writer;
  int64_t any = -1;
  for (int64_t m : members) {
    if (holds(joining, m)) continue;
    if (!holds(q.joining, m)) return m;
    if (any < 0) any = m;
  }
  return any;
}

}  // namespace

// A replica joins once every one of its ranks has asked (each is built and waiting): every
// replica's requests are read in one request to dtrain's store.
std::vector<int64_t> ReplicaAgreement::asking_to_join() {
  std::vector<std::string> keys;
  for (int64_t r = 0; r < replicas_; ++r)
    for (int64_t at = 0; at < place_.count; ++at) keys.push_back(join_key(r, at));
  const auto requests = values_now(store_, keys);
  std::vector<int64_t> asked;
  for (int64_t r = 0; r < replicas_; ++r) {
    const auto first = requests.begin() + r * place_.count;
    if (std::all_of(first, first + place_.count, [](const auto& v) { return v.has_value(); }))
      asked.push_back(r);
  }
  return asked;
}

Quorum ReplicaAgreement::next(const Quorum& q, int64_t step) {
  json p;
  p["step"] = step;
  p["joins"] = store_.add(kJoins, 0);  // before the requests: see ask_to_join
  const auto leaving = decide(q, last_votes_).leaving;  // none where the step was discarded
  std::vector<int64_t> voted;  // the members that go on: alive, and not leaving
  for (size_t i = 0; i < q.members.size(); ++i)
    if (i < last_votes_.size() && last_votes_[i] != Vote::kDead && !holds(leaving, q.members[i]))
      voted.push_back(q.members[i]);
  const auto asked = asking_to_join();
  const auto dead = dead_(sorted_union(voted, asked));
  std::vector<int64_t> members, joining;
  for (int64_t r : voted)
    if (!holds(dead, r)) members.push_back(r);
  for (int64_t r : asked)
    if (!holds(dead, r)) joining.push_back(r);
  // The proposer is a member with state (it voted), so there is a source.
  const auto with_state = std::find_if(members.begin(), members.end(),
                                       [&](int64_t m) { return !holds(joining, m); });
  p["source"] = joining.empty() || with_state == members.end() ? -1 : *with_state;
  p["writer"] = next_writer(q, members, joining);
  for (int64_t r : joining)
    if (!holds(members, r)) members.push_back(r);
  std::sort(members.begin(), members.end());
  p["members"] = members;
  p["joining"] = joining;
  const auto won = json::parse(text(store_.compareSet(quorum_key(q.id + 1), {}, bytes(p.dump()))));
  joins_seen_ = won.at("joins").get<int64_t>();
  return from_record(q.id + 1, won);
}

}  // namespace dtrain
