// fault_tolerance: replicas (docs/fault-tolerance.md): the sync mode's step, each replica a
// world of its own (one process, its tensor and pipeline ranks, and data ranks of them that
// shard ZeRO's state: fault_tolerance.replica_data) and the data-parallel sum over the
// replicas' set (comm/replica_set.hpp), one set per place in a replica.
// The set votes before each update; when a replica failed, every survivor discards the
// step and trains it again on the same global batch, each taking a share of it and its
// loss weighted by that share's size. The quorum names the replica that writes the run
// directory (the first one's lowest, for as long as it lives); when it fails, the lowest
// survivor takes over.
#include <algorithm>
#include <csignal>
#include <iostream>
#include <map>
#include <optional>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "comm/replica_set.hpp"
#include "grad/zero.hpp"
#include "run/mode.hpp"
#include "util/error.hpp"

namespace dtrain {
namespace {

class Replicas : public Lockstep {
 public:
  Replicas(const JobConfig& cfg, const ParallelDims& dims, std::shared_ptr<Comm> world,
           std::shared_ptr<ReplicaSet> set, std::vector<int64_t> job_ranks)
      : Lockstep(cfg, dims, std::move(world), false, std::move(job_ranks)), set_(std::move(set)) {}

  // Over the replicas; under ZeRO, inside the replica first (each data rank's shard).
  std::unique_ptr<GradSync> make_sync(FlatParams& params, int64_t micro_batches,
                                      int64_t total_steps, Tied tied) const override {
    auto share = [this] { return double(share_size()) / double(batch()); };
    if (cfg_.parallel.zero > 0)
      return make_zero_sync(cfg_.parallel, mesh(), params, micro_batches, std::move(tied),
                            {set_->comm(), share});
    return make_replica_sync(cfg_.parallel, set_->comm(), params, micro_batches, total_steps,
                             mesh().coord().tensor, share, std::move(tied));
  }
  void bind(const TrainParts& parts) override {
    take_over_ = parts.take_over;
    hand_over_ = parts.hand_over;
    log_ = &parts.log;
    job_sampler_.emplace(parts.sampler);
  }
  bool writes_files() const override {
    return !set_->joining() && set_->quorum().writer == replica();
  }
  bool state_from_peer() const override { return set_->joining(); }
  // A joining replica enters the set once built, takes its state and trains from the
  // admitting quorum's step.
  RunResult run(TrainParts& parts) override {
    if (set_->joining()) {
      // Admitted from a step past the last (the others saw its request in the last step's
      // vote): they end without a step to hand it their state at.
      if (!set_->join() || set_->quorum().step > parts.total_steps) {
        std::cerr << fmt::format("dtrain: replica {}: the others completed the run before it "
                                 "could join\n", replica());
        return {0, nlohmann::json()};
      }
      receive_or_send_state();
    }
    RunResult r = Lockstep::run(parts);
    if (r.exit_code == 0) set_->finished();
    return r;
  }
  std::string describe() const override {
    const auto& d = mesh().dims();
    return fmt::format("data {} fault-tolerant replicas{}{}{}", set_->count(),
                       d.data > 1 ? fmt::format(" of data {} (ZeRO-{} within)", d.data,
                                                cfg_.parallel.zero) : "",
                       d.tensor > 1 ? fmt::format(" x tensor {}", d.tensor) : "",
                       d.pipeline > 1 ? fmt::format(" x pipeline {}", d.pipeline) : "");
  }
  // "data": the data ranks that train now, over every replica in the quorum.
  nlohmann::json layout() const override {
    return {{"data", set_->count() * mesh().dims().data}, {"tensor", mesh().dims().tensor},
            {"pipeline", mesh().dims().pipeline}};
  }

  // Over the replica's own ranks first (a tensor rank past the first adds no loss), then
  // over the replicas: every rank of every replica reads the same figures and judges the
  // step alike. A failure of the first is the replica's end (its ranks are restarted
  // together); of the second, the step's vote.
  void agree(int64_t /*n*/, torch::Tensor figures, ReduceOp op) override {
    if (mesh().world()->size() > 1) mesh().world()->all_reduce(figures, op);
    if (set_->count() > 1) set_->comm()->all_reduce(figures, op);
  }
  // Every rank of the job has a slot in the figures (a replica that is out leaves its own
  // empty): the slowest rank is named across replicas.
  RankInJob rank_in_job() const override {
    const auto& o = set_->options();
    const int64_t ranks = o.replicas * o.place.count;
    return {ranks > 1 ? ranks : 0, o.world_rank(replica())};
  }
  // The data ranks that summed step n's losses: the quorum that trained it (which may have
  // changed by the time they are read, two steps later), each replica's data ranks.
  int64_t replicas(int64_t n) const override {
    const auto it = trained_by_.find(n);
    return (it != trained_by_.end() ? it->second : set_->count()) * mesh().dims().data;
  }
  double loss_weight() const override {
    return double(share_size() * set_->count() * mesh().dims().data) / double(batch());
  }
  // The replica's share dealt again among its data ranks: data rank i of D in replica k of
  // K takes share i x K + k of K x D, whose union over i is replica k's share of K.
  ShardedSampler share(const ShardedSampler& job) const override {
    const int64_t inside = mesh().dims().data;
    return job.reshared(mesh().coord().data * set_->count() + set_->index(),
                        set_->count() * inside);
  }
  void before_step(int64_t n) override {
    const auto& ft = cfg_.fault_tolerance;
    if (ft.debug_kill_rank == set_->options().world_rank(replica()) && n == ft.debug_kill_step)
      std::raise(SIGKILL);
    if (set_->quorum().step == n) receive_or_send_state();  // a quorum with joiners starts
  }
  bool commit(int64_t n) override {
    const bool wrote = writes_files();
    trained_by_[n] = set_->count();
    trained_by_.erase(trained_by_.begin(), trained_by_.lower_bound(n - 8));  // long read
    const bool ok = set_->commit(n);
    if (!wrote && writes_files() && take_over_) take_over_();
    return ok;
  }

 private:
  int64_t replica() const { return set_->replica(); }
  // Once per quorum that admitted replicas: the source's state into theirs, over the set.
  // A failure on the way (a member gone) fails the joiners, which cannot train without the
  // state; the others go on, and the next step's vote forms a quorum without the dead.
  void receive_or_send_state() {
    const Quorum& q = set_->quorum();
    if (q.joining.empty() || handed_ == q.id) return;
    handed_ = q.id;
    const auto& m = q.members;
    const int64_t source = std::find(m.begin(), m.end(), q.source) - m.begin();
    const bool joins = std::find(q.joining.begin(), q.joining.end(), replica()) != q.joining.end();
    const auto& comm = *set_->comm();
    Handover h;
    try {
      h = hand_over_(*set_->comm(), source, joins);
    } catch (const std::exception&) {  // a garbled header, where the group failed
      if (!comm.failed()) throw;
    }
    if (comm.failed()) {
      fail_if<DistError>(joins, "live recovery: replica {} could not take its state from "
                         "replica {}: {}", replica(), q.source, comm.error());
      return;
    }
    fail_if<DistError>(joins && !h.identical(),
                       "live recovery: the state replica {} took from replica {} hashes to "
                       "{:016x} here, {:016x} there: it is not identical to its source",
                       replica(), q.source, h.mine, h.source);
    log_->say(fmt::format("replica(s) {} joined at step {}: state from replica {} over the "
                          "group, no checkpoint read (hash {:016x})",
                          fmt::join(q.joining, ", "), q.step, q.source, h.source));
  }
  int64_t batch() const { return cfg_.data.batch_size; }
  int64_t share_size() const { return share(*job_sampler_).rank_batch(); }

  std::shared_ptr<ReplicaSet> set_;
  std::function<void()> take_over_;
  std::function<Handover(Comm&, int64_t, bool)> hand_over_;
  RunLog* log_ = nullptr;
  int64_t handed_ = -1;  // the last quorum whose joiners took their state
  std::optional<ShardedSampler> job_sampler_;  // the job's, once bound
  std::map<int64_t, int64_t> trained_by_;      // step -> its quorum's size, the last few
};

}  // namespace

std::unique_ptr<Mode> make_replicas_mode(const JobConfig& cfg, const ParallelDims& dims,
                                         std::shared_ptr<Comm> world,
                                         std::shared_ptr<ReplicaSet> set) {
  auto job_ranks = set->options().ranks;
  return std::make_unique<Replicas>(cfg, dims, std::move(world), std::move(set),
                                    std::move(job_ranks));
}

}  // namespace dtrain
