#include <map>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "models/model.hpp"
#include "util/error.hpp"

namespace dtrain {
namespace {

const std::map<std::string, ModelSpec>& registry() {
  static const std::map<std::string, ModelSpec> specs{
      {"mlp", {&classification_task(), validate_mlp, build_mlp}},
      {"cnn", {&classification_task(), validate_cnn, build_cnn, torch::MemoryFormat::ChannelsLast}},
      {"gpt", {&language_model_task(), validate_gpt, build_gpt}},
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
  for (auto& layer : layers_) y = layer.forward(y);
  return y;
}

}  // namespace dtrain
