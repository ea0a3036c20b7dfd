// The model registry: output shapes and parameter counts worked out by hand from the layer
// sizes, BatchNorm buffers, and shapes that do not fit refused with ConfigError; initial
// weights as functions of the seed and the parameter's name, whatever part a rank holds.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>

#include <torch/torch.h>

#include "config/config.hpp"
#include "models/attention.hpp"
#include "models/model.hpp"
#include "util/compat.hpp"
#include "util/error.hpp"

namespace unit_models_models {

using namespace dtrain;

namespace {
int64_t count_params(const NetworkPtr& m) {
  int64_t n = 0;
  for (const auto& p : m->parameters()) n += p.numel();
  return n;
}
ModelConfig arch(const char* name) {
  ModelConfig c;
  c.arch = name;
  return c;
}
struct Shape {
  Ints sample;
  int64_t classes;
};
NetworkPtr build_model(const ModelConfig& cfg, const Shape& shape, int64_t first_part = 0,
                       int64_t last_part = -1) {
  ModelContext ctx;
  ctx.sample_shape = shape.sample;
  ctx.classes = shape.classes;
  ctx.first_part = first_part, ctx.last_part = last_part;
  return build_initialised(cfg, ctx, /*seed=*/11);
}
}  // namespace

TEST_CASE("models: mlp 784-512-256-10") {
  auto cfg = arch("mlp");
  cfg.hidden = {512, 256};
  auto m = build_model(cfg, {{1, 28, 28}, 10});
  // (784*512 + 512) + (512*256 + 256) + (256*10 + 10)
  CHECK(count_params(m) == 535818);
  auto out = m->forward(torch::randn({5, 1, 28, 28}));
  CHECK(out.sizes() == torch::IntArrayRef{5, 10});

  // Flat samples, other widths and classes.
  cfg.hidden = {16};
  auto small = build_model(cfg, {{784}, 7});
  CHECK(count_params(small) == 784 * 16 + 16 + 16 * 7 + 7);
  CHECK(small->forward(torch::randn({3, 784})).sizes() == torch::IntArrayRef{3, 7});
  cfg.hidden = {};
  CHECK(count_params(build_model(cfg, {{2, 3}, 4})) == 6 * 4 + 4);  // logistic regression
}

TEST_CASE("models: cnn conv32-pool-conv64-pool-fc128-fc10") {
  auto cfg = arch("cnn");
  cfg.channels = {32, 64};
  cfg.fc = {128};
  auto m = build_model(cfg, {{1, 28, 28}, 10});
  const int64_t conv1 = 32 * 1 * 9 + 32, conv2 = 64 * 32 * 9 + 64;
  const int64_t fc1 = 64 * 7 * 7 * 128 + 128, fc2 = 128 * 10 + 10;  // 28 -> 14 -> 7
  CHECK(count_params(m) == conv1 + conv2 + fc1 + fc2);
  CHECK(count_params(m) == 421642);
  m->eval();
  CHECK(m->forward(torch::randn({3, 1, 28, 28})).sizes() == torch::IntArrayRef{3, 10});

  // Odd sizes floor through the pools: 3x15x9 -> 7x4 -> 3x2.
  cfg.channels = {4, 8};
  cfg.fc = {};
  auto odd = build_model(cfg, {{3, 15, 9}, 5});
  CHECK(count_params(odd) == (4 * 3 * 9 + 4) + (8 * 4 * 9 + 8) + (8 * 3 * 2 * 5 + 5));
  CHECK(odd->forward(torch::randn({2, 3, 15, 9})).sizes() == torch::IntArrayRef{2, 5});
}

TEST_CASE("models: cnn with batch_norm has BatchNorm buffers and no conv bias") {
  auto cfg = arch("cnn");
  cfg.channels = {32, 64};
  cfg.fc = {128};
  cfg.batch_norm = true;
  auto m = build_model(cfg, {{1, 28, 28}, 10});
  std::vector<std::string> buffers;
  for (const auto& b : m->named_buffers()) buffers.push_back(b.key());
  for (const char* want : {"running_mean", "running_var", "num_batches_tracked"}) {
    CAPTURE(want);
    CHECK(std::count_if(buffers.begin(), buffers.end(), [&](const std::string& k) {
            return k.size() > std::strlen(want) &&
                   k.compare(k.size() - std::strlen(want), std::string::npos, want) == 0;
          }) == 2);  // one per conv stage
  }
  // conv weights without bias, BatchNorm weight and bias per channel.
  const int64_t conv = 32 * 9 + 64 * 32 * 9, bn = 2 * 32 + 2 * 64;
  CHECK(count_params(m) == conv + bn + (3136 * 128 + 128) + (128 * 10 + 10));
  m->train();
  CHECK(m->forward(torch::randn({4, 1, 28, 28})).sizes() == torch::IntArrayRef{4, 10});

  cfg.batch_norm = false;
  auto plain = build_model(cfg, {{1, 28, 28}, 10});
  CHECK(plain->named_buffers().size() == 0);
}

TEST_CASE("models: dropout adds no parameters and is off in eval mode") {
  auto cfg = arch("mlp");
  cfg.hidden = {32, 16};
  cfg.dropout = 0.5;
  auto m = build_model(cfg, {{1, 28, 28}, 10});
  CHECK(count_params(m) == 784 * 32 + 32 + 32 * 16 + 16 + 16 * 10 + 10);
  m->eval();
  auto x = torch::randn({2, 1, 28, 28});
  CHECK(torch::equal(m->forward(x), m->forward(x)));
}

TEST_CASE("models: shapes that do not fit and unknown archs are ConfigErrors") {
  CHECK_THROWS_AS(build_model(arch("cnn"), {{784}, 10}), ConfigError);
  CHECK_THROWS_AS(build_model(arch("cnn"), {{28, 28}, 10}), ConfigError);
  auto deep = arch("cnn");
  deep.channels = {8, 8, 8};
  CHECK_NOTHROW(build_model(deep, {{1, 8, 8}, 10}));  // 8 -> 4 -> 2 -> 1
  CHECK_THROWS_AS(build_model(deep, {{1, 4, 4}, 10}), ConfigError);  // 4 -> 2 -> 1 -> ?
  CHECK_THROWS_AS(model_spec("resnet-9000"), ConfigError);
  try {
    build_model(arch("cnn"), {{784}, 10});
  } catch (const ConfigError& e) {
    CHECK(std::string(e.what()).find("model.arch") != std::string::npos);
  }
  auto names = model_names();
  CHECK(std::find(names.begin(), names.end(), "mlp") != names.end());
  CHECK(std::find(names.begin(), names.end(), "cnn") != names.end());
  CHECK(std::find(names.begin(), names.end(), "gpt") != names.end());
  // Each model brings its task.
  CHECK(std::string(model_spec("mlp").task->metric()) == "accuracy");
  CHECK(model_spec("mlp").task->higher_is_better());
  CHECK(std::string(model_spec("gpt").task->metric()) == "perplexity");
  CHECK(!model_spec("gpt").task->higher_is_better());
  CHECK(model_spec("cnn").format == torch::MemoryFormat::ChannelsLast);
}

namespace {
ModelConfig small_gpt() {
  auto cfg = arch("gpt");
  cfg.layers = 2;
  cfg.heads = 4;
  cfg.dim = 16;
  cfg.vocab = 50;
  cfg.seq_len = 12;
  return cfg;
}
NetworkPtr build_gpt_for(const ModelConfig& cfg, int64_t seq, int64_t vocab,
                         int64_t first_part = 0, int64_t last_part = -1) {
  ModelContext ctx;
  ctx.sample_shape = {seq};
  ctx.vocab = vocab;
  ctx.first_part = first_part, ctx.last_part = last_part;
  return build_initialised(cfg, ctx, /*seed=*/11);
}
}  // namespace

TEST_CASE("models: gpt parameters, names and a head tied to the token embedding") {
  torch::manual_seed(3);
  auto cfg = small_gpt();
  auto m = build_gpt_for(cfg, 12, 50);
  const int64_t d = 16, v = 50, t = 12;
  // Per block: 2 LayerNorms (2d each), QKV (3d x d + 3d), proj (d x d + d),
  // fc (4d x d + 4d), proj (d x 4d + d). Embeddings v x d and t x d, final LayerNorm 2d.
  // The head adds nothing: it is the token embedding.
  const int64_t block = 4 * d + (3 * d * d + 3 * d) + (d * d + d) + (4 * d * d + 4 * d) + (4 * d * d + d);
  CHECK(count_params(m) == v * d + t * d + 2 * block + 2 * d);
  auto named = m->named_parameters();
  for (const char* key : {"wte.weight", "wpe.weight", "h.0.ln_1.weight", "h.0.attn.c_attn.weight",
                          "h.0.attn.c_proj.bias", "h.1.mlp.c_fc.weight", "h.1.mlp.c_proj.weight",
                          "ln_f.bias"})
    CHECK_MESSAGE(named.contains(key), key);
  CHECK(named["h.0.attn.c_attn.weight"].sizes() == torch::IntArrayRef{3 * d, d});
  // GPT-2's initialisation: N(0, 0.02) weights, residual projections scaled by 1/sqrt(2L).
  CHECK(named["h.0.mlp.c_fc.weight"].std().item<double>() == doctest::Approx(0.02).epsilon(0.1));
  CHECK(named["h.0.mlp.c_proj.weight"].std().item<double>() ==
        doctest::Approx(0.02 / 2.0).epsilon(0.1));
  CHECK(named["h.0.attn.c_attn.bias"].abs().sum().item<double>() == 0);
  CHECK(named["h.1.ln_2.weight"].eq(1).all().item<bool>());
  CHECK(named["ln_f.bias"].eq(0).all().item<bool>());

  auto idx = torch::randint(50, {3, 12}, torch::kInt64);
  auto logits = m->forward(idx);
  CHECK(logits.sizes() == torch::IntArrayRef{3, 12, 50});
  // Tied: the gradient of the logits reaches the token embedding through the head too.
  logits.sum().backward();
  CHECK(named["wte.weight"].grad().defined());
  // Shorter windows than the context work (positions 0..seq-1).
  CHECK(m->forward(idx.narrow(1, 0, 5)).sizes() == torch::IntArrayRef{3, 5, 50});
}

TEST_CASE("models: gpt is causal: a position's logits do not depend on later tokens") {
  torch::manual_seed(4);
  auto m = build_gpt_for(small_gpt(), 12, 50);
  m->eval();
  auto a = torch::randint(50, {1, 12}, torch::kInt64);
  auto b = a.clone();
  b.index_put_({0, torch::indexing::Slice(7, torch::indexing::None)}, 0);  // change the future
  auto la = m->forward(a), lb = m->forward(b);
  CHECK(torch::allclose(la.narrow(1, 0, 7), lb.narrow(1, 0, 7), 1e-6, 1e-6));
  CHECK(!torch::allclose(la.narrow(1, 7, 5), lb.narrow(1, 7, 5), 1e-6, 1e-6));
}

TEST_CASE("models: gpt refuses data it cannot model") {
  auto cfg = small_gpt();
  CHECK_THROWS_AS(build_gpt_for(cfg, 12, 256), ConfigError);  // vocab 50 < the data's 256
  CHECK_THROWS_AS(build_gpt_for(cfg, 13, 50), ConfigError);   // window beyond the context
  ModelContext images;
  images.sample_shape = {1, 28, 28};
  images.classes = 10;
  CHECK_THROWS_AS(model_spec("gpt").build(cfg, images), ConfigError);
}

TEST_CASE("attention: the causal attention equals an explicit loop over positions") {
  torch::manual_seed(9);
  auto q = torch::randn({2, 3, 6, 4}), k = torch::randn({2, 3, 6, 4}), v = torch::randn({2, 3, 6, 4});
  // Reference: for each query position t, softmax over keys 0..t, by hand.
  auto want = torch::zeros_like(q);
  for (int64_t t = 0; t < 6; ++t) {
    auto keys = k.narrow(2, 0, t + 1), vals = v.narrow(2, 0, t + 1);
    auto qt = q.narrow(2, t, 1);
    auto w = torch::softmax((qt * keys).sum(-1, true) / 2.0, 2);  // sqrt(4) = 2
    want.narrow(2, t, 1).copy_((w * vals).sum(2, true));
  }
  CHECK(torch::allclose(plain_causal_attention(q, k, v), want, 1e-5, 1e-6));
  // The kernel training uses (LibTorch's fused one) gives the same numbers.
  CHECK(torch::allclose(causal_attention(q, k, v), want, 1e-5, 1e-6));
}

TEST_CASE("models: split into parts, stages run in turn give the whole model's output") {
  // Each arch, cut at every part boundary: the first stage's output fed to the second
  // equals the unsplit model's, names stay the whole model's, and every parameter of the
  // whole model is held by exactly one stage (GPT's tied head weight by both ends).
  struct Arch {
    ModelConfig cfg;
    Shape shape;
    torch::Tensor input;
  };
  auto mlp = arch("mlp");
  mlp.hidden = {12, 8};
  auto cnn = arch("cnn");
  cnn.channels = {4, 6};
  cnn.fc = {10};
  cnn.batch_norm = true;
  std::vector<Arch> archs = {{mlp, {{1, 4, 4}, 3}, torch::randn({5, 1, 4, 4})},
                             {cnn, {{1, 8, 8}, 3}, torch::randn({5, 1, 8, 8})},
                             {small_gpt(), {{12}, 0}, torch::randint(50, {3, 12}, torch::kInt64)}};
  for (auto& a : archs) {
    CAPTURE(a.cfg.arch);
    // Parts [first, last), initialised by name from one seed: no stage sees the others'.
    auto build = [&](int64_t first, int64_t last) {
      if (a.cfg.arch == "gpt") return build_gpt_for(a.cfg, 12, 50, first, last);
      return build_model(a.cfg, a.shape, first, last);
    };
    auto whole = build(0, -1);
    whole->eval();
    const auto sizes = whole->part_params();
    const int64_t parts = model_spec(a.cfg.arch).parts(a.cfg);
    REQUIRE(int64_t(sizes.size()) == parts);
    int64_t total = 0;
    for (auto n : sizes) total += n;
    CHECK(total == count_params(whole));
    torch::NoGradGuard no_grad;
    const auto expected = whole->forward(a.input);
    const auto names = whole->named_parameters();
    for (int64_t cut = 1; cut < parts; ++cut) {
      CAPTURE(cut);
      auto first = build(0, cut), second = build(cut, parts);
      first->eval(), second->eval();
      CHECK(torch::equal(second->forward(first->forward(a.input)), expected));
      int64_t held = 0;
      for (auto* stage : {&first, &second})
        for (const auto& p : (*stage)->named_parameters()) {
          REQUIRE_MESSAGE(names.contains(p.key()), p.key());
          CHECK(torch::equal(p.value(), names[p.key()]));  // the whole model's weights
          const auto tied = (*stage)->tied_parameters();
          const bool counted_elsewhere = stage == &second && first->named_parameters().contains(p.key());
          CHECK((!counted_elsewhere || std::count(tied.begin(), tied.end(), p.key()) == 1));
          if (!counted_elsewhere) held += p.value().numel();
        }
      CHECK(held == count_params(whole));
    }
  }
}

TEST_CASE("models: a part built alone creates only its own parameters") {
  auto cfg = small_gpt();
  auto middle = build_gpt_for(cfg, 12, 50, /*first_part=*/1, /*last_part=*/2);  // block 0
  std::vector<std::string> names;
  for (const auto& p : middle->named_parameters()) names.push_back(p.key());
  CHECK(!names.empty());
  for (const auto& n : names) CHECK_MESSAGE(n.rfind("h.0.", 0) == 0, n);
  // The outline: every part's shapes on the meta device, no memory.
  ModelContext ctx;
  ctx.sample_shape = {12};
  ctx.vocab = 50;
  ctx.options = torch::TensorOptions().device(torch::kMeta);
  auto outline = model_spec("gpt").build(cfg, ctx);
  CHECK(outline->named_parameters()["h.1.mlp.c_fc.weight"].device().is_meta());
  CHECK(outline->part_params() == build_gpt_for(cfg, 12, 50)->part_params());
}

TEST_CASE("models: a pipeline's split evens out parameters or FLOPs (parallel.balance)") {
  // A GPT whose vocabulary outweighs its blocks: d 64, 3 layers, v 4096, 32 tokens. Its
  // parts: the embedding (v d + s d = 264,192 parameters, no FLOPs), three blocks (12 d^2 +
  // 13 d = 49,984 parameters; 24 d^2 + 4 s d = 106,496 FLOPs a token forward) and the head
  // (the final LayerNorm's 2 d = 128 parameters, the tied weight counted once, in the
  // embedding; 2 d v = 524,288 FLOPs a token).
  JobConfig job;
  job.model = arch("gpt");
  job.model.layers = 3, job.model.heads = 2, job.model.dim = 64, job.model.vocab = 4096, job.model.seq_len = 32;
  ModelContext ctx;
  ctx.sample_shape = {32};
  ctx.vocab = 4096;
  ctx.options = torch::TensorOptions().device(torch::kMeta);
  const auto outline = model_spec("gpt").build(job.model, ctx);
  // (Compared in parentheses: doctest would print the lists through glog's operator<<.)
  // By parameters: the embedding alone (264k) against the rest (150k); any other cut
  // puts more than 264k on stage 0.
  CHECK((stage_split(job, *outline, ctx, 2) == std::vector<PartRange>{{0, 1}, {1, 5}}));
  // By FLOPs: the head alone (524k) against the embedding and the blocks (319k); moving
  // the last block over gives stage 1 631k.
  job.parallel.balance = "flops";
  CHECK((stage_split(job, *outline, ctx, 2) == std::vector<PartRange>{{0, 4}, {4, 5}}));
  // Three stages: the head, and the blocks two and one (213k and 106k) or one and two.
  CHECK((stage_split(job, *outline, ctx, 3).back() == PartRange{4, 5}));
  // parallel.stages, where given, whatever the balance.
  job.parallel.stages = {2, 3};
  CHECK((stage_split(job, *outline, ctx, 2) == std::vector<PartRange>{{0, 2}, {2, 5}}));
}

TEST_CASE("models: initial weights are a function of the seed and each parameter's name") {
  auto cfg = arch("mlp");
  cfg.hidden = {6};
  ModelContext ctx;
  ctx.sample_shape = {4};
  ctx.classes = 3;
  auto a = build_initialised(cfg, ctx, 5), b = build_initialised(cfg, ctx, 5);
  auto c = build_initialised(cfg, ctx, 6);
  const auto pa = a->named_parameters(), pb = b->named_parameters(), pc = c->named_parameters();
  for (const auto& p : pa) {
    CAPTURE(p.key());
    CHECK(torch::equal(p.value(), pb[p.key()]));
    CHECK(!torch::equal(p.value(), pc[p.key()]));
  }
  // torch.nn's Linear bounds: U(+-1 / sqrt(fan_in)) for the weight and the bias.
  CHECK(pa["1.weight"].abs().max().item<double>() <= 1 / std::sqrt(4.0));
  CHECK(pa["1.bias"].abs().max().item<double>() <= 1 / std::sqrt(4.0));
  CHECK(pa["3.weight"].abs().max().item<double>() <= 1 / std::sqrt(6.0));
  // Two parameters of the same shape draw different values (their names differ).
  auto gpt = build_gpt_for(small_gpt(), 12, 50)->named_parameters();
  CHECK(!torch::equal(gpt["h.0.mlp.c_fc.weight"], gpt["h.1.mlp.c_fc.weight"]));
  // The default generator is not what draws them.
  torch::manual_seed(1);
  auto d = build_initialised(cfg, ctx, 5);
  torch::manual_seed(2);
  auto e = build_initialised(cfg, ctx, 5);
  CHECK(torch::equal(d->named_parameters()["1.weight"], e->named_parameters()["1.weight"]));
}

}  // namespace unit_models_models
