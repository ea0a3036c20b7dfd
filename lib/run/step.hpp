// One optimizer step, whatever the layout, and the reading of what it computed.
//
// The host does not wait for the device between steps. What a step computes for the host
// (the global batch's loss, the gradient norm, whether some rank was asked to stop) stays
// on the device and is copied back as the device gets there; the loop reads it a few steps
// later (read_step), by which time it has usually arrived. On the CPU the copy is
// immediate, but the reading is the same, so both devices behave alike.
#pragma once
#include <chrono>
#include <optional>

#include <c10/core/Event.h>

#include "config/config.hpp"
#include "data/dataset.hpp"
#include "grad/grad_sync.hpp"
#include "optim/optimizer.hpp"
#include "parallel/mesh.hpp"
#include "pipeline/runner.hpp"
#include "precision/loss_scaler.hpp"
#include "run/mode.hpp"
#include "run/run_log.hpp"

namespace dtrain {

// The step's figures travel as one fp64 tensor: one all-reduce over the ranks that agree
// on the step (the mode's figures_group: the world, or between local SGD's averages one
// replica) and one copy to the host move them all. Its slots, for a pipeline of `stages`
// ranks (0 without one):
//   [0, summed())  summed over those ranks: the batch's loss (over the ranks that hold it),
//                  the ranks asked to stop, the ranks whose replica diverged since the last
//                  meeting (local SGD), the ranks whose gradient norm is not finite, and
//                  per pipeline rank its bubble and peak activation memory (each rank adds
//                  its own into its stage's slots), and per world rank its busy time (its
//                  own slot; 0 for a rank that did not agree on the step)
//   grad_norm()    the gradient norm; NaN when not taken. The same on every rank that
//                  syncs gradients; where local SGD's replicas meet, each replica's own, so
//                  whether a step is skipped goes by the summed count above
//   local_loss()   this rank's loss (0 where it has none): names a rank that saw a NaN
struct Figures {
  int64_t stages = 0;
  int64_t ranks = 0;  // the world's, where it has more than one: each rank's busy time
  static constexpr int64_t kLossSum = 0, kStopVotes = 1, kEndVotes = 2, kBadNorms = 3;
  int64_t bubble(int64_t stage) const { return 4 + stage; }
  int64_t activation_mb(int64_t stage) const { return 4 + stages + stage; }
  int64_t busy_ms(int64_t rank) const { return 4 + 2 * stages + rank; }
  int64_t summed() const { return 4 + 2 * stages + ranks; }
  int64_t grad_norm() const { return summed(); }
  int64_t local_loss() const { return summed() + 1; }
  int64_t count() const { return summed() + 2; }
};

struct PendingStep {
  int64_t step = 0;          // the step's number, from 1
  StepStats stats;           // the host's timings now; read_step() adds the device's figures
  torch::Tensor figures;     // Figures' values, on the host once `ready`
  double local_loss = 0;     // this rank's, once read: it names a rank that saw a NaN
  bool norm_taken = false;   // whether the norm was taken (else it reads NaN)
  bool bad_norm = false;     // whether a rank that agreed on the step saw a non-finite norm
  bool decided = false;      // fp16: the step read its figures itself to decide its update
  // A replica failed during it (fault tolerance): nothing of it was applied, and it is
  // trained again (Lockstep::commit).
  bool discarded = false;
  // Discarded with every step since this one, whose state the ranks hold again (local SGD
  // under fault tolerance: Lockstep::after_update); -1 when only the step itself is.
  int64_t back_to = -1;
  // This rank's replica leaves the job after the step (fault tolerance: a stop signal came
  // to it; the others go on): the loop ends here, with no checkpoint of its own.
  bool leaves = false;
  std::optional<c10::Event> ready;  // on a GPU: when `figures` is on the host
  // When the host first saw the step finished (the loop's clock for its step time).
  std::optional<std::chrono::steady_clock::time_point> finished_at;
  // Whether the device has finished it, without waiting: always on the CPU, where the
  // step ran as it was queued.
  bool finished() { return !ready || ready->query(); }
};

// What one optimizer step uses: the run's components (or a test's stand-ins).
struct StepParts {
  MicroBatchRunner& runner;
  GradSync& sync;
  FlatParams& params;
  Optimizer& optimizer;
  LossScaler* scaler;  // fp16 only
  const Mesh& mesh;
  Lockstep& mode;      // where the ranks meet, and what they do after an update
  const Tied& tied;    // a weight tied across stages: its copy is left out of the norm
  // optimizer.grad_clip and the learning rate's schedule, train.on_nonfinite,
  // dist.timeout_s, train.debug_slow_*.
  const JobConfig& cfg;
  int64_t total_steps = 0;
  c10::Device device = c10::Device(c10::kCPU);
};

// Step n (from 1) on `batch`, this data rank's share of its global batch (`data_wait_ms`:
// what the loader kept the step waiting). `logged`: a step whose line is written (its norm
// is taken; on a GPU its phases are timed on the device). `kept`: an evaluation or a
// checkpoint follows it, so its norm is taken too: a non-finite gradient there is caught
// before either sees the weights. `apart_diverged`: this rank's replica diverged since the
// ranks last met (its vote).
PendingStep train_step(StepParts& parts, int64_t n, const Batch& batch, double data_wait_ms,
                       bool logged, bool kept, bool apart_diverged = false);

// The step's stats, complete: waits for its figures (on a GPU: for that step's work, not
// for the steps queued after it). Every rank must read the same steps in the same order:
// naming the rank that saw a non-finite loss is a collective, which also agrees on the most
// non-finite steps in a row any of them had before (`in_a_row`: this rank's).
StepStats read_step(StepParts& parts, PendingStep& p, bool apart_diverged = false,
                    int64_t in_a_row = 0);

}  // namespace dtrain
