// ZeRO-1, 2 and 3 over two ranks as threads, against the arithmetic: the flat buffers
// padded into equal shards, each rank's shard of the reduced gradient the mean of both
// ranks' gradients, the optimizer updating only that shard, and every rank holding the
// whole updated parameters after the broadcasts; ZeRO-2 keeps the gradient of its shard
// only; ZeRO-3 the parameters too, a unit whole only while gathered, under bf16 the
// weights autocast casts held and gathered in bf16.
#include <doctest/doctest.h>

#include <torch/torch.h>

#include "comm/comm.hpp"
#include "grad/zero.hpp"
#include "optim/optimizer.hpp"
#include "parallel/mesh.hpp"
#include "precision/autocast.hpp"
#include "ranks.hpp"

namespace unit_grad_zero {

using namespace dtrain;
using test::quick;
using test::RankFailures;

namespace {

// ZeRO-3 over the two data ranks of `comm`, on two Linear layers (20 -> 3 -> 2), each a
// unit; the k-th parameter (from 1) holds linspace(-1, 1) x scale(k), kept in `start`.
struct TwoUnits {
  TwoUnits(std::shared_ptr<Comm> comm, double (*scale)(int))
      : mesh(data_two(), std::move(comm)), net(std::make_shared<torch::nn::Module>()),
        l1(20, 3), l2(3, 2) {
    cfg.zero = 3;
    cfg.bucket_mb = 1e-4;
    dims = data_two();
    net->register_module("0", l1);
    net->register_module("1", l2);
    torch::NoGradGuard no_grad;
    int k = 0;
    for (auto& p : net->parameters()) {
      p.copy_(torch::linspace(-1, 1, p.numel()).view(p.sizes()) * scale(++k));
      start.push_back(p.detach().clone());
    }
    shard_flat(cfg, dims, mesh.coord(), opts);
    opts.units = {{l1.get(), l2.get()}};
  }
  static ParallelDims data_two() {
    ParallelDims d;
    d.data = 2;
    return d;
  }
  ParallelConfig cfg;
  ParallelDims dims;
  Mesh mesh;
  std::shared_ptr<torch::nn::Module> net;
  torch::nn::Linear l1, l2;
  std::vector<torch::Tensor> start;
  FlatOptions opts;
};

}  // namespace

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
  cfg.zero = 3;
  FlatOptions three;
  shard_flat(cfg, dims, at, three);
  CHECK(three.grad_ranks == 4);
  CHECK(three.param_ranks == 4);
  CHECK(three.param_rank == 2);
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

TEST_CASE("zero: stage 3 keeps the parameters' shard, gathers a unit where forward runs it, "
          "again before its backward, and frees the others") {
  RankFailures failures;
  test::run_ranks_as_threads(2, [&](std::shared_ptr<Comm> comm) {
    const int64_t r = comm->rank();
    auto fail = [&](const std::string& what) { failures.add(r, what); };
    // Two units of 63 and 8 values: the first lies in rank 0's shard and spills into rank
    // 1's (the layout is padded to 96, 48 each).
    TwoUnits two(comm, [](int k) { return double(k); });
    FlatParams flat(std::vector<torch::nn::Module*>{two.net.get()}, two.opts);
    if (!flat.sharded() || flat.units().size() != 2) return fail("not two units");
    if (flat.data().numel() * 2 != flat.numel()) return fail("more than the shard of the parameters");
    for (size_t u = 0; u < 2; ++u)
      if (flat.resident(u)) fail("a unit resident before any forward");
    OptimizerConfig ocfg;
    ocfg.name = "sgd";
    ocfg.momentum = 0;
    auto opt = make_optimizer(ocfg, flat, update_shard(two.cfg, two.dims, two.mesh.coord(), flat));
    auto sync = make_zero_sync(two.cfg, two.mesh, flat, /*micro_batches=*/1, Tied{});
    // Forward as Network::with() runs it: the hooks around each unit.
    auto run = [&](torch::nn::Linear& m, const torch::Tensor& in) {
      sync->before_use({m.get()});
      auto out = m->forward(in);
      sync->after_use({m.get()}, out);
      return out;
    };
    const auto x = torch::full({2, 20}, double(r + 1));
    sync->begin_step(1);
    sync->begin_micro_batch(true);
    auto h = run(two.l1, x);
    if (!flat.resident(0) || !flat.resident(1)) fail("unit 0 and the next one ahead not gathered");
    if (!torch::equal(two.l1->weight, two.start[0])) fail("unit 0 gathered wrong");
    auto y = run(two.l2, h);
    if (!torch::equal(two.l2->weight, two.start[2])) fail("unit 1 gathered wrong");
    if (flat.resident(0)) fail("unit 0 still held once unit 1 runs");
    // Backward gathers unit 1 (whose weight the input's gradient reads) before its part,
    // then unit 0, and the step's end frees them.
    (y.square().sum() * sync->loss_factor()).backward();
    sync->finish();
    for (size_t u = 0; u < 2; ++u)
      if (flat.resident(u)) fail("a unit still held after the step");
    // The reference: the mean of both ranks' gradients, from the start values.
    auto mean_grad = [&] {
      std::vector<torch::Tensor> sum;
      for (double scale : {1.0, 2.0}) {
        std::vector<torch::Tensor> p;
        for (const auto& s : two.start) p.push_back(s.clone().requires_grad_(true));
        auto hh = torch::linear(torch::full({2, 20}, scale), p[0], p[1]);
        torch::linear(hh, p[2], p[3]).square().sum().backward();
        for (size_t i = 0; i < p.size(); ++i)
          sum.size() > i ? void(sum[i] += p[i].grad()) : sum.push_back(p[i].grad().clone());
      }
      for (auto& g : sum) g /= 2;
      return sum;
    }();
    opt->step(/*lr=*/0.1);
    sync->after_update({});
    // The shards updated in place: gathered again, the whole parameters are the reference
    // step on every rank.
    sync->before_use({two.l1.get()});
    sync->before_use({two.l2.get()});  // unit 0 released, unit 1 gathered
    sync->before_use({two.l1.get()});  // and back
    if (!torch::allclose(two.l1->weight, two.start[0] - 0.1 * mean_grad[0], 1e-5, 1e-6)) fail("weight 0");
    if (!torch::allclose(two.l1->bias, two.start[1] - 0.1 * mean_grad[1], 1e-5, 1e-6)) fail("bias 0");
    sync->before_use({two.l2.get()});
    if (!torch::allclose(two.l2->weight, two.start[2] - 0.1 * mean_grad[2], 1e-5, 1e-6)) fail("weight 1");
    sync->settle();
  }, quick());
  failures.check();
}

TEST_CASE("zero: stage 3 under bf16 holds and gathers the weights in bf16, the biases in fp32, "
          "and makes autocast's fp32 gradient exactly") {
  RankFailures failures;
  test::run_ranks_as_threads(2, [&](std::shared_ptr<Comm> comm) {
    const int64_t r = comm->rank();
    auto fail = [&](const std::string& what) { failures.add(r, what); };
    TwoUnits two(comm, [](int k) { return 1.0 / (3 + k); });  // values bf16 does not hold exactly
    if (cast_by_autocast(*two.net) != std::set<std::string>{"0.weight", "1.weight"})
      return fail("torch's Linear: only the weight is cast");
    two.opts.compute_dtype = torch::kBFloat16;
    FlatParams flat(std::vector<torch::nn::Module*>{two.net.get()}, two.opts);
    if (two.l1->weight.scalar_type() != torch::kBFloat16 ||
        two.l1->bias.scalar_type() != torch::kFloat32)
      return fail("the weight not bf16, or the bias not fp32");
    if (flat.units()[0].low.numel() != 60 || flat.units()[0].buffer.numel() != 3)
      return fail("unit 0 not 60 bf16 values and 3 fp32 ones");
    if (flat.data().scalar_type() != torch::kFloat32) return fail("the master shard not fp32");
    const int64_t micro = 2;
    auto sync = make_zero_sync(two.cfg, two.mesh, flat, micro, Tied{});
    const double factor = sync->loss_factor();
    auto loss_of = [&](const torch::Tensor& y) { return y.to(torch::kFloat).square().sum() * factor; };
    auto input = [&](int64_t rank, int64_t mb) { return torch::full({2, 20}, double(rank + 1) / double(mb + 2)); };
    sync->begin_step(1);
    for (int64_t mb = 0; mb < micro; ++mb) {
      sync->begin_micro_batch(mb + 1 == micro);
      torch::Tensor loss;
      {
        AutocastGuard autocast("bf16", torch::kCPU);
        sync->before_use({two.l1.get()});
        if (!torch::equal(two.l1->weight, two.start[0].to(torch::kBFloat16)) ||
            !torch::equal(two.l1->bias, two.start[1]))
          fail("unit 0 gathered wrong");
        auto h = two.l1->forward(input(r, mb));
        sync->after_use({two.l1.get()}, h);
        sync->before_use({two.l2.get()});
        auto y = two.l2->forward(h);
        sync->after_use({two.l2.get()}, y);
        loss = loss_of(y);
      }
      loss.backward();
    }
    sync->finish();
    // The reference: fp32 parameters under autocast (which casts the weights per use), both
    // ranks' micro-batches, the gradients summed in fp32.
    std::vector<torch::Tensor> sum(two.start.size());
    for (int64_t rank : {0, 1}) {
      std::vector<torch::Tensor> p;
      for (const auto& s : two.start) p.push_back(s.clone().requires_grad_(true));
      for (int64_t mb = 0; mb < micro; ++mb) {
        torch::Tensor loss;
        {
          AutocastGuard autocast("bf16", torch::kCPU);
          auto h = torch::nn::functional::linear(input(rank, mb), p[0], p[1]);
          loss = loss_of(torch::nn::functional::linear(h, p[2], p[3]));
        }
        loss.backward();
      }
      for (size_t i = 0; i < p.size(); ++i) sum[i] = sum[i].defined() ? sum[i] + p[i].grad() : p[i].grad();
    }
    std::vector<torch::Tensor> flat_sum;
    for (const auto& g : sum) flat_sum.push_back(g.reshape(-1));
    const auto cat = torch::cat(flat_sum);
    auto whole = torch::zeros({flat.numel()});
    whole.narrow(0, 0, cat.numel()).copy_(cat);
    const auto held = flat.grad_held();
    if (!torch::equal(flat.grad(), whole.narrow(0, held.offset, held.numel))) {
      fail("the shard's gradient is not autocast's fp32 sum");
      if (torch::allclose(flat.grad(), whole.narrow(0, held.offset, held.numel), 1e-3, 1e-5))
        fail("(it is close: a sum in another order or dtype)");
    }
    sync->settle();
  }, quick());
  failures.check();
}

}  // namespace unit_grad_zero
