// A run's checkpoints, collectively (torchtitan's CheckpointManager): the run directory
// claimed and locked and the checkpoint to resume from chosen, once; then checkpoints
// saved from the Stateful components (stateful.hpp) and restored into them. It collects,
// writes, verifies and reads; what each component holds is the component's.
//
// Saving, over the ranks that hold the run: rank 0 opens the temporary folder; every rank
// of the first data replica writes what it holds of the model and the optimizer (its
// stage's tensors, ".ppN", of split tensors its tensor rank's part, ".tpT"), every data
// rank what it keeps of its own (sync.dpD); rank 0 commits once every part is written,
// trainer.json and the manifest last. No rank moves on (or exits) before the checkpoint
// is complete, and if a part could not be written every rank stops with the writer's
// reason. A checkpoint resumes on any layout: each component takes its part of what was
// saved at full logical shapes.
#pragma once
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "checkpoint/checkpoint.hpp"
#include "checkpoint/stateful.hpp"
#include "comm/comm.hpp"
#include "config/config.hpp"
#include "parallel/dims.hpp"
#include "util/files.hpp"

namespace dtrain {

// Collective over `group`: its rank 0 runs `part` (which may throw) and every rank learns
// how it went: the value it returned, or its failure, which every rank then throws with
// rank 0's exit code (rank 0 with its message, the others pointing at rank 0; `what`
// completes "could not ..."). No rank is left waiting in a collective rank 0 never enters.
int64_t root_does(Comm& group, const std::string& what, const std::function<int64_t()>& part);
// Collective over `group`: every rank runs `part` and all learn whether every one
// succeeded; if one failed, every rank throws (the failed one with its message, the others
// naming it), rank 0 having first run `undo`.
void every_rank_does(Comm& group, const std::string& what, const std::function<void()>& part,
                     const std::function<void()>& undo);

class Checkpointer {
 public:
  struct Options {
    std::string run_dir;
    CheckpointConfig cfg;
    std::string resume;  // "" fresh, "auto" newest valid if any, else a checkpoint folder
    std::string run_id;  // torchrun's elastic run (a worker it restarts continues it)
    ParallelDims layout;
    Coord at;            // this rank's place in it
    // Where rank 0 says what it did (the checkpoint written, a damaged one skipped).
    std::function<void(const std::string&)> say;
  };
  // `group`: the ranks that hold the run; its rank 0 writes.
  Checkpointer(Options opts, std::shared_ptr<Comm> group);

  // Collective. Rank 0 creates and locks the run directory and decides which checkpoint
  // (if any) the job resumes from; the others follow, or fail together with rank 0's exit
  // code. The lock is held while the Checkpointer lives.
  std::optional<std::string> open();
  // Collective: a checkpoint of step `step` from every component, in order.
  void save(int64_t step, int64_t epoch, const std::optional<Metric>& metric,
            const std::string& config_yaml, const std::vector<Stateful*>& parts);
  // Every rank reads the checkpoint in `folder` and each component takes its part.
  void restore(const std::string& folder, const std::vector<Stateful*>& parts);
  const std::string& run_dir() const { return opts_.run_dir; }

 private:
  int64_t claim_and_choose();

  Options opts_;
  std::shared_ptr<Comm> group_;
  std::optional<DirLock> lock_;            // rank 0
  std::unique_ptr<CheckpointStore> store_;  // rank 0
};

}  // namespace dtrain
