#include "optim/clip.hpp"

#include <algorithm>
#include <cmath>
#include <vector>

#include <torch/torch.h>

#include "comm/comm.hpp"
#include "parallel/flat_params.hpp"

namespace dtrain {

torch::Tensor global_grad_norm(const FlatParams& params, Comm& tensor, Comm& pipeline,
                               const std::vector<size_t>& copies) {
  if (tensor.size() == 1 && pipeline.size() == 1) return params.grad().norm();
  const auto f64 = params.grad().options().dtype(torch::kFloat64);
  torch::Tensor total;
  if (tensor.size() == 1) {
    // The whole buffer's squares, less those of the copies another stage counts.
    total = params.grad().pow(2).sum().to(torch::kFloat64);
    for (size_t i : copies) total = total - params.view(params.grad(), i).pow(2).sum().to(torch::kFloat64);
  } else {
    // Every rank adds its parts of the split entries; rank 0 alone the replicated ones. The
    // squares stay tensors until one reduction.
    std::vector<torch::Tensor> squares;
    for (size_t i = 0; i < params.entries().size(); ++i) {
      if (std::find(copies.begin(), copies.end(), i) != copies.end()) continue;
      if (params.entries()[i].placement.is_split() || tensor.rank() == 0)
        squares.push_back(params.view(params.grad(), i).pow(2).sum());
    }
    total = squares.empty() ? torch::zeros({}, f64) : torch::stack(squares).to(torch::kFloat64).sum();
  }
  total = total.reshape({1});
  if (tensor.size() > 1) tensor.all_reduce(total);
  if (pipeline.size() > 1) pipeline.all_reduce(total);
  return total.sqrt().squeeze(0);
}

void clip_grad(FlatParams& params, const torch::Tensor& norm, double max_norm, double loss_scale) {
  if (max_norm > 0) {
    auto factor = (max_norm / (norm + 1e-6)).clamp_max(1.0);
    params.grad().mul_(loss_scale == 1.0 ? factor : factor / loss_scale);
  } else if (loss_scale != 1.0) {
    params.grad().mul_(1.0 / loss_scale);
  }
}

}  // namespace dtrain
