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

// A trainable network, run as an ordered list of parts (GPT: the embeddings, each block,
// the final norm with the head; mlp and cnn: their layers) so that a pipeline stage can
// hold a contiguous run of them. Parameter names are the whole model's
// ("h.7.attn.c_attn.weight") whichever parts a process holds, so checkpoints and exports
// do not depend on the layout.
class Network : public torch::nn::Module {
 public:
  // Runs the parts held, in order: the whole model on a batch of inputs (class logits, or
  // next-token logits), or a pipeline stage's share on the previous stage's output.
  virtual torch::Tensor forward(const torch::Tensor& x) = 0;
  // The parameters of each part of the whole model, in order (a tied weight counted with
  // its first part): what stages are balanced by. Valid before keep_parts().
  virtual std::vector<int64_t> part_params() const = 0;
  // Keeps parts [first, last) and drops the others, their parameters and buffers with
  // them. Called once, right after the model is built: every process builds and
  // initialises the whole model alike, so a stage's weights are the unsplit model's.
  virtual void keep_parts(int64_t first, int64_t last) = 0;
  // Parameters that more than one part uses (GPT's token embedding, the head's weight
  // too). Where those parts sit on different stages each holds a copy; the pipeline keeps
  // the copies equal by summing their gradients.
  virtual std::vector<std::string> tied_parameters() const { return {}; }
  // train.recompute: blocks. Only models whose spec says `blocks` have any.
  virtual void recompute_blocks(bool) {}
  // Called by forward() with each module it is about to run, before it reads the module's
  // parameters (ZeRO waits there for the parameters' all-gather, still in flight).
  using BeforeUse = std::function<void(const torch::nn::Module&)>;
  void before_use(BeforeUse hook) { before_use_ = std::move(hook); }

 protected:
  void using_module(const torch::nn::Module& m) const {
    if (before_use_) before_use_(m);
  }

 private:
  BeforeUse before_use_;
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
  // Builds the network (after fits()).
  std::function<NetworkPtr(const ModelConfig&, const ModelContext&)> build;
  // How many parts (Network::part_params) the network has: what a pipeline splits.
  std::function<int64_t(const ModelConfig&)> parts;
  // The memory format the model's kernels run fastest on: ChannelsLast for convolutional
  // models (oneDNN on CPU: the CNN's step 1.4x faster), Contiguous otherwise.
  torch::MemoryFormat format = torch::MemoryFormat::Contiguous;
  // Whether it is built of blocks whose activations train.recompute can drop.
  bool blocks = false;
  // Checks that need the data (its sample shape, classes, vocabulary): ConfigError when
  // the model does not fit it. Run by `validate` once the data is read, and before build.
  std::function<void(const ModelConfig&, const ModelContext&)> fits =
      [](const ModelConfig&, const ModelContext&) {};
};

// model.arch's spec; throws ConfigError for an unknown arch.
const ModelSpec& model_spec(const std::string& arch);
std::vector<std::string> model_names();

// The factories, one per file.
NetworkPtr build_mlp(const ModelConfig& cfg, const ModelContext& ctx);
NetworkPtr build_cnn(const ModelConfig& cfg, const ModelContext& ctx);
NetworkPtr build_gpt(const ModelConfig& cfg, const ModelContext& ctx);
void cnn_fits(const ModelConfig& cfg, const ModelContext& ctx);
void gpt_fits(const ModelConfig& cfg, const ModelContext& ctx);
void validate_mlp(const ModelConfig& cfg, const ParallelDims& dims);
void validate_cnn(const ModelConfig& cfg, const ParallelDims& dims);
void validate_gpt(const ModelConfig& cfg, const ParallelDims& dims);
int64_t mlp_parts(const ModelConfig& cfg);
int64_t cnn_parts(const ModelConfig& cfg);
int64_t gpt_parts(const ModelConfig& cfg);

// A network that runs its child modules in order (mlp, cnn). Children are registered as
// "0", "1", ..., the names torch::nn::Sequential gives them, and keep those names when a
// stage holds some of them. A part is a run of children: add(m, /*new_part=*/true) starts
// one.
class LayerStack : public Network {
 public:
  template <class M>
  void add(M module, bool new_part = false) {
    register_module(std::to_string(layers_.size()), module.ptr());
    if (new_part || part_of_.empty()) ++parts_;
    part_of_.push_back(parts_ - 1);
    layers_.emplace_back(std::move(module));
  }
  torch::Tensor forward(const torch::Tensor& x) override;
  std::vector<int64_t> part_params() const override;
  void keep_parts(int64_t first, int64_t last) override;

 private:
  std::vector<torch::nn::AnyModule> layers_;  // the held ones (all, until keep_parts)
  std::vector<int64_t> part_of_;              // each held child's part
  int64_t parts_ = 0;
};

}  // namespace dtrain
