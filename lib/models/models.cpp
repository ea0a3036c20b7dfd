// The mlp and cnn families. Layer shapes follow ../shared/bench so dtrain and the PyTorch
// baseline run the same kernels: mlp 784-512-256-10; cnn conv32-pool-conv64-pool-fc128-fc10.
#include "models/models.hpp"

#include <map>

#include <torch/nn.h>

#include "parallel/sync_batchnorm.hpp"
#include "util/error.hpp"

namespace dtrain {
namespace nn = torch::nn;

namespace {

int64_t product(const Ints& v) {
  int64_t p = 1;
  for (auto x : v) p *= x;
  return p;
}

// Hidden layers: Linear + ReLU (+ Dropout) for each width, then the classifier.
void add_dense_stack(Model& m, int64_t in, const Ints& widths, int64_t classes, double dropout) {
  for (auto w : widths) {
    m->push_back(nn::Linear(in, w));
    m->push_back(nn::ReLU(nn::ReLUOptions().inplace(true)));
    if (dropout > 0) m->push_back(nn::Dropout(dropout));
    in = w;
  }
  m->push_back(nn::Linear(in, classes));
}

Model mlp(const ModelConfig& cfg, const ModelInput& in) {
  Model m;
  m->push_back(nn::Flatten());
  add_dense_stack(m, product(in.sample_shape), cfg.hidden, in.classes, cfg.dropout);
  return m;
}

Model cnn(const ModelConfig& cfg, const ModelInput& in) {
  fail_if<ConfigError>(in.sample_shape.size() != 3,
                       "model.arch: cnn needs samples shaped [channels, height, width], the data "
                       "has {} dimension(s)", in.sample_shape.size());
  int64_t c = in.sample_shape[0], h = in.sample_shape[1], w = in.sample_shape[2];
  Model m;
  for (auto out : cfg.channels) {
    fail_if<ConfigError>(h < 2 || w < 2,
                         "model.channels: {} conv+pool stages shrink the {}x{} input below 1x1",
                         cfg.channels.size(), in.sample_shape[1], in.sample_shape[2]);
    // With BatchNorm right after, the conv bias would be cancelled by the mean: leave it out.
    m->push_back(nn::Conv2d(nn::Conv2dOptions(c, out, 3).padding(1).bias(!cfg.batch_norm)));
    if (cfg.batch_norm && in.sync_batchnorm)
      m->push_back(SyncBatchNorm2d(out, in.sync_batchnorm));
    else if (cfg.batch_norm)
      m->push_back(nn::BatchNorm2d(out));
    m->push_back(nn::ReLU(nn::ReLUOptions().inplace(true)));
    m->push_back(nn::MaxPool2d(nn::MaxPool2dOptions(2)));
    c = out, h /= 2, w /= 2;
  }
  m->push_back(nn::Flatten());
  add_dense_stack(m, c * h * w, cfg.fc, in.classes, cfg.dropout);
  return m;
}

const std::map<std::string, ModelFactory>& registry() {
  static const std::map<std::string, ModelFactory> factories{{"mlp", mlp}, {"cnn", cnn}};
  return factories;
}

}  // namespace

std::vector<std::string> model_names() {
  std::vector<std::string> names;
  for (const auto& [name, f] : registry()) names.push_back(name);
  return names;
}

torch::MemoryFormat preferred_format(const ModelConfig& cfg) {
  return cfg.arch == "cnn" ? torch::MemoryFormat::ChannelsLast : torch::MemoryFormat::Contiguous;
}

Model build_model(const ModelConfig& cfg, const ModelInput& input) {
  auto it = registry().find(cfg.arch);
  fail_if<ConfigError>(it == registry().end(), "model.arch: unknown model '{}'", cfg.arch);
  return it->second(cfg, input);
}

}  // namespace dtrain
