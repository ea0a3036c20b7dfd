// Checkpoints: RUN_DIR/checkpoints/step-XXXXXXXX/, written under a temporary name, every
// file fsynced, then renamed into place. manifest.json lists each file with its size and
// CRC-32; a folder whose manifest is missing or does not match does not count as a checkpoint.
//
// The tensors may come in parts written by several processes (a pipeline's stages each
// write model.ppN.safetensors and optimizer.ppN.safetensors; one writer writes
// model.safetensors and optimizer.safetensors): rank 0 begins the temporary folder, every
// writer adds its part, and rank 0 commits once all are written, the manifest last.
#pragma once
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "checkpoint/safetensors.hpp"
#include "config/config.hpp"
#include "parallel/flat_params.hpp"

namespace dtrain {

inline constexpr int kCheckpointVersion = 1;

// Everything that affects the next step.
struct CheckpointState {
  NamedTensors model;        // parameters and buffers, by module path (loaded: every part's)
  NamedTensors optimizer;    // per-parameter slots and scalars
  nlohmann::json trainer;    // step, epoch, position in the epoch, RNG, counters
  std::string config_yaml;   // the resolved job that wrote it
  std::string run_id;        // the elastic run that wrote it (torchrun's), or ""
};

struct Metric {
  std::string name;              // the task's metric, e.g. "accuracy" or "perplexity"
  double value;
  bool higher_is_better = true;  // which way "best" goes
};

// What a run directory holds: the newest checkpoint that verifies, and the newer (or all)
// folders that did not, each with the reason.
struct CheckpointScan {
  struct Damaged {
    std::string folder, why;
  };
  std::optional<std::string> newest_valid;
  nlohmann::json newest_manifest;  // its manifest, as verified (null when none verifies)
  std::vector<Damaged> skipped;  // newer than newest_valid (or all, when none verifies)
  size_t folders = 0;            // step-* folders found, valid or not
};

class CheckpointStore {
 public:
  // Creates RUN_DIR/checkpoints; touches nothing in it.
  CheckpointStore(std::string run_dir, const CheckpointConfig& cfg);

  // Writes the checkpoint for `step`, points `latest` (and `best` when `metric` beats it)
  // at it, and prunes beyond checkpoint.keep_last. Returns the folder. On any failure
  // (a full disk) the temporary folder is removed, earlier checkpoints are untouched, and
  // CheckpointError says what could not be written.
  std::string save(const CheckpointState& state, int64_t step, int64_t epoch,
                   const nlohmann::json& layout, const std::optional<Metric>& metric);

  // The same in three steps for several writers. The temporary folder of step's checkpoint
  // (every rank can name it); begin() makes it afresh.
  static std::string temp_folder(const std::string& run_dir, int64_t step);
  void begin(int64_t step);
  // One writer's tensors into the temporary folder: model`part`.safetensors and
  // optimizer`part`.safetensors (`part` "" for a single writer, ".ppN" for a stage,
  // ".tpT" for a tensor rank, ".ppN.tpT" for both). The tensors named in `parts` are one
  // tensor rank's part of a split tensor: the file's metadata says which, and loading
  // assembles the whole.
  static void write_part(const std::string& temp, const std::string& part,
                         const NamedTensors& model, const NamedTensors& optimizer,
                         const PartsOf& parts = {});
  // Once every part is written: trainer.json, config.yaml and the manifest of every file,
  // then the rename, `latest`, `best` and pruning, as save(). Returns the folder.
  std::string commit(const CheckpointState& state, int64_t step, int64_t epoch,
                     const nlohmann::json& layout, const std::optional<Metric>& metric);
  // Removes what a failed save left of step's temporary folder.
  void abort(int64_t step);
  CheckpointScan scan() const;
  // The newest folder that verifies, if any.
  std::optional<std::string> newest_valid() const { return scan().newest_valid; }
  // Removes the temporary folders of saves a crash cut short (once the run owns the folder).
  void discard_partial();
  std::string dir() const { return dir_; }

 private:
  std::optional<std::string> best() const;
  void prune();

  std::string dir_;
  CheckpointConfig cfg_;
};

// Checks the manifest against the files; returns the manifest or throws CheckpointError.
nlohmann::json verify_checkpoint(const std::string& folder);
// Verifies, then reads everything, every writer's part merged.
CheckpointState load_checkpoint(const std::string& folder);
// What a user may name where a checkpoint folder is expected: the folder itself, a run
// directory or its checkpoints/ folder (their `latest`), or a `latest`/`best` pointer file.
// Returns the checkpoint folder it names; throws CheckpointError when it names none.
std::string resolve_checkpoint(const std::string& path);

}  // namespace dtrain
