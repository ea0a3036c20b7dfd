// The replicas a fault-tolerant job's replica trains with, step by step: the quorum it is
// in (comm/quorum.hpp), the group across its members (comm/replica_comm.hpp), and this
// replica's share of every global batch. A step's collectives run over comm(); before its
// update every member calls commit(n). When a member failed or went silent the step is
// discarded everywhere and trained again on the same global batch by the survivors, each
// taking a share of it (data/sampler.hpp's reshared), the shares' losses weighted by their
// size: so no sample is lost or seen twice, the learning rate stays, and the result is the
// uninterrupted run's up to the order of a sum.
#pragma once
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "comm/quorum.hpp"
#include "comm/replica_comm.hpp"

namespace dtrain {

class ReplicaSet {
 public:
  struct Options {
    int64_t replica = 0;   // this replica's index
    int64_t replicas = 1;  // the most the job can have
    // How many start together in the first quorum (0: all); one of the others starts as
    // one more and joins (scale-up).
    int64_t starting = 0;
    // This rank's place in its replica (its rank among the replica's own), and the job rank
    // of replica r's rank at that place: with one rank per replica, r itself. The set is
    // one per place: each place's group sums its part of the gradient, and all of them
    // vote and read one quorum.
    Place place;
    std::function<int64_t(int64_t r)> world_rank = [](int64_t r) { return r; };
    std::vector<int64_t> ranks;  // this replica's job ranks, in place order
    DeadAmong dead;  // the replicas among those asked about that a rank of has gone
    // A restarted replica's: says this rank lives again (its former self's end, which the
    // launcher marked, cleared), once its peers have left that self out.
    std::function<void()> revive = [] {};
    // Makes the group of job ranks `members` named `name` (comm/job_link.hpp's JobLink).
    std::function<std::shared_ptr<Comm>(const std::string& name, const std::vector<int64_t>& members)>
        make_group;
    std::chrono::milliseconds timeout{120000};  // a quorum's or a live member's vote
    std::chrono::milliseconds poll{5};
  };
  // `store`: the job's, which the agreement's keys live in. Every replica of the job
  // starts together, in the first quorum (all of them) from `step`; or, `joining`, this
  // one starts later (restarted, or one more) and is in no quorum until join().
  ReplicaSet(c10d::Store& store, Options opts, int64_t step, bool joining = false);

  // A joining replica, once ready to train: waits for its peers to leave its former self
  // out, revives, asks to join and waits (up to the timeout) for the quorum that admits
  // it, whose members then hand it their state (hand_over). False when the others
  // finished the run first.
  bool join();
  // The run is complete (a replica waiting to join then stops).
  void finished() { agreement_.finished(); }
  bool joining() const { return joining_; }

  // The group across the quorum's members, the same object for the whole run.
  const std::shared_ptr<ReplicaComm>& comm() const { return comm_; }
  const Quorum& quorum() const { return quorum_; }
  int64_t replica() const { return opts_.replica; }
  const Options& options() const { return opts_; }
  // This replica's place among the members, and their number: its share of a global batch.
  int64_t index() const;
  int64_t count() const { return int64_t(quorum_.members.size()); }

  // The members' vote on step n (this one's: whether comm() failed). True: apply the
  // update. False: the step is discarded, the quorum has changed, and the new members
  // train again from step `again` (n, or an earlier step whose state they went back to:
  // local SGD's last average). DistError when this replica is no longer a member (its
  // peers voted it dead) or an agreement timed out.
  bool commit(int64_t n, int64_t again);
  bool commit(int64_t n) { return commit(n, n); }

 private:
  Options opts_;
  ReplicaAgreement agreement_;
  Quorum quorum_;
  std::shared_ptr<ReplicaComm> comm_;
  bool joining_;
};

}  // namespace dtrain
