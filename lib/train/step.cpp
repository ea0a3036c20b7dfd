// One optimizer step, read top to bottom:
//   1. this data rank's shard of the global batch, on the device
//   2. forward, per micro-batch (autocast keeps fp32 master weights)
//   3. backward of the (fp16: scaled) loss, the gradient sync overlapped; then agreement
//      over the world
//   4. the gradient's global norm: clipping, and the finiteness check
//   5. optimizer update, unless some rank saw a non-finite loss or gradient (fp16: unless
//      the scaled gradient overflowed, which lowers the scale instead)
//
// On a GPU the host waits for the device once per step, in 3: the step's loss and the
// agreement are read there (every rank must know before the update whether to make it).
#include "train/step.hpp"

#include <chrono>

#include <torch/cuda.h>
#include <torch/torch.h>

#include "optim/clip.hpp"
#include "optim/schedule.hpp"
#include "precision/autocast.hpp"
#include "train/signals.hpp"

namespace dtrain {
namespace {

using Clock = std::chrono::steady_clock;
double ms_since(Clock::time_point t) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t).count();
}

}  // namespace

StepStats train_step(Context& c, Loader& loader, bool want_norm) {
  StepStats s;
  // On a GPU the phases run asynchronously to the host. A logged step waits for the device
  // at the start and at each phase's end, so that its phase times are the GPU's (report.cpp
  // logs that step's); the other steps never wait there.
  s.device_timed = want_norm && c.device().is_cuda();
  auto settle = [&] {
    if (s.device_timed) torch::cuda::synchronize();
  };
  const auto t_step = Clock::now();
  settle();  // the previous step's last kernels: in this step's total, as without the wait
  // 1. next batch (prepared ahead by the loader's threads), queued to the device
  Batch batch = to_device(loader.next(&s.data_wait_ms), c.device());
  const int64_t accum = c.cfg.train.grad_accum;
  const int64_t micro = batch.y.size(0) / accum;
  const double scale = c.scaler ? c.scaler->scale() : 1.0;
  std::vector<torch::Tensor> losses;  // per micro-batch, read once all are queued
  for (int64_t a = 0; a < accum; ++a) {
    Batch mb = accum == 1 ? batch : Batch{batch.x.narrow(0, a * micro, micro),
                                          batch.y.narrow(0, a * micro, micro)};
    if (mb.x.dim() == 4) mb.x = mb.x.contiguous(c.format());
    // 2. forward; the loss is taken in fp32
    auto t0 = Clock::now();
    torch::Tensor loss;
    {
      AutocastGuard guard(c.cfg.precision.dtype, c.device().type());
      loss = c.task->loss(c.model->forward(mb.x), mb, *c.mesh.tensor());
    }
    losses.push_back(loss.detach());
    // What makes the gradient a global mean, and fp16's loss scale.
    const double factor = c.sync->loss_factor() * scale;
    if (factor != 1.0) loss = loss * factor;
    settle();
    s.forward_ms += ms_since(t0);
    // 3. backward: gradients accumulate into the flat buffer; the sync strategy starts
    //    communicating from backward's hooks on the last micro-batch
    t0 = Clock::now();
    c.sync->begin_micro_batch(a == accum - 1);
    loss.backward();
    settle();
    s.backward_ms += ms_since(t0);
  }
  auto t0 = Clock::now();
  c.sync->finish();
  double loss_sum = 0;
  for (const auto& l : losses) loss_sum += l.item<double>() / double(accum);
  // The global batch's loss and whether any rank was asked to stop, in one small reduce
  // over the world: every rank stops after the same step whatever the layout. Each data
  // replica's loss counts once (tensor ranks hold the same value).
  const bool counts = c.mesh.coord().tensor == 0;
  double agree[3] = {counts ? loss_sum : 0.0, stop_signal() ? 1.0 : 0.0,
                     std::isfinite(loss_sum) ? 0.0 : 1.0};
  c.mesh.world()->all_reduce(torch::from_blob(agree, {3}, torch::kFloat64));
  s.loss = agree[0] / double(c.mesh.dims().data);
  s.stop = agree[1] > 0;
  s.comm_ms = ms_since(t0);

  const auto t_opt = Clock::now();
  // 4. clip by the global norm over every shard. The norm is also the gradient's check:
  //    taken when clipping or logging, and on every step when non-finite steps are skipped
  //    or fp16 gradients are checked for overflow (otherwise a non-finite gradient shows
  //    in the next step's loss). It is the norm of the scaled gradient, divided back.
  const double clip = c.cfg.optimizer.grad_clip;
  const bool skip_mode = c.cfg.train.on_nonfinite == "skip";
  const bool norm_taken = want_norm || clip > 0 || skip_mode || c.scaler;
  s.grad_norm =
      norm_taken ? global_grad_norm(*c.params, *c.mesh.tensor()) / scale : std::nan("");
  // The norm is the same on every rank (after the gradient sync), so these verdicts need
  // no further agreement.
  const bool loss_finite = agree[2] == 0;
  const bool grad_finite = !norm_taken || std::isfinite(s.grad_norm);
  bool update = loss_finite && grad_finite;
  if (c.scaler && loss_finite) {
    // A finite loss with an overflowing gradient is fp16's range, not a divergence: lower
    // the scale and skip, until the floor.
    switch (c.scaler->after_backward(grad_finite)) {
      case LossScaler::Verdict::kUpdate: break;
      case LossScaler::Verdict::kSkip: s.overflow = true; break;
      case LossScaler::Verdict::kNonFinite: break;  // update is false: handled below
    }
  }
  const bool seen_here = !std::isfinite(loss_sum) || !grad_finite;
  s.nonfinite = !update && !s.overflow;
  if (s.nonfinite) {
    // Name the lowest rank that saw it: one more reduction, on this rare path only.
    const int64_t world = c.mesh.world()->size(), rank = c.mesh.rank();
    double seen[1] = {seen_here ? double(world - rank) : 0.0};
    c.mesh.world()->all_reduce(torch::from_blob(seen, {1}, torch::kFloat64), ReduceOp::kMax);
    s.nonfinite_rank = seen[0] > 0 ? world - int64_t(seen[0]) : 0;
  } else if (update) {
    clip_grad(*c.params, s.grad_norm, clip, scale);  // and fp16's unscaling, in one multiply
    // 5. optimizer update
    c.optimizer->step(lr_at(c.cfg.schedule, c.cfg.optimizer.lr, c.state.step + 1, c.total_steps));
  }
  c.params->zero_grad();
  ++c.state.step;
  settle();
  s.optim_ms = ms_since(t_opt);
  s.step_ms = ms_since(t_step);
  return s;
}

}  // namespace dtrain
