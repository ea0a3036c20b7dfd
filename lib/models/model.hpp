// Models by name: a registry where each model brings its task, its checks and its
// factory. A new model is one new file plus one line in registry.cpp.
#pragma once
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <torch/nn/module.h>

#include "comm/comm.hpp"
#include "config/config.hpp"
#include "models/task.hpp"
#include "parallel/dims.hpp"

namespace dtrain {

// A trainable network: a batch of inputs to outputs (class logits, or next-token logits).
class Network : public torch::nn::Module {
 public:
  virtual torch::Tensor forward(const torch::Tensor& x) = 0;
};
using NetworkPtr = std::shared_ptr<Network>;

// What a factory needs besides the model's own keys.
struct ModelContext {
  Ints sample_shape;     // one sample, e.g. {1, 28, 28} (classification) or {seq} (tokens)
  int64_t classes = 0;   // classification: number of classes
  int64_t vocab = 0;     // token data: distinct token values
  // The data-parallel group BatchNorm reduces over, when it must see the whole global
  // batch (parallel.sync_batchnorm with more than one data-parallel rank); else null.
  std::shared_ptr<Comm> sync_batchnorm;
  // The tensor-parallel group the model's split layers use (a local Comm for tensor 1).
  std::shared_ptr<Comm> tensor = make_local_comm();
};

struct ModelSpec {
  const Task* task;
  // Checks that need only the job spec (run at validation, before any data or process
  // group): the model's own keys and whether its layers split over dims.tensor.
  std::function<void(const ModelConfig&, const ParallelDims&)> validate;
  // Builds the network; throws ConfigError when it does not fit the data.
  std::function<NetworkPtr(const ModelConfig&, const ModelContext&)> build;
  // The memory format the model's kernels run fastest on: ChannelsLast for convolutional
  // models (oneDNN on CPU: the CNN's step 1.4x faster), Contiguous otherwise.
  torch::MemoryFormat format = torch::MemoryFormat::Contiguous;
};

// model.arch's spec; throws ConfigError for an unknown arch.
const ModelSpec& model_spec(const std::string& arch);
std::vector<std::string> model_names();

// The factories, one per file.
NetworkPtr build_mlp(const ModelConfig& cfg, const ModelContext& ctx);
NetworkPtr build_cnn(const ModelConfig& cfg, const ModelContext& ctx);
NetworkPtr build_gpt(const ModelConfig& cfg, const ModelContext& ctx);
void validate_mlp(const ModelConfig& cfg, const ParallelDims& dims);
void validate_cnn(const ModelConfig& cfg, const ParallelDims& dims);
void validate_gpt(const ModelConfig& cfg, const ParallelDims& dims);

// A network that runs its child modules in order (mlp, cnn). Children are registered as
// "0", "1", ..., the names torch::nn::Sequential gives them.
class LayerStack : public Network {
 public:
  template <class M>
  void add(M module) {
    register_module(std::to_string(layers_.size()), module.ptr());
    layers_.emplace_back(std::move(module));
  }
  torch::Tensor forward(const torch::Tensor& x) override;

 private:
  std::vector<torch::nn::AnyModule> layers_;
};

}  // namespace dtrain
