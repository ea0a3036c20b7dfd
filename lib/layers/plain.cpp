#include "layers/plain.hpp"

#include <torch/torch.h>

namespace dtrain {

// Every parameter is created uninitialised, as the tensor-parallel layers' are: the
// model's rule fills it by name (models/init.hpp). Buffers start as torch::nn's.

Conv2dImpl::Conv2dImpl(int64_t in, int64_t out, int64_t kernel, int64_t padding, bool bias,
                       torch::TensorOptions options)
    : in_(in), out_(out), kernel_(kernel), padding_(padding), has_bias_(bias), options_(options) {
  reset();
}

void Conv2dImpl::reset() {
  weight = register_parameter("weight", torch::empty({out_, in_, kernel_, kernel_}, options_));
  if (has_bias_) bias = register_parameter("bias", torch::empty({out_}, options_));
}

torch::Tensor Conv2dImpl::forward(const torch::Tensor& x) {
  return torch::conv2d(x, weight, bias, /*stride=*/1, /*padding=*/padding_);
}

BatchNorm2dImpl::BatchNorm2dImpl(int64_t channels, torch::TensorOptions options)
    : channels_(channels), options_(options) {
  reset();
}

void BatchNorm2dImpl::reset() {
  weight = register_parameter("weight", torch::empty({channels_}, options_));
  bias = register_parameter("bias", torch::empty({channels_}, options_));
  running_mean = register_buffer("running_mean", torch::zeros({channels_}, options_));
  running_var = register_buffer("running_var", torch::ones({channels_}, options_));
  num_batches_tracked =
      register_buffer("num_batches_tracked", torch::zeros({}, options_.dtype(torch::kInt64)));
}

torch::Tensor BatchNorm2dImpl::forward(const torch::Tensor& x) {
  if (is_training()) num_batches_tracked.add_(1);
  return torch::batch_norm(x, weight, bias, running_mean, running_var, is_training(),
                           /*momentum=*/0.1, /*eps=*/1e-5,
                           at::globalContext().userEnabledCuDNN());
}

LayerNormImpl::LayerNormImpl(int64_t dim, torch::TensorOptions options)
    : dim_(dim), options_(options) {
  reset();
}

void LayerNormImpl::reset() {
  weight = register_parameter("weight", torch::empty({dim_}, options_));
  bias = register_parameter("bias", torch::empty({dim_}, options_));
}

torch::Tensor LayerNormImpl::forward(const torch::Tensor& x) {
  return torch::layer_norm(x, {dim_}, weight, bias, /*eps=*/1e-5);
}

EmbeddingImpl::EmbeddingImpl(int64_t rows, int64_t dim, torch::TensorOptions options)
    : rows_(rows), dim_(dim), options_(options) {
  reset();
}

void EmbeddingImpl::reset() {
  weight = register_parameter("weight", torch::empty({rows_, dim_}, options_));
}

torch::Tensor EmbeddingImpl::forward(const torch::Tensor& ids) {
  return torch::embedding(weight, ids);
}

}  // namespace dtrain
