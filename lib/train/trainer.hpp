// Runs one training job: data, model, optimizer, the step loop, evaluation, checkpoints
// and logs, on this process's share of the world.
#pragma once
#include <memory>
#include <string>

#include <nlohmann/json.hpp>

#include "config/config.hpp"
#include "dist/comm.hpp"
#include "launch/world.hpp"

namespace dtrain {

struct RunOptions {
  std::string resume;  // "" = fresh, "auto" = newest valid checkpoint if any, else a folder
};

struct RunResult {
  int exit_code = 0;          // 0, or 128 + signal after a preemption checkpoint
  nlohmann::json summary;     // the summary line written to metrics.jsonl
};

// `cfg` must be resolved and validated for world.world processes; `comm` spans them all
// (make_local_comm() for one). Throws dtrain::Error subclasses on failure.
RunResult run_training(const JobConfig& cfg, const RunOptions& opts, const WorldInfo& world,
                       std::shared_ptr<Comm> comm);

}  // namespace dtrain
