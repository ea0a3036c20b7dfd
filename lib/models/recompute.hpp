// Activation recompute: a module's forward that keeps none of what its backward needs
// beyond its input, and runs again in backward to rebuild it (torch.utils.checkpoint's
// reentrant form; the C++ frontend has none). The rerun sees the random state, the autocast
// setting and the dropout draw (models/dropout.hpp) the forward saw, so dropout draws the
// same masks and the gradients are the ones a plain forward would give, bit for bit.
#pragma once
#include <torch/nn/module.h>

namespace dtrain {

namespace detail {
using RunFn = torch::Tensor (*)(void* module, const torch::Tensor& x);
torch::Tensor recompute(RunFn run, void* module, const torch::Tensor& x);
}  // namespace detail

// `module` applied to `x` (which must require grad: the recomputation happens in x's
// backward), recomputed in backward. `module` must outlive the graph (a model's own block).
template <class M>
torch::Tensor recompute(M& module, const torch::Tensor& x) {
  detail::RunFn run = [](void* m, const torch::Tensor& in) {
    return static_cast<M*>(m)->forward(in);
  };
  return detail::recompute(run, &module, x);
}

}  // namespace dtrain
