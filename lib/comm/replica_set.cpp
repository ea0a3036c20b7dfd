#include "comm/replica_set.hpp"

#include <algorithm>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "util/error.hpp"

namespace dtrain {
namespace {

std::shared_ptr<Comm> group_of(const Quorum& q, const ReplicaSet::Options& o) {
  std::vector<int64_t> ranks;
  for (int64_t m : q.members) ranks.push_back(o.world_rank(m));
  // Named by the quorum (no later group shares it: a restarted replica's group is new) and
  // its first member's job rank (one group per place in a replica; the same for every
  // member of it).
  return o.make_group(fmt::format("ft/q{}/{}", q.id, ranks.front()), ranks);
}

}  // namespace

ReplicaSet::ReplicaSet(c10d::Store& store, Options opts, int64_t step, bool joining)
    : opts_(std::move(opts)),
      agreement_(store, opts_.replica, opts_.replicas, opts_.dead, opts_.timeout, opts_.poll,
                 opts_.place, opts_.starting),
      quorum_(agreement_.starting_quorum(step)),
      comm_(std::make_shared<ReplicaComm>(joining ? make_local_comm() : group_of(quorum_, opts_),
                                          [this] { return gone(); })),
      joining_(joining) {}

// Asked while a collective of the step waits (on the thread that waits; the quorum changes
// only at a vote, once the step's collectives are waited).
std::string ReplicaSet::gone() const {
  if (!opts_.dead) return "";
  std::vector<int64_t> others;
  for (int64_t m : quorum_.members)
    if (m != opts_.replica) others.push_back(m);
  const auto dead = opts_.dead(others);
  if (dead.empty()) return "";
  return fmt::format("replica(s) {} gone (the launcher's word, or a heartbeat older than "
                     "fault_tolerance.heartbeat_s)", fmt::join(dead, ", "));
}

bool ReplicaSet::join() {
  if (!joining_) return true;
  if (!agreement_.wait_until_left_out(opts_.stopping)) return false;
  opts_.revive();
  agreement_.ask_to_join();
  const auto admitted = agreement_.admitted(opts_.stopping);
  if (!admitted) return false;
  quorum_ = *admitted;
  comm_->reform(group_of(quorum_, opts_));
  joining_ = false;
  return true;
}

int64_t ReplicaSet::index() const {
  const auto& m = quorum_.members;
  return std::find(m.begin(), m.end(), opts_.replica) - m.begin();
}

bool ReplicaSet::leaves() const {
  return decided_.stop || std::find(decided_.leaving.begin(), decided_.leaving.end(),
                                    opts_.replica) != decided_.leaving.end();
}

bool ReplicaSet::commit(int64_t n, int64_t again) {
  decided_ = agreement_.vote(quorum_, n, !comm_->failed(), opts_.stopping());
  const Decision& d = decided_;
  if (!d.reform || leaves()) return d.commit;  // a leaver forms no quorum: it is in none
  const std::string why = comm_->failed() ? comm_->error() : "a member was silent";
  quorum_ = agreement_.next(quorum_, d.commit ? n + 1 : again);
  if (index() == count())
    throw DistError(fmt::format("fault tolerance: replica {} was left out of quorum {} at step "
                                "{}: its peers voted it dead ({})",
                                opts_.replica, quorum_.id, quorum_.step, why));
  comm_->reform(group_of(quorum_, opts_));
  return d.commit;
}

}  // namespace dtrain
