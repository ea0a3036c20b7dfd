// Devices and backends: the choices are pure functions of what they depend on, so every
// case is checked on any machine.
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

namespace unit_launch_device {

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
  CHECK(pick_backend("auto", c10::kCUDA, true, false, /*any_source=*/"a parameter server needs it") == "gloo");
  try {
    pick_backend("nccl", c10::kCUDA, true, false, /*any_source=*/"a parameter server needs it");
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

}  // namespace unit_launch_device
