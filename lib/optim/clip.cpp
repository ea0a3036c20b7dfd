#include "optim/clip.hpp"

#include <cmath>
#include <vector>

#include <torch/torch.h>

#include "comm/comm.hpp"
#include "parallel/flat_params.hpp"

namespace dtrain {

double global_grad_norm(const FlatParams& params, Comm& tensor) {
  if (tensor.size() == 1) return params.grad().norm().item<double>();
  // Every rank adds its parts of the split entries; rank 0 alone the replicated ones. The
  // squares stay tensors until one reduction, so the step waits once, not per entry.
  std::vector<torch::Tensor> squares;
  for (size_t i = 0; i < params.entries().size(); ++i)
    if (params.entries()[i].placement.is_split() || tensor.rank() == 0)
      squares.push_back(params.view(params.grad(), i).pow(2).sum());
  auto total = squares.empty() ? torch::zeros({1}, torch::kFloat64)
                               : torch::stack(squares).to(torch::kFloat64).sum().reshape({1});
  tensor.all_reduce(total);
  return std::sqrt(total.item<double>());
}

void clip_grad(FlatParams& params, double norm, double max_norm, double loss_scale) {
  const double clip = max_norm > 0 && norm > max_norm ? max_norm / (norm + 1e-6) : 1.0;
  const double f = clip / loss_scale;
  if (f != 1.0) params.grad().mul_(f);
}

}  // namespace dtrain
