// The mlp family: Flatten, then Linear + ReLU (+ Dropout) per hidden width, then the
// classifier. The shipped job is 784-512-256-10, the shape of scripts/baselines' PyTorch
// MLP, so dtrain and the baseline run the same kernels.
//
// Tensor parallelism pairs the layers Megatron's way: hidden layers alternate
// column-parallel (output split) and row-parallel (input split, summed), so activations
// stay split between a pair and one all-reduce per pair joins them. The classifier is
// row-parallel when it follows a column-parallel layer, else replicated.
#include <fmt/format.h>
#include <torch/nn.h>

#include "models/dropout.hpp"
#include "models/model.hpp"
#include "layers/tensor_parallel.hpp"
#include "util/error.hpp"
#include "util/shape.hpp"

namespace dtrain {
namespace nn = torch::nn;

namespace {
bool column_parallel(size_t layer) { return layer % 2 == 0; }

void validate_mlp(const ModelConfig& cfg, const ParallelDims& dims) {
  for (size_t i = 0; i < cfg.hidden.size(); ++i) {
    fail_if<ConfigError>(cfg.hidden[i] <= 0, "model.hidden: widths must be positive (got {})",
                         cfg.hidden[i]);
    fail_if<ConfigError>(column_parallel(i) && cfg.hidden[i] % dims.tensor != 0,
                         "model.hidden: layer {} has {} units, which do not split over "
                         "parallel.tensor {}", i + 1, cfg.hidden[i], dims.tensor);
  }
  fail_if<ConfigError>(cfg.dropout < 0 || cfg.dropout >= 1, "model.dropout: must be in [0, 1) "
                       "(got {})", cfg.dropout);
  // Every weight a tensor LibTorch can address (a width of 1e10 is a typo, not a model):
  // those between hidden layers here, the ends against the data in mlp_fits.
  check_dense_sizes("model.hidden", "layer", 0, cfg.hidden, 0);
}

void mlp_fits(const ModelConfig& cfg, const ModelContext& ctx) {
  fail_if<ConfigError>(!addressable(ctx.sample_shape), "model.arch: mlp flattens samples of {} "
                       "values, more than a tensor can address", fmt::format("{}", ctx.sample_shape));
  check_dense_sizes("model.hidden", "layer", shape_numel(ctx.sample_shape), cfg.hidden, ctx.classes);
}

// Parts: each hidden layer (with its ReLU and dropout), then the classifier; the first
// part also flattens.
int64_t mlp_parts(const ModelConfig& cfg) { return int64_t(cfg.hidden.size()) + 1; }

NetworkPtr build_mlp(const ModelConfig& cfg, const ModelContext& ctx) {
  mlp_fits(cfg, ctx);
  auto m = std::make_shared<LayerStack>(ctx, mlp_parts(cfg));
  m->add([] { return nn::Flatten(); });
  int64_t in = shape_numel(ctx.sample_shape);
  auto linear = [&](bool column, int64_t out, const std::shared_ptr<Comm>& tensor) {
    return [=, &ctx]() -> nn::AnyModule {
      ParallelLinearOptions o{in, out};
      o.options = ctx.options;
      if (column) return nn::AnyModule(ColumnParallelLinear(o, tensor));
      return nn::AnyModule(RowParallelLinear(o, tensor));
    };
  };
  for (size_t i = 0; i < cfg.hidden.size(); ++i) {
    const int64_t w = cfg.hidden[i];
    m->add(linear(column_parallel(i), w, ctx.tensor), /*new_part=*/i > 0);
    m->add([] { return nn::ReLU(nn::ReLUOptions().inplace(true)); });
    if (cfg.dropout > 0) {  // a column-parallel layer's output is this rank's part of it
      const LayerSlice slice = column_parallel(i) ? LayerSlice{1, ctx.tensor->rank(), ctx.tensor->size()}
                                                  : LayerSlice{};
      m->add([&] { return SeededDropout(cfg.dropout, dropout_site(fmt::format("hidden.{}", i)), slice); });
    }
    in = w;
  }
  const bool new_part = !cfg.hidden.empty();
  if (!cfg.hidden.empty() && column_parallel(cfg.hidden.size() - 1))
    m->add(linear(false, ctx.classes, ctx.tensor), new_part);
  else
    m->add(linear(true, ctx.classes, make_local_comm()), new_part);
  return m;
}

std::vector<PartCost> mlp_costs(const ModelConfig& cfg, const SizeContext& ctx) {
  return dense_costs(double(shape_numel(ctx.sample_shape)), cfg.hidden, ctx.classes, ctx.tensor,
                     /*first=*/true, cfg.dropout > 0);
}

}  // namespace

ModelSpec mlp_spec() {
  ModelSpec s;
  s.task = &classification_task();
  s.validate = validate_mlp;
  s.fits = mlp_fits;
  s.build = build_mlp;
  s.parts = mlp_parts;
  s.costs = mlp_costs;
  return s;
}

}  // namespace dtrain
