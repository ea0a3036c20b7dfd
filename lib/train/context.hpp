// Everything one training run owns, built once by setup() and shared by the loop, the
// step, the evaluator and the checkpoint code.
#pragma once
#include <cmath>
#include <memory>
#include <optional>
#include <string>

#include "checkpoint/checkpoint.hpp"
#include "config/config.hpp"
#include "data/dataset.hpp"
#include "data/sampler.hpp"
#include "launch/world.hpp"
#include "logging/metrics.hpp"
#include "models/model.hpp"
#include "optim/optimizer.hpp"
#include "parallel/flat_params.hpp"
#include "parallel/grad_sync.hpp"
#include "parallel/mesh.hpp"
#include "precision/loss_scaler.hpp"
#include "train/mode.hpp"
#include "train/runner.hpp"
#include "train/trainer.hpp"
#include "util/files.hpp"

namespace dtrain {

struct EvalResult {
  double loss = 0;    // mean per item (sample or token)
  double metric = 0;  // the task's metric
};

// What changes from step to step and is saved with a checkpoint (with the model and the
// optimizer).
struct RunState {
  int64_t step = 0;                    // optimizer steps done
  double last_loss = std::nan("");
  double best_metric = std::nan("");   // NaN until the first evaluation
  int64_t best_step = 0;
  std::optional<EvalResult> last_eval;
  int64_t last_saved = -1;
  int64_t skipped_in_a_row = 0;        // train.on_nonfinite: skip
  int64_t skipped = 0;
  // Local SGD: the step at which this replica diverged since the ranks last met (0: none).
  // The run ends where they next meet, all together; never saved (nothing is saved then).
  int64_t diverged_at = 0;
  int64_t bytes_sent = 0;  // by this process since it started (not saved)
  // async_ps: the pushes each worker has had applied, its data position (saved). Empty
  // otherwise, and in a fresh run until the servers start.
  std::vector<int64_t> worker_pushes;
};

struct Context {
  Context(const JobConfig& cfg, const ParallelDims& dims, const RunOptions& opts,
          const WorldInfo& world, std::shared_ptr<Comm> comm)
      : cfg(cfg), opts(opts), world(world),
        mesh(cfg.parallel.mode == "async_ps"
                 ? Mesh::for_role(cfg.parallel.servers, std::move(comm))
                 : Mesh(dims, std::move(comm), /*replica_group=*/cfg.parallel.mode == "local_sgd")) {}

  JobConfig cfg;
  RunOptions opts;
  WorldInfo world;
  Mesh mesh;
  DataSplits data;
  const ModelSpec* spec = nullptr;
  const Task* task = nullptr;
  // This rank's share of the model: one network per chunk it holds (several only under
  // interleaved_1f1b), each the whole model's parts of one stage under their global names.
  std::vector<NetworkPtr> chunks;
  std::vector<int64_t> chunk_stage;  // each chunk's global stage: chunk x pipeline + pipeline rank
  int64_t stages = 1;                // global stages: pipeline x virtual_stages
  // Entries of `params` that another stage holds a copy of (GPT's token embedding and its
  // head), kept equal by summing their gradients over the mesh's embedding group;
  // `tied_copy` when this rank holds the head's copy, which the norm and checkpoints leave
  // to the embedding's.
  std::vector<size_t> tied;
  bool tied_copy = false;
  // Every parameter and buffer name of the whole model, whatever this rank holds: what a
  // checkpoint to resume from must hold, no more, no less.
  std::vector<std::string> model_names;
  std::unique_ptr<MicroBatchRunner> runner;
  std::unique_ptr<FlatParams> params;
  std::unique_ptr<Optimizer> optimizer;
  std::unique_ptr<GradSync> sync;
  std::unique_ptr<TrainingMode> mode;
  std::unique_ptr<LossScaler> scaler;  // fp16 only
  std::optional<ShardedSampler> sampler;
  int64_t total_steps = 0;
  bool finished = false;  // resumed at or past total_steps: nothing to train
  std::optional<DirLock> run_dir_lock;           // rank 0: held for the whole run
  std::unique_ptr<CheckpointStore> checkpoints;  // rank 0 (async_ps: server 0)
  std::unique_ptr<MetricsLog> metrics;           // rank 0 (async_ps: server 0)
  std::unique_ptr<Progress> progress;
  RunState state;

  bool root() const { return mesh.is_root(); }
  bool worker() const { return mesh.role() == Role::kWorker; }
  bool holds_first() const { return chunk_stage.front() == 0; }
  bool holds_last() const { return chunk_stage.back() == stages - 1; }
  // The buffers this rank holds (BatchNorm's statistics), by their names in the model.
  NamedTensors named_buffers() const;
  void set_training(bool on) const;
  const c10::Device& device() const { return opts.device; }
  torch::MemoryFormat format() const { return spec->format; }
  int64_t steps_per_epoch() const { return sampler->steps_per_epoch(); }
  // Items per sample: 1, or the tokens of a window (for tokens/s).
  int64_t items_per_sample() const { return task->items_per_sample(data.sample_shape); }
  void say(const std::string& line) const {
    if (root()) progress->print(line);
  }
};

// Builds the run: threads, data, model, optimizer, gradient sync; resumes when asked.
void setup(Context& c);

}  // namespace dtrain
