// fault_tolerance: replicas (docs/fault-tolerance.md): the sync mode's step, each replica a
// world of its own (one process, its tensor and pipeline ranks, and data ranks of them that
// shard ZeRO's state: fault_tolerance.replica_data) and the data-parallel sum over the
// replicas' set (comm/replica_set.hpp), one set per place in a replica.
// The set votes before each update; when a replica failed, every survivor discards the
// step and trains it again on the same global batch, each taking a share of it and its
// loss weighted by that share's size. The quorum names the replica that writes the run
// directory (the first one's lowest, for as long as it lives); when it fails, the lowest
// survivor takes over. Under parallel.mode: local_sgd the replicas step alone between
// averages (modes/local_replicas.cpp, on top of this).
// Under fault_tolerance.batch: shrink each data rank keeps its own share's size instead, so
// the global batch is the members' shares (and the learning rate scaled with it): the
// job's sampler continued in those batches from the step the quorum changed at, the course
// kept in checkpoints and handed to joiners.
#pragma once
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "checkpoint/handover.hpp"
#include "comm/replica_set.hpp"
#include "run/mode.hpp"

namespace dtrain {

class Replicas : public Lockstep {
 public:
  Replicas(const JobConfig& cfg, const ParallelDims& dims, std::shared_ptr<Comm> world,
           std::shared_ptr<ReplicaSet> set, std::vector<int64_t> job_ranks);

  // Over the replicas; under ZeRO, inside the replica first (each data rank's shard).
  std::unique_ptr<GradSync> make_sync(FlatParams& params, int64_t micro_batches,
                                      int64_t total_steps, Tied tied) const override;
  void bind(const TrainParts& parts) override;
  bool writes_files() const override;
  bool state_from_peer() const override { return set_->joining(); }
  // A joining replica enters the set once built, takes its state and trains from the
  // admitting quorum's step.
  RunResult run(TrainParts& parts) override;
  std::string describe() const override;
  // "data": the data ranks that train now, over every replica in the quorum.
  nlohmann::json layout() const override;

  // Over the replica's own ranks first (a tensor rank past the first adds no loss), then
  // over the replicas: every rank of every replica reads the same figures and judges the
  // step alike. A failure of the first is the replica's end (its ranks are restarted
  // together); of the second, the step's vote.
  void agree(int64_t n, torch::Tensor figures, ReduceOp op) override;
  // Every rank of the job has a slot in the figures (a replica that is out leaves its own
  // empty): the slowest rank is named across replicas.
  RankInJob rank_in_job() const override;
  // The data ranks that summed step n's losses: the quorum that trained it (which may have
  // changed by the time they are read, two steps later), each replica's data ranks.
  int64_t replicas(int64_t n) const override;
  double loss_weight() const override;
  double batch_scale() const override;
  Stateful* state() override;
  // The replica's share dealt again among its data ranks: data rank i of D in replica k of
  // K takes share i x K + k of K x D, whose union over i is replica k's share of K.
  ShardedSampler share(const ShardedSampler& job) const override;
  void before_step(int64_t n) override;
  bool commit(int64_t n) override { return vote(n, n); }
  // A stop signal goes into the vote on the step: a replica asked leaves the job after the
  // next vote and the others go on; when every member has been asked, the job stops (its
  // checkpoint, then every rank exits) as without fault tolerance.
  bool stop_in_figures() const override { return false; }
  Ending ending_after(int64_t n) const override;
  // Over every member's data ranks, summed across the set, where each member holds the
  // same weights: not while replicas admitted at step n's vote wait for their state.
  EvalSplit eval_split(int64_t n) const override;

 protected:
  // The set's vote on step n (ReplicaSet::commit: `again` is where a discarded one trains
  // again from), and what follows from it here: the writer taking over.
  bool vote(int64_t n, int64_t again);
  const ReplicaSet& set() const { return *set_; }
  RunLog& log() const { return *log_; }
  // This replica's share of the global batch now (each of its data ranks' shares summed).
  double batch_share() const {
    return double(share_size() * mesh().dims().data) / double(batch());
  }
  // Under shrink, the course's state (trainer.json's data_course); else null.
  Stateful* course_state() { return shrinks() ? &course_state_ : nullptr; }
  const Stateful* course_state() const { return shrinks() ? &course_state_ : nullptr; }
  // Whether every member's share is the same size: under shrink each keeps its own.
  bool even_shares() const {
    return shrinks() || cfg_.data.batch_size % set_->count() == 0;
  }

 private:
  int64_t replica() const { return set_->replica(); }
  // The data ranks that train now: each member's.
  int64_t data_ranks() const { return set_->count() * mesh().dims().data; }
  // Whether replicas the quorum admitted still wait for their state (before_step hands
  // it over as the quorum's first step starts).
  bool joiners_wait() const {
    return !set_->quorum().joining.empty() && handed_ != set_->quorum().id;
  }
  // Once per quorum that admitted replicas: the source's state into theirs, over the set
  // (what this member sent or took, and how long that lasted).
  Handover receive_or_send_state();
  // The global batch now: the job's, or under shrink the members' shares.
  int64_t batch() const { return course_->global_batch(); }
  int64_t share_size() const { return share(*course_).rank_batch(); }
  bool shrinks() const { return cfg_.fault_tolerance.batch == "shrink"; }
  // Testing (fault_tolerance.debug_kill_*): whether this rank kills itself at step n, `in`
  // "step" (as it starts) or "eval" (the evaluation after it); not again once restarted.
  bool dies_at(int64_t n, const std::string& in) const;
  // The course's state (fault_tolerance.batch: shrink): where its batches began.
  class CourseState : public Stateful {
   public:
    explicit CourseState(Replicas& r) : r_(r) {}
    void save(StateWriter& out) const override;
    void load(const StateReader& in) override;

   private:
    Replicas& r_;
  };

  std::shared_ptr<ReplicaSet> set_;
  bool restarted_;  // started to join (a debug_kill_rank does not kill itself again)
  std::function<void()> take_over_;
  std::function<Handover(Comm&, int64_t, bool)> hand_over_;
  RunLog* log_ = nullptr;
  int64_t handed_ = -1;  // the last quorum whose joiners took their state
  // The job's sampler once bound; under shrink continued in the members' batches.
  std::optional<ShardedSampler> course_;
  int64_t rank_batch_ = 0;  // under shrink: a data rank's share, as the job started
  CourseState course_state_{*this};
  std::map<int64_t, int64_t> trained_by_;      // step -> its quorum's size, the last few
};

// parallel.mode: local_sgd over the replicas (modes/local_replicas.cpp).
std::unique_ptr<Mode> make_local_replicas_mode(const JobConfig& cfg, const ParallelDims& dims,
                                               std::shared_ptr<Comm> world,
                                               std::shared_ptr<ReplicaSet> set,
                                               std::vector<int64_t> job_ranks);

}  // namespace dtrain
