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
    // Whether a stop signal came to this rank: a replica waiting to join then gives up,
    // and one training asks to leave in its votes.
    std::function<bool()> stopping = [] { return false; };
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
  ~ReplicaSet() { comm_->watch_members(nullptr); }  // comm() may outlive it
  ReplicaSet(const ReplicaSet&) = delete;  // its group asks it who has gone
  ReplicaSet& operator=(const ReplicaSet&) = delete;

  // A joining replica, once ready to train: waits for its peers to leave its former self
  // out, revives, asks to join and waits (up to the timeout) for the quorum that admits
  // it, whose members then hand it their state (hand_over). False when the others
  // ended the run first (ended() says how) or a stop signal came meanwhile.
  bool join();
  // The run has ended, `how` ("completed", "stopped"): a replica waiting to join then
  // stops. ended(): that word, or "" while the run goes on.
  void finished(const std::string& how) { agreement_.finished(how); }
  std::string ended() { return agreement_.ended(); }
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
  // peers voted it dead) or an agreement timed out. A stop signal on this rank (stopping)
  // goes into the vote: see leaves().
  bool commit(int64_t n, int64_t again);
  bool commit(int64_t n) { return commit(n, n); }
  // What the last commit decided of stop signals: whether the job stops after that step
  // (every member was asked to), or this replica leaves it (asked at an earlier vote; the
  // others go on without it); and the members that leave.
  bool stops() const { return decided_.stop; }
  bool leaves() const;
  const std::vector<int64_t>& leaving() const { return decided_.leaving; }

 private:
  std::string gone() const;  // which members have gone, for comm()'s waits ("": none)

  Options opts_;
  ReplicaAgreement agreement_;
  Quorum quorum_;
  std::shared_ptr<ReplicaComm> comm_;
  bool joining_;
  Decision decided_;  // the last commit's
};

}  // namespace dtrain
