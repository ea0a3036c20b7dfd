#include "optim/clip.hpp"

#include <cmath>

#include <torch/torch.h>

#include "comm/comm.hpp"
#include "parallel/flat_params.hpp"

namespace dtrain {

double global_grad_norm(const FlatParams& params, Comm& tensor) {
  if (tensor.size() == 1) return params.grad().norm().item<double>();
  double split = 0, replicated = 0;
  for (size_t i = 0; i < params.entries().size(); ++i) {
    const double sq = params.view(params.grad(), i).pow(2).sum().item<double>();
    (params.entries()[i].placement.is_split() ? split : replicated) += sq;
  }
  auto total = torch::tensor({split + (tensor.rank() == 0 ? replicated : 0.0)}, torch::kFloat64);
  tensor.all_reduce(total);
  return std::sqrt(total.item<double>());
}

void clip_grad(FlatParams& params, double norm, double max_norm) {
  if (max_norm > 0 && norm > max_norm) params.grad().mul_(max_norm / (norm + 1e-6));
}

}  // namespace dtrain
