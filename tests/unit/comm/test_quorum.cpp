// The replicas' agreement (comm/quorum.hpp) over an in-memory store, the replicas as
// threads: every member decides the same from the same votes, a silent member is voted
// dead, and a replica that asks to join is admitted by the next quorum and no stale one.
#include <doctest/doctest.h>

#include <array>
#include <atomic>
#include <future>
#include <thread>

#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/torch.h>

#include "comm/comm.hpp"
#include "comm/quorum.hpp"
#include "comm/tcp_store.hpp"
#include "ranks.hpp"
#include "util/error.hpp"

namespace unit_comm_quorum {
using namespace dtrain;
using namespace std::chrono_literals;

struct Replicas {
  // c10's in-memory store (a request a key read), or dtrain's own (a vote's keys read in one).
  explicit Replicas(c10::intrusive_ptr<c10d::Store> s = c10::make_intrusive<c10d::HashStore>())
      : store(std::move(s)) {}
  c10::intrusive_ptr<c10d::Store> store;
  std::array<std::atomic<bool>, 4> alive{true, true, true, true};
  ReplicaAgreement agreement(int64_t r, std::chrono::milliseconds timeout = 10s) {
    return ReplicaAgreement(*store, r, 4, test::dead_unless([this](int64_t m) { return alive[size_t(m)].load(); }),
                            timeout, 1ms);
  }
};

bool operator==(const Decision& a, const Decision& b) {
  return a.commit == b.commit && a.reform == b.reform && a.stop == b.stop && a.leaving == b.leaving;
}

// Each of `who` votes on `step` under `q` at once; their decisions, in order.
std::vector<Decision> vote_all(Replicas& r, const Quorum& q, int64_t step,
                               const std::vector<int64_t>& who, int64_t failing = -1) {
  std::vector<std::future<Decision>> votes;
  for (int64_t m : who)
    votes.push_back(std::async(std::launch::async, [&, m] {
      return r.agreement(m).vote(q, step, m != failing);
    }));
  std::vector<Decision> out;
  for (auto& v : votes) out.push_back(v.get());
  return out;
}

void all_ok_then_failed(Replicas& r) {
  const auto q = ReplicaAgreement::first(3, 5);
  CHECK(q.members == std::vector<int64_t>{0, 1, 2});
  for (auto d : vote_all(r, q, 5, {0, 1, 2})) CHECK(d == Decision{true, false});
  for (auto d : vote_all(r, q, 6, {0, 1, 2}, /*failing=*/1)) CHECK(d == Decision{false, true});
}

void silent_voted_dead(Replicas& r) {
  const auto q = ReplicaAgreement::first(3, 0);
  r.alive[2] = false;  // it never votes
  auto a0 = r.agreement(0), a1 = r.agreement(1);
  auto d1 = std::async(std::launch::async, [&] { return a1.vote(q, 0, true); });
  CHECK(a0.vote(q, 0, true) == Decision{false, true});
  CHECK(d1.get() == Decision{false, true});
  // Its late vote cannot change what was decided: the first word on its key stands.
  r.alive[2] = true;
  CHECK(r.agreement(2).vote(q, 0, true) == Decision{false, true});
  r.alive[2] = false;
  auto n1 = std::async(std::launch::async, [&] { return a1.next(q, 0); });
  const auto n0 = a0.next(q, 0);
  CHECK(n0.id == 1);
  CHECK(n0.step == 0);  // the step is trained again
  CHECK(n0.members == std::vector<int64_t>{0, 1});
  CHECK(n0.joining.empty());
  CHECK(n1.get().members == n0.members);
}

void two_rank_replica(Replicas& r) {
  // Replica m's rank at place p: each votes for its place, all read one quorum.
  auto at = [&](int64_t m, int64_t p) {
    return ReplicaAgreement(*r.store, m, 4, test::dead_unless([&r](int64_t k) { return r.alive[size_t(k)].load(); }), 10s,
                            1ms, Place{p, 2});
  };
  std::vector<ReplicaAgreement> ranks;
  for (int64_t m = 0; m < 2; ++m)
    for (int64_t p = 0; p < 2; ++p) ranks.push_back(at(m, p));
  auto all = [&](auto&& each) {  // every member rank at once, in order
    std::vector<std::future<decltype(each(ranks[0], 0))>> fs;
    for (size_t i = 0; i < ranks.size(); ++i)
      fs.push_back(std::async(std::launch::async, [&, i] { return each(ranks[i], int64_t(i)); }));
    std::vector<decltype(each(ranks[0], 0))> out;
    for (auto& f : fs) out.push_back(f.get());
    return out;
  };
  auto q = ReplicaAgreement::first(2, 0);
  // Replica 1's second rank saw its reduction fail; its first did not: every rank of
  // both replicas discards the step.
  for (auto d : all([&](ReplicaAgreement& a, int64_t i) { return a.vote(q, 0, i != 3); }))
    CHECK(d == Decision{false, true});
  for (const auto& n : all([&](ReplicaAgreement& a, int64_t) { return a.next(q, 0); }))
    CHECK(n.members == std::vector<int64_t>{0, 1});
  q = ranks[0].next(q, 0);  // the stored one, as every rank read it

  // A third replica's first rank asks to join: the members see it, but it is not admitted
  // until its second rank has asked too (both are built and waiting).
  auto j0 = at(2, 0), j1 = at(2, 1);
  j0.ask_to_join();
  auto admitted0 = std::async(std::launch::async, [&] { return j0.admitted(); });
  for (auto d : all([&](ReplicaAgreement& a, int64_t) { return a.vote(q, 1, true); }))
    CHECK(d == Decision{true, true});
  for (const auto& n : all([&](ReplicaAgreement& a, int64_t) { return a.next(q, 2); }))
    CHECK(n.joining.empty());
  q = ranks[0].next(q, 2);
  j1.ask_to_join();
  auto admitted1 = std::async(std::launch::async, [&] { return j1.admitted(); });
  for (auto d : all([&](ReplicaAgreement& a, int64_t) { return a.vote(q, 2, true); }))
    CHECK(d == Decision{true, true});
  for (const auto& n : all([&](ReplicaAgreement& a, int64_t) { return a.next(q, 3); })) {
    CHECK(n.members == std::vector<int64_t>{0, 1, 2});
    CHECK(n.joining == std::vector<int64_t>{2});
  }
  const auto seen0 = admitted0.get(), seen1 = admitted1.get();
  REQUIRE(seen0);
  REQUIRE(seen1);
  CHECK(seen0->id == seen1->id);
  CHECK(seen0->id == q.id + 1);
}

// Each of `as` votes on `step` under `q` at once (`stop`: whom a stop signal has reached,
// `failing`: whose reduction failed); their decisions, in order. The agreements persist:
// each remembers that it was asked to stop.
std::vector<Decision> vote_each(std::vector<ReplicaAgreement>& as, const Quorum& q, int64_t step,
                                const std::vector<bool>& stop, int64_t failing = -1) {
  std::vector<std::future<Decision>> votes;
  for (size_t i = 0; i < as.size(); ++i)
    votes.push_back(std::async(std::launch::async, [&, i] {
      return as[i].vote(q, step, int64_t(i) != failing, stop[i]);
    }));
  std::vector<Decision> out;
  for (auto& v : votes) out.push_back(v.get());
  return out;
}

// A stop signal is a notice at the vote it first reaches a member at, and that member
// leaves at its next (the others go on, without forming a quorum for the notice); when
// every member has been reached the job stops, whichever vote each was first reached at.
void stop_signals(Replicas& r) {
  std::vector<ReplicaAgreement> as;
  for (int64_t m = 0; m < 3; ++m) as.push_back(r.agreement(m));
  auto q = ReplicaAgreement::first(3, 0);
  for (auto d : vote_each(as, q, 0, {false, true, false})) CHECK(d == Decision{true, false});
  // Replica 1 leaves; replica 2 is reached now.
  for (auto d : vote_each(as, q, 1, {false, true, true}))
    CHECK(d == Decision{true, true, false, {1}});
  std::vector<ReplicaAgreement> rest;
  rest.push_back(std::move(as[0])), rest.push_back(std::move(as[2]));
  auto n2 = std::async(std::launch::async, [&, q] { return rest[1].next(q, 2); });
  q = rest[0].next(q, 2);
  CHECK(n2.get().id == q.id);
  CHECK(q.members == std::vector<int64_t>{0, 2});
  CHECK(q.writer == 0);
  // Replica 0 reached a step after replica 2: every member has been, and the job stops.
  for (auto d : vote_each(rest, q, 2, {true, true})) CHECK(d == Decision{true, false, true, {}});
  rest[0].finished("stopped");
  CHECK(r.agreement(1).ended() == "stopped");
}

// A leaver whose step is discarded (another member failed) trains it again with the others
// and leaves at its vote; the writer, leaving, hands the run directory on.
void leaver_in_a_discarded_step(Replicas& r) {
  std::vector<ReplicaAgreement> as;
  for (int64_t m = 0; m < 3; ++m) as.push_back(r.agreement(m));
  auto q = ReplicaAgreement::first(3, 4);
  for (auto d : vote_each(as, q, 4, {true, false, false})) CHECK(d == Decision{true, false});
  for (auto d : vote_each(as, q, 5, {true, false, false}, /*failing=*/2))
    CHECK(d == Decision{false, true});
  std::vector<std::future<Quorum>> next;
  for (auto& a : as) next.push_back(std::async(std::launch::async, [&] { return a.next(q, 5); }));
  for (auto& n : next) CHECK(n.get().members == std::vector<int64_t>{0, 1, 2});
  q = as[1].next(q, 5);
  for (auto d : vote_each(as, q, 5, {true, false, false})) CHECK(d == Decision{true, true, false, {0}});
  auto n2 = std::async(std::launch::async, [&] { return as[2].next(q, 6); });
  const auto after = as[1].next(q, 6);
  CHECK(n2.get().id == after.id);
  CHECK(after.members == std::vector<int64_t>{1, 2});
  CHECK(after.writer == 1);
}

TEST_SUITE("quorum") {
  TEST_CASE("quorum: a stop signal is a step's notice, then its replica leaves; all reached and the job stops") {
    Replicas r;
    stop_signals(r);
  }

  TEST_CASE("quorum: a leaver in a discarded step trains it again, then leaves; its writing moves on") {
    Replicas r;
    leaver_in_a_discarded_step(r);
  }

  TEST_CASE("quorum: a joiner reached by a stop signal withdraws its request and is admitted by no quorum") {
    Replicas r;
    auto a0 = r.agreement(0), a1 = r.agreement(1);
    const auto q = ReplicaAgreement::first(2, 0);
    auto j = r.agreement(3);
    j.ask_to_join();
    std::atomic<bool> stop{false};
    auto admitted = std::async(std::launch::async, [&] { return j.admitted([&] { return stop.load(); }); });
    CHECK(admitted.wait_for(50ms) == std::future_status::timeout);
    stop = true;
    CHECK_FALSE(admitted.get());
    // The members see that a request came (a count only goes up), but none stands.
    auto t = std::async(std::launch::async, [&] { return a1.vote(q, 0, true); });
    CHECK(a0.vote(q, 0, true) == Decision{true, true});
    t.get();
    auto n1 = std::async(std::launch::async, [&] { return a1.next(q, 1); });
    CHECK(a0.next(q, 1).joining.empty());
    CHECK(n1.get().members == std::vector<int64_t>{0, 1});
  }

  TEST_CASE("quorum: all ok commits; one failed reduction and every member discards the step") {
    Replicas r;
    all_ok_then_failed(r);
  }

  TEST_CASE("quorum: a silent member is voted dead by whoever sees it first, and left out") {
    Replicas r;
    silent_voted_dead(r);
  }

  TEST_CASE("quorum: a replica that asks to join is admitted at the next boundary, with a source") {
    Replicas r;
    auto a0 = r.agreement(0), a1 = r.agreement(1), a2 = r.agreement(2);
    auto q = ReplicaAgreement::first(3, 0);
    r.alive[2] = false;
    std::thread t([&] { a1.vote(q, 0, true); });
    a0.vote(q, 0, true);
    t.join();
    auto n1 = std::async(std::launch::async, [&, q] { return a1.next(q, 0); });
    q = a0.next(q, 0);
    n1.get();
    CHECK(q.members == std::vector<int64_t>{0, 1});

    r.alive[2] = true;  // restarted
    a2.ask_to_join();
    auto admitted = std::async(std::launch::async, [&] { return a2.admitted(); });
    // Both members see the request in their votes: the step stands, a new quorum forms.
    std::thread t2([&] { a1.vote(q, 1, true); });
    CHECK(a0.vote(q, 1, true) == Decision{true, true});
    t2.join();
    auto m1 = std::async(std::launch::async, [&] { return a1.next(q, 2); });
    const auto joined = a0.next(q, 2);
    CHECK(m1.get().id == joined.id);
    CHECK(joined.members == std::vector<int64_t>{0, 1, 2});
    CHECK(joined.joining == std::vector<int64_t>{2});
    CHECK(joined.source == 0);
    CHECK(joined.step == 2);
    const auto seen = admitted.get();
    REQUIRE(seen);
    CHECK(seen->id == joined.id);
    CHECK(seen->members == joined.members);

    // Nobody asks now: the next votes keep the quorum.
    std::thread t3([&] { a1.vote(joined, 2, true); });
    std::thread t4([&] { a2.vote(joined, 2, true); });
    CHECK(a0.vote(joined, 2, true) == Decision{true, false});
    t3.join();
    t4.join();

    // Restarted once more: the quorum that admitted it before is not the one it waits for.
    a2.ask_to_join();
    auto again = std::async(std::launch::async, [&] { return a2.admitted(); });
    CHECK(again.wait_for(50ms) == std::future_status::timeout);
    r.alive[2] = false;  // its old self stopped before voting on step 3
    std::thread t5([&] { a1.vote(joined, 3, true); });
    CHECK(a0.vote(joined, 3, true) == Decision{false, true});
    t5.join();
    r.alive[2] = true;
    auto m2 = std::async(std::launch::async, [&] { return a1.next(joined, 3); });
    const auto later = a0.next(joined, 3);
    m2.get();
    CHECK(later.id == joined.id + 1);
    CHECK(later.joining == std::vector<int64_t>{2});
    CHECK(again.get()->id == later.id);

    // The others finish the run before another request is taken: the joiner stops waiting.
    a2.ask_to_join();
    auto late = std::async(std::launch::async, [&] { return a2.admitted(); });
    CHECK(late.wait_for(50ms) == std::future_status::timeout);
    a0.finished();
    CHECK(!late.get());
  }

  TEST_CASE("quorum: a replica of two ranks fails when either of them did, and joins once both ask") {
    Replicas r;
    two_rank_replica(r);
  }

  // Restarted, a replica beats its heartbeat at once: asked too early, its peers would take
  // that for its former self's and wait for that self's vote.
  TEST_CASE("quorum: a restarted replica waits until its peers have left its former self out") {
    Replicas r;
    auto a0 = r.agreement(0), a1 = r.agreement(1), a2 = r.agreement(2);
    const auto q = ReplicaAgreement::first(3, 0);
    auto left = std::async(std::launch::async, [&] { return a2.wait_until_left_out(); });
    CHECK(left.wait_for(50ms) == std::future_status::timeout);  // its former self is in quorum 0
    r.alive[2] = false;  // the launcher's mark: its former self ended
    std::thread t([&] { a1.vote(q, 0, true); });
    CHECK(a0.vote(q, 0, true) == Decision{false, true});
    t.join();
    auto n1 = std::async(std::launch::async, [&] { return a1.next(q, 0); });
    CHECK(a0.next(q, 0).members == std::vector<int64_t>{0, 1});
    n1.get();
    CHECK(left.get());
    // The run finished before its peers left it out: nothing to join.
    Replicas other;
    auto b2 = other.agreement(2);
    auto done = std::async(std::launch::async, [&] { return b2.wait_until_left_out(); });
    other.agreement(0).finished();
    CHECK(!done.get());
  }

  // The writer's successor has every step's line: a member from before the last quorum,
  // not one it just admitted (which never trained the steps before its join, some of whose
  // lines the failed writer may not have written yet), unless no other is left.
  // Members a and b vote ok on `step` under `q` (both deciding `want`) and form the next
  // quorum from step `from`.
  Quorum two_vote(ReplicaAgreement& a, ReplicaAgreement& b, const Quorum& q, int64_t step,
                  Decision want, int64_t from) {
    auto theirs = std::async(std::launch::async, [&] { return a.vote(q, step, true); });
    CHECK(b.vote(q, step, true) == want);
    CHECK(theirs.get() == want);
    auto formed = std::async(std::launch::async, [&] { return a.next(q, from); });
    const auto ours = b.next(q, from);
    CHECK(formed.get().id == ours.id);
    return ours;
  }

  TEST_CASE("quorum: a new writer is a member from before the last quorum, not one it just admitted") {
    Replicas r;
    auto a1 = r.agreement(1), a2 = r.agreement(2);
    const auto q0 = ReplicaAgreement::first(3, 0);
    CHECK(q0.writer == 0);
    // The writer dies: the lowest survivor writes.
    r.alive[0] = false;
    const auto q1 = two_vote(a1, a2, q0, 0, Decision{false, true}, 0);
    CHECK(q1.writer == 1);
    // Restarted, it is admitted; the writer stays.
    r.alive[0] = true;
    auto a0 = r.agreement(0);
    a0.ask_to_join();
    auto admitted = std::async(std::launch::async, [&] { return a0.admitted(); });
    const auto q2 = two_vote(a1, a2, q1, 1, Decision{true, true}, 2);
    REQUIRE(admitted.get());
    CHECK(q2.joining == std::vector<int64_t>{0});
    CHECK(q2.writer == 1);
    // The writer dies at once: 2 writes, not the lowest, 0, just admitted.
    r.alive[1] = false;
    const auto q3 = two_vote(a0, a2, q2, 2, Decision{false, true}, 2);
    CHECK(q3.members == std::vector<int64_t>{0, 2});
    CHECK(q3.writer == 2);
    // And when 2 dies too, 0 is the one left.
    r.alive[2] = false;
    CHECK(a0.vote(q3, 3, true) == Decision{false, true});
    CHECK(a0.next(q3, 3).writer == 0);
  }

  // Scale-up: a job that started with replicas 0 and 1 of up to 4.
  TEST_CASE("quorum: one more replica than the job started with is left out at once and admitted at the next boundary") {
    Replicas r;
    auto agreement = [&](int64_t m) {
      return ReplicaAgreement(*r.store, m, 4, test::dead_unless([&r](int64_t x) { return r.alive[size_t(x)].load(); }), 10s,
                              1ms, Place{}, /*starting=*/2);
    };
    auto a0 = agreement(0), a1 = agreement(1), a3 = agreement(3);
    const auto q = ReplicaAgreement::first(2, 0);
    CHECK(q.members == std::vector<int64_t>{0, 1});
    auto left = std::async(std::launch::async, [&] { return a3.wait_until_left_out(); });
    REQUIRE(left.wait_for(5s) == std::future_status::ready);  // in no quorum ever: at once
    CHECK(left.get());
    a3.ask_to_join();
    auto admitted = std::async(std::launch::async, [&] { return a3.admitted(); });
    std::thread t([&] { a1.vote(q, 0, true); });
    CHECK(a0.vote(q, 0, true) == Decision{true, true});  // the step stands, the quorum grows
    t.join();
    auto n1 = std::async(std::launch::async, [&] { return a1.next(q, 1); });
    const auto grown = a0.next(q, 1);
    CHECK(n1.get().id == grown.id);
    CHECK(grown.members == std::vector<int64_t>{0, 1, 3});
    CHECK(grown.joining == std::vector<int64_t>{3});
    CHECK(grown.source == 0);
    const auto seen = admitted.get();
    REQUIRE(seen);
    CHECK(seen->id == grown.id);
    // A replica of the first quorum, restarted, still waits for its former self to be left out.
    auto a1again = agreement(1);
    auto again = std::async(std::launch::async, [&] { return a1again.wait_until_left_out(); });
    CHECK(again.wait_for(50ms) == std::future_status::timeout);
    r.agreement(0).finished();
    CHECK_FALSE(again.get());
  }

  TEST_CASE("quorum: a live member that never votes ends the wait with an error naming it") {
    Replicas r;
    const auto q = ReplicaAgreement::first(2, 7);
    auto a0 = r.agreement(0, 100ms);
    try {
      a0.vote(q, 7, true);
      FAIL("no error");
    } catch (const DistError& e) {
      CHECK(std::string(e.what()).find("replica 1 is alive but has not voted on step 7") !=
            std::string::npos);
    }
    // A joiner that no quorum takes in time: the store's wait ends it, named.
    auto joiner = r.agreement(3, 100ms);
    joiner.ask_to_join();
    try {
      joiner.admitted();
      FAIL("no error");
    } catch (const DistError& e) {
      CHECK(std::string(e.what()).find("replica 3: waiting up to 0.1 s for 'ft/quorum/1'") !=
            std::string::npos);
    }
  }

  // What fault tolerance asks of a process group: a member gone mid-collective fails the
  // others' wait well before the group's timeout, and the survivors go on in a new group
  // made from the same store, dropping the broken one without waiting on it.
  TEST_CASE("quorum: a member's group gone mid-collective fails the others', and the survivors' new group works") {
    auto opts = test::quick();
    std::atomic<int> failed{0};
    test::RankFailures fails;
    test::run_ranks_as_threads(3, [&](std::shared_ptr<Comm> world) {
      auto q1 = world->new_group("ft/q1", {0, 1, 2});
      auto t = torch::ones({1 << 16});
      q1->all_reduce(t);  // all three are in
      if (world->rank() == 2) {
        q1.reset();  // this replica dies: its connections close
        return;
      }
      try {
        for (int i = 0; i < 100; ++i) q1->all_reduce(t);
        fails.add(world->rank(), "no error from a group with a member gone");
      } catch (const DistError& e) {
        ++failed;
        // The peer's closed connection, not the group's timeout, ended the wait.
        if (std::string(e.what()).find("closed its connection") == std::string::npos)
          fails.add(world->rank(), e.what());
      }
      q1.reset();
      auto q2 = world->new_group("ft/q2", {0, 1});
      auto u = torch::full({1 << 16}, double(world->rank() + 1));
      q2->all_reduce(u);
      if (u[0].item<double>() != 3.0) fails.add(world->rank(), "the survivors' sum is wrong");
    }, opts);
    fails.check();
    CHECK(failed == 2);
  }

  TEST_CASE("quorum: the same over dtrain's store, where a vote's keys are read in one request") {
    for (auto scenario : {all_ok_then_failed, silent_voted_dead, two_rank_replica, stop_signals,
                          leaver_in_a_discarded_step}) {
      TcpStore::Options o;
      o.host = "127.0.0.1", o.server = true, o.timeout = 10s;
      Replicas r(c10::make_intrusive<TcpStore>(o));
      scenario(r);
    }
  }
}

}  // namespace unit_comm_quorum
