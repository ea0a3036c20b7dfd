// The parallel core without processes: ParallelDims arithmetic, the Mesh's groups, the
// collectives (one-process and ranks as threads over real Gloo), Placement, and the
// tensor-parallel layers against an unsplit layer (forward and gradients).
#include <doctest/doctest.h>

#include <atomic>
#include <mutex>
#include <set>

#include <torch/torch.h>

#include "comm/comm.hpp"
#include "config/config.hpp"
#include "models/model.hpp"
#include "optim/clip.hpp"
#include "optim/optimizer.hpp"
#include "parallel/compression.hpp"
#include "parallel/dims.hpp"
#include "parallel/flat_params.hpp"
#include "parallel/mesh.hpp"
#include "parallel/tensor_parallel.hpp"
#include "parallel/vocab_parallel.hpp"
#include "util/error.hpp"

using namespace dtrain;

namespace {
// Failures seen on rank threads, reported from the test's own thread.
class RankFailures {
 public:
  void add(int64_t rank, const std::string& what) {
    std::lock_guard<std::mutex> lock(mu_);
    list_.push_back(fmt::format("rank {}: {}", rank, what));
  }
  void check() const {
    for (const auto& f : list_) FAIL_CHECK(f);
  }

 private:
  std::mutex mu_;
  std::vector<std::string> list_;
};

CommOptions quick() {
  CommOptions o;
  o.timeout = std::chrono::seconds(30);
  o.gloo_threads = 1;
  return o;
}
}  // namespace

TEST_CASE("dims: coordinates and groups for several layouts") {
  ParallelConfig p;
  p.tensor = 2;
  p.pipeline = 2;
  auto d = ParallelDims::resolve(p, 8);
  CHECK(d.data == 2);
  CHECK(d.str() == "data 2 x tensor 2 x pipeline 2");
  // Tensor fastest, then data, then pipeline.
  for (int64_t r = 0; r < 8; ++r) {
    auto c = d.coord_of(r);
    CHECK(c.tensor == r % 2);
    CHECK(c.data == (r / 2) % 2);
    CHECK(c.pipeline == r / 4);
    CHECK(d.rank_of(c) == r);
  }
  CHECK(d.group_of(5, Axis::kTensor) == std::vector<int64_t>{4, 5});
  CHECK(d.group_of(5, Axis::kData) == std::vector<int64_t>{5, 7});
  CHECK(d.group_of(5, Axis::kPipeline) == std::vector<int64_t>{1, 5});
  // Every axis's groups partition the world.
  for (Axis a : {Axis::kData, Axis::kTensor, Axis::kPipeline}) {
    std::set<std::vector<int64_t>> groups;
    for (int64_t r = 0; r < 8; ++r) groups.insert(d.group_of(r, a));
    CHECK(int64_t(groups.size()) == 8 / d.size(a));
  }
  // data 0 takes the rest; explicit sizes must multiply to the world.
  ParallelConfig only_tensor;
  only_tensor.tensor = 4;
  auto t = ParallelDims::resolve(only_tensor, 4);
  CHECK(t.data == 1);
  CHECK(t.group_of(2, Axis::kTensor) == std::vector<int64_t>{0, 1, 2, 3});
  CHECK(t.group_of(2, Axis::kData) == std::vector<int64_t>{2});
  only_tensor.data = 2;
  CHECK_THROWS_AS(ParallelDims::resolve(only_tensor, 4), ConfigError);
  CHECK_THROWS_AS(ParallelDims::resolve(only_tensor, 6), ConfigError);
}

TEST_CASE("comm: the one-process collectives are identities") {
  auto c = make_local_comm();
  auto t = torch::tensor({1.0f, 2.0f});
  c->all_reduce(t, ReduceOp::kAvg);
  CHECK(torch::equal(t, torch::tensor({1.0f, 2.0f})));
  auto out = torch::zeros({2});
  c->all_gather_into(out, t);
  CHECK(torch::equal(out, t));
  auto rs = torch::zeros({2});
  c->reduce_scatter(rs, t);
  CHECK(torch::equal(rs, t));
  CHECK(c->all_gather(t).size() == 1);
  CHECK(c->new_group("g", {0}).get() == c.get());
  CHECK_THROWS(c->send(t, 0));
}

TEST_CASE("comm: collectives over ranks as threads") {
  const int64_t n = 3;
  RankFailures failures;
  run_ranks_as_threads(n, [&](std::shared_ptr<Comm> c) {
    const int64_t r = c->rank();
    auto fail = [&](const std::string& what) { failures.add(r, what); };
    // sum, avg, max
    auto s = torch::full({4}, double(r + 1), torch::kFloat64);
    c->all_reduce(s);
    if (!torch::equal(s, torch::full({4}, 6.0, torch::kFloat64))) fail("sum");
    auto a = torch::full({2}, double(r), torch::kFloat64);
    c->all_reduce(a, ReduceOp::kAvg);
    if (!torch::equal(a, torch::full({2}, 1.0, torch::kFloat64))) fail("avg");
    auto m = torch::tensor({double(r), double(-r)}, torch::kFloat64);
    c->all_reduce(m, ReduceOp::kMax);
    if (!torch::equal(m, torch::tensor({2.0, 0.0}, torch::kFloat64))) fail("max");
    // all-gather into one flat tensor: rank r's [r, r+10] at [2r, 2r+2)
    auto flat = torch::zeros({2 * n});
    c->all_gather_into(flat, torch::tensor({float(r), float(r + 10)}));
    if (!torch::equal(flat, torch::tensor({0.f, 10.f, 1.f, 11.f, 2.f, 12.f}))) fail("all_gather_into");
    // reduce-scatter: chunk r of the sum
    auto in = torch::arange(2 * n, torch::kFloat32) * float(r + 1);  // sum over ranks: 6 * arange
    auto out = torch::zeros({2});
    c->reduce_scatter(out, in);
    if (!torch::equal(out, torch::tensor({6.f * 2 * r, 6.f * (2 * r + 1)}))) fail("reduce_scatter");
    // a ring of sends and receives posted together: no deadlock, every value arrives
    auto got = torch::zeros({3});
    c->exchange_async({{P2POp::kSend, torch::full({3}, float(r)), (r + 1) % n},
                       {P2POp::kRecv, got, (r + n - 1) % n}})
        ->wait();
    if (!torch::equal(got, torch::full({3}, float((r + n - 1) % n)))) fail("exchange");
    // a sub-group of ranks {0, 2}; rank 1 alone gets a local group
    auto g = r == 1 ? c->new_group("solo-1", {1}) : c->new_group("pair", {0, 2});
    auto x = torch::full({1}, double(r), torch::kFloat64);
    g->all_reduce(x);
    if (x.item<double>() != (r == 1 ? 1.0 : 2.0)) fail("sub-group");
    if (g->size() != (r == 1 ? 1 : 2)) fail("sub-group size");
    c->barrier();
  }, quick());
  failures.check();
}

TEST_CASE("mesh: each rank gets the groups its coordinates name") {
  RankFailures failures;
  // world 4 = data 2 x tensor 2: rank r has tensor peers {r^1}, data peers {r^2}.
  run_ranks_as_threads(4, [&](std::shared_ptr<Comm> world) {
    ParallelConfig p;
    p.tensor = 2;
    Mesh mesh(ParallelDims::resolve(p, 4), world);
    const int64_t r = world->rank();
    auto fail = [&](const std::string& what) { failures.add(r, what); };
    if (mesh.coord().tensor != r % 2 || mesh.coord().data != r / 2) fail("coordinates");
    if (mesh.tensor()->size() != 2 || mesh.tensor()->rank() != r % 2) fail("tensor group");
    if (mesh.data()->size() != 2 || mesh.data()->rank() != r / 2) fail("data group");
    if (mesh.pipeline()->size() != 1) fail("pipeline group");
    // Sum of world ranks over each group identifies its members.
    auto t = torch::full({1}, double(r), torch::kFloat64);
    mesh.tensor()->all_reduce(t);
    if (t.item<double>() != double((r / 2) * 4 + 1)) fail("tensor members");
    auto d = torch::full({1}, double(r), torch::kFloat64);
    mesh.data()->all_reduce(d);
    if (d.item<double>() != double(2 * (r % 2) + 2)) fail("data members");
  }, quick());
  failures.check();
}

TEST_CASE("placement: shard and assemble are inverse, blocks split separately") {
  auto full = torch::arange(24, torch::kFloat32).view({6, 4});
  auto rows = Placement::split(0, 2);
  CHECK(torch::equal(rows.shard(full, 1), full.narrow(0, 3, 3)));
  CHECK(torch::equal(rows.assemble({rows.shard(full, 0), rows.shard(full, 1)}), full));
  // Three blocks of two rows (Q, K, V): rank 0 holds row 0 of each block.
  auto qkv = Placement::split(0, 2, 3);
  auto r0 = qkv.shard(full, 0);
  CHECK(torch::equal(r0, torch::stack({full[0], full[2], full[4]})));
  CHECK(torch::equal(qkv.assemble({r0, qkv.shard(full, 1)}), full));
  auto cols = Placement::split(1, 4);
  CHECK(cols.full_shape({6, 1}) == std::vector<int64_t>{6, 4});
  CHECK(!Placement::replicated().is_split());
}

namespace {
// The unsplit two-layer block: column then row, as in a transformer MLP.
struct Reference {
  torch::nn::Linear a{nullptr}, b{nullptr};
};
}  // namespace

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
    run_ranks_as_threads(ranks, [&](std::shared_ptr<Comm> tensor) {
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
  run_ranks_as_threads(2, [](std::shared_ptr<Comm> tensor) {
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
    run_ranks_as_threads(ranks, [&](std::shared_ptr<Comm> tensor) {
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
  run_ranks_as_threads(2, [&](std::shared_ptr<Comm> tensor) {
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
  run_ranks_as_threads(2, [&](std::shared_ptr<Comm> tensor) {
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
    run_ranks_as_threads(2, [&](std::shared_ptr<Comm> comm) {
      const int64_t r = comm->rank();
      auto fail = [&](const std::string& what) { failures.add(r, how + ": " + what); };
      torch::nn::Linear layer(40, 8);  // 328 values
      FlatParams flat(*layer);
      ParallelConfig cfg;
      cfg.compression = how;
      cfg.topk_ratio = 0.1;
      auto reduction = make_compression(cfg, comm, flat);
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
  run_ranks_as_threads(2, [&](std::shared_ptr<Comm> comm) {
    const int64_t r = comm->rank();
    auto fail = [&](const std::string& what) { failures.add(r, what); };
    torch::nn::Linear layer(40, 8);
    FlatParams flat(*layer);
    ParallelConfig cfg;
    cfg.compression = "powersgd";
    cfg.powersgd_rank = 2;
    auto reduction = make_compression(cfg, comm, flat);
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
