// One optimizer step, read top to bottom:
//   1. this data rank's shard of the global batch, on the device
//   2. forward, per micro-batch (autocast keeps fp32 master weights)
//   3. backward of the (fp16: scaled) loss, the gradient sync overlapped
//   4. the figures the host reads later: the global batch's loss and the stop votes (one
//      small all-reduce over the world), the gradient's global norm, this rank's loss
//   5. clipping and the optimizer update
//
// Nothing here waits for the device, with two exceptions: fp16 reads the step's figures
// at once, because whether the update is made and how the loss scale moves decide the next
// step (DeepSpeed does the same); and a logged step on a GPU waits at each phase's end, so
// that its phase times are the GPU's.
//
// A non-finite loss or gradient. Under train.on_nonfinite: skip the update is gated on the
// device (the optimizer's `skip`), so the run goes on from unchanged weights. Under stop it
// is not gated: the run ends when the step is read, a few steps on, and nothing computed
// after it is kept, because the loop reads every pending step before it evaluates,
// checkpoints or ends.
#include "run/step.hpp"

#include <chrono>
#include <cmath>
#include <thread>
#include <vector>

#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <fmt/format.h>
#include <torch/cuda.h>
#include <torch/torch.h>

#include "launch/device.hpp"
#include "optim/clip.hpp"
#include "optim/schedule.hpp"
#include "run/signals.hpp"
#include "util/clock.hpp"
#include "util/error.hpp"

namespace dtrain {
namespace {

// The figures (step.hpp's Figures) as one fp64 tensor on the step's device. A rank whose
// loss does not count (tensor ranks past the first hold the same value) adds loss x 0:
// nothing, unless it is not finite, so the sum is non-finite when any rank's loss is. On
// the CPU from the values themselves: reading them costs nothing there, and a handful of
// tensor ops would cost more than the step's arithmetic. On a GPU by stacking them on the
// device: reading them would wait.
torch::Tensor assemble_figures(const StepParts& parts, const Figures& layout,
                               const std::vector<torch::Tensor>& losses, bool counts, bool stop,
                               bool apart_diverged, const torch::Tensor& norm, const StepStats& s) {
  const double accum = double(losses.size());
  const int64_t stage = parts.mesh.coord().pipeline;
  if (!parts.device.is_cuda()) {
    double loss = 0;
    for (const auto& l : losses) loss += l.item<double>() / accum;
    auto figures = torch::zeros({layout.count()}, torch::kFloat64);
    double* f = figures.data_ptr<double>();
    f[Figures::kLossSum] = counts ? loss * parts.mode.loss_weight() : loss * 0.0;
    f[Figures::kStopVotes] = stop ? 1.0 : 0.0;
    f[Figures::kEndVotes] = apart_diverged ? 1.0 : 0.0;
    f[layout.grad_norm()] = norm.defined() ? norm.item<double>() : std::nan("");
    f[Figures::kBadNorms] = norm.defined() && !std::isfinite(f[layout.grad_norm()]) ? 1.0 : 0.0;
    if (layout.stages > 0) {
      f[layout.bubble(stage)] = s.bubble;
      f[layout.activation_mb(stage)] = s.activation_mb;
    }
    if (layout.ranks > 0) f[layout.busy_ms(parts.mode.rank_in_job().rank)] = s.busy_ms;
    f[layout.local_loss()] = loss;
    return figures;
  }
  const auto f64 = torch::dtype(torch::kFloat64).device(parts.device);
  auto loss = losses.empty()      ? torch::zeros({}, f64)
              : losses.size() == 1 ? losses[0].to(torch::kFloat64)
                                   : (torch::stack(losses).sum() / accum).to(torch::kFloat64);
  std::vector<torch::Tensor> f(size_t(layout.count()));
  for (auto& slot : f) slot = torch::zeros({}, f64);
  f[Figures::kLossSum] = counts ? loss * parts.mode.loss_weight() : loss * 0.0;
  f[Figures::kStopVotes] = torch::full({}, stop ? 1.0 : 0.0, f64);
  f[Figures::kEndVotes] = torch::full({}, apart_diverged ? 1.0 : 0.0, f64);
  if (layout.stages > 0) {
    f[size_t(layout.bubble(stage))] = torch::full({}, s.bubble, f64);
    f[size_t(layout.activation_mb(stage))] = torch::full({}, s.activation_mb, f64);
  }
  if (layout.ranks > 0) f[size_t(layout.busy_ms(parts.mode.rank_in_job().rank))] = torch::full({}, s.busy_ms, f64);
  f[size_t(layout.grad_norm())] = norm.defined() ? norm.to(torch::kFloat64) : torch::full({}, NAN, f64);
  f[Figures::kBadNorms] = norm.defined() ? f[size_t(layout.grad_norm())].isfinite().logical_not().to(f64)
                                         : torch::zeros({}, f64);
  f[size_t(layout.local_loss())] = loss;
  return torch::stack(f);
}

Figures figures_of(const StepParts& parts) {
  const int64_t stages = parts.mesh.dims().pipeline;
  return {stages > 1 ? stages : 0, parts.mode.rank_in_job().ranks};
}

// On a GPU: the figures go to pinned host memory without blocking, and an event marks
// their arrival. On the CPU they are already where the host reads them.
void send_to_host(const torch::Tensor& figures, PendingStep& p) {
  if (!figures.is_cuda()) {
    p.figures = figures;
    return;
  }
  const auto pinned = figures.options().device(torch::kCPU).pinned_memory(true);
  p.figures = torch::empty(figures.sizes(), pinned);
  p.figures.copy_(figures, /*non_blocking=*/true);
  const auto* cuda = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
  p.ready.emplace(c10::DeviceType::CUDA);
  p.ready->record(cuda->getStream(figures.device()));
}

// Waits for the figures and puts them into the step's stats. Read two steps late, they
// have usually arrived; otherwise the host sleeps in short naps (a spinning host would take
// a core from the loader), for at most dist.timeout_s.
void take_figures(const StepParts& parts, PendingStep& p) {
  if (p.ready) {
    const auto give_up = Clock::now() + std::chrono::seconds(parts.cfg.dist.timeout_s);
    while (!p.ready->query()) {
      if (Clock::now() > give_up)
        throw DistError(fmt::format("the device did not finish step {} within dist.timeout_s = "
                                    "{} s", p.step, parts.cfg.dist.timeout_s));
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
    p.ready.reset();
  }
  const Figures layout = figures_of(parts);
  const auto f = p.figures.accessor<double, 1>();
  const double replicas = double(parts.mode.replicas(p.step)), tensor = double(parts.mesh.dims().tensor);
  const bool meets = parts.mode.meets(p.step);
  p.stats.loss = f[Figures::kLossSum] / replicas;  // each data replica's counts once
  // A stop, or a replica's divergence, is acted on only where every rank agrees on it.
  p.stats.stop = p.stats.stop || (meets && f[Figures::kStopVotes] > 0);  // or the mode's vote
  p.stats.replica_diverged = meets && f[Figures::kEndVotes] > 0;
  for (int64_t stage = 0; stage < layout.stages; ++stage) {  // each stage's ranks' mean
    p.stats.stage_bubble.push_back(f[layout.bubble(stage)] / (replicas * tensor));
    p.stats.stage_activation_mb.push_back(f[layout.activation_mb(stage)] / (replicas * tensor));
  }
  for (int64_t r = 0; r < layout.ranks; ++r) p.stats.rank_busy_ms.push_back(f[layout.busy_ms(r)]);
  p.stats.grad_norm = f[layout.grad_norm()];
  p.bad_norm = f[Figures::kBadNorms] > 0;
  p.local_loss = f[layout.local_loss()];
}

// Whether every rank that agreed on the step saw a finite gradient norm (this one's
// counted among them): so all of them judge the step alike, local SGD's replicas (each with
// a norm of its own) where they meet.
bool grads_finite(const PendingStep& p) { return !p.norm_taken || !p.bad_norm; }

// What this rank sent over the groups the model's layers and stages use since the last
// call: tensor-parallel all-reduces, activations and their gradients between stages, a tied
// weight's sum. (The data group's traffic is the gradient sync's and the mode's to count.)
int64_t model_traffic(const Mesh& mesh) {
  int64_t bytes = mesh.tensor()->take_sent() + mesh.pipeline()->take_sent();
  const auto& tied = mesh.embedding();
  if (tied && tied != mesh.pipeline() && tied != mesh.tensor()) bytes += tied->take_sent();
  return bytes;
}

// The gradient's global norm over every shard (the same on every rank after the sync),
// fp16's scale divided out; a tied weight's copy counted once.
torch::Tensor unscaled_norm(const StepParts& parts, double scale) {
  auto norm = global_grad_norm(parts.params, *parts.mesh.tensor(), *parts.mesh.pipeline(),
                               parts.tied.copy ? parts.tied.entries : std::vector<size_t>{},
                               parts.sync.shard(), parts.mesh.data().get());
  return scale != 1.0 ? norm / scale : norm;
}

// Step 5: clipping and the optimizer's update, fp16's and skip's as the top says. Returns
// the skip flag (undefined when none).
torch::Tensor update(StepParts& parts, PendingStep& p, const torch::Tensor& figures,
                     const torch::Tensor& norm, double scale) {
  StepStats& s = p.stats;
  const double clip = parts.cfg.optimizer.grad_clip;
  // A batch that shrank with its replicas takes a step as much smaller (the linear rule).
  s.batch_scale = parts.mode.batch_scale();
  s.lr = lr_at(parts.cfg.schedule, parts.cfg.optimizer.lr, p.step, parts.total_steps) *
         parts.mode.lr_scale();
  const double lr = s.lr;
  torch::Tensor skip;  // train.on_nonfinite: skip: 1 when the step makes no update
  if (parts.scaler) {
    take_figures(parts, p);
    p.decided = true;
    const bool loss_finite = std::isfinite(s.loss), grad_finite = grads_finite(p);
    bool update = loss_finite && grad_finite;
    // A finite loss with an overflowing gradient is fp16's range, not a divergence: lower
    // the scale and skip, until the floor.
    if (loss_finite && parts.scaler->after_backward(grad_finite) == LossScaler::Verdict::kSkip)
      s.overflow = true;
    s.nonfinite = !update && !s.overflow;
    s.loss_scale = parts.scaler->scale();
    s.overflow_steps = parts.scaler->overflows();
    if (update) {
      clip_grad(parts.params, norm, clip, scale, parts.sync.shard());
      parts.optimizer.step(lr);
    }
    return skip;
  }
  if (parts.cfg.train.on_nonfinite == "skip")
    skip = figures.select(0, Figures::kLossSum).isfinite().logical_not()
               .logical_or(figures.select(0, Figures::kBadNorms) > 0)
               .to(torch::kFloat32);
  clip_grad(parts.params, norm, clip, 1.0, parts.sync.shard());
  parts.optimizer.step(lr, skip);
  return skip;
}

}  // namespace

PendingStep train_step(StepParts& parts, int64_t n, const Batch& host_batch, double data_wait_ms,
                       bool logged, bool kept, bool apart_diverged) {
  PendingStep p;
  p.step = n;
  StepStats& s = p.stats;
  s.data_wait_ms = data_wait_ms;
  const auto started = Clock::now();
  // A logged step on a GPU waits at its start and each phase's end (see the top).
  s.device_timed = logged && parts.device.is_cuda();
  auto settle = [&] {
    if (s.device_timed) torch::cuda::synchronize();
  };
  settle();  // the previous step's last kernels, so that this step's phases are its own
  if (parts.cfg.train.debug_slow_rank == parts.mode.rank_in_job().rank)  // a slow worker, for benchmarks
    std::this_thread::sleep_for(std::chrono::milliseconds(parts.cfg.train.debug_slow_ms));
  // The steps that wait for the device by design (see the top; with several ranks, every
  // collective waits); under DTRAIN_SYNC_DEBUG PyTorch's sync check holds the others to it.
  const bool skip_mode = parts.cfg.train.on_nonfinite == "skip";
  const bool waits = s.device_timed || parts.scaler || parts.mesh.world()->size() > 1;
  SyncDebugScope sync_check(parts.device.is_cuda() && !waits ? sync_debug_mode() : "off");
  parts.sync.begin_step(n);
  model_traffic(parts.mesh);  // what went before (an evaluation) is not the step's
  // 1. the batch (prepared ahead by the loader's threads), queued to the device
  const Batch batch = to_device(host_batch, parts.device);
  const double scale = parts.scaler ? parts.scaler->scale() : 1.0;
  // 2-3. forward (autocast keeps fp32 master weights) and backward of every micro-batch,
  //      the loss scaled by what makes the gradient a global mean and by fp16's scale;
  //      their mean is this rank's loss (on a pipeline, the last stage's)
  MicroBatchTimes times;
  const auto losses = parts.runner.train(n, batch, parts.sync.loss_factor() * scale, times, settle);
  s.forward_ms = times.forward_ms, s.backward_ms = times.backward_ms;
  s.bubble = times.bubble, s.activation_mb = times.activation_mb;
  auto t0 = Clock::now();
  parts.sync.finish();  // also sums a tied weight's copies across stages
  settle();
  s.comm_ms = ms_since(t0);
  // Busy: up to here, less the wait for the others in the sync's finish (the hooks'
  // reductions run on the backend's threads meanwhile).
  s.busy_ms = data_wait_ms + ms_since(started) - s.comm_ms;
  const auto t_opt = Clock::now();  // the optimizer's phase: norm, figures, clip, update
  // 4. The figures. The norm is taken when clipping, logging, before an evaluation or a
  //    checkpoint, on every step when non-finite steps are skipped, and under fp16 (its
  //    overflow check); otherwise a non-finite gradient shows in the next step's loss.
  p.norm_taken = logged || kept || parts.cfg.optimizer.grad_clip > 0 || skip_mode || parts.scaler;
  const torch::Tensor norm = p.norm_taken ? unscaled_norm(parts, scale) : torch::Tensor();
  // Each data replica's loss counts once (tensor ranks hold the same value); a rank asked
  // to stop votes so: every rank stops after the same step, whatever the layout.
  const bool counts = parts.mesh.coord().tensor == 0 && parts.runner.holds_last();
  const Figures layout = figures_of(parts);
  const bool stop = stop_signal() != 0 && parts.mode.stop_in_figures();
  auto figures = assemble_figures(parts, layout, losses, counts, stop, apart_diverged, norm, s);
  parts.mode.agree(n, figures.narrow(0, 0, layout.summed()), ReduceOp::kSum);
  send_to_host(figures, p);
  if (!parts.mode.commit(n)) {  // a replica failed: the survivors train step n again
    p.discarded = true;
    parts.sync.discard();
    parts.params.zero_grad();
    return p;
  }

  // 5. clip by the global norm (and fp16's unscaling, in the same multiply), and update
  const torch::Tensor skip = update(parts, p, figures, norm, scale);
  parts.sync.after_update(skip);
  const auto after = parts.mode.after_update(n);
  parts.params.zero_grad();
  if (after.back_to >= 0) {  // a replica failed since the ranks last met: back to there
    p.discarded = true;
    p.back_to = after.back_to;
    return p;
  }
  // A stop the replicas voted on with the step (fault tolerance): acted on at once, where
  // the members that voted are.
  const auto ending = parts.mode.ending_after(n);
  s.stop = s.stop || ending == Lockstep::Ending::kJob;  // fp16 has read its figures' already
  p.leaves = ending == Lockstep::Ending::kReplica;
  s.comm_bytes = parts.sync.bytes_per_step() + after.bytes + model_traffic(parts.mesh);
  settle();
  s.optim_ms = ms_since(t_opt);
  return p;  // its step_ms is the loop's to measure: the host's time here is not the device's
}

StepStats read_step(StepParts& parts, PendingStep& p, bool apart_diverged, int64_t in_a_row) {
  StepStats& s = p.stats;
  if (!p.decided) {
    take_figures(parts, p);
    s.nonfinite = !std::isfinite(s.loss) || !grads_finite(p) || s.replica_diverged;
  }
  if (s.nonfinite) {
    // Name the lowest rank that saw it, and agree on the longest run of skipped steps: one
    // more reduction over the ranks that agreed on the step, on this rare path only.
    const bool seen_here = !std::isfinite(p.local_loss) ||
                           (p.norm_taken && !std::isfinite(s.grad_norm)) ||  // its own norm
                           (s.replica_diverged && apart_diverged);
    const int64_t world = parts.mesh.world()->size(), rank = parts.mesh.rank();
    double seen[2] = {seen_here ? double(world - rank) : 0.0, double(in_a_row)};
    parts.mode.agree(p.step, torch::from_blob(seen, {2}, torch::kFloat64), ReduceOp::kMax);
    s.nonfinite_rank = seen[0] > 0 ? world - int64_t(seen[0]) : 0;
    s.peers_in_a_row = int64_t(seen[1]);
  }
  return s;
}

}  // namespace dtrain
