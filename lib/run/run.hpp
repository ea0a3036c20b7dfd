// A training run as named components (torchtitan's Trainer fields), built once by
// build_run() (setup.cpp) and handed piece by piece to what uses each: the step takes the
// runner, the gradient sync, the flat parameters and the optimizer; the loop the step, the
// run log, the evaluator and the checkpointer; a training mode the run.
//
//   a batch's path   loader -> runner (forward, loss, backward; the sync's hooks reduce
//                    the gradient into `params`) -> sync.finish -> clip, optimizer.step
//                    -> mode.after_update -> the figures read by the run log
//   its state        every Stateful component (stateful()) saves itself into a checkpoint
//                    and loads itself back (checkpoint/checkpointer.hpp)
#pragma once
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "checkpoint/checkpointer.hpp"
#include "config/config.hpp"
#include "data/dataset.hpp"
#include "data/sampler.hpp"
#include "grad/grad_sync.hpp"
#include "launch/world.hpp"
#include "logging/metrics.hpp"
#include "optim/optimizer.hpp"
#include "parallel/flat_params.hpp"
#include "pipeline/runner.hpp"
#include "precision/loss_scaler.hpp"
#include "run/mode.hpp"
#include "run/model_parts.hpp"
#include "run/run_log.hpp"
#include "run/trainer.hpp"

namespace dtrain {

struct Run {
  JobConfig cfg;
  RunOptions opts;
  WorldInfo world;
  std::shared_ptr<Comm> job;  // every process of the job
  Mode* mode = nullptr;       // run_training's
  DataSplits data;
  std::optional<ShardedSampler> sampler;
  int64_t total_steps = 0, steps_per_epoch = 1;
  bool finished = false;  // resumed at or past total_steps: nothing to train
  ModelParts model;
  std::unique_ptr<FlatParams> params;
  std::unique_ptr<Optimizer> optimizer;
  std::unique_ptr<GradSync> sync;
  std::unique_ptr<LossScaler> scaler;  // fp16 only
  std::unique_ptr<MicroBatchRunner> runner;
  std::unique_ptr<Checkpointer> checkpointer;  // ranks that hold the run
  std::unique_ptr<MetricsLog> metrics;         // their rank 0
  std::unique_ptr<Progress> progress;
  std::unique_ptr<RunLog> log;
  // The components that save their state, in the order they are saved and restored.
  std::vector<std::unique_ptr<Stateful>> savers;  // the run's own (weights, run state...)

  const Mesh& mesh() const { return mode->mesh(); }
  const c10::Device& device() const { return opts.device; }
  RunState& state() { return log->state(); }
  const RunState& state() const { return log->state(); }
  void say(const std::string& line) const { log->say(line); }
  // Every Stateful component of the run, the mode's included.
  std::vector<Stateful*> stateful() const;
};

// What a mode is given of `run` (mode.hpp), which must outlive it.
TrainParts train_parts(Run& run);

// Builds the run for `run.mode`: threads, data, model, optimizer, gradient sync; resumes
// when asked. Collective over the job.
void build_run(Run& run);

// Collective over the ranks that hold the run: a checkpoint after step n from every
// Stateful component (`evaluated`: with that step's evaluation as its metric), written in
// the background when `background` (checkpoint.async). The time it holds up training goes
// to the run log (checkpoint_stall_ms).
void save_checkpoint(Run& run, int64_t n, bool evaluated, bool background = false);
// Collective, where the ranks meet: the background checkpoint's progress (Checkpointer::
// poll), or with `wait` its end (finish).
void checkpoint_progress(Run& run, bool wait);
// This replica writes the run directory from now on (TrainParts::take_over).
void take_over_files(Run& run);

}  // namespace dtrain
