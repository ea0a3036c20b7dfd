// One optimizer step with stand-in components (no setup(), no data): a runner whose loss
// has a gradient worked out by hand, one rank's gradient sync, SGD over a flat buffer. The
// step gets its number as an argument and hands it to the runner; its update, clipping,
// figures and train.on_nonfinite: skip are checked against the arithmetic.
#include <doctest/doctest.h>

#include <cmath>
#include <vector>

#include <torch/torch.h>

#include "config/config.hpp"
#include "grad/grad_sync.hpp"
#include "optim/optimizer.hpp"
#include "run/mode.hpp"
#include "run/step.hpp"

namespace unit_run_step {

using namespace dtrain;

namespace {

// loss = w . x for each micro-batch row sum, so d loss / d w = x: known exactly.
class DotRunner : public MicroBatchRunner {
 public:
  explicit DotRunner(torch::Tensor w) : w_(std::move(w)) {}
  std::vector<int64_t> steps;
  bool poison = false;  // a NaN loss

  std::vector<torch::Tensor> train(int64_t step, const Batch& batch, double factor,
                                   MicroBatchTimes& /*t*/,
                                   const std::function<void()>& /*settle*/) override {
    steps.push_back(step);
    auto loss = (w_ * batch.x.sum(0)).sum();
    if (poison) loss = loss * std::nan("");
    (loss * factor).backward();
    return {loss.detach()};
  }
  torch::Tensor infer(const torch::Tensor& x) override { return x; }
  bool holds_last() const override { return true; }
  void deal(int64_t, int64_t) override {}

 private:
  torch::Tensor w_;
};

struct Bench {
  explicit Bench(JobConfig c)
      : cfg(std::move(c)),
        weight(torch::nn::LinearOptions(3, 1).bias(false)),
        flat(*weight),
        runner(weight->weight),
        optimizer(make_optimizer(cfg.optimizer, flat)),
        mode(cfg, ParallelDims{}, make_local_comm()),
        sync(mode.make_sync(flat, 1, 100, Tied{})),
        parts{runner, *sync, flat, *optimizer, nullptr, mode.mesh(), mode, tied, cfg, 10,
              c10::Device(c10::kCPU)} {
    torch::NoGradGuard no_grad;
    weight->weight.copy_(torch::tensor({{1.0f, 2.0f, 3.0f}}));
  }
  JobConfig cfg;
  torch::nn::Linear weight;
  FlatParams flat;
  DotRunner runner;
  std::unique_ptr<Optimizer> optimizer;
  Lockstep mode;
  std::unique_ptr<GradSync> sync;
  Tied tied;
  StepParts parts;
};

JobConfig sgd(double lr, double clip = 0) {
  JobConfig cfg;
  cfg.optimizer.name = "sgd";
  cfg.optimizer.lr = lr;
  cfg.optimizer.momentum = 0;
  cfg.optimizer.grad_clip = clip;
  cfg.schedule.decay = "constant";
  return cfg;
}

Batch rows(std::vector<float> x) {
  return {torch::tensor(x).view({1, 3}), torch::zeros({1}, torch::kInt64)};
}

}  // namespace

TEST_CASE("step: the step's number reaches the runner; SGD moves w by lr x the gradient") {
  Bench b(sgd(0.1));
  auto p = train_step(b.parts, /*n=*/7, rows({1, -2, 0.5}), /*data_wait_ms=*/3, /*logged=*/true,
                      /*kept=*/false);
  CHECK(b.runner.steps == std::vector<int64_t>{7});
  CHECK(p.step == 7);
  const auto s = read_step(b.parts, p);
  CHECK(s.loss == doctest::Approx(1 * 1 - 2 * 2 + 3 * 0.5));
  CHECK(s.grad_norm == doctest::Approx(std::sqrt(1 + 4 + 0.25)));
  CHECK(s.data_wait_ms == 3);
  CHECK(!s.nonfinite);
  // w - 0.1 x (1, -2, 0.5), and the gradient is zero for the next step.
  CHECK(torch::allclose(b.weight->weight, torch::tensor({{0.9f, 2.2f, 2.95f}})));
  CHECK(b.flat.grad().abs().sum().item<double>() == 0);
}

TEST_CASE("step: clipping by the global norm") {
  Bench b(sgd(1.0, /*clip=*/0.5));
  auto p = train_step(b.parts, 1, rows({3, 0, 4}), 0, false, false);  // norm 5
  read_step(b.parts, p);
  // The gradient scaled to norm 0.5: (0.3, 0, 0.4).
  CHECK(torch::allclose(b.weight->weight, torch::tensor({{0.7f, 2.0f, 2.6f}}), 1e-5, 1e-6));
}

TEST_CASE("step: a non-finite loss under on_nonfinite: skip makes no update") {
  auto cfg = sgd(0.1);
  cfg.train.on_nonfinite = "skip";
  Bench b(cfg);
  b.runner.poison = true;
  auto p = train_step(b.parts, 1, rows({1, 1, 1}), 0, false, false);
  const auto s = read_step(b.parts, p);
  CHECK(s.nonfinite);
  CHECK(s.nonfinite_rank == 0);
  CHECK(torch::equal(b.weight->weight, torch::tensor({{1.0f, 2.0f, 3.0f}})));
}

}  // namespace unit_run_step
