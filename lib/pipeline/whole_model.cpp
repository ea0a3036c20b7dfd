#include "train/runner.hpp"

#include <chrono>

#include <torch/torch.h>

#include "precision/autocast.hpp"
#include "train/context.hpp"
#include "train/report.hpp"

namespace dtrain {
namespace {

using Clock = std::chrono::steady_clock;
double ms_since(Clock::time_point t) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t).count();
}

class WholeModel : public MicroBatchRunner {
 public:
  explicit WholeModel(Context& c) : c_(c) {}

  std::vector<torch::Tensor> train(const Batch& batch, double factor, StepStats& s,
                                   const std::function<void()>& settle) override {
    const int64_t accum = c_.cfg.train.grad_accum;
    const int64_t micro = batch.y.size(0) / accum;
    auto& model = *c_.chunks.front();
    std::vector<torch::Tensor> losses;
    for (int64_t a = 0; a < accum; ++a) {
      Batch mb = accum == 1 ? batch : Batch{batch.x.narrow(0, a * micro, micro),
                                            batch.y.narrow(0, a * micro, micro)};
      if (mb.x.dim() == 4) mb.x = mb.x.contiguous(c_.format());
      // forward; the loss is taken in fp32
      auto t0 = Clock::now();
      torch::Tensor loss;
      {
        AutocastGuard guard(c_.cfg.precision.dtype, c_.device().type());
        DropoutScope draw(micro_batch_draw(c_, a * micro, micro));
        loss = c_.task->loss(model.forward(mb.x), mb, *c_.mesh.tensor(),
                             c_.cfg.optimizer.label_smoothing);
      }
      losses.push_back(loss.detach());
      if (factor != 1.0) loss = loss * factor;
      settle();
      s.forward_ms += ms_since(t0);
      // backward: gradients accumulate into the flat buffer; the sync strategy starts
      // communicating from backward's hooks on the last micro-batch
      t0 = Clock::now();
      c_.sync->begin_micro_batch(a == accum - 1);
      loss.backward();
      settle();
      s.backward_ms += ms_since(t0);
    }
    return losses;
  }

  torch::Tensor infer(const torch::Tensor& x) override {
    AutocastGuard guard(c_.cfg.precision.dtype, c_.device().type());
    return c_.chunks.front()->forward(x.dim() == 4 ? x.contiguous(c_.format()) : x);
  }

 private:
  Context& c_;
};

}  // namespace

DropoutDraw micro_batch_draw(const Context& c, int64_t first, int64_t rows) {
  DropoutDraw d{uint64_t(c.cfg.seed), c.state.step + 1, {}};
  if (c.cfg.model.dropout > 0) {
    const int64_t data = c.mesh.dims().data;
    d.positions = (torch::arange(first, first + rows, torch::kInt64) * data +
                   c.mesh.coord().data).to(c.device());
  }
  return d;
}

std::unique_ptr<MicroBatchRunner> make_runner(Context& c) {
  if (c.stages > 1) return make_pipeline_runner(c);
  return std::make_unique<WholeModel>(c);
}

}  // namespace dtrain
