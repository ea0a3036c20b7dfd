#include <map>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "models/model.hpp"
#include "util/error.hpp"

namespace dtrain {
namespace {

const std::map<std::string, ModelSpec>& registry() {
  static const std::map<std::string, ModelSpec> specs = [] {
    std::map<std::string, ModelSpec> m;
    m["mlp"] = {&classification_task(), validate_mlp, build_mlp, mlp_parts};
    m["cnn"] = {&classification_task(), validate_cnn, build_cnn, cnn_parts,
                torch::MemoryFormat::ChannelsLast};
    m["cnn"].fits = cnn_fits;
    m["gpt"] = {&language_model_task(), validate_gpt, build_gpt, gpt_parts};
    m["gpt"].blocks = true;
    m["gpt"].fits = gpt_fits;
    return m;
  }();
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
  for (auto& layer : layers_) {
    using_module(*layer.ptr());
    y = layer.forward(y);
  }
  return y;
}

std::vector<int64_t> LayerStack::part_params() const {
  std::vector<int64_t> sizes(size_t(parts_), 0);
  for (size_t i = 0; i < layers_.size(); ++i)
    for (const auto& p : layers_[i].ptr()->parameters()) sizes[size_t(part_of_[i])] += p.numel();
  return sizes;
}

void LayerStack::keep_parts(int64_t first, int64_t last) {
  std::vector<torch::nn::AnyModule> kept;
  std::vector<int64_t> kept_part;
  for (size_t i = 0; i < layers_.size(); ++i) {
    if (part_of_[i] >= first && part_of_[i] < last) {
      kept.push_back(layers_[i]);
      kept_part.push_back(part_of_[i]);
    } else {
      unregister_module(std::to_string(i));
    }
  }
  layers_ = std::move(kept);
  part_of_ = std::move(kept_part);
}


}  // namespace dtrain
