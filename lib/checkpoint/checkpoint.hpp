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

#include "util/safetensors.hpp"
#include "checkpoint/timeline.hpp"
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

class CheckpointStore {
 public:
  // Creates RUN_DIR/checkpoints; touches nothing in it.
  CheckpointStore(std::string run_dir, const CheckpointConfig& cfg);

  // A checkpoint in three steps, for several writers. The temporary folder of step's
  // checkpoint (every rank can name it); begin() makes it afresh.
  static std::string temp_folder(const std::string& run_dir, int64_t step);
  void begin(int64_t step);
  // One writer's tensors into the temporary folder: model`part`.safetensors and
  // optimizer`part`.safetensors (`part` "" for a single writer, ".ppN" for a stage,
  // ".tpT" for a tensor rank, ".ppN.tpT" for both). The tensors named in `parts` are one
  // tensor rank's part of a split tensor: the file's metadata says which, and loading
  // assembles the whole.
  static void write_part(const std::string& temp, const std::string& part,
                         const NamedTensors& model, const NamedTensors& optimizer,
                         const PartsOf& parts = {}, bool with_optimizer = true,
                         bool with_model = true);
  // A data rank's shard of the optimizer state (ZeRO; `kind` "optimizer") or of the
  // parameters (ZeRO-3; "model") as `KIND.dpD<part>.safetensors`: pieces of tensors whose
  // places `ranges` gives (the file's metadata says them too), and the rest whole (the
  // optimizer's scalars, the model's buffers); loading merges every data rank's shard.
  // Kind "sync" is a data rank's training-strategy state (gradient compression's
  // residuals), which the data ranks do not hold alike: no ranges, and nothing to merge.
  static void write_shard(const std::string& temp, const std::string& kind, int64_t data_rank,
                          const std::string& part, const NamedTensors& state,
                          const PartsOf& parts, const RangesOf& ranges);
  // Once every part is written: trainer.json, config.yaml and the manifest of every file,
  // then the rename; points `latest` (and `best` when `metric` beats it) at it and prunes
  // the line beyond checkpoint.keep_last (timeline.hpp). Returns the folder. On a failure
  // (a full disk) the temporary folder is removed, earlier checkpoints are untouched, and
  // CheckpointError says what could not be written.
  std::string commit(const CheckpointState& state, int64_t step, int64_t epoch,
                     const nlohmann::json& layout, const std::optional<Metric>& metric);
  // Removes what a failed save left of step's temporary folder.
  void abort(int64_t step);
  // What `--resume auto` takes (Timeline::resume_point).
  CheckpointScan scan() const { return timeline_.resume_point(); }
  std::optional<std::string> newest_valid() const { return scan().newest_valid; }
  Timeline& timeline() { return timeline_; }
  // Removes the temporary folders of saves a crash cut short (once the run owns the folder).
  void discard_partial();
  std::string dir() const { return dir_; }

 private:
  void prune();

  std::string dir_;
  CheckpointConfig cfg_;
  Timeline timeline_;
};

// Checks the manifest against the files; returns the manifest or throws CheckpointError.
nlohmann::json verify_checkpoint(const std::string& folder);
// Verifies, then reads everything, every writer's part merged.
CheckpointState load_checkpoint(const std::string& folder);

// A verified checkpoint whose tensors are read on demand: only the headers are read up
// front, then each tensor from the parts that hold it. A rank that restores reads its own
// stage's tensors only, and of a tensor saved with the split it needs only its own part
// (another split: the whole, assembled, then its slice).
class CheckpointReader {
 public:
  explicit CheckpointReader(const std::string& folder);
  CheckpointReader(const CheckpointReader&) = delete;  // tensors() reads through it
  CheckpointReader& operator=(const CheckpointReader&) = delete;
  const std::string& folder() const { return folder_; }
  const nlohmann::json& manifest() const { return manifest_; }
  nlohmann::json trainer() const;
  std::string config_yaml() const;
  // "model", "optimizer" or "sync.dpD" (data rank D's strategy state): every tensor's
  // name, in the order the parts list them; and the tensors, read as a rank needs them
  // (valid while the reader lives).
  bool has(const std::string& kind) const { return kinds_.count(kind) > 0; }
  std::vector<std::string> names(const std::string& kind) const { return kinds_.at(kind).order; }
  SavedTensors tensors(const std::string& kind) const;
  // Every tensor of `kind` whole.
  NamedTensors all(const std::string& kind) const;

 private:
  struct Piece {  // one file's part of a tensor
    size_t file;
    const SafetensorsIndex::Entry* entry;
    int64_t rank;         // the tensor rank whose part it is (0 when whole)
    int64_t offset = -1;  // a ZeRO shard's range of that part's elements: where it starts
  };
  struct Stored {
    std::vector<int64_t> full_shape;
    Placement placement;  // how it was split when saved (replicated: one piece, whole)
    std::vector<Piece> pieces;  // by tensor rank, then offset
    // Saved in ranges (ZeRO's shards): the shape of each tensor rank's part, and whether
    // the ranges run over it channels-last.
    std::optional<RangeOf> ranged;
  };
  struct Kind {
    std::vector<std::string> order;
    std::map<std::string, Stored> stored;
  };
  torch::Tensor read(const Kind& kind, const std::string& name, const Placement& want,
                     int64_t rank) const;
  // Tensor rank `rank`'s part of `st` as saved (from its ranges, when in ranges).
  torch::Tensor read_part(const Stored& st, int64_t rank) const;
  void check_pieces(const std::string& name, Stored& st) const;

  std::string folder_;
  nlohmann::json manifest_;
  std::vector<SafetensorsIndex> files_;
  std::map<std::string, Kind> kinds_;
};
// What a user may name where a checkpoint folder is expected: the folder itself, a run
// directory or its checkpoints/ folder (their `latest`), or a `latest`/`best` pointer file.
// Returns the checkpoint folder it names; throws CheckpointError when it names none.
std::string resolve_checkpoint(const std::string& path);

}  // namespace dtrain
