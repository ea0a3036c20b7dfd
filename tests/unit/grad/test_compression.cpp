// Gradient compression's reductions over ranks as threads, against the arithmetic.
#include <doctest/doctest.h>

#include <mutex>
#include <set>

#include <atomic>
#include <mutex>
#include <set>
#include <torch/torch.h>
#include "comm/comm.hpp"
#include "ranks.hpp"
#include "config/config.hpp"
#include "models/model.hpp"
#include "optim/clip.hpp"
#include "optim/optimizer.hpp"
#include "grad/compression.hpp"
#include "grad/grad_sync.hpp"
#include "parallel/dims.hpp"
#include "parallel/flat_params.hpp"
#include "parallel/mesh.hpp"
#include "layers/tensor_parallel.hpp"
#include "layers/vocab_parallel.hpp"
#include "util/error.hpp"

namespace unit_grad_compression {

using namespace dtrain;
using test::quick;
using test::RankFailures;

TEST_CASE("compression: each reduction's sum, bytes and error-feedback residual, by hand") {
  // Two ranks, each with its own gradient; a slice from inside the weight (320 values)
  // into the bias (8). sign's scales are per block of 256 values of a parameter: the
  // slice holds the weight's [200, 256) and [256, 320), and 4 values of the bias.
  const int64_t offset = 200, numel = 124;
  const std::vector<int64_t> blocks{56, 64, 4};
  auto gradient_of = [](int64_t rank, int64_t n) {
    std::vector<float> g(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i)
      g[size_t(i)] = float(std::sin(0.37 * double(i) + double(rank)) * double(i % 7 + 1));
    return torch::tensor(g);
  };
  // Top k of |g| by hand: the k largest magnitudes (the values here have no ties).
  auto top = [](const torch::Tensor& g, int64_t k) {
    std::vector<std::pair<float, int64_t>> by;
    for (int64_t i = 0; i < g.numel(); ++i) by.emplace_back(std::abs(g[i].item<float>()), i);
    std::sort(by.begin(), by.end(), std::greater<>());
    auto kept = torch::zeros_like(g);
    for (int64_t j = 0; j < k; ++j) kept[by[size_t(j)].second] = g[by[size_t(j)].second];
    return kept;
  };
  // Of each parameter's part: the weight's 120 values (12 kept at 10%), the bias's 4 (1).
  auto top_per_parameter = [&](const torch::Tensor& g) {
    return torch::cat({top(g.narrow(0, 0, 120), 12), top(g.narrow(0, 120, 4), 1)});
  };
  // Each block scaled by its own mean magnitude.
  auto signed_mean = [&](const torch::Tensor& c) {
    auto sign = torch::where(c.ge(0), torch::ones_like(c), -torch::ones_like(c));
    std::vector<torch::Tensor> scales;
    int64_t at = 0;
    for (int64_t n : blocks) {
      auto block = c.narrow(0, at, n);
      scales.push_back(torch::full_like(block, block.abs().mean().item<float>()));
      at += n;
    }
    return sign * torch::cat(scales);
  };
  for (const std::string how : {"fp16", "bf16", "sign", "topk"}) {
    CAPTURE(how);
    RankFailures failures;
    test::run_ranks_as_threads(2, [&](std::shared_ptr<Comm> comm) {
      const int64_t r = comm->rank();
      auto fail = [&](const std::string& what) { failures.add(r, how + ": " + what); };
      torch::nn::Linear layer(40, 8);  // 328 values
      FlatParams flat(*layer);
      ParallelConfig cfg;
      cfg.compression = how;
      cfg.topk_ratio = 0.1;
      auto reduction = compression_spec(cfg.compression).make(cfg, comm, flat);
      std::vector<torch::Tensor> g{gradient_of(0, numel), gradient_of(1, numel)};
      std::vector<torch::Tensor> residual{torch::zeros({numel}), torch::zeros({numel})};
      for (int step = 0; step < 2; ++step) {  // the second step carries the first's residual
        flat.grad().zero_();
        flat.grad().narrow(0, offset, numel).copy_(g[size_t(r)]);
        reduction->start(flat.grad().narrow(0, offset, numel), offset)->wait();
        torch::Tensor want = torch::zeros({numel});
        int64_t bytes = 0;
        for (size_t q = 0; q < 2; ++q) {
          const auto c = g[q] + residual[q];
          torch::Tensor sent;
          if (how == "fp16") sent = c.to(torch::kFloat16).to(torch::kFloat32), bytes = numel * 2;
          if (how == "bf16") sent = c.to(torch::kBFloat16).to(torch::kFloat32), bytes = numel * 2;
          if (how == "sign") sent = signed_mean(c), bytes = (numel + 7) / 8 + 3 * 4;
          if (how == "topk") sent = top_per_parameter(c), bytes = 13 * 8;
          if (how == "sign" || how == "topk") residual[q] = c - sent;
          want += sent;
        }
        const auto got = flat.grad().narrow(0, offset, numel);
        if (!torch::allclose(got, want, 1e-5, 1e-6)) fail(fmt::format("step {}: sum", step));
        if (flat.grad().narrow(0, 0, offset).abs().sum().item<double>() != 0)
          fail("wrote outside its slice");
        if (reduction->take_sent() != bytes) fail("bytes sent");
        const auto state = reduction->state();
        if (how == "fp16" || how == "bf16") {
          if (!state.empty()) fail("a cast keeps no state");
          continue;
        }
        if (state.size() != 1 || state[0].first != "residual") fail("state");
        else if (!torch::allclose(state[0].second.narrow(0, offset, numel), residual[size_t(r)],
                                  1e-5, 1e-6))
          fail(fmt::format("step {}: residual", step));
      }
      if (how != "sign" && how != "topk") return;
      // A step that made no update leaves nothing behind; one that did keeps its residual.
      auto e = reduction->state()[0].second;  // the buffer itself
      reduction->after_step(torch::zeros({1}));
      if (e.abs().sum().item<double>() == 0) fail("a kept step dropped its residual");
      reduction->after_step(torch::ones({1}));
      if (e.abs().sum().item<double>() != 0) fail("a skipped step kept its residual");
    }, quick());
    failures.check();
  }
}

TEST_CASE("compression: powersgd's sum, bytes, residual and warm-started Q, against a QR by hand") {
  // Two ranks; a Linear(40, 8): the weight [8, 40] is a matrix (rank 2 shrinks it 3x), the
  // bias goes as it is. Slices in backward's order: [200, 328) (the weight's tail and the
  // bias) then [0, 200), which completes the weight.
  auto gradient_of = [](int64_t rank, int64_t n, double phase) {
    std::vector<float> g(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i)
      g[size_t(i)] = float(std::sin(0.37 * double(i) + double(rank) + phase) * double(i % 7 + 1));
    return torch::tensor(g);
  };
  RankFailures failures;
  test::run_ranks_as_threads(2, [&](std::shared_ptr<Comm> comm) {
    const int64_t r = comm->rank();
    auto fail = [&](const std::string& what) { failures.add(r, what); };
    torch::nn::Linear layer(40, 8);
    FlatParams flat(*layer);
    ParallelConfig cfg;
    cfg.compression = "powersgd";
    cfg.powersgd_rank = 2;
    auto reduction = compression_spec(cfg.compression).make(cfg, comm, flat);
    const auto factors = reduction->factors();
    if (factors.size() != 1 || factors[0].first != 0) return fail("one matrix: the weight");
    torch::Tensor q = factors[0].second.clone();  // [40, 2], the same on both ranks
    std::vector<torch::Tensor> e{torch::zeros({8, 40}), torch::zeros({8, 40})};
    for (int step = 0; step < 2; ++step) {
      std::vector<torch::Tensor> w, b;
      for (int64_t k = 0; k < 2; ++k) {
        w.push_back(gradient_of(k, 320, step).view({8, 40}));
        b.push_back(gradient_of(k, 8, 10 + step));
      }
      flat.grad().narrow(0, 0, 320).copy_(w[size_t(r)].view(-1));
      flat.grad().narrow(0, 320, 8).copy_(b[size_t(r)]);
      auto upper = reduction->start(flat.grad().narrow(0, 200, 128), 200);
      auto lower = reduction->start(flat.grad().narrow(0, 0, 200), 0);
      upper->wait();
      lower->wait();
      // By hand: P = sum (M + e) Q, orthonormal by QR; Q' = sum (M + e)^T P; the result
      // P Q'^T; each rank keeps (M + e) - P P^T (M + e).
      std::vector<torch::Tensor> c{w[0] + e[0], w[1] + e[1]};
      auto p = std::get<0>(torch::linalg_qr(c[0].mm(q) + c[1].mm(q)));
      auto q_next = c[0].t().mm(p) + c[1].t().mm(p);
      const auto want = p.mm(q_next.t());
      for (size_t k = 0; k < 2; ++k) e[k] = c[k] - p.mm(p.t().mm(c[k]));
      const auto got = flat.grad().narrow(0, 0, 320).view({8, 40});
      if (!torch::allclose(got, want, 1e-4, 1e-5)) fail(fmt::format("step {}: the weight", step));
      if (!torch::allclose(flat.grad().narrow(0, 320, 8), b[0] + b[1]))
        fail(fmt::format("step {}: the bias, sent as it is", step));
      const auto residual = reduction->state().at(0).second;
      if (!torch::allclose(residual.narrow(0, 0, 320).view({8, 40}), e[size_t(r)], 1e-4, 1e-5))
        fail(fmt::format("step {}: residual", step));
      if (residual.narrow(0, 320, 8).abs().sum().item<double>() != 0)
        fail("a vector sent as it is keeps no residual");
      // QR and Gram-Schmidt may differ in each column's sign, which changes Q's sign only.
      if (!torch::allclose(factors[0].second.abs(), q_next.abs(), 1e-4, 1e-5))
        fail(fmt::format("step {}: the next step's Q", step));
      q = factors[0].second.clone();
      // The bias all-reduced (32 bytes at 2 ranks), P (8 x 2 values) and Q (40 x 2).
      if (reduction->take_sent() != 32 + 64 + 320) fail("bytes sent");
    }
    // A skipped step's Q is the one before it, and its residual nothing.
    const auto kept = factors[0].second.clone();
    reduction->after_step(torch::zeros({1}));
    if (!torch::equal(factors[0].second, kept)) fail("a kept step changed its Q");
    reduction->after_step(torch::ones({1}));
    if (torch::equal(factors[0].second, kept)) fail("a skipped step kept its Q");
    if (reduction->state().at(0).second.abs().sum().item<double>() != 0)
      fail("a skipped step kept its residual");
  }, quick());
  failures.check();
}

TEST_CASE("compression: the warm-up, a number or auto (a share of the run for the lossy methods)") {
  ParallelConfig cfg;
  auto warmup = [&](const std::string& how, const std::string& setting, int64_t total) {
    cfg.compression = how;
    cfg.compression_warmup = setting;
    return compression_warmup_steps(cfg, total);
  };
  CHECK(warmup("sign", "auto", 400) == 100);
  CHECK(warmup("sign", "auto", 937) == 235);
  CHECK(warmup("topk", "auto", 401) == 81);  // rounded up: never less than a fifth
  CHECK(warmup("powersgd", "auto", 2811) == 282);
  CHECK(warmup("powersgd", "auto", 1) == 1);
  CHECK(warmup("fp16", "auto", 400) == 0);
  CHECK(warmup("bf16", "auto", 400) == 0);
  CHECK(warmup("sign", "0", 400) == 0);
  CHECK(warmup("fp16", "300", 400) == 300);
}

// Under fault_tolerance: replicas a step whose vote failed is discarded and trained again
// (grad_sync.hpp's make_replica_sync): the compression's residual and PowerSGD's factors
// must be as the step found them, or the second try sums on top of the first's leftovers.
TEST_CASE("compression: a step the replicas discard leaves the residuals and factors as it found them") {
  for (const std::string how : {"sign", "topk", "powersgd"}) {
    CAPTURE(how);
    RankFailures failures;
    test::run_ranks_as_threads(2, [&](std::shared_ptr<Comm> comm) {
      const int64_t r = comm->rank();
      auto fail = [&](const std::string& what) { failures.add(r, what); };
      torch::nn::Linear layer(20, 6);
      {
        torch::NoGradGuard no_grad;
        layer->weight.copy_(torch::sin(torch::linspace(0, 9, 120)).view({6, 20}));
        layer->bias.copy_(torch::linspace(-0.3, 0.3, 6));
      }
      FlatParams flat(*layer);
      ParallelConfig cfg;
      cfg.compression = how;
      cfg.compression_warmup = "0";
      auto sync = make_replica_sync(cfg, comm, flat, /*micro_batches=*/1, /*total_steps=*/10,
                                    /*tensor_rank=*/0, [] { return 0.5; }, Tied{});
      // Step n's summed gradient over both ranks, each with inputs of its own.
      auto step = [&](int64_t n) {
        sync->begin_step(n);
        sync->begin_micro_batch(true);
        const auto x = torch::cos(torch::linspace(0, double(n + 3 * r), 60)).view({3, 20});
        (layer->forward(x).square().mean() * sync->loss_factor()).backward();
        sync->finish();
        auto sum = flat.grad().clone();
        flat.zero_grad();
        return sum;
      };
      step(1);
      sync->after_update({});
      const auto first = step(2);
      sync->discard();  // a replica failed: step 2 again, from where it began
      const auto again = step(2);
      if (!torch::equal(first, again)) fail(how + ": step 2 trained again sums otherwise");
      sync->after_update({});
      // Kept, the step's residual lives on: the next step's sum is not the discarded one's.
      if (torch::equal(step(3), again)) fail(how + ": the test's steps are alike");
    }, quick());
    failures.check();
  }
}

}  // namespace unit_grad_compression
