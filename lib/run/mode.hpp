// A training mode: how the ranks' parameters move and who updates them, over the whole run
// (Marian's GraphGroup family). One interface; each mode is one file in run/modes/ and one
// line in run/modes/registry.cpp:
//   sync       every step's gradient averaged over the data group, every rank meets after
//              every step (modes/sync.cpp)
//   local_sgd  each data replica steps alone, averaged every few steps (modes/local_sgd.cpp)
//   async_ps   parameter servers and workers that never wait for one another
//              (modes/async_ps.cpp)
// A mode says what it refuses and what it needs from the backend (ModeSpec: validation and
// the launcher ask), builds the groups its rank trains in, lays out the flat buffers and
// the gradient sync, keeps its own state (Stateful), and runs the rank's part of the run.
// The lock-step modes share one loop (run/loop.hpp) and differ only where they meet.
// fault_tolerance: replicas runs the sync mode's step as a replica of its own among the
// job's set of them (modes/replicas.cpp: make_replicas_mode, not a parallel.mode).
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "checkpoint/handover.hpp"
#include "checkpoint/stateful.hpp"
#include "comm/comm.hpp"
#include "config/config.hpp"
#include "data/sampler.hpp"
#include "grad/grad_sync.hpp"
#include "grad/sync_cost.hpp"
#include "parallel/dims.hpp"
#include "parallel/flat_params.hpp"
#include "parallel/mesh.hpp"
#include "run/run_log.hpp"

namespace dtrain {

class Dataset;
class LossScaler;
class MicroBatchRunner;
class Optimizer;
class ReplicaSet;
struct ModelParts;

// What a mode is given of the built run (run/run.hpp's train_parts): the components a rank
// trains with, and the run's own services (evaluation, checkpoints) as calls; not the run,
// its building or what owns the parts.
struct TrainParts {
  const JobConfig& cfg;
  Comm& job;  // every process of the job
  const ModelParts& model;
  FlatParams& params;
  Optimizer& optimizer;
  GradSync& sync;
  MicroBatchRunner& runner;
  LossScaler* scaler;  // fp16 only
  const Dataset& train;
  const ShardedSampler& sampler;
  RunLog& log;
  int64_t total_steps, steps_per_epoch;
  bool finished;  // resumed at or past total_steps: nothing to train
  c10::Device device;
  std::string requeue_job;  // where a stop puts the job back in the queue ("": not)
  // Collective over the ranks that hold the run: evaluate after step n and report it; a
  // checkpoint after step n (run.hpp's save_checkpoint, checkpoint_progress).
  std::function<void(int64_t n)> evaluate;
  std::function<void(int64_t n, bool evaluated, bool background)> save;
  std::function<void(bool wait)> save_progress;
  // From now on this rank's world writes the run directory: a fault-tolerant job's replica
  // that wrote it failed (run/modes/replicas.cpp).
  std::function<void()> take_over;
  // Collective over `group`: every stateful component's state from group rank `source`
  // into this member's where it `receives` (checkpoint/handover.hpp).
  std::function<Handover(Comm& group, int64_t source, bool receive)> hand_over;
};

// How the held-out set is split for an evaluation: part `part` of `parts` on this rank,
// the sums added over the mesh's data ranks and then by `across` (a fault-tolerant job's
// other replicas), which says false where that failed: each rank then scores its replica's
// share of the whole set instead (run/evaluator.cpp).
struct EvalSplit {
  int64_t part = 0, parts = 1;
  std::function<bool(torch::Tensor& sums)> across;  // null: none beyond the mesh
};

class Mode {
 public:
  virtual ~Mode() = default;
  // The groups this rank trains in: the job's mesh, or its role's share of the job.
  virtual const Mesh& mesh() const = 0;
  // Whether this rank holds the run: opens the run directory, restores, writes the logs
  // and checkpoints (rank 0 of them writes); and whether it reads training data.
  virtual bool holds_run() const { return true; }
  virtual bool reads_data() const { return true; }
  // How the flat buffers are laid out, the part this rank updates, and its gradient sync.
  virtual void shape_flat(FlatOptions& opts) const = 0;
  virtual Shard update_shard(const FlatParams& params) const = 0;
  // `total_steps`: the run's length, which parallel.compression_warmup: auto is a share of.
  virtual std::unique_ptr<GradSync> make_sync(FlatParams& params, int64_t micro_batches,
                                              int64_t total_steps, Tied tied) const = 0;
  // Whether this rank's world writes the run directory (its rank 0: logs, checkpoints):
  // all but a fault-tolerant job's replicas other than the writing one, which only read it.
  virtual bool writes_files() const { return true; }
  // Whether this rank takes its state from a peer as it starts training (a replica that
  // joins a fault-tolerant job): it reads no checkpoint.
  virtual bool state_from_peer() const { return false; }
  // The layout in the start line and the summary.
  virtual std::string describe() const { return mesh().dims().str(); }
  virtual nlohmann::json layout() const;
  // Once the run is built, before it is restored: what the mode keeps of it (local SGD the
  // parameters and the optimizer it averages).
  virtual void bind(const TrainParts& /*parts*/) {}
  // The state it carries between steps, saved under its own names (nullptr: none).
  virtual Stateful* state() { return nullptr; }
  // The evaluation after step n: over the mesh's data ranks.
  virtual EvalSplit eval_split(int64_t /*n*/) const {
    return {mesh().coord().data, mesh().dims().data, nullptr};
  }
  // This rank's whole run, once built: steps until the end or a stop. Every rank of the job
  // returns the same exit code.
  virtual RunResult run(TrainParts& parts) = 0;
};

// The lock-step family (sync, local SGD): every rank runs the same steps, and the loop
// (run/loop.hpp) asks the mode where the ranks meet.
class Lockstep : public Mode {
 public:
  // Whether every rank meets after step n (from 1): there a step's figures are agreed over
  // the world, a stop is acted on, and the model is evaluated and checkpointed.
  virtual bool meets(int64_t /*n*/) const { return true; }
  // The ranks that add up step n's figures, and how many data replicas' losses that sum
  // holds: the world and every replica where they meet, else this replica's own ranks.
  virtual Comm& figures_group(int64_t /*n*/) const { return *mesh().world(); }
  virtual int64_t replicas(int64_t /*n*/) const { return mesh().dims().data; }
  // Adds up step n's `figures` over those ranks (kMax: their largest), in place.
  virtual void agree(int64_t n, torch::Tensor figures, ReduceOp op);
  // This rank among the job's (`ranks`: 0 for a job of one): the world's, or a
  // fault-tolerant job's, whose world is its replica's. The figures carry each rank's busy
  // time, and a debug_slow_rank is one of these.
  struct RankInJob {
    int64_t ranks = 0, rank = 0;
  };
  virtual RankInJob rank_in_job() const;
  // After step n's update (local SGD averages the replicas where they meet): the bytes
  // this rank sent, and where a failure since the ranks last met discarded the steps
  // since then (local SGD under fault tolerance), the step whose state the ranks hold
  // again: they train the steps after it again.
  struct AfterUpdate {
    int64_t bytes = 0;
    int64_t back_to = -1;  // -1: step n stands
  };
  virtual AfterUpdate after_update(int64_t /*n*/) { return {}; }
  // Whether after_update may send the ranks back: then a step between meetings is
  // recorded (its line written) only once the meeting after it stands.
  virtual bool may_go_back() const { return false; }
  // How the ranks are apart between meetings, in messages ("" when they always meet).
  virtual std::string apart() const { return ""; }
  // Before step n (from 1) is trained, and again before each time it is trained again.
  virtual void before_step(int64_t /*n*/) {}
  // Whether step n's update is made, asked after its reductions: false where a replica
  // failed and the survivors train step n again (fault tolerance).
  virtual bool commit(int64_t /*n*/) { return true; }
  // How a stop signal (SIGTERM, SIGINT, SIGUSR1) on this rank is voted on: in the step's
  // figures, so that every rank stops after the same step with a checkpoint (true); or,
  // under fault tolerance, in the replicas' vote on the step (false): see ending_after().
  virtual bool stop_in_figures() const { return true; }
  // What the replicas' vote on step n made of stop signals, asked after its update: the
  // job's stop (every member was asked: a checkpoint, then every rank exits), this
  // replica's leaving the job (the others go on without it), or nothing.
  enum class Ending { kNone, kJob, kReplica };
  virtual Ending ending_after(int64_t /*n*/) const { return Ending::kNone; }
  // This rank's share of each global batch now: the job's sampler's, or the survivors'.
  virtual ShardedSampler share(const ShardedSampler& job) const { return job; }
  // How much this rank's loss counts in the figures' sum over replicas(n) (its share's size
  // against an even share's: 1 unless the shares are uneven).
  virtual double loss_weight() const { return 1.0; }
  // The global batch now against data.batch_size (fault_tolerance.batch: shrink: the
  // survivors' shares only).
  virtual double batch_scale() const { return 1.0; }
  // The learning rate's factor: the batch's where an update is over the global batch (the
  // linear rule); a local SGD step's is over the replica's own share, which shrink keeps.
  virtual double lr_scale() const { return batch_scale(); }

  // The job's mesh over `world`; ZeRO's flat layout and gradient sync.
  // `job_ranks`: the world's ranks in the job, where it is not the job's (a fault-tolerant
  // job's replica).
  Lockstep(const JobConfig& cfg, const ParallelDims& dims, std::shared_ptr<Comm> world,
           bool replica_group = false, std::vector<int64_t> job_ranks = {});
  const Mesh& mesh() const override { return mesh_; }
  void shape_flat(FlatOptions& opts) const override;
  Shard update_shard(const FlatParams& params) const override;
  std::unique_ptr<GradSync> make_sync(FlatParams& params, int64_t micro_batches,
                                      int64_t total_steps, Tied tied) const override;
  RunResult run(TrainParts& parts) override;

 protected:
  JobConfig cfg_;
  Mesh mesh_;
};

// What a rank of a mode keeps and sends for its parameters in a step, for the planner
// (plan/), which adds it to the model's and the schedule's costs and names no mode.
struct RankCost {
  SyncCost sync;       // its flat buffers, what it updates, its sync's buffers and bytes
  bool trains = true;  // runs forward and backward (a rank outside the layout may not)
  std::string role;    // its part, for the plan's table ("" when every rank is alike)
};

// The lock-step modes' cost to a rank: the job's gradient sync over `group` (its data
// group), or under fault_tolerance: replicas with ZeRO ZeRO's over the replica's own data
// ranks, each shard then all-reduced across the replicas (HSDP, run/modes/replicas.cpp).
RankCost lockstep_cost(const JobConfig& cfg, const FlatShape& shape, const DataGroup& group,
                       int64_t rank);

// What validation, the launcher and the planner ask of a mode before any process group
// exists.
struct ModeSpec {
  // The mode's own checks: what it cannot run with, the world it needs (ConfigError).
  std::function<void(const JobConfig&, int64_t world)> validate;
  // The ranks of a world of `world` that form the data x tensor x pipeline layout.
  std::function<int64_t(const JobConfig&, int64_t world)> trainers =
      [](const JobConfig&, int64_t world) { return world; };
  // Non-empty when it receives from whichever rank sends first, which a backend must
  // allow (NCCL cannot): why, for the refusal.
  std::string any_source;
  // Non-empty when no layout repeats another's losses (`dtrain verify` cannot compare
  // them): why, for the refusal.
  std::string unrepeatable;
  // A rank's part in the job, for the launcher's messages ("" when all are alike).
  std::function<std::string(const JobConfig&, int64_t rank)> role =
      [](const JobConfig&, int64_t) { return std::string(); };
  // What world rank `rank` keeps and sends for its parameters: `shape` is its pipeline
  // rank's parameters (the whole model's for a rank outside the layout: those are the
  // world's first ranks), `group` where it syncs. Default: the lock-step modes'
  // (lockstep_cost).
  std::function<RankCost(const JobConfig&, const FlatShape& shape, const DataGroup& group,
                         int64_t rank)>
      cost = lockstep_cost;
  // This rank's mode: collective over `world`, whose groups it creates. `dims`: the
  // layout validate() resolved (of the trainers).
  std::function<std::unique_ptr<Mode>(const JobConfig&, const ParallelDims&,
                                      std::shared_ptr<Comm> world)>
      make;
};

// fault_tolerance: replicas (run/modes/replicas.cpp): this replica's mode, the sync mode's
// step over `set`, the replica's own ranks `world` (one process: a local Comm) laid out as
// `dims` (data 1).
std::unique_ptr<Mode> make_replicas_mode(const JobConfig& cfg, const ParallelDims& dims,
                                         std::shared_ptr<Comm> world,
                                         std::shared_ptr<ReplicaSet> set);

// parallel.mode's spec (run/modes/registry.cpp); ConfigError for an unknown one.
const ModeSpec& mode_spec(const std::string& name);
std::vector<std::string> mode_names();  // the registry's, for the config's choices

// A mode's refusals: refuse(bad, what, why) is a ConfigError naming the mode, `what` and why.
struct ModeRefusal {
  std::string mode;
  void operator()(bool bad, const std::string& what, const std::string& why) const;
};

}  // namespace dtrain
