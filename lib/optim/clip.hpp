// The global gradient norm, over every shard of every parameter, each counted once.
#pragma once
#include <vector>

#include <torch/types.h>

#include "parallel/flat_params.hpp"

namespace dtrain {

class Comm;

// The L2 norm of the whole model's gradient. Parameters split over `tensor` contribute
// their squares from every rank; replicated ones (identical on every tensor rank) once;
// each pipeline stage its own parts, except `copies` (entries another stage counts: the
// head's copy of a tied embedding). Under ZeRO each data rank holds the final gradient of
// its `shard` only: it adds that part's squares, summed over `data`. A 0-dim tensor on the
// gradient's device, not read here: the host need not wait for it. A collective over
// `tensor`, `pipeline` and (with a shard) `data` when they have more than one rank.
torch::Tensor global_grad_norm(const FlatParams& params, Comm& tensor, Comm& pipeline,
                               const std::vector<size_t>& copies = {}, const Shard& shard = {},
                               Comm* data = nullptr);

// Divides the gradient (of `shard`: the part this rank updates) by `loss_scale` (fp16's; 1
// otherwise) and scales it so that its global norm, `norm` (already divided by the loss
// scale), is at most `max_norm` (torch's clip_grad_norm_: factor min(1, max_norm / (norm +
// 1e-6)), on the device; max_norm 0 is off and `norm` may then be undefined). One multiply,
// none when there is nothing to do.
void clip_grad(FlatParams& params, const torch::Tensor& norm, double max_norm,
               double loss_scale = 1.0, const Shard& shard = {});

}  // namespace dtrain
