#include <algorithm>
#include <map>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "models/model.hpp"
#include "util/error.hpp"

namespace dtrain {
namespace {

const std::map<std::string, ModelSpec>& registry() {
  static const std::map<std::string, ModelSpec> specs{
      {"mlp", mlp_spec()},
      {"cnn", cnn_spec()},
      {"gpt", gpt_spec()},
  };
  return specs;
}

}  // namespace

const ModelSpec& model_spec(const std::string& arch) {
  auto it = registry().find(arch);
  fail_if<ConfigError>(it == registry().end(), "model.arch: unknown model '{}' (one of {})", arch,
                       fmt::join(model_names(), " | "));
  return it->second;
}

std::vector<std::string> model_names() {
  std::vector<std::string> names;
  for (const auto& [name, spec] : registry()) names.push_back(name);
  return names;
}

torch::Tensor LayerStack::forward(const torch::Tensor& x) {
  auto y = x;
  for (auto& layer : layers_) y = with({layer.ptr().get()}, [&] { return layer.forward(y); });
  return y;
}

std::vector<const torch::nn::Module*> LayerStack::units() const {
  std::vector<const torch::nn::Module*> out;
  for (const auto& layer : layers_) out.push_back(layer.ptr().get());
  return out;
}

ModelSize dense_size(double in, const Ints& widths, int64_t classes) {
  ModelSize s;
  for (auto width : widths) {
    s.params += in * double(width) + double(width);
    s.largest_unit = std::max(s.largest_unit, in * double(width) + double(width));
    s.activation_bytes += 4 * 2 * double(width);
    in = double(width);
  }
  s.params += in * double(classes) + double(classes);
  s.largest_unit = std::max(s.largest_unit, in * double(classes) + double(classes));
  return s;
}

NetworkPtr build_initialised(const ModelConfig& cfg, const ModelContext& ctx, uint64_t seed) {
  const auto& spec = model_spec(cfg.arch);
  auto net = spec.build(cfg, ctx);
  init_parameters(*net, spec.init(cfg), seed, ctx.tensor->rank());
  return net;
}

}  // namespace dtrain
