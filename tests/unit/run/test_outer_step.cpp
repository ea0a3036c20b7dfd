// DiLoCo's outer step (run/modes/local_sgd.hpp's OuterStep) against torch.optim.SGD with
// Nesterov momentum on the pseudo-gradient, its two steps worked out by hand (and by
// PyTorch 2.15: [0.335, 2.665], then [-0.0815, 2.9485]).
#include <doctest/doctest.h>

#include <torch/torch.h>

#include "run/modes/local_sgd.hpp"

namespace unit_run_outer_step {

using namespace dtrain;

TEST_CASE("outer step: Nesterov SGD along (outer copy - average), from the outer copy") {
  ParallelConfig cfg;
  cfg.outer_lr = 0.7, cfg.outer_momentum = 0.9;
  const auto f64 = torch::kFloat64;
  auto params = torch::tensor({0.5, 2.5}, f64);  // the replicas' average
  OuterStep outer(cfg, params);
  REQUIRE(outer.active());
  // delta = [0.5, -0.5]; buffer = delta; d = delta + 0.9 buffer = [0.95, -0.95];
  // [1, 2] - 0.7 d.
  outer.step(params, torch::tensor({1.0, 2.0}, f64));
  CHECK(params[0].item<double>() == doctest::Approx(0.335).epsilon(1e-12));
  CHECK(params[1].item<double>() == doctest::Approx(2.665).epsilon(1e-12));
  // The next meeting: delta = [0.1, 0]; buffer = 0.9 [0.5, -0.5] + delta = [0.55, -0.45];
  // d = delta + 0.9 buffer = [0.595, -0.405]; [0.335, 2.665] - 0.7 d.
  const auto kept = params.clone();
  params = torch::tensor({0.235, 2.665}, f64);
  outer.step(params, kept);
  CHECK(params[0].item<double>() == doctest::Approx(-0.0815).epsilon(1e-12));
  CHECK(params[1].item<double>() == doctest::Approx(2.9485).epsilon(1e-12));
  CHECK(outer.buffer()[0].item<double>() == doctest::Approx(0.55).epsilon(1e-12));
}

TEST_CASE("outer step: at rate 1 without momentum it is the plain average, and inactive") {
  ParallelConfig cfg;  // outer_lr 1, outer_momentum 0: local SGD
  const auto params = torch::tensor({0.5, 2.5}, torch::kFloat64);
  OuterStep outer(cfg, params);
  CHECK(!outer.active());
  CHECK(!outer.buffer().defined());
  cfg.outer_lr = 0.5;
  OuterStep half(cfg, params);
  CHECK(half.active());
  auto p = params.clone();
  half.step(p, torch::tensor({1.5, 1.5}, torch::kFloat64));  // halfway to the average
  CHECK(p[0].item<double>() == doctest::Approx(1.0));
  CHECK(p[1].item<double>() == doctest::Approx(2.0));
}

}  // namespace unit_run_outer_step
