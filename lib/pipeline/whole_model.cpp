// WholeModel (runner.hpp): every part on this rank, the micro-batches one after another.
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
    for (int64_t a = 0, first = 0; a < accum; ++a) {
      // Equal micro-batches, or where a fault-tolerant job's survivors dealt a share that
      // does not split evenly, the first rows % accum one row larger: each one's mean loss
      // then counts by its rows (its losses' sum over the share's, as even ones' would).
      const int64_t micro = rows / accum + (a < rows % accum ? 1 : 0);
      const double weight = rows % accum == 0 ? 1.0 : double(micro * accum) / double(rows);
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
      first += micro;
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
