// fp16's loss scaler: its verdicts come from gradients with injected inf and nan, through
// the same global norm the step uses.
#include <doctest/doctest.h>
#include <cmath>
#include <limits>
#include <string>
#include <torch/torch.h>
#include "comm/comm.hpp"
#include "launch/device.hpp"
#include "optim/clip.hpp"
#include "parallel/flat_params.hpp"
#include "layers/sync_batchnorm.hpp"
#include "precision/loss_scaler.hpp"
#include "util/error.hpp"

namespace unit_precision_loss_scaler {

using namespace dtrain;

TEST_CASE("loss scaler: dynamic scale grows after clean steps, halves and skips on overflow") {
  LossScaler::Options o;
  o.growth_interval = 3;
  LossScaler s(o);
  CHECK(s.scale() == 65536.0);
  using V = LossScaler::Verdict;
  CHECK(s.after_backward(true) == V::kUpdate);
  CHECK(s.after_backward(true) == V::kUpdate);
  CHECK(s.scale() == 65536.0);
  CHECK(s.after_backward(true) == V::kUpdate);  // the third clean step in a row
  CHECK(s.scale() == 131072.0);
  CHECK(s.after_backward(true) == V::kUpdate);
  CHECK(s.after_backward(false) == V::kSkip);  // overflow: halve, and the count restarts
  CHECK(s.scale() == 65536.0);
  CHECK(s.overflows() == 1);
  CHECK(s.after_backward(true) == V::kUpdate);
  CHECK(s.after_backward(true) == V::kUpdate);
  CHECK(s.scale() == 65536.0);
  CHECK(s.after_backward(true) == V::kUpdate);
  CHECK(s.scale() == 131072.0);
}

TEST_CASE("loss scaler: at the floor an overflow is the run's non-finite policy's to judge") {
  LossScaler::Options o;
  o.scale = 4.0;
  o.floor = 1.0;
  LossScaler s(o);
  using V = LossScaler::Verdict;
  CHECK(s.after_backward(false) == V::kSkip);
  CHECK(s.after_backward(false) == V::kSkip);
  CHECK(s.scale() == 1.0);
  CHECK(s.after_backward(false) == V::kNonFinite);
  CHECK(s.scale() == 1.0);  // never below the floor
  CHECK(s.overflows() == 2);
}

TEST_CASE("loss scaler: a fixed scale never changes and reports every overflow") {
  PrecisionConfig p;
  p.dtype = "fp16";
  p.loss_scale = "1024";
  LossScaler s(LossScaler::from_config(p));
  CHECK(s.scale() == 1024.0);
  for (int i = 0; i < 5000; ++i) REQUIRE(s.after_backward(true) == LossScaler::Verdict::kUpdate);
  CHECK(s.scale() == 1024.0);
  CHECK(s.after_backward(false) == LossScaler::Verdict::kNonFinite);
  CHECK(s.scale() == 1024.0);
  p.loss_scale = "dynamic";
  CHECK(LossScaler(LossScaler::from_config(p)).scale() == 65536.0);
}

TEST_CASE("loss scaler: its state round-trips through a checkpoint; a bad one is an error") {
  LossScaler::Options o;
  o.growth_interval = 10;
  LossScaler a(o);
  for (int i = 0; i < 4; ++i) a.after_backward(true);
  a.after_backward(false);
  a.after_backward(true);
  LossScaler b(o);
  b.load(a.state(), "ck/trainer.json");
  CHECK(b.scale() == a.scale());
  CHECK(b.overflows() == 1);
  // The same number of clean steps to the next growth.
  for (int i = 0; i < 8; ++i) a.after_backward(true), b.after_backward(true);
  CHECK(b.scale() == a.scale());
  a.after_backward(true), b.after_backward(true);
  CHECK(a.scale() == 65536.0);  // 32768 * 2 after ten clean steps
  CHECK(b.scale() == a.scale());

  for (const auto& bad : {nlohmann::json{{"scale", -1.0}, {"clean_steps", 0}, {"overflows", 0}},
                          nlohmann::json{{"scale", 8.0}, {"clean_steps", "x"}, {"overflows", 0}},
                          nlohmann::json{{"scale", 8.0}}}) {
    CAPTURE(bad.dump());
    try {
      b.load(bad, "ck/trainer.json");
      FAIL("accepted");
    } catch (const CheckpointError& e) {
      CHECK(std::string(e.what()).find("ck/trainer.json") != std::string::npos);
    }
  }
}

TEST_CASE("loss scaler: injected inf and nan gradients overflow; finite ones unscale exactly") {
  torch::manual_seed(3);
  torch::nn::Sequential model(torch::nn::Linear(4, 3), torch::nn::Linear(3, 2));
  FlatParams flat(*model);
  auto local = make_local_comm();
  LossScaler scaler(LossScaler::Options{});
  const double scale = scaler.scale();
  // A gradient of known norm, as backward of the scaled loss would leave it.
  auto g = torch::randn({flat.grad().numel()});
  flat.grad().copy_(g * scale);
  const double true_norm = g.norm().item<double>();
  const auto norm = global_grad_norm(flat, *local, *local) / scale;
  CHECK(norm.item<double>() == doctest::Approx(true_norm).epsilon(1e-6));
  CHECK(scaler.after_backward(std::isfinite(norm.item<double>())) == LossScaler::Verdict::kUpdate);
  clip_grad(flat, norm, /*max_norm=*/0.0, scale);  // the step's unscaling
  CHECK(torch::allclose(flat.grad(), g, 1e-6, 1e-7));

  for (double bad : {std::numeric_limits<double>::infinity(), std::nan("")}) {
    CAPTURE(bad);
    flat.grad().copy_(g * scaler.scale());
    flat.grad()[7] = bad;  // one element of one parameter
    const double n = (global_grad_norm(flat, *local, *local) / scaler.scale()).item<double>();
    CHECK(!std::isfinite(n));
    const double before = scaler.scale();
    CHECK(scaler.after_backward(std::isfinite(n)) == LossScaler::Verdict::kSkip);
    CHECK(scaler.scale() == before / 2);
  }
}

}  // namespace unit_precision_loss_scaler
