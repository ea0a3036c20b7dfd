// Runs one training job on this process's share of the world: the entry point the
// executable calls. The run is split by concern:
//   setup.cpp       threads, data, model, optimizer, gradient sync, resume
//   loop.cpp        the cadence: steps, logs, evaluation, checkpoints, stopping
//   step.cpp        one optimizer step, in numbered phases
//   evaluator.cpp   the held-out split, over the data-parallel group
//   state.cpp       choosing, writing and restoring checkpoints
//   report.cpp      the metrics lines' keys
#pragma once
#include <memory>
#include <string>

#include <c10/core/Device.h>
#include <nlohmann/json.hpp>

#include "comm/comm.hpp"
#include "config/config.hpp"
#include "launch/world.hpp"
#include "parallel/dims.hpp"

namespace dtrain {

struct RunOptions {
  std::string resume;  // "" = fresh, "auto" = newest valid checkpoint if any, else a folder
  // The SLURM job to requeue after a SIGUSR1 checkpoint ("" = none: not under SLURM, or
  // dist.requeue / --no-requeue turned it off).
  std::string requeue_job;
  // Where this rank computes (plan_device's choice for it).
  c10::Device device = c10::Device(c10::kCPU);
};

struct RunResult {
  int exit_code = 0;          // 0, or 128 + signal after a preemption checkpoint
  nlohmann::json summary;     // the summary line written to metrics.jsonl
};

// `cfg` must be resolved and validated for world.world processes (`dims` is what
// validate() returned); `comm` spans them all (make_local_comm() for one). Throws
// dtrain::Error subclasses on failure.
RunResult run_training(const JobConfig& cfg, const ParallelDims& dims, const RunOptions& opts,
                       const WorldInfo& world, std::shared_ptr<Comm> comm);

}  // namespace dtrain
