// Devices, backends and fp16's loss scaler: the choices are pure functions of what they
// depend on, so every case is checked on any machine; the scaler's verdicts come from
// gradients with injected inf and nan, through the same global norm the step uses.
#include <doctest/doctest.h>

#include <cmath>
#include <limits>
#include <string>

#include <torch/torch.h>

#include "comm/comm.hpp"
#include "launch/device.hpp"
#include "optim/clip.hpp"
#include "parallel/flat_params.hpp"
#include "parallel/sync_batchnorm.hpp"
#include "precision/loss_scaler.hpp"
#include "util/error.hpp"

using namespace dtrain;

namespace {

std::string device_error(const std::string& spec, int64_t local_rank, int64_t local_world,
                         int64_t visible) {
  try {
    pick_device(spec, local_rank, local_world, visible);
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "";
}

std::string backend_error(const std::string& backend, c10::DeviceType type, bool nccl) {
  try {
    pick_backend(backend, type, nccl);
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST_CASE("device: train.device resolves per local rank and visible GPUs") {
  CHECK(pick_device("cpu", 0, 1, 4) == c10::Device(c10::kCPU));
  CHECK(pick_device("auto", 0, 1, 0) == c10::Device(c10::kCPU));
  CHECK(pick_device("auto", 0, 1, 2) == c10::Device(c10::kCUDA, 0));
  CHECK(pick_device("auto", 3, 4, 4) == c10::Device(c10::kCUDA, 3));
  CHECK(pick_device("cuda", 1, 2, 2) == c10::Device(c10::kCUDA, 1));
  // Each process sees one GPU of its own (SLURM --gpus-per-task=1): always its cuda:0.
  CHECK(pick_device("cuda", 5, 8, 1) == c10::Device(c10::kCUDA, 0));
  CHECK(pick_device("cuda:1", 0, 4, 2) == c10::Device(c10::kCUDA, 1));
}

TEST_CASE("device: a GPU that is not there is a one-line error naming train.device") {
  struct Case {
    std::string spec;
    int64_t local_rank, local_world, visible;
    std::vector<std::string> says;
  } cases[] = {
      {"cuda", 0, 1, 0, {"train.device", "no CUDA device is visible"}},
      {"cuda:0", 0, 1, 0, {"train.device", "no CUDA device is visible"}},
      {"cuda:2", 0, 1, 2, {"train.device", "cuda:2", "only 2 CUDA device(s)"}},
      {"cuda", 2, 4, 2, {"train.device", "local rank 2 of 4", "at most 2 processes"}},
      {"auto", 3, 4, 2, {"train.device", "local rank 3 of 4"}},
      {"gpu", 0, 1, 1, {"train.device", "auto, cpu, cuda or cuda:N", "'gpu'"}},
      {"cuda:x", 0, 1, 1, {"train.device", "'cuda:x'"}},
      {"cuda:", 0, 1, 1, {"train.device", "'cuda:'"}},
      {"cuda:-1", 0, 1, 1, {"train.device", "'cuda:-1'"}},
  };
  for (const auto& c : cases) {
    CAPTURE(c.spec);
    const auto msg = device_error(c.spec, c.local_rank, c.local_world, c.visible);
    CAPTURE(msg);
    CHECK(msg.find('\n') == std::string::npos);
    for (const auto& s : c.says) CHECK(msg.find(s) != std::string::npos);
  }
}

TEST_CASE("device: dist.backend auto is NCCL for CUDA where built, Gloo otherwise") {
  CHECK(pick_backend("auto", c10::kCPU, true) == "gloo");
  CHECK(pick_backend("auto", c10::kCUDA, true) == "nccl");
  CHECK(pick_backend("auto", c10::kCUDA, false) == "gloo");  // Gloo moves CUDA tensors too
  CHECK(pick_backend("gloo", c10::kCUDA, true) == "gloo");
  CHECK(pick_backend("nccl", c10::kCUDA, true) == "nccl");
  const auto on_cpu = backend_error("nccl", c10::kCPU, true);
  CHECK(on_cpu.find("dist.backend") != std::string::npos);
  CHECK(on_cpu.find("CPU") != std::string::npos);
  // async_ps's servers receive from any rank: Gloo has that, NCCL not.
  CHECK(pick_backend("auto", c10::kCUDA, true, false, /*any_source=*/true) == "gloo");
  try {
    pick_backend("nccl", c10::kCUDA, true, false, /*any_source=*/true);
    FAIL("nccl with receive-from-any was accepted");
  } catch (const ConfigError& e) {
    CHECK(std::string(e.what()).find("receive-from-any") != std::string::npos);
  }
  // Local processes sharing one GPU: NCCL refuses that, so auto is Gloo.
  CHECK(pick_backend("auto", c10::kCUDA, true, /*gpu_shared=*/true) == "gloo");
  const auto shared = backend_error("nccl", c10::kCUDA, true);
  CHECK(shared.empty());
  try {
    pick_backend("nccl", c10::kCUDA, true, /*gpu_shared=*/true);
    FAIL("nccl on a shared GPU was accepted");
  } catch (const ConfigError& e) {
    CHECK(std::string(e.what()).find("one GPU") != std::string::npos);
  }
  const auto unbuilt = backend_error("nccl", c10::kCUDA, false);
  CHECK(unbuilt.find("dist.backend") != std::string::npos);
  CHECK(unbuilt.find("no NCCL") != std::string::npos);
}

TEST_CASE("device: fp16 on the CPU is refused with a pointer to bf16") {
  JobConfig cfg;
  cfg.train.device = "cpu";
  cfg.precision.dtype = "fp16";
  try {
    plan_device(cfg, 0, 1);
    FAIL("fp16 on the CPU was accepted");
  } catch (const ConfigError& e) {
    const std::string msg = e.what();
    CHECK(msg.find("precision.dtype") != std::string::npos);
    CHECK(msg.find("bf16") != std::string::npos);
  }
  cfg.precision.dtype = "bf16";
  CHECK(plan_device(cfg, 0, 1).device == c10::Device(c10::kCPU));
  CHECK(plan_device(cfg, 0, 1).backend == "gloo");
}

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

TEST_CASE("sync batchnorm: a bf16 or fp16 input (autocast's) keeps fp32 statistics") {
  auto comm = make_local_comm();
  // 1 x 17 x 17 = 289 elements per channel (bf16 rounds it to 288); 128 x 28 x 28 = 100352
  // (more than fp16 holds).
  for (auto shape : {std::vector<int64_t>{1, 3, 17, 17}, std::vector<int64_t>{128, 2, 28, 28}}) {
    for (auto dtype : {torch::kBFloat16, torch::kHalf}) {
      CAPTURE(shape[0]);
      const std::string type = c10::toString(dtype);
      CAPTURE(type);
      torch::manual_seed(1);
      SyncBatchNorm2d bn(shape[1], comm);
      auto x = (torch::randn(shape) * 20 + 3).to(dtype);  // squares past fp16's range
      auto y = bn->forward(x);
      auto xf = x.to(torch::kFloat);
      auto ref = torch::batch_norm(xf, torch::ones({shape[1]}), torch::zeros({shape[1]}), {}, {},
                                   /*training=*/true, 0.1, 1e-5, /*cudnn_enabled=*/false);
      CHECK((y.scalar_type() == torch::kFloat));
      CHECK(torch::allclose(y, ref, 1e-4, 1e-4));
      auto dims = std::vector<int64_t>{0, 2, 3};
      CHECK(torch::allclose(bn->running_mean, xf.mean(dims) * 0.1, 1e-4, 1e-4));
    }
  }
}
