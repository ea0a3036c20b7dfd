// The lock-step loop (sync and local SGD): the cadence of steps, their reading, evaluation,
// checkpoints and stopping. What happens inside a step is step.cpp's; what a read step
// means (its line, a non-finite value, the summaries) is the run log's.
//
// The host does not wait for the device between steps: a step's figures are read
// kReadLag steps after it was queued, except before anything that must not see a
// non-finite step (an evaluation, a checkpoint, the end) and where the ranks meet after
// steps apart (local SGD), where every pending step is read first.
//
// Where a meeting may send the ranks back (LoopBody::may_go_back), a step between meetings
// is recorded (its line written) once the next meeting stands; one that sends them back
// takes the steps since the earlier meeting with it, unrecorded, and the loop trains them
// again: the lines and the summary hold each step once, as it stood.
//
// Under checkpoint.async a checkpoint is written while the next steps run, and committed
// where the ranks meet once all have written; the last step's and a stop's are written at
// once, after the one in flight.
#pragma once
#include <cstdint>
#include <string>

#include "run/cadence.hpp"
#include "run/run_log.hpp"
#include "run/step.hpp"

namespace dtrain {

// What the loop drives: in a run, the step's phases, the evaluator and the checkpointer
// (Lockstep::run); in a test, stand-ins.
class LoopBody {
 public:
  virtual ~LoopBody() = default;
  // Queues step n (from 1); `logged` and `kept` as train_step's.
  virtual PendingStep step(int64_t n, bool logged, bool kept) = 0;
  // Its figures, once every earlier step's have been read.
  virtual StepStats read(PendingStep& p) = 0;
  // Where a non-finite step n came from, for the messages.
  virtual Culprit culprit(int64_t n, const StepStats& s) const = 0;
  virtual void evaluate(int64_t n) = 0;
  // A checkpoint after step n (`evaluated`: with that step's evaluation as its metric),
  // written while the next steps run when `background` (checkpoint.async).
  virtual void save(int64_t n, bool evaluated, bool background) = 0;
  // Where the ranks meet after step n, while a background checkpoint is in flight: its
  // progress (committed once every rank has written).
  virtual void poll_save(int64_t /*n*/) {}
  // Before the run ends (completed, stopped, diverged): the background checkpoint done.
  virtual void finish_save() {}
  // A stop signal's end, after its checkpoint: the run's result.
  virtual RunResult stop(int sig) = 0;
  // Whether a step where the ranks meet may come back discarded with every step since an
  // earlier meeting (PendingStep::back_to; local SGD under fault tolerance).
  virtual bool may_go_back() const { return false; }
};

// Runs steps start + 1 .. total of `body` at `cadence`, recording them in `log`; the step
// number is the loop's (log.state().step follows it). Ends completed (the summary and the
// "done" line), stopped by a signal (after a checkpoint), or with DivergedError or another
// dtrain::Error (a "failed" summary) thrown.
RunResult lockstep_loop(LoopBody& body, RunLog& log, const Cadence& cadence, int64_t total,
                        const JobConfig& cfg);

}  // namespace dtrain
