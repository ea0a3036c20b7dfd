// The ordinary layers a model builds from, each created where the model is built: on the
// CPU, a GPU, or the meta device (ModelContext::options), where torch::nn's own allocate on
// the CPU whatever the model asks. A model built for its shapes only (`plan`, `validate`,
// the outline a rank splits its parts from) then allocates nothing, however wide.
// Parameter and buffer names, shapes and computations are torch::nn's (Conv2d, BatchNorm2d,
// LayerNorm, Embedding), so checkpoints and losses stay what they were.
#pragma once
#include <torch/nn/cloneable.h>
#include <torch/nn/pimpl.h>
#include <torch/types.h>

#include "parallel/flat_params.hpp"

namespace dtrain {

// A 2-D convolution, stride 1: torch::nn::Conv2d's.
class Conv2dImpl : public torch::nn::Cloneable<Conv2dImpl>, public CastModule {
 public:
  Conv2dImpl(int64_t in, int64_t out, int64_t kernel, int64_t padding, bool bias,
             torch::TensorOptions options);
  void reset() override;
  torch::Tensor forward(const torch::Tensor& x);
  // The weight, as torch::nn::Conv2d's (autocast casts it; the bias stays apart).
  bool cast_by_autocast(const std::string& param) const override { return param == "weight"; }

  torch::Tensor weight, bias;

 private:
  int64_t in_, out_, kernel_, padding_;
  bool has_bias_;
  torch::TensorOptions options_;
};
TORCH_MODULE(Conv2d);

// Batch normalisation over [N, C, H, W]: torch::nn::BatchNorm2d's, momentum 0.1.
class BatchNorm2dImpl : public torch::nn::Cloneable<BatchNorm2dImpl> {
 public:
  BatchNorm2dImpl(int64_t channels, torch::TensorOptions options);
  void reset() override;
  torch::Tensor forward(const torch::Tensor& x);

  torch::Tensor weight, bias, running_mean, running_var, num_batches_tracked;

 private:
  int64_t channels_;
  torch::TensorOptions options_;
};
TORCH_MODULE(BatchNorm2d);

// Layer normalisation over the last dimension, eps 1e-5: torch::nn::LayerNorm's.
class LayerNormImpl : public torch::nn::Cloneable<LayerNormImpl> {
 public:
  LayerNormImpl(int64_t dim, torch::TensorOptions options);
  void reset() override;
  torch::Tensor forward(const torch::Tensor& x);

  torch::Tensor weight, bias;

 private:
  int64_t dim_;
  torch::TensorOptions options_;
};
TORCH_MODULE(LayerNorm);

// A lookup table, rows by id: torch::nn::Embedding's.
class EmbeddingImpl : public torch::nn::Cloneable<EmbeddingImpl> {
 public:
  EmbeddingImpl(int64_t rows, int64_t dim, torch::TensorOptions options);
  void reset() override;
  torch::Tensor forward(const torch::Tensor& ids);

  torch::Tensor weight;

 private:
  int64_t rows_, dim_;
  torch::TensorOptions options_;
};
TORCH_MODULE(Embedding);

}  // namespace dtrain
