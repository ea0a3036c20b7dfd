// The cnn family (LeNet-style): per stage a 3x3 conv (pad 1) [+ BatchNorm] + ReLU + 2x2
// max-pool, then the dense layers. The shipped job is conv32-pool-conv64-pool-fc128-fc10,
// the shape of scripts/baselines' PyTorch CNN, so the two run the same kernels. It has no
// tensor-parallel form; data and pipeline parallelism are what it scales with.
#include <algorithm>
#include <cmath>

#include <fmt/format.h>
#include <torch/nn.h>

#include "models/dropout.hpp"
#include "models/model.hpp"
#include "layers/plain.hpp"
#include "layers/sync_batchnorm.hpp"
#include "layers/tensor_parallel.hpp"
#include "util/error.hpp"
#include "util/shape.hpp"

namespace dtrain {
namespace nn = torch::nn;

namespace {

void validate_cnn(const ModelConfig& cfg, const ParallelDims& dims) {
  fail_if<ConfigError>(dims.tensor != 1, "parallel.tensor: the cnn model has no tensor-parallel "
                       "layers; use parallel.tensor: 1 (data parallelism scales it)");
  for (const Ints* v : {&cfg.channels, &cfg.fc})
    for (auto x : *v)
      fail_if<ConfigError>(x <= 0, "model.{}: widths must be positive (got {})",
                           v == &cfg.channels ? "channels" : "fc", x);
  fail_if<ConfigError>(cfg.dropout < 0 || cfg.dropout >= 1, "model.dropout: must be in [0, 1) "
                       "(got {})", cfg.dropout);
  // Weights between dense layers a tensor LibTorch can address; the rest against the data
  // in cnn_fits.
  check_dense_sizes("model.fc", "dense layer", 0, cfg.fc, 0);
}

// Parts: each conv stage (conv, norm, ReLU, pool), each hidden dense layer, the
// classifier; the first dense part also flattens.
int64_t cnn_parts(const ModelConfig& cfg) {
  return int64_t(cfg.channels.size() + cfg.fc.size()) + 1;
}

void cnn_fits(const ModelConfig& cfg, const ModelContext& ctx) {
  const auto& shape = ctx.sample_shape;
  fail_if<ConfigError>(shape.size() != 3,
                       "model.arch: cnn needs samples shaped [channels, height, width], the data "
                       "has {} dimension(s)", shape.size());
  int64_t c = shape[0], h = shape[1], w = shape[2];
  for (size_t i = 0; i < cfg.channels.size(); ++i, h /= 2, w /= 2) {
    fail_if<ConfigError>(h < 2 || w < 2,
                         "model.channels: {} conv+pool stages shrink the {}x{} input below 1x1",
                         cfg.channels.size(), shape[1], shape[2]);
    // Each stage's weight and its output for one sample: tensors LibTorch can address.
    fail_if<ConfigError>(!addressable({cfg.channels[i], c, 9}) || !addressable({cfg.channels[i], h, w}),
                         "model.channels: stage {}'s {} channels make tensors of more values "
                         "than LibTorch can address (2^60)", i + 1, cfg.channels[i]);
    c = cfg.channels[i];
  }
  check_dense_sizes("model.fc", "dense layer", c * h * w, cfg.fc, ctx.classes);
}

NetworkPtr build_cnn(const ModelConfig& cfg, const ModelContext& ctx) {
  cnn_fits(cfg, ctx);
  const auto& shape = ctx.sample_shape;
  int64_t c = shape[0], h = shape[1], w = shape[2];
  auto m = std::make_shared<LayerStack>(ctx, cnn_parts(cfg));
  for (auto out : cfg.channels) {
    // With BatchNorm right after, the conv bias would be cancelled by the mean: leave it out.
    m->add([&] { return Conv2d(c, out, /*kernel=*/3, /*padding=*/1, /*bias=*/!cfg.batch_norm, ctx.options); },
           /*new_part=*/true);
    if (cfg.batch_norm && ctx.sync_batchnorm)
      m->add([&] { return SyncBatchNorm2d(out, ctx.sync_batchnorm, ctx.options); });
    else if (cfg.batch_norm)
      m->add([&] { return BatchNorm2d(out, ctx.options); });
    m->add([] { return nn::ReLU(nn::ReLUOptions().inplace(true)); });
    m->add([] { return nn::MaxPool2d(nn::MaxPool2dOptions(2)); });
    c = out, h /= 2, w /= 2;
  }
  m->add([] { return nn::Flatten(); }, /*new_part=*/true);  // joins the first dense layer's part
  int64_t in = c * h * w;
  bool first_dense = true;
  int64_t fc_index = 0;
  auto linear = [&](int64_t out) {
    ParallelLinearOptions o{in, out};
    o.options = ctx.options;
    return ColumnParallelLinear(o, make_local_comm());
  };
  for (auto width : cfg.fc) {
    m->add([&] { return linear(width); }, !first_dense);
    m->add([] { return nn::ReLU(nn::ReLUOptions().inplace(true)); });
    if (cfg.dropout > 0) {
      const auto site = dropout_site(fmt::format("fc.{}", fc_index++));
      m->add([&] { return SeededDropout(cfg.dropout, site); });
    }
    in = width, first_dense = false;
  }
  m->add([&] { return linear(ctx.classes); }, !first_dense);
  return m;
}

// Per conv stage: what backward keeps, the convolution's multiply-adds, the pooled output
// handed on; then the dense layers'.
std::vector<PartCost> cnn_costs(const ModelConfig& cfg, const SizeContext& ctx) {
  std::vector<PartCost> parts;
  double in = 1;
  for (auto x : ctx.sample_shape) in *= double(x);
  if (ctx.sample_shape.size() == 3) {
    double c = double(ctx.sample_shape[0]), h = double(ctx.sample_shape[1]),
           w = double(ctx.sample_shape[2]);
    for (auto out : cfg.channels) {
      PartCost p;
      const double maps = double(out) * h * w, input = c * h * w;
      p.flops = 2 * c * 9 * maps;
      c = double(out), h = std::floor(h / 2), w = std::floor(w / 2);
      p.output = c * h * w;
      // Kept (measured: tests/unit/models/test_activations.cpp): the ReLU's output (the
      // pool's input too), the norm's input, the pool's indices (int64) and output. Under
      // autocast the maps and the pooled output are 16-bit, and the first keeps the data's
      // cast. Backward holds about one and a half maps' gradients (measured: 1.4-1.8 in
      // fp32, less in bf16) and its input's.
      const double norm = cfg.batch_norm ? 2 : 1;
      p.activation_bytes = 4 * norm * maps + (8 + 4) * p.output;
      p.activation_bytes_16 = 2 * norm * maps + (8 + 2) * p.output + (parts.empty() ? 2 * input : 0);
      p.backward_bytes = 6 * maps + (parts.empty() ? 0 : 4 * input);
      // Convolution, batch norm (and its count of batches), ReLU, pooling; under autocast
      // the weight and the bias (without batch norm) cast, and the first the data.
      p.kernels = cfg.batch_norm ? 5 : 3;
      p.casts = (cfg.batch_norm ? 1 : 2) + (parts.empty() ? 1 : 0);
      // The norm, the ReLU, the pool's output and indices; backward the pool's, the ReLU's
      // and the norm's gradients (the convolution's are its product's); the data's cast.
      p.values.plain = norm * maps + 2 * p.output;
      p.values_back.plain = (1 + norm) * maps;
      p.values.casts_16 = parts.empty() ? input : 0;
      parts.push_back(p);
    }
    in = c * h * w;
  }
  for (const auto& p : dense_costs(in, cfg.fc, ctx.classes, /*tensor=*/1, /*first=*/false, cfg.dropout > 0))
    parts.push_back(p);
  return parts;
}

}  // namespace

ModelSpec cnn_spec() {
  ModelSpec s;
  s.task = &classification_task();
  s.validate = validate_cnn;
  s.build = build_cnn;
  s.parts = cnn_parts;
  s.costs = cnn_costs;
  s.format = torch::MemoryFormat::ChannelsLast;
  s.fits = cnn_fits;
  return s;
}

}  // namespace dtrain
