// The lock-step family's share (run/mode.hpp): the job's mesh, ZeRO's layout of the flat
// buffers and the gradient sync, and the loop over the run's components.
#include <fmt/format.h>

#include "data/loader.hpp"
#include "grad/zero.hpp"
#include "optim/optimizer.hpp"
#include "pipeline/runner.hpp"
#include "run/loop.hpp"
#include "run/mode.hpp"
#include "run/step.hpp"

namespace dtrain {

Lockstep::Lockstep(const JobConfig& cfg, const ParallelDims& dims, std::shared_ptr<Comm> world,
                   bool replica_group, std::vector<int64_t> job_ranks)
    : cfg_(cfg), mesh_(dims, std::move(world), replica_group, std::move(job_ranks)) {}

void Lockstep::agree(int64_t n, torch::Tensor figures, ReduceOp op) {
  Comm& group = figures_group(n);
  if (group.size() > 1) group.all_reduce(std::move(figures), op);
}

Lockstep::RankInJob Lockstep::rank_in_job() const {
  const int64_t world = mesh_.world()->size();
  return {world > 1 ? world : 0, mesh_.rank()};
}

void Lockstep::shape_flat(FlatOptions& opts) const {
  shard_flat(cfg_.parallel, mesh_.dims(), mesh_.coord(), opts);
}

Shard Lockstep::update_shard(const FlatParams& params) const {
  return dtrain::update_shard(cfg_.parallel, mesh_.dims(), mesh_.coord(), params);
}

std::unique_ptr<GradSync> Lockstep::make_sync(FlatParams& params, int64_t micro_batches,
                                              int64_t total_steps, Tied tied) const {
  return make_grad_sync(cfg_.parallel, mesh_, params, micro_batches, total_steps,
                        std::move(tied));
}

RankCost lockstep_cost(const JobConfig& cfg, const FlatShape& shape, const DataGroup& group,
                       int64_t /*rank*/) {
  if (cfg.fault_tolerance.mode != "replicas" || cfg.parallel.zero == 0)
    return RankCost{grad_sync_cost(cfg.parallel, shape, group), true, ""};
  DataGroup inside = group;
  inside.ranks = cfg.fault_tolerance.replica_data;
  inside.rank = group.rank % inside.ranks;
  RankCost c{grad_sync_cost(cfg.parallel, shape, inside), true, ""};
  c.sync.bytes = c.sync.bytes.value_or(0) +
                 ring_all_reduce_share(4 * double(c.sync.shard), group.ranks / inside.ranks);
  c.sync.ops += 1;
  return c;
}

namespace {

// The loop's body over a run's components.
class RunBody : public LoopBody {
 public:
  RunBody(TrainParts& run, Lockstep& mode)
      : run_(run),
        share_(mode.share(run.sampler)),
        loader_(load(share_, run.log.state().step)),
        parts_{run.runner,  run.sync, run.params,     run.optimizer, run.scaler,
               mode.mesh(), mode,     run.model.tied, run.cfg,       run.total_steps,
               run.device},
        mode_(mode),
        next_(run.log.state().step + 1) {
    run.runner.deal(share_.rank(), share_.ranks());
  }

  PendingStep step(int64_t n, bool logged, bool kept) override {
    mode_.mesh().world()->note_step(n);
    for (;;) {
      mode_.before_step(n);  // again for a step trained again: its new quorum may admit
      // The survivors of a failed replica deal the global batch anew (fault tolerance),
      // from where the loop is: a step after the last one, where it went back.
      if (const auto share = mode_.share(run_.sampler);
          !share.same_shares(share_) || n != next_)
        share_ = share, loader_ = load(share_, n - 1), run_.runner.deal(share.rank(), share.ranks());
      double wait_ms = 0;
      Batch batch = loader_->next(&wait_ms);
      auto p = train_step(parts_, n, batch, wait_ms, logged, kept, apart_diverged());
      if (!p.discarded || p.back_to >= 0) {  // going back is the loop's
        next_ = p.discarded ? -1 : n + 1;
        return p;
      }
      loader_ = load(share_, n - 1);  // step n's batch again
    }
  }
  bool may_go_back() const override { return mode_.may_go_back(); }
  StepStats read(PendingStep& p) override {
    return read_step(parts_, p, apart_diverged(), run_.log.state().skipped_in_a_row);
  }
  Culprit culprit(int64_t n, const StepStats& s) const override {
    Culprit c;
    c.what = fmt::format("step {}", n);
    c.who = fmt::format("rank {}", s.nonfinite_rank);
    c.rank = s.nonfinite_rank;
    c.peers_in_a_row = s.peers_in_a_row;
    if (s.replica_diverged) c.apart = mode_.apart();
    return c;
  }
  void evaluate(int64_t n) override { run_.evaluate(n); }
  void save(int64_t n, bool evaluated, bool background) override {
    if (mode_.writes_files()) run_.save(n, evaluated, background);
  }
  void poll_save(int64_t /*n*/) override { run_.save_progress(/*wait=*/false); }
  void finish_save() override { run_.save_progress(/*wait=*/true); }
  RunResult stop(int sig) override { return run_.log.stopped(sig, run_.requeue_job); }

 private:
  bool apart_diverged() const { return run_.log.state().diverged_at > 0; }
  // The batches of `share` from global step `first` on (0-based).
  std::unique_ptr<Loader> load(const ShardedSampler& share, int64_t first) const {
    const auto& cfg = run_.cfg;
    return std::make_unique<Loader>(
        run_.train, share, first, run_.total_steps, cfg.data.workers, cfg.data.prefetch,
        /*pin=*/run_.device.is_cuda(),
        Augment{cfg.data.augment, cfg.data.crop_padding, uint64_t(cfg.seed)});
  }

  TrainParts& run_;
  ShardedSampler share_;
  std::unique_ptr<Loader> loader_;
  StepParts parts_;
  Lockstep& mode_;
  int64_t next_;  // the step the loader's next batch is for (-1: none)
};

}  // namespace

RunResult Lockstep::run(TrainParts& run) {
  if (run.finished) return {0, nlohmann::json()};
  RunBody body(run, *this);
  Cadence cadence{run.cfg, run.steps_per_epoch, run.total_steps,
                  [this](int64_t n) { return meets(n); }};
  return lockstep_loop(body, run.log, cadence, run.total_steps, run.cfg);
}

}  // namespace dtrain
