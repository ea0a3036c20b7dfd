// One optimizer step, whatever the layout, and the reading of what it computed.
//
// The host does not wait for the device between steps. What a step computes for the host
// (the global batch's loss, the gradient norm, whether some rank was asked to stop) stays
// on the device and is copied back as the device gets there; the loop reads it a few steps
// later (read_step), by which time it has usually arrived. On the CPU the copy is
// immediate, but the reading is the same, so both devices behave alike.
#pragma once
#include <optional>

#include <c10/core/Event.h>

#include "data/loader.hpp"
#include "train/report.hpp"

namespace dtrain {

// The step's figures travel as one fp64 tensor: one all-reduce over the world and one copy
// to the host move them all. These name its slots; the first kSummed are summed over the
// world.
namespace figure {
constexpr int64_t kLossSum = 0;    // the global batch's loss, summed over the ranks that hold it
constexpr int64_t kStopVotes = 1;  // ranks asked to stop
constexpr int64_t kSummed = 2;
constexpr int64_t kGradNorm = 2;   // the global gradient norm; NaN when not taken
constexpr int64_t kLocalLoss = 3;  // this rank's loss (0 where it has none): names a rank
constexpr int64_t kCount = 4;
}  // namespace figure

struct PendingStep {
  int64_t step = 0;          // the step's number, from 1
  StepStats stats;           // the host's timings now; read_step() adds the device's figures
  torch::Tensor figures;     // figure::kCount values, on the host once `ready`
  double local_loss = 0;     // this rank's, once read: it names a rank that saw a NaN
  bool norm_taken = false;   // whether the norm was taken (else it reads NaN)
  bool decided = false;      // fp16: the step read its figures itself to decide its update
  std::optional<c10::Event> ready;  // on a GPU: when `figures` is on the host
};

// `logged`: a step whose line is written (its norm is taken; on a GPU its phases are
// timed on the device). `kept`: an evaluation or a checkpoint follows it, so its norm is
// taken too: a non-finite gradient there is caught before either sees the weights.
PendingStep train_step(Context& c, Loader& loader, bool logged, bool kept);

// The step's stats, complete: waits for its figures (on a GPU: for that step's work, not
// for the steps queued after it). Every rank must read the same steps in the same order:
// naming the rank that saw a non-finite loss is a collective.
StepStats read_step(Context& c, PendingStep& p);

}  // namespace dtrain
