// The model registry: output shapes and parameter counts worked out by hand from the layer
// sizes, BatchNorm buffers, and shapes that do not fit refused with ConfigError.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstring>
#include <string>

#include <torch/torch.h>

#include "config/config.hpp"
#include "models/models.hpp"
#include "util/error.hpp"

using namespace dtrain;

namespace {
int64_t count_params(const Model& m) {
  int64_t n = 0;
  for (const auto& p : m->parameters()) n += p.numel();
  return n;
}
ModelConfig arch(const char* name) {
  ModelConfig c;
  c.arch = name;
  return c;
}
}  // namespace

TEST_CASE("models: mlp 784-512-256-10") {
  auto cfg = arch("mlp");
  cfg.hidden = {512, 256};
  Model m = build_model(cfg, {{1, 28, 28}, 10});
  // (784*512 + 512) + (512*256 + 256) + (256*10 + 10)
  CHECK(count_params(m) == 535818);
  auto out = m->forward(torch::randn({5, 1, 28, 28}));
  CHECK(out.sizes() == torch::IntArrayRef{5, 10});

  // Flat samples, other widths and classes.
  cfg.hidden = {16};
  Model small = build_model(cfg, {{784}, 7});
  CHECK(count_params(small) == 784 * 16 + 16 + 16 * 7 + 7);
  CHECK(small->forward(torch::randn({3, 784})).sizes() == torch::IntArrayRef{3, 7});
  cfg.hidden = {};
  CHECK(count_params(build_model(cfg, {{2, 3}, 4})) == 6 * 4 + 4);  // logistic regression
}

TEST_CASE("models: cnn conv32-pool-conv64-pool-fc128-fc10") {
  auto cfg = arch("cnn");
  cfg.channels = {32, 64};
  cfg.fc = {128};
  Model m = build_model(cfg, {{1, 28, 28}, 10});
  const int64_t conv1 = 32 * 1 * 9 + 32, conv2 = 64 * 32 * 9 + 64;
  const int64_t fc1 = 64 * 7 * 7 * 128 + 128, fc2 = 128 * 10 + 10;  // 28 -> 14 -> 7
  CHECK(count_params(m) == conv1 + conv2 + fc1 + fc2);
  CHECK(count_params(m) == 421642);
  m->eval();
  CHECK(m->forward(torch::randn({3, 1, 28, 28})).sizes() == torch::IntArrayRef{3, 10});

  // Odd sizes floor through the pools: 3x15x9 -> 7x4 -> 3x2.
  cfg.channels = {4, 8};
  cfg.fc = {};
  Model odd = build_model(cfg, {{3, 15, 9}, 5});
  CHECK(count_params(odd) == (4 * 3 * 9 + 4) + (8 * 4 * 9 + 8) + (8 * 3 * 2 * 5 + 5));
  CHECK(odd->forward(torch::randn({2, 3, 15, 9})).sizes() == torch::IntArrayRef{2, 5});
}

TEST_CASE("models: cnn with batch_norm has BatchNorm buffers and no conv bias") {
  auto cfg = arch("cnn");
  cfg.channels = {32, 64};
  cfg.fc = {128};
  cfg.batch_norm = true;
  Model m = build_model(cfg, {{1, 28, 28}, 10});
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
  Model plain = build_model(cfg, {{1, 28, 28}, 10});
  CHECK(plain->named_buffers().size() == 0);
}

TEST_CASE("models: dropout adds no parameters and is off in eval mode") {
  auto cfg = arch("mlp");
  cfg.hidden = {32, 16};
  cfg.dropout = 0.5;
  Model m = build_model(cfg, {{1, 28, 28}, 10});
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
  CHECK_THROWS_AS(build_model(arch("resnet-9000"), {{1, 28, 28}, 10}), ConfigError);
  try {
    build_model(arch("cnn"), {{784}, 10});
  } catch (const ConfigError& e) {
    CHECK(std::string(e.what()).find("model.arch") != std::string::npos);
  }
  auto names = model_names();
  CHECK(std::find(names.begin(), names.end(), "mlp") != names.end());
  CHECK(std::find(names.begin(), names.end(), "cnn") != names.end());
}
