// Causal self-attention over q, k, v shaped [batch, heads, seq, head_dim].
#pragma once
#include <torch/types.h>

namespace dtrain {

// LibTorch's fused kernel (at::scaled_dot_product_attention) where the version has it,
// else plain_causal_attention. The two agree to float tolerance (tested where both exist).
torch::Tensor causal_attention(const torch::Tensor& q, const torch::Tensor& k,
                               const torch::Tensor& v, double dropout);
// softmax(q k^T / sqrt(head_dim), future positions masked) v, with dropout on the weights.
torch::Tensor plain_causal_attention(const torch::Tensor& q, const torch::Tensor& k,
                                     const torch::Tensor& v, double dropout);

}  // namespace dtrain
