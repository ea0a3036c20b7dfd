// Causal self-attention over q, k, v shaped [batch, heads, seq, head_dim].
#pragma once
#include <functional>

#include <torch/types.h>

namespace dtrain {

// LibTorch's fused kernel (at::scaled_dot_product_attention). It agrees with
// plain_causal_attention to float tolerance (tested).
// No dropout: the fused kernel would draw its own masks (see models/dropout.hpp).
torch::Tensor causal_attention(const torch::Tensor& q, const torch::Tensor& k,
                               const torch::Tensor& v);
// softmax(q k^T / sqrt(head_dim), future positions masked) v, with `drop` (if given)
// applied to the weights.
using WeightsDropout = std::function<torch::Tensor(const torch::Tensor&)>;
torch::Tensor plain_causal_attention(const torch::Tensor& q, const torch::Tensor& k,
                                     const torch::Tensor& v, const WeightsDropout& drop = {});

}  // namespace dtrain
