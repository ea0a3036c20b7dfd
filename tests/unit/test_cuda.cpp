// What only a GPU can check, at the unit level: the flat buffers and the fused SGD and
// AdamW on CUDA (with a skipped step) against the CPU's update, autocast on CUDA, and NCCL
// behind the Comm interface (a group of one: one GPU holds one NCCL rank), and the sync
// check that holds a steady step to never waiting, and seeded dropout's GPU form drawing the
// CPU's masks. Skipped where
// no GPU is visible (CI).
#include <doctest/doctest.h>

#include <cmath>

#include <torch/torch.h>

#include "comm/comm.hpp"
#include "ranks.hpp"
#include "config/config.hpp"
#include "launch/device.hpp"
#include "models/dropout.hpp"
#include "optim/optimizer.hpp"
#include "parallel/flat_params.hpp"
#include "precision/autocast.hpp"

namespace unit_cuda {

using namespace dtrain;

namespace {
bool no_gpu() { return visible_gpus() == 0; }
}  // namespace

TEST_SUITE("cuda" * doctest::skip(no_gpu())) {
  TEST_CASE("cuda: seeded dropout draws on the GPU the masks it draws on the CPU") {
    // The GPU draws the mask with dtrain's kernel, the CPU in a loop: the same masks, in
    // each dtype, so a job keeps its dropout moving between devices.
    auto positions = torch::tensor(std::vector<int64_t>{0, 3, 5, 8, 13, 21}, torch::kInt64);
    for (const auto dtype : {torch::kFloat32, torch::kBFloat16, torch::kFloat16})
    for (const LayerSlice slice : {LayerSlice{}, LayerSlice{1, 1, 3}}) {
      CAPTURE(dtype);
      auto x = torch::randn({6, 4, 9, 9}).to(dtype);
      torch::Tensor cpu, gpu;
      {
        DropoutScope draw(DropoutDraw{42, 3, positions});
        cpu = seeded_dropout(x, 0.1, 7, slice);
      }
      {
        DropoutScope draw(DropoutDraw{42, 3, positions.cuda()});
        gpu = seeded_dropout(x.cuda(), 0.1, 7, slice);
      }
      CHECK(torch::equal(gpu.cpu(), cpu));
    }
  }

  TEST_CASE("cuda: flat SGD and AdamW on the GPU (fused where LibTorch has it) match the CPU") {
    // Six steps, the third one skipped (a NaN in the gradient, skip = 1 on the device).
    for (const char* name : {"sgd", "adamw"}) {
      CAPTURE(name);
      OptimizerConfig cfg;
      cfg.name = name;
      cfg.lr = 0.01;
      cfg.momentum = 0.9;
      cfg.nesterov = true;
      cfg.weight_decay = 0.1;  // the 2-D weights decay, the biases do not: two fused groups
      auto make = [](const c10::Device& d) {
        torch::manual_seed(5);
        torch::nn::Sequential m(torch::nn::Linear(64, 32), torch::nn::Linear(32, 8));
        m->to(d);
        FlatOptions o;
        o.device = d;
        return std::make_pair(m, std::make_unique<FlatParams>(*m, o));
      };
      auto [cpu_model, cpu] = make(c10::Device(c10::kCPU));
      auto [gpu_model, gpu] = make(c10::Device(c10::kCUDA, 0));
      REQUIRE(gpu->data().is_cuda());
      REQUIRE(torch::equal(cpu->data(), gpu->data().cpu()));
      auto cpu_opt = make_optimizer(cfg, *cpu);
      auto gpu_opt = make_optimizer(cfg, *gpu);
      for (int step = 1; step <= 6; ++step) {
        auto g = torch::randn({cpu->grad().numel()});
        if (step == 3) g[5] = std::nan("");
        cpu->grad().copy_(g);
        gpu->grad().copy_(g);
        const auto skip = torch::full({}, step == 3 ? 1.0f : 0.0f);
        cpu_opt->step(0.01, skip);
        gpu_opt->step(0.01, skip.to(gpu->data().device()));
      }
      CHECK(gpu->data().isfinite().all().item<bool>());
      CHECK(torch::allclose(cpu->data(), gpu->data().cpu(), 1e-5, 1e-6));
      CHECK(torch::allclose(cpu_opt->slots().back().second, gpu_opt->slots().back().second.cpu(),
                            1e-5, 1e-7));
      CHECK(torch::equal(cpu_opt->scalars()[0].second, gpu_opt->scalars()[0].second));
    }
  }

  TEST_CASE("cuda: autocast runs matrix products in bf16 and fp16, and only inside the guard") {
    auto a = torch::randn({16, 16}, torch::Device(torch::kCUDA, 0));
    {
      AutocastGuard guard("bf16", c10::kCUDA);
      CHECK((torch::matmul(a, a).scalar_type() == torch::kBFloat16));
    }
    {
      AutocastGuard guard("fp16", c10::kCUDA);
      CHECK((torch::matmul(a, a).scalar_type() == torch::kHalf));
    }
    CHECK((torch::matmul(a, a).scalar_type() == torch::kFloat));
  }

  TEST_CASE("cuda: SyncDebugScope makes a read of the GPU an error, and only inside it") {
    // What tests/e2e/test_cuda.cpp relies on to show that a steady step never waits: the
    // mode reaches LibTorch's own check (the same global state), and is restored.
    auto t = torch::ones({4}, torch::Device(torch::kCUDA, 0));
    {
      SyncDebugScope check("error");
      auto u = t * 2;  // queued, no wait
      CHECK_THROWS_AS(u.sum().item<float>(), c10::Error);
      auto host = torch::empty({4}, torch::dtype(torch::kFloat32).pinned_memory(true));
      CHECK_NOTHROW(host.copy_(u, /*non_blocking=*/true));  // the figures' path: no wait
    }
    CHECK(t.sum().item<float>() == 4.0f);
    SyncDebugScope off("off");
    CHECK(t.sum().item<float>() == 4.0f);
  }

  TEST_CASE("cuda: NCCL collectives behind Comm, CUDA tensors in place and CPU ones staged") {
    if (!nccl_built()) return;  // a LibTorch without NCCL
    CommOptions o;
    o.backend = "nccl";
    o.device = c10::Device(c10::kCUDA, 0);
    o.timeout = std::chrono::seconds(60);
    test::run_ranks_as_threads(1, [&](std::shared_ptr<Comm> comm) {
      REQUIRE(comm->size() == 1);
      auto dev = torch::arange(8, torch::dtype(torch::kFloat32).device(o.device));
      comm->all_reduce(dev, ReduceOp::kAvg);
      CHECK(torch::equal(dev.cpu(), torch::arange(8, torch::kFloat32)));
      double agree[3] = {1.5, 0.0, 2.0};  // the step's agreement: a CPU tensor
      comm->all_reduce(torch::from_blob(agree, {3}, torch::kFloat64), ReduceOp::kMax);
      CHECK(agree[0] == 1.5);
      CHECK(agree[2] == 2.0);
      auto cpu = torch::tensor({3.0, 4.0});
      comm->broadcast(cpu, 0);
      CHECK(cpu[1].item<double>() == 4.0);
      auto parts = comm->all_gather(torch::tensor({7}, torch::kInt64));
      REQUIRE(parts.size() == 1);
      CHECK(parts[0].device().is_cpu());
      CHECK(parts[0].item<int64_t>() == 7);
      comm->barrier();
    }, o);
  }
}

}  // namespace unit_cuda
