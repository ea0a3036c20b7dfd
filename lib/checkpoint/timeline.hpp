// A run's timeline of checkpoints, RUN_DIR/checkpoints/. Its line is the step-* folders
// there, each written after the one before from the same training; `latest` names the
// line's head: the checkpoint the run last wrote, or resumed from. `--resume auto` follows
// `latest` (falling back along the line past a head that does not verify).
//
// A resume from anything but the head starts a new branch: from an older checkpoint (a
// rollback, e.g. another learning rate after a loss spike), from a checkpoint of another
// line (an abandoned branch, another run), or past a head that does not verify. The line's
// checkpoints that are not behind the one resumed are kept aside in
// checkpoints/abandoned/branch-K/ (with branch.json: from where, when, what), where
// keep_last never counts them, nothing overwrites them and `auto` never takes them; a
// user may still name one. `latest` is pointed at the resumed checkpoint first, then the
// folders move: a crash between the two leaves a head whose next resume sets aside the
// rest. (The anchors do not branch: Megatron's latest_checkpointed_iteration.txt and
// torchtitan's highest step folder both resume the abandoned future, and a save of a step
// number that exists there overwrites it.)
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace dtrain {

// "step-00000500": the folder of step 500's checkpoint.
std::string checkpoint_name(int64_t step);
bool is_checkpoint_name(const std::string& name);

// The checkpoint folder a pointer file (`latest`, `best`) names: a folder beside it
// ("step-00000500"), one under it ("abandoned/branch-1/step-00000500"), or an absolute
// path (a resume from another run directory). std::nullopt when the file does not exist;
// CheckpointError when it names nothing a pointer may name.
std::optional<std::string> follow_pointer(const std::string& pointer);

// What `--resume auto` resumes from: the head if it verifies, else the newest folder of
// the line older than the head that does, with the reason for each it passed.
struct CheckpointScan {
  struct Damaged {
    std::string folder, why;
  };
  std::optional<std::string> newest_valid;
  nlohmann::json newest_manifest;  // its manifest, as verified (null when none verifies)
  std::vector<Damaged> skipped;    // the head and older folders that did not verify
  size_t folders = 0;              // checkpoints the run directory holds (the line's, the head)
};

// Where a new branch starts, and what it set aside (Timeline::continue_from).
struct Branch {
  int64_t step = 0;                 // the resumed checkpoint's: the branch's first is step + 1
  std::string resumed;              // its folder
  // Whether it is one of the line's: the line up to it stays, its metrics lines too;
  // otherwise (another line's: an abandoned branch, another run) the whole line goes.
  bool on_line = true;
  std::string kept_in;              // the folder holding what was set aside ("": nothing was)
  std::vector<int64_t> set_aside;   // the steps of the checkpoints kept there
};

class Timeline {
 public:
  explicit Timeline(std::string dir) : dir_(std::move(dir)) {}  // RUN_DIR/checkpoints

  // The line's folder names, oldest first (zero-padded names sort by step).
  std::vector<std::string> line() const;
  // The folder `latest` names, if any (whether or not it verifies).
  std::optional<std::string> head() const { return follow_pointer(dir_ + "/latest"); }
  std::optional<std::string> best() const { return follow_pointer(dir_ + "/best"); }
  CheckpointScan resume_point() const;

  // A checkpoint of the line just committed (its folder name) is the head; it is best when
  // `metric` (the manifest's {name, value, higher_is_better}) beats best's.
  void advance(const std::string& name, const nlohmann::json& metric, bool keep_best);
  // Makes the checkpoint in `folder`, which the run resumed from, the head. Every folder
  // of the line not behind it is set aside in a new branch folder, and `best` moves to the
  // best of what stays; returns the branch, none when the run goes on along its line (from
  // the head, or from the newest folder of a line without a head). Throws what the file
  // system throws.
  std::optional<Branch> continue_from(const std::string& folder);

 private:
  std::string pointer_to(const std::string& folder) const;
  void point(const char* pointer, const std::optional<std::string>& folder) const;
  std::optional<std::string> best_of_line() const;

  std::string dir_;
};

}  // namespace dtrain
