#include "optim/clip.hpp"

#include <algorithm>
#include <cmath>
#include <vector>

#include <torch/torch.h>

#include "comm/comm.hpp"
#include "optim/optimizer.hpp"
#include "parallel/flat_params.hpp"

namespace dtrain {
namespace {

// The sum of `t`'s squares, in fp64, a piece at a time: pow(2) of the whole would take a
// temporary its size (the shard under ZeRO, an entry's part under tensor parallelism).
torch::Tensor squares(const torch::Tensor& t) {
  torch::Tensor total = torch::zeros({}, t.options().dtype(torch::kFloat64));
  for_each_piece(t.numel(), [&](int64_t at, int64_t n) {
    total += t.narrow(0, at, n).pow(2).sum().to(torch::kFloat64);
  });
  return total;
}

}  // namespace

torch::Tensor global_grad_norm(const FlatParams& params, Comm& tensor, Comm& pipeline,
                               const std::vector<size_t>& copies, const Shard& shard,
                               Comm* data) {
  const bool sharded = data && data->size() > 1 && !shard.whole();
  const auto grad = params.grad_of(sharded ? shard : Shard{});
  if (tensor.size() == 1 && pipeline.size() == 1 && !sharded) return grad.norm();
  const auto f64 = grad.options().dtype(torch::kFloat64);
  const int64_t lo = sharded ? shard.offset : 0, hi = lo + grad.numel();
  // Entry i's part of the shard (all of it without one), as a flat slice.
  auto within = [&](size_t i) -> torch::Tensor {
    const auto& e = params.entries()[i];
    const int64_t from = std::max(lo, e.offset), to = std::min(hi, e.offset + e.numel);
    return from < to ? params.grad_of({from, to - from}) : torch::Tensor();
  };
  torch::Tensor total;
  if (tensor.size() == 1) {
    // The part's squares, less those of the copies another stage counts.
    total = squares(grad);
    for (size_t i : copies)
      if (auto part = within(i); part.defined()) total = total - squares(part);
  } else {
    // Every rank adds its parts of the split entries; rank 0 alone the replicated ones. The
    // squares stay tensors until one reduction.
    std::vector<torch::Tensor> parts;
    for (size_t i = 0; i < params.entries().size(); ++i) {
      if (std::find(copies.begin(), copies.end(), i) != copies.end()) continue;
      if (!params.entries()[i].placement.is_split() && tensor.rank() != 0) continue;
      if (auto part = within(i); part.defined()) parts.push_back(squares(part));
    }
    total = parts.empty() ? torch::zeros({}, f64) : torch::stack(parts).sum();
  }
  total = total.reshape({1});
  if (tensor.size() > 1) tensor.all_reduce(total);
  if (pipeline.size() > 1) pipeline.all_reduce(total);
  if (sharded) data->all_reduce(total);
  return total.sqrt().squeeze(0);
}

void clip_grad(FlatParams& params, const torch::Tensor& norm, double max_norm, double loss_scale,
               const Shard& shard) {
  auto grad = params.grad_of(shard);
  if (max_norm > 0) {
    auto factor = (max_norm / (norm + 1e-6)).clamp_max(1.0);
    grad.mul_(loss_scale == 1.0 ? factor : factor / loss_scale);
  } else if (loss_scale != 1.0) {
    grad.mul_(1.0 / loss_scale);
  }
}

}  // namespace dtrain
