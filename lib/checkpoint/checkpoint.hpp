// Checkpoints: RUN_DIR/checkpoints/step-XXXXXXXX/, written under a temporary name, every
// file fsynced, then renamed into place. manifest.json lists each file with its size and
// CRC-32; a folder whose manifest is missing or does not match does not count as a checkpoint.
#pragma once
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

#include "checkpoint/safetensors.hpp"
#include "config/config.hpp"

namespace dtrain {

inline constexpr int kCheckpointVersion = 1;

// Everything that affects the next step.
struct CheckpointState {
  NamedTensors model;        // parameters and buffers, by module path
  NamedTensors optimizer;    // per-parameter slots and scalars
  nlohmann::json trainer;    // step, epoch, position in the epoch, RNG, counters
  std::string config_yaml;   // the resolved job that wrote it
};

struct Metric {
  std::string name;              // the task's metric, e.g. "accuracy" or "perplexity"
  double value;
  bool higher_is_better = true;  // which way "best" goes
};

class CheckpointStore {
 public:
  CheckpointStore(std::string run_dir, const CheckpointConfig& cfg);

  // Writes the checkpoint for `step`, points `latest` (and `best` when `metric` beats it)
  // at it, and prunes beyond checkpoint.keep_last. Returns the folder.
  std::string save(const CheckpointState& state, int64_t step, int64_t epoch,
                   const nlohmann::json& layout, const std::optional<Metric>& metric);
  // The newest folder that verifies, if any.
  std::optional<std::string> newest_valid() const;
  std::string dir() const { return dir_; }

 private:
  std::optional<std::string> best() const;
  void prune();

  std::string dir_;
  CheckpointConfig cfg_;
};

// Checks the manifest against the files; returns the manifest or throws CheckpointError.
nlohmann::json verify_checkpoint(const std::string& folder);
// Verifies, then reads everything.
CheckpointState load_checkpoint(const std::string& folder);

}  // namespace dtrain
