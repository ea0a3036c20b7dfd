// ZeRO-1 and ZeRO-2 over two ranks as threads, against the arithmetic: the flat buffers
// padded into equal shards, each rank's shard of the reduced gradient the mean of both
// ranks' gradients, the optimizer updating only that shard, and every rank holding the
// whole updated parameters after the broadcasts; ZeRO-2 keeps the gradient of its shard
// only.
#include <doctest/doctest.h>

#include <torch/torch.h>

#include "comm/comm.hpp"
#include "grad/zero.hpp"
#include "optim/optimizer.hpp"
#include "parallel/mesh.hpp"
#include "ranks.hpp"

using namespace dtrain;
using test::quick;
using test::RankFailures;

TEST_CASE("zero: the shard layout is one place's arithmetic") {
  ParallelConfig cfg;
  ParallelDims dims;
  dims.data = 4;
  Coord at;
  at.data = 2;
  FlatOptions opts;
  shard_flat(cfg, dims, at, opts);
  CHECK(opts.pad_to == 1);  // zero 0: nothing padded
  cfg.zero = 1;
  shard_flat(cfg, dims, at, opts);
  CHECK(opts.pad_to == 4 * kShardAlign);
  CHECK(opts.grad_ranks == 1);
  cfg.zero = 2;
  FlatOptions two;
  shard_flat(cfg, dims, at, two);
  CHECK(two.grad_ranks == 4);
  CHECK(two.grad_rank == 2);
  // 10 + 3 = 13 values padded to 64: rank 2 updates [32, 48).
  torch::nn::Linear layer(10, 1);
  FlatParams flat(*layer, two);
  CHECK(flat.data().numel() == 64);
  const Shard s = update_shard(cfg, dims, at, flat);
  CHECK(s.offset == 32);
  CHECK(s.numel == 16);
  CHECK(flat.grad().numel() == 16);  // ZeRO-2: the gradient of the shard only
}

TEST_CASE("zero: stages 1 and 2 reduce to the owners, update shards, gather the whole") {
  for (int64_t stage : {1, 2}) {
    CAPTURE(stage);
    RankFailures failures;
    test::run_ranks_as_threads(2, [&](std::shared_ptr<Comm> comm) {
      const int64_t r = comm->rank();
      auto fail = [&](const std::string& what) { failures.add(r, what); };
      ParallelConfig cfg;
      cfg.zero = stage;
      cfg.bucket_mb = 1e-4;  // a few values per bucket: several reductions in flight
      ParallelDims dims;
      dims.data = 2;
      Mesh mesh(dims, comm);
      torch::nn::Linear layer(20, 3);
      {
        // The same start on both ranks, not from the generator the rank threads share.
        torch::NoGradGuard no_grad;
        layer->weight.copy_(torch::linspace(-1, 1, 60).view({3, 20}));
        layer->bias.copy_(torch::tensor({0.1f, -0.2f, 0.3f}));
      }
      const auto w0 = layer->weight.detach().clone(), b0 = layer->bias.detach().clone();
      FlatOptions opts;
      shard_flat(cfg, dims, mesh.coord(), opts);
      FlatParams flat(*layer, opts);
      OptimizerConfig ocfg;
      ocfg.name = "sgd";
      ocfg.momentum = 0;
      auto opt = make_optimizer(ocfg, flat, update_shard(cfg, dims, mesh.coord(), flat));
      auto sync = make_zero_sync(cfg, mesh, flat, /*micro_batches=*/1, Tied{});
      // Each rank's own data; the reference gradient is the mean of both ranks' own.
      const auto x = torch::full({2, 20}, double(r + 1)), y = torch::zeros({2, 3});
      auto mean_grad = [&](const torch::Tensor& w, const torch::Tensor& b, double scale) {
        auto wr = w.clone().requires_grad_(true), br = b.clone().requires_grad_(true);
        torch::mse_loss(torch::linear(torch::full({2, 20}, scale), wr, br), y).backward();
        return std::make_pair(wr.grad(), br.grad());
      };
      const auto [gw1, gb1] = mean_grad(w0, b0, 1.0);
      const auto [gw2, gb2] = mean_grad(w0, b0, 2.0);
      sync->begin_step(1);
      sync->begin_micro_batch(true);
      (torch::mse_loss(layer->forward(x), y) * sync->loss_factor()).backward();
      sync->finish();
      opt->step(/*lr=*/0.5);
      sync->after_update({});
      sync->settle();
      const auto want_w = w0 - 0.5 * (gw1 + gw2) / 2, want_b = b0 - 0.5 * (gb1 + gb2) / 2;
      if (!torch::allclose(layer->weight, want_w, 1e-5, 1e-6)) fail("weight after the gather");
      if (!torch::allclose(layer->bias, want_b, 1e-5, 1e-6)) fail("bias after the gather");
      if (stage == 2 && flat.grad().numel() * 2 != flat.data().numel())
        fail("ZeRO-2 holds more than its shard of the gradient");
      if (sync->bytes_per_step() <= 0) fail("no bytes counted");
    }, quick());
    failures.check();
  }
}
