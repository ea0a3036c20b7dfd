// Models by name: a registry where each model brings its task, its checks, its factory,
// its initialisation and its memory estimate (ModelSpec). A new model is one new file (its
// spec) plus one line in registry.cpp and its name in model.arch's choices (config.hpp).
#pragma once
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <torch/nn/module.h>

#include "comm/comm.hpp"
#include "config/config.hpp"
#include "models/init.hpp"
#include "models/task.hpp"
#include "parallel/dims.hpp"
#include "parallel/stages.hpp"

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
  // its first part): what stages are balanced by. Meaningful on a network built with every
  // part (its outline: ModelContext::options on the meta device).
  virtual std::vector<int64_t> part_params() const = 0;
  // Parameters that more than one part uses (GPT's token embedding, the head's weight
  // too). Where those parts sit on different stages each holds a copy; the pipeline keeps
  // the copies equal by summing their gradients.
  virtual std::vector<std::string> tied_parameters() const { return {}; }
  // train.recompute: blocks. Only models whose spec says `blocks` have any.
  virtual void recompute_blocks(bool) {}
  // The modules forward runs one at a time, in order, each with its own parameters
  // (GPT: wte, wpe, each block, ln_f; mlp and cnn: their layers): ZeRO-3's units, which
  // it gathers before they run. Every parameter belongs to one.
  virtual std::vector<const torch::nn::Module*> units() const = 0;
  // What forward tells about the parameters it reads: before it runs `modules` (ZeRO
  // waits there for their gathers, still in flight, or starts them), and after, with what
  // they made (ZeRO-3 gathers them again before that output's backward).
  using Modules = std::vector<const torch::nn::Module*>;
  // Those calls in the order forward makes them (each `with`'s modules; a module may come
  // twice, as GPT's tied embedding does): what ZeRO-3 gathers when, which `dtrain plan`
  // follows. Default: each unit alone, in order.
  virtual std::vector<Modules> uses() const {
    std::vector<Modules> out;
    for (const auto* m : units()) out.push_back({m});
    return out;
  }
  struct UseHooks {
    std::function<void(const Modules&)> before;
    std::function<void(const Modules&, const torch::Tensor&)> after;
  };
  void use_hooks(UseHooks hooks) { hooks_ = std::move(hooks); }

 protected:
  // `run()`, which reads `modules`' parameters, between the hooks.
  template <class Run>
  torch::Tensor with(const Modules& modules, Run run) const {
    if (hooks_.before) hooks_.before(modules);
    torch::Tensor out = run();
    if (hooks_.after) hooks_.after(modules, out);
    return out;
  }

 private:
  UseHooks hooks_;
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
  // The parts of the whole model the network holds, [first_part, last_part) (-1: to the
  // last): a pipeline stage's. Only those are created; names stay the whole model's.
  int64_t first_part = 0, last_part = -1;
  // Where the big parameters are created, uninitialised (init_parameters fills them): the
  // CPU, a GPU, or the meta device for the outline (every part's shapes and names, no
  // memory).
  torch::TensorOptions options = {};
  bool holds(int64_t part, int64_t parts) const {
    return part >= first_part && part < (last_part < 0 ? parts : last_part);
  }
};

// What one part of the model (Network::part_params' order) costs per sample on one rank of
// a tensor group of SizeContext::tensor ranks: what `dtrain plan` and the memory check add
// up over the parts a pipeline stage holds. Counts are of fp32 values unless named bytes.
struct PartCost {
  double activation_bytes = 0;  // what its forward leaves for backward (in fp32)
  // ... under 16-bit autocast (bf16, fp16): what products write and elementwise ops on them
  // keep is 2 bytes a value, what autocast keeps in fp32 (layer norms, the log-softmax)
  // and the fp32 residual stream 4. Below 0 where not worked out (activation_bytes).
  double activation_bytes_16 = -1;
  // What its backward holds at most at once besides: its activations' gradients in flight
  // and its input's (the parameters' gradients aside: the plan counts those apart).
  double backward_bytes = 0;
  double backward_bytes_16 = -1;  // ... under 16-bit autocast (below 0: backward_bytes)
  // Per micro-batch, not per sample: under 16-bit autocast, the copy of a weight that the
  // parameters' own dtype leaves fp32 (a tied weight that a lookup also reads) which
  // autocast casts at each forward and backward keeps.
  double weight_copy_16 = 0;
  double flops = 0;             // its forward's (backward takes twice that)
  double reduced = 0;           // values all-reduced over the tensor group in forward
  double reduced_back = 0;      // ... and in backward
  double reductions = 0;        // the all-reduces that carry them in forward, per micro-batch
  double reductions_back = 0;   // ... and in backward
  double output = 0;            // values it hands the next part (what a pipeline sends)
  double matmuls = 1;           // the matrix multiplies its flops are spread over
  double side = 0;              // their smallest side, where the model knows it (else 0)
  // Of `flops`, those of small batched products (attention's, per head), whose rate is that
  // of a batch of products with `small_side` as their smallest side (the machine profile's
  // bmm). Not among `matmuls`.
  double small_flops = 0, small_side = 0;
  // The values its elementwise kernels write per sample, in forward and in backward: layer
  // norms, sums, masks, the copies into a product's layout, the gradients through them;
  // those through exp or tanh (softmax, GELU) apart, several times slower on a CPU; and
  // the casts 16-bit autocast adds. A product's work is its flops; what a micro-batch
  // writes once (a weight's cast, a bias's gradient) is left out. As LibTorch's kernels
  // write them (tests/unit/models/test_kernels.cpp).
  struct Values {
    double plain = 0, transcendental = 0, casts_16 = 0;
  };
  Values values, values_back;
  bool block = false;           // train.recompute keeps only its input for backward
  // The kernels its forward launches (a GPU's host launches each: what bounds a small
  // model's step there), the loss's with the last part; backward launches about twice as
  // many. A dropout is kDropoutKernels.
  double kernels = 2;
  // The kernels 16-bit autocast adds: the casts of its products' weights and biases, of an
  // fp32 input to them, and of a 16-bit result to fp32 where autocast keeps the operation
  // in fp32 (the log-softmax). Counted as LibTorch's CPU autocast casts; CUDA's lists may
  // differ by an operation or two.
  double casts = 0;
};
// A dropout's kernels: its mask (dtrain's own loop, or kernel on a GPU) and the product.
constexpr double kDropoutKernels = 2;

struct SizeContext {
  Ints sample_shape;  // as the data says
  int64_t classes = 0;
  int64_t tensor = 1;  // parallel.tensor: split layers cost 1 / tensor of themselves
  // Whether the parts run on a GPU: CUDA's autocast keeps some operations in fp32 that the
  // CPU's runs in 16 bits (softmax).
  bool cuda = false;
};

// Throws ConfigError naming `key` where a weight of the dense layers `in` -> `widths` ->
// `out` would hold more values than a tensor can address (LibTorch counts its bytes in an
// int64): "KEY: LAYER N's weight would be ...". `in` or `out` 0: that end is not known yet
// (validation before the data is read), so only the weights it does not touch are checked.
void check_dense_sizes(const std::string& key, const std::string& layer, int64_t in,
                       const Ints& widths, int64_t out);

// Dense layers from `in` inputs through `widths` to `classes` outputs, alternately
// column- and row-parallel over `tensor` ranks as the mlp splits them (tensor 1 for the
// cnn's): a part per layer, each hidden one followed by a dropout where `dropout`. `first`:
// the model's first part is the first layer's (its input, the data, has no gradient to
// reduce and is fp32).
std::vector<PartCost> dense_costs(double in, const Ints& widths, int64_t classes, int64_t tensor,
                                  bool first, bool dropout);

struct ModelSpec {
  const Task* task;
  // Checks that need only the job spec (run at validation, before any data or process
  // group): the model's own keys and whether its layers split over dims.tensor.
  std::function<void(const ModelConfig&, const ParallelDims&)> validate;
  // Builds the network's held parts (after fits()), parameters uninitialised.
  std::function<NetworkPtr(const ModelConfig&, const ModelContext&)> build;
  // How many parts (Network::part_params) the network has: what a pipeline splits.
  std::function<int64_t(const ModelConfig&)> parts;
  // How each parameter starts, by name (models/init.hpp); by default as torch.nn's.
  std::function<InitRule(const ModelConfig&)> init =
      [](const ModelConfig&) -> InitRule { return torch_default_init; };
  // Its parts' costs (PartCost), for the memory check and `dtrain plan`.
  std::function<std::vector<PartCost>(const ModelConfig&, const SizeContext&)> costs;
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

// The parts each of `stages` global stages holds: parallel.stages where the job gives it,
// else the contiguous split that evens out (parallel.balance) each part's parameters, as
// the model's `outline` holds them, or its forward FLOPs per sample (its cost sheet at one
// tensor rank, so every layout of the job splits alike).
std::vector<PartRange> stage_split(const JobConfig& cfg, const Network& outline, const ModelContext& mc,
                                   int64_t stages);

// model.arch's spec; throws ConfigError for an unknown arch.
const ModelSpec& model_spec(const std::string& arch);
std::vector<std::string> model_names();

// The specs, one per file.
ModelSpec mlp_spec();
ModelSpec cnn_spec();
ModelSpec gpt_spec();

// A whole model, initialised where it stands from `seed` (tools and tests: a run builds
// its parts into flat buffers instead).
NetworkPtr build_initialised(const ModelConfig& cfg, const ModelContext& ctx, uint64_t seed);

// A network that runs its child modules in order (mlp, cnn). Children are named "0", "1",
// ..., in the whole stack's order (the names torch::nn::Sequential gives them), whichever
// parts are held. A part is a run of children: add(make, /*new_part=*/true) starts one;
// `make` builds the child, and is called only for the parts held.
class LayerStack : public Network {
 public:
  explicit LayerStack(const ModelContext& ctx, int64_t parts)
      : ctx_(ctx), sizes_(size_t(parts), 0) {}
  template <class Make>
  void add(Make make, bool new_part = false) {
    if (new_part || children_ == 0) ++part_;
    const int64_t index = children_++;
    if (!ctx_.holds(part_, int64_t(sizes_.size()))) return;
    auto module = make();
    auto held = module.ptr();
    register_module(std::to_string(index), held);
    for (const auto& p : held->parameters()) sizes_[size_t(part_)] += p.numel();
    layers_.emplace_back(std::move(module));
  }
  torch::Tensor forward(const torch::Tensor& x) override;
  std::vector<int64_t> part_params() const override { return sizes_; }
  std::vector<const torch::nn::Module*> units() const override;

 private:
  ModelContext ctx_;
  std::vector<torch::nn::AnyModule> layers_;  // the held ones
  std::vector<int64_t> sizes_;                // each part's parameters (held ones)
  int64_t children_ = 0, part_ = -1;
};

}  // namespace dtrain
