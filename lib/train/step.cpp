// One optimizer step, read top to bottom:
//   1. this data rank's shard of the global batch
//   2. forward, per micro-batch (bf16 autocast keeps fp32 master weights)
//   3. backward, the gradient sync overlapped; then agreement over the world
//   4. clip by the global norm
//   5. optimizer update
#include "train/step.hpp"

#include <chrono>
#include <iostream>

#include <fmt/format.h>
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
  const auto t_step = Clock::now();
  // 1. next batch (prepared ahead by the loader's threads)
  Batch batch = loader.next(&s.data_wait_ms);
  const int64_t accum = c.cfg.train.grad_accum;
  const int64_t micro = batch.y.size(0) / accum;
  const bool bf16 = c.cfg.precision.dtype == "bf16";
  double loss_sum = 0;
  for (int64_t a = 0; a < accum; ++a) {
    Batch mb = accum == 1 ? batch : Batch{batch.x.narrow(0, a * micro, micro),
                                          batch.y.narrow(0, a * micro, micro)};
    if (mb.x.dim() == 4) mb.x = mb.x.contiguous(c.format());
    // 2. forward; the loss is taken in fp32
    auto t0 = Clock::now();
    torch::Tensor loss;
    {
      AutocastGuard guard(bf16);
      loss = c.task->loss(c.model->forward(mb.x), mb, *c.mesh.tensor());
    }
    loss_sum += loss.item<double>() / double(accum);
    const double factor = c.sync->loss_factor();  // what makes the gradient a global mean
    if (factor != 1.0) loss = loss * factor;
    s.forward_ms += ms_since(t0);
    // 3. backward: gradients accumulate into the flat buffer; the sync strategy starts
    //    communicating from backward's hooks on the last micro-batch
    t0 = Clock::now();
    c.sync->begin_micro_batch(a == accum - 1);
    loss.backward();
    s.backward_ms += ms_since(t0);
  }
  auto t0 = Clock::now();
  c.sync->finish();
  // The global batch's loss and whether any rank was asked to stop, in one small reduce
  // over the world: every rank stops after the same step whatever the layout. Each data
  // replica's loss counts once (tensor ranks hold the same value).
  const bool counts = c.mesh.coord().tensor == 0;
  double agree[2] = {counts ? loss_sum : 0.0, stop_signal() ? 1.0 : 0.0};
  c.mesh.world()->all_reduce(torch::from_blob(agree, {2}, torch::kFloat64));
  s.loss = agree[0] / double(c.mesh.dims().data);
  s.stop = agree[1] > 0;
  s.comm_ms = ms_since(t0);

  const auto t_opt = Clock::now();
  // 4. clip by the global norm over every shard
  const double clip = c.cfg.optimizer.grad_clip;
  s.grad_norm = std::nan("");
  if (want_norm || clip > 0) {
    s.grad_norm = global_grad_norm(*c.params, *c.mesh.tensor());
    clip_grad(*c.params, s.grad_norm, clip);
  }
  // 5. optimizer update
  c.optimizer->step(lr_at(c.cfg.schedule, c.cfg.optimizer.lr, c.state.step + 1, c.total_steps));
  c.params->zero_grad();
  ++c.state.step;
  s.optim_ms = ms_since(t_opt);
  s.step_ms = ms_since(t_step);
  if (!std::isfinite(s.loss) && c.root())
    std::cerr << fmt::format("dtrain: warning: loss is {} at step {}\n", s.loss, c.state.step);
  return s;
}

}  // namespace dtrain
