// WholeModel (runner.hpp): every part on this rank, the micro-batches one after another.
#include <algorithm>
#include <chrono>

#include <torch/torch.h>

#include "grad/grad_sync.hpp"
#include "pipeline/runner.hpp"
#include "precision/autocast.hpp"
#include "util/clock.hpp"

namespace dtrain {
namespace {

class WholeModel : public MicroBatchRunner {
 public:
  explicit WholeModel(RunnerParts p) : p_(std::move(p)) {}

  std::vector<torch::Tensor> train(int64_t step, const Batch& batch, double factor,
                                   MicroBatchTimes& t,
                                   const std::function<void()>& settle) override {
    const int64_t accum = p_.grad_accum, rows = batch.y.size(0);
    auto& model = *p_.chunks.front();
    std::vector<torch::Tensor> losses;
    for (int64_t a = 0; a < accum; ++a) {
      const auto [first, micro, weight] = micro_slice(rows, accum, a);
      Batch mb = accum == 1 ? batch : Batch{batch.x.narrow(0, first, micro),
                                            batch.y.narrow(0, first, micro)};
      if (mb.x.dim() == 4) mb.x = mb.x.contiguous(p_.format);
      // forward; the loss is taken in fp32
      auto t0 = Clock::now();
      torch::Tensor loss;
      {
        AutocastGuard guard(p_.dtype, p_.device.type());
        DropoutScope draw(micro_batch_draw(p_, step, first, micro));
        loss = p_.task->loss(model.forward(mb.x), mb, *p_.tensor, p_.label_smoothing);
      }
      if (weight != 1.0) loss = loss * weight;
      losses.push_back(loss.detach());
      if (factor != 1.0) loss = loss * factor;
      settle();
      t.forward_ms += ms_since(t0);
      // backward: gradients accumulate into the flat buffer; the sync strategy starts
      // communicating from backward's hooks on the last micro-batch
      t0 = Clock::now();
      p_.sync->begin_micro_batch(a == accum - 1);
      loss.backward();
      settle();
      t.backward_ms += ms_since(t0);
    }
    return losses;
  }

  torch::Tensor infer(const torch::Tensor& x) override {
    AutocastGuard guard(p_.dtype, p_.device.type());
    return p_.chunks.front()->forward(x.dim() == 4 ? x.contiguous(p_.format) : x);
  }

  bool holds_last() const override { return true; }
  void deal(int64_t rank, int64_t ranks) override { p_.data_rank = rank, p_.data_ranks = ranks; }

 private:
  RunnerParts p_;
};

}  // namespace

MicroSlice micro_slice(int64_t rows, int64_t accum, int64_t m) {
  const int64_t even = rows / accum, over = rows % accum;
  MicroSlice s;
  s.first = m * even + std::min(m, over);
  s.rows = even + (m < over ? 1 : 0);
  s.weight = over == 0 ? 1.0 : double(s.rows * accum) / double(rows);
  return s;
}

DropoutDraw micro_batch_draw(const RunnerParts& p, int64_t step, int64_t first, int64_t rows) {
  DropoutDraw d{p.seed, step, {}};
  if (p.dropout)
    d.positions = (torch::arange(first, first + rows, torch::kInt64) * p.data_ranks + p.data_rank)
                      .to(p.device);
  return d;
}

std::unique_ptr<MicroBatchRunner> make_runner(RunnerParts parts) {
  if (parts.stages > 1) return make_pipeline_runner(std::move(parts));
  return std::make_unique<WholeModel>(std::move(parts));
}

}  // namespace dtrain
