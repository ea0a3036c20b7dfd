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
//
// checkpoint.async: the same checkpoint, its writing left to a background thread. At the
// step boundary every rank takes its state as now and copies it to host memory (pinned on
// a GPU); then training goes on while its thread writes the files. The ranks learn that
// every part is written where they next meet (poll(): one small all-reduce per boundary,
// only while a save is in flight), and rank 0's thread then commits (the manifest last, so
// until then, or after a crash, `latest` is the previous checkpoint). At most one save is
// in flight: the next save, a stop and the end wait for it (finish()).
#pragma once
#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
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
    // False: the run directory is another's to write (a fault-tolerant job's replica other
    // than the writing one): open() decides the resume alike without locking or tidying
    // the folder, and nothing is saved until take_over().
    bool writer = true;
  };
  // `group`: the ranks that hold the run; its rank 0 writes.
  Checkpointer(Options opts, std::shared_ptr<Comm> group)
      : opts_(std::move(opts)), group_(std::move(group)) {}

  // Collective. Rank 0 creates and locks the run directory and decides which checkpoint
  // (if any) the job resumes from; the others follow, or fail together with rank 0's exit
  // code. The lock is held while the Checkpointer lives.
  std::optional<std::string> open();
  // A reader becomes the writer (the replica that wrote failed): it locks the folder,
  // waiting up to `wait` for the failed writer's lock to go (CheckpointError after).
  void take_over(std::chrono::seconds wait);
  // Rank 0, once every rank has restored `folder`: it becomes the head of the run's line;
  // a rollback's checkpoints past it are kept aside (timeline.hpp). Returns that branch.
  std::optional<Branch> continue_from(const std::string& folder) {
    return store_->timeline().continue_from(folder);
  }
  // Joins a save still in flight (a run that failed): not committed, so the previous
  // checkpoint stays `latest`.
  ~Checkpointer();

  // Collective: a checkpoint of step `step` from every component, in order; written in
  // the background when `background` (checkpoint.async), once any save in flight is done.
  void save(int64_t step, int64_t epoch, const std::optional<Metric>& metric,
            const std::string& config_yaml, const std::vector<Stateful*>& parts,
            bool background = false);
  // Collective, at a step boundary where every rank is: commits the save in flight once
  // every rank has written its part (nothing while none is in flight). A part that could
  // not be written stops every rank, as a synchronous save does.
  void poll() { advance(/*wait=*/false); }
  // Collective: waits for the save in flight, if any, and commits it.
  void finish() {
    while (flight_) advance(/*wait=*/true);
  }
  bool in_flight() const { return flight_ != nullptr; }
  // Every rank reads the checkpoint in `folder` and each component takes its part.
  void restore(const std::string& folder, const std::vector<Stateful*>& parts);

 private:
  int64_t claim_and_choose();
  // One round of the in-flight save's agreement (wait: this rank's thread joined first).
  void advance(bool wait);

  // A save whose files a background thread writes (rank 0's then commits).
  struct Flight {
    int64_t step = 0, epoch = 0;
    std::optional<Metric> metric;
    CheckpointState state;  // trainer.json's entries, the config, the run id
    bool committing = false;
    std::thread thread;
    std::atomic<bool> done{false};
    int code = 0;  // the thread's failure (its exit code), once done
    std::string why;
    std::string folder;  // committed (rank 0)
  };
  // Runs `work` on the flight's thread, its failure kept for the agreement.
  void launch(Flight& f, std::function<void()> work);

  Options opts_;
  std::shared_ptr<Comm> group_;
  std::optional<DirLock> lock_;            // rank 0
  std::unique_ptr<CheckpointStore> store_;  // rank 0
  std::unique_ptr<Flight> flight_;
};

}  // namespace dtrain
