#include <algorithm>
#include <cmath>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "models/model.hpp"
#include "util/error.hpp"
#include "util/shape.hpp"

namespace dtrain {
namespace {

// In the order model.arch lists them.
const std::vector<std::pair<std::string, ModelSpec>>& registry() {
  static const std::vector<std::pair<std::string, ModelSpec>> specs{
      {"mlp", mlp_spec()},
      {"cnn", cnn_spec()},
      {"gpt", gpt_spec()},
  };
  return specs;
}
const ListedBy kListed{"model.arch", model_names};

}  // namespace

const ModelSpec& model_spec(const std::string& arch) {
  auto it = std::find_if(registry().begin(), registry().end(),
                         [&](const auto& entry) { return entry.first == arch; });
  fail_if<ConfigError>(it == registry().end(), "model.arch: unknown model '{}' (one of {})", arch,
                       fmt::join(model_names(), " | "));
  return it->second;
}

std::vector<PartRange> stage_split(const JobConfig& cfg, const Network& outline, const ModelContext& mc,
                                   int64_t stages) {
  std::vector<int64_t> weights = outline.part_params();
  if (cfg.parallel.balance == "flops") {
    const auto costs = model_spec(cfg.model.arch).costs(cfg.model, SizeContext{mc.sample_shape, mc.classes});
    weights.clear();
    for (const auto& c : costs) weights.push_back(std::llround(c.flops));
  }
  return split_stages(weights, stages, cfg.parallel.stages);
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

void check_dense_sizes(const std::string& key, const std::string& layer, int64_t in,
                       const Ints& widths, int64_t out) {
  Ints sizes{in};  // every layer's inputs, then the last one's outputs
  sizes.insert(sizes.end(), widths.begin(), widths.end());
  sizes.push_back(out);
  for (size_t i = 1; i < sizes.size(); ++i)  // layer i: sizes[i] x sizes[i - 1]
    fail_if<ConfigError>(sizes[i - 1] > 0 && sizes[i] > 0 && !addressable({sizes[i], sizes[i - 1]}),
                         "{}: {} {}'s weight would be {} x {}, more values than a tensor can "
                         "address (2^60)", key, layer, i, sizes[i], sizes[i - 1]);
}

std::vector<PartCost> dense_costs(double in, const Ints& widths, int64_t classes, int64_t tensor,
                                  bool first, bool dropout) {
  enum Split { kColumn, kRow, kWhole };
  const double t = double(tensor);
  std::vector<PartCost> parts;
  auto add = [&](double out, Split split, bool last) {
    PartCost c;
    const bool on_data = first && parts.empty();  // its input is the data: no gradient
    // A column-parallel layer takes the whole input and makes its share of the outputs; a
    // row-parallel one takes that share and all-reduces the whole output.
    const double in_here = split == kRow ? in / t : in, out_here = split == kColumn ? out / t : out;
    c.flops = 2 * in_here * out_here;
    // What backward keeps (measured: tests/unit/models/test_activations.cpp): a hidden
    // layer's ReLU output (its product's is freed), with a dropout its mask and its output;
    // the classifier's logits and their log-softmax, whose gradients backward then holds
    // both at once. Under autocast the product and what follows it are 16-bit but the
    // log-softmax, and the first layer keeps its input's 16-bit cast.
    const double kept = last ? 1 : 1 + (dropout ? 2 : 0);
    c.activation_bytes = 4 * kept * out_here + (last ? 4 * out_here : 0);
    c.activation_bytes_16 = 2 * kept * out_here + (last ? 4 * out_here : 0) + (on_data ? 2 * in : 0);
    // Backward holds two gradients at once: its output's and its ReLU's (the log-softmax's
    // and the logits'), then the ReLU's and its input's, its ReLU's output freed meanwhile
    // (the logits stay). Under autocast a hidden layer's are 16-bit, and so is the
    // classifier's input gradient, after the log-softmax's fp32 one and its 16-bit cast
    // (where the product is 16-bit: a GPU, LibTorch 1.13 on a CPU with AVX512-BF16; a CPU
    // that converts through fp32 holds up to the fp32 count more, bytes a sample).
    const double in_grad = on_data ? 0 : in_here;
    c.backward_bytes = last ? std::max(8 * out_here, 4 * out_here + 4 * in_grad)
                            : std::max(8 * out_here, 4 * in_grad);
    c.backward_bytes_16 = last ? std::max(8 * out_here, 6 * out_here + 2 * in_grad)
                               : std::max(4 * out_here, 2 * in_grad);
    if (tensor > 1) {
      c.reduced = split == kRow ? out : 0;
      // backward all-reduces a column-parallel layer's input gradient
      c.reduced_back = split == kColumn && !on_data ? in : 0;
      c.reductions = c.reduced > 0 ? 1 : 0;
      c.reductions_back = c.reduced_back > 0 ? 1 : 0;
    }
    c.output = last ? 0 : out_here;
    // The product with its bias, then the ReLU and its dropout (or the loss's two); under
    // autocast the weight and bias cast, the data too, and the logits back to fp32.
    c.kernels = last ? 3 : 2 + (dropout ? kDropoutKernels : 0);
    c.casts = 2 + (on_data ? 1 : 0) + (last ? 1 : 0);
    // Its ReLU (a dropout's mask and product), or the log-softmax; backward the same
    // (the loss's picks with the log-softmax's); under autocast the data's cast, and the
    // logits' back to fp32 and their gradient's.
    if (last) {
      c.values.transcendental = c.values_back.transcendental = out_here;
      c.values_back.plain = out_here;
      c.values.casts_16 = c.values_back.casts_16 = out_here;
    } else {
      c.values.plain = out_here * (dropout ? 3 : 1);
      c.values_back.plain = out_here * (dropout ? 2 : 1);
    }
    if (on_data) c.values.casts_16 += in;
    // Split: a row-parallel product's copy for its all-reduce and its bias added after it;
    // backward, a column-parallel one's input gradient copied for its all-reduce.
    if (tensor > 1 && split == kRow) c.values.plain += 2 * out;
    if (tensor > 1 && split == kColumn && !on_data) c.values_back.plain += in;
    parts.push_back(c);
    in = out;
  };
  for (size_t i = 0; i < widths.size(); ++i) add(double(widths[i]), i % 2 == 0 ? kColumn : kRow, false);
  // The classifier is row-parallel after a column-parallel layer, else whole on every rank.
  add(double(classes), widths.size() % 2 == 1 ? kRow : kWhole, true);
  return parts;
}

NetworkPtr build_initialised(const ModelConfig& cfg, const ModelContext& ctx, uint64_t seed) {
  const auto& spec = model_spec(cfg.arch);
  auto net = spec.build(cfg, ctx);
  init_parameters(*net, spec.init(cfg), seed, ctx.tensor->rank());
  return net;
}

}  // namespace dtrain
