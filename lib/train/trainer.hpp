// Runs one training job: data, model, optimizer, the step loop, evaluation, checkpoints
// and logs, in one process.
#pragma once
#include <string>

#include <nlohmann/json.hpp>

#include "config/config.hpp"

namespace dtrain {

struct RunOptions {
  std::string resume;  // "" = fresh, "auto" = newest valid checkpoint if any, else a folder
};

struct RunResult {
  int exit_code = 0;          // 0, or 128 + signal after a preemption checkpoint
  nlohmann::json summary;     // the summary line written to metrics.jsonl
};

// `cfg` must be resolved and validated. Throws dtrain::Error subclasses on failure.
RunResult run_training(const JobConfig& cfg, const RunOptions& opts);

}  // namespace dtrain
