// The tensor- and vocab-parallel layers against unsplit ones (forward and gradients), and a
// GPT's initial weights and replicated parameters across tensor ranks.
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
#include "parallel/dims.hpp"
#include "parallel/flat_params.hpp"
#include "parallel/mesh.hpp"
#include "layers/tensor_parallel.hpp"
#include "layers/vocab_parallel.hpp"
#include "util/error.hpp"

namespace unit_layers_tensor_parallel {

using namespace dtrain;
using test::quick;
using test::RankFailures;

TEST_CASE("tensor parallel: column + row layers on 1 and 2 ranks equal the unsplit layers") {
  const int64_t in = 6, hidden = 8, out = 5, batch = 4;
  // The unsplit model, drawn from the same seed in the same order as the parallel layers.
  torch::manual_seed(21);
  torch::nn::Linear ref_a(in, hidden), ref_b(hidden, out);
  auto x = torch::randn({batch, in}), target = torch::randn({batch, out});
  auto xr = x.clone().requires_grad_(true);
  auto ref_y = ref_b(torch::relu(ref_a(xr)));
  torch::mse_loss(ref_y, target).backward();

  for (int64_t ranks : {1, 2}) {
    CAPTURE(ranks);
    RankFailures failures;
    test::run_ranks_as_threads(ranks, [&](std::shared_ptr<Comm> tensor) {
      // The layers are created uninitialised (a model's rule fills them: models/init.hpp);
      // here each takes its part of the unsplit weights.
      ColumnParallelLinear a(ParallelLinearOptions{in, hidden}, tensor);
      RowParallelLinear b(ParallelLinearOptions{hidden, out}, tensor);
      const int64_t r = tensor->rank();
      auto fail = [&](const std::string& what) { failures.add(r, what); };
      {
        torch::NoGradGuard no_grad;
        a->weight.copy_(ref_a->weight.chunk(ranks, 0)[r]);
        a->bias.copy_(ref_a->bias.chunk(ranks, 0)[r]);
        b->weight.copy_(ref_b->weight.chunk(ranks, 1)[r]);
        b->bias.copy_(ref_b->bias);
      }
      torch::nn::Sequential both(a, torch::nn::Functional(torch::relu), b);
      FlatParams flat(*both);  // before backward: gradients land in its buffer
      auto xi = x.clone().requires_grad_(true);
      auto y = b(torch::relu(a(xi)));
      if (!torch::allclose(y, ref_y, 1e-5, 1e-6)) fail("forward");
      torch::mse_loss(y, target).backward();
      if (!torch::allclose(a->weight.grad(), ref_a->weight.grad().chunk(ranks, 0)[r], 1e-5, 1e-6))
        fail("column weight gradient");
      if (!torch::allclose(b->weight.grad(), ref_b->weight.grad().chunk(ranks, 1)[r], 1e-5, 1e-6))
        fail("row weight gradient");
      if (!torch::allclose(b->bias.grad(), ref_b->bias.grad(), 1e-5, 1e-6)) fail("row bias gradient");
      // The input gradient is whole on every rank (the column layer's backward all-reduce).
      if (!torch::allclose(xi.grad(), xr.grad(), 1e-5, 1e-6)) fail("input gradient");

      // The flat buffer knows the placements: every rank's owned parts, assembled, are the
      // unsplit tensors, and the global norm counts the replicated bias once.
      PartsOf parts;
      NamedTensors full;
      for (auto& [name, local] : flat.owned(flat.data(), "", r, parts)) {
        auto it = parts.find(name);
        if (it == parts.end()) full.emplace_back(name, local);
        else full.emplace_back(name, it->second.placement.assemble(tensor->all_gather(local.contiguous())));
      }
      std::map<std::string, torch::Tensor> by_name(full.begin(), full.end());
      if (r == 0 && !by_name.count("2.bias")) fail("rank 0 owns the replicated bias");
      if (r == 1 && by_name.count("2.bias")) fail("rank 1 does not own the replicated bias");
      if (r == 1) by_name["2.bias"] = b->bias;  // replicated: every rank holds the same
      full.assign(by_name.begin(), by_name.end());
      if (!torch::equal(by_name.at("0.weight"), ref_a->weight)) fail("gathered column weight");
      if (!torch::equal(by_name.at("2.weight"), ref_b->weight)) fail("gathered row weight");
      double ref_sq = 0;
      for (auto* p : {&ref_a->weight, &ref_a->bias, &ref_b->weight, &ref_b->bias})
        ref_sq += p->grad().pow(2).sum().item<double>();
      const double norm = global_grad_norm(flat, *tensor, *make_local_comm()).item<double>();
      if (std::abs(norm - std::sqrt(ref_sq)) > 1e-5 * std::sqrt(ref_sq)) fail("global norm");
      // scatter_full is the inverse: every rank takes back its part.
      auto copy = torch::zeros_like(flat.data());
      flat.scatter_full(copy, "", SavedTensors(full, "test"), r);
      if (!torch::equal(copy, flat.data())) fail("scatter_full");
    }, quick());
    failures.check();
  }
}

TEST_CASE("tensor parallel: a width that does not split is a ConfigError") {
  test::run_ranks_as_threads(2, [](std::shared_ptr<Comm> tensor) {
    CHECK_THROWS_AS(ColumnParallelLinear(ParallelLinearOptions{4, 5}, tensor), ConfigError);
    CHECK_THROWS_AS(RowParallelLinear(ParallelLinearOptions{5, 4}, tensor), ConfigError);
  }, quick());
}

TEST_CASE("vocab parallel: embedding, tied head and cross-entropy on 1 and 2 ranks equal torch's") {
  const int64_t vocab = 10, dim = 4;
  torch::manual_seed(33);
  auto table = torch::empty({vocab, dim});
  torch::nn::init::normal_(table, 0.0, 0.02);
  auto ids = torch::tensor({{1, 7, 3}, {9, 0, 5}}, torch::kInt64);
  auto targets = torch::tensor({7, 3, 2, 0, 5, 9}, torch::kInt64);
  auto mix = torch::randn({dim, dim});  // something between lookup and head
  auto ref_table = table.clone().requires_grad_(true);
  auto ref_h = torch::matmul(torch::nn::functional::embedding(ids, ref_table), mix);
  auto ref_loss = torch::nn::functional::cross_entropy(
      torch::nn::functional::linear(ref_h, ref_table).view({-1, vocab}), targets);
  ref_loss.backward();

  for (int64_t ranks : {1, 2}) {
    CAPTURE(ranks);
    RankFailures failures;
    test::run_ranks_as_threads(ranks, [&](std::shared_ptr<Comm> tensor) {
      VocabParallelEmbedding wte(vocab, dim, tensor);
      const int64_t r = tensor->rank();
      auto fail = [&](const std::string& what) { failures.add(r, what); };
      {
        torch::NoGradGuard no_grad;
        wte->weight.copy_(table.chunk(ranks, 0)[r]);
      }
      auto h = torch::matmul(wte(ids), mix);
      if (!torch::allclose(h, ref_h, 1e-6, 1e-7)) fail("lookup");
      auto logits = wte->logits(h);
      if (logits.size(-1) != vocab / ranks) fail("logits are this rank's part");
      auto per_item = vocab_parallel_cross_entropy(logits.view({-1, vocab / ranks}), targets, *tensor);
      auto loss = per_item.mean();
      if (std::abs(loss.item<double>() - ref_loss.item<double>()) > 1e-6) fail("loss");
      loss.backward();
      if (!torch::allclose(wte->weight.grad(), ref_table.grad().chunk(ranks, 0)[r], 1e-5, 1e-7))
        fail("gradient");
    }, quick());
    failures.check();
  }
}

TEST_CASE("tensor parallel: each rank starts from its part of one process's weights") {
  // Initialised by name (models/init.hpp): a split parameter's part on rank r is the
  // one-process tensor's part r, exactly, and a replicated one is the whole.
  ModelConfig cfg;
  cfg.arch = "gpt";
  cfg.layers = 2;
  cfg.heads = 2;
  cfg.dim = 8;
  cfg.vocab = 16;
  cfg.seq_len = 6;
  ModelContext one;
  one.sample_shape = {6};
  one.vocab = 16;
  const auto whole = build_initialised(cfg, one, /*seed=*/9)->named_parameters();
  RankFailures failures;
  test::run_ranks_as_threads(2, [&](std::shared_ptr<Comm> tensor) {
    ModelContext ctx = one;
    ctx.tensor = tensor;
    auto model = build_initialised(cfg, ctx, /*seed=*/9);
    const auto placements = placements_of(*model);
    for (const auto& p : model->named_parameters()) {
      auto it = placements.find(p.key());
      const Placement place = it == placements.end() ? Placement::replicated() : it->second;
      if (!torch::equal(p.value(), place.shard(whole[p.key()], tensor->rank())))
        failures.add(tensor->rank(), p.key() + " is not its part of the one-process weights");
    }
    if (placements.empty()) failures.add(tensor->rank(), "no split parameter");
  }, quick());
  failures.check();
}

TEST_CASE("tensor parallel: a GPT's replicated parameters stay bitwise identical across ranks") {
  // LayerNorms, the position embedding and the row-parallel biases are held whole by every
  // tensor rank and must receive the same gradient there, or the ranks' copies drift apart.
  RankFailures failures;
  test::run_ranks_as_threads(2, [&](std::shared_ptr<Comm> tensor) {
    ModelConfig cfg;
    cfg.arch = "gpt";
    cfg.layers = 2;
    cfg.heads = 2;
    cfg.dim = 8;
    cfg.vocab = 16;
    cfg.seq_len = 6;
    ModelContext ctx;
    ctx.sample_shape = {6};
    ctx.vocab = 16;
    ctx.tensor = tensor;
    auto model = build_initialised(cfg, ctx, /*seed=*/8);
    FlatParams flat(*model);
    OptimizerConfig ocfg;
    ocfg.name = "adamw";
    ocfg.lr = 0.01;
    ocfg.weight_decay = 0.1;
    auto opt = make_optimizer(ocfg, flat);
    auto gen = at::make_generator<at::CPUGeneratorImpl>(77);  // the same batches on both ranks
    for (int step = 0; step < 4; ++step) {
      auto tokens = at::randint(16, {3, 7}, gen, torch::kInt64);
      Batch b{tokens.narrow(1, 0, 6), tokens.narrow(1, 1, 6)};
      language_model_task().loss(model->forward(b.x), b, *tensor).backward();
      clip_grad(flat, global_grad_norm(flat, *tensor, *make_local_comm()), 0.5);
      opt->step(0.01);
      flat.zero_grad();
    }
    int64_t replicated = 0;
    for (size_t i = 0; i < flat.entries().size(); ++i) {
      if (flat.entries()[i].placement.is_split()) continue;
      ++replicated;
      auto mine = flat.view(flat.data(), i).contiguous();
      auto both = tensor->all_gather(mine);
      if (!torch::equal(both[0], both[1]))
        failures.add(tensor->rank(), flat.entries()[i].name + " differs between tensor ranks");
    }
    if (replicated < 8) failures.add(tensor->rank(), "too few replicated parameters checked");
  }, quick());
  failures.check();
}

}  // namespace unit_layers_tensor_parallel
