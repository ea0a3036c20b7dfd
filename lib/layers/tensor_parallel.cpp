#include "layers/tensor_parallel.hpp"

#include <cmath>

#include <fmt/format.h>
#include <torch/torch.h>

#include "layers/linear.hpp"
#include "util/error.hpp"

namespace dtrain {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct CopyToRegion : torch::autograd::Function<CopyToRegion> {
  static torch::Tensor forward(AutogradContext* ctx, torch::Tensor x, Comm* comm) {
    ctx->saved_data["comm"] = comm_handle(comm);
    return x.view_as(x);  // a new node for autograd; no copy
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto g = grads[0].contiguous().clone();  // the incoming gradient may be shared
    comm_from_handle(ctx->saved_data["comm"].toInt())->all_reduce(g);
    return {g, torch::Tensor()};
  }
};

struct ReduceFromRegion : torch::autograd::Function<ReduceFromRegion> {
  static torch::Tensor forward(AutogradContext*, torch::Tensor x, Comm* comm) {
    auto y = x.contiguous().clone();
    comm->all_reduce(y);
    return y;
  }
  static variable_list backward(AutogradContext*, variable_list grads) {
    return {grads[0], torch::Tensor()};
  }
};

int64_t parts_dividing(const std::shared_ptr<Comm>& tensor, int64_t n, const char* what) {
  const int64_t t = tensor->size();
  if (n % t != 0)
    throw ConfigError(fmt::format("parallel.tensor: {} {} do not split over {} ranks", n, what, t));
  return t;
}

}  // namespace

torch::Tensor copy_to_tensor_region(const torch::Tensor& x, const std::shared_ptr<Comm>& tensor) {
  return tensor->size() == 1 ? x : CopyToRegion::apply(x, tensor.get());
}

torch::Tensor reduce_from_tensor_region(const torch::Tensor& x,
                                        const std::shared_ptr<Comm>& tensor) {
  return tensor->size() == 1 ? x : ReduceFromRegion::apply(x, tensor.get());
}

ColumnParallelLinearImpl::ColumnParallelLinearImpl(const ParallelLinearOptions& opts,
                                                   std::shared_ptr<Comm> tensor)
    : opts_(opts), tensor_(std::move(tensor)) {
  const int64_t out = opts.out / parts_dividing(tensor_, opts.out / opts.blocks, "output features");
  weight = register_parameter("weight", torch::empty({out, opts.in}, opts.options));
  if (opts.bias) bias = register_parameter("bias", torch::empty({out}, opts.options));
}

Placement ColumnParallelLinearImpl::placement_of(const std::string&) const {
  return Placement::split(/*dim=*/0, tensor_->size(), opts_.blocks);  // weight rows, bias
}

// layers/linear.hpp's (ATen's linear, or oneDNN's on the CPU), not the C++ frontend's
// F::linear: that one multiplies and then adds the bias for 3-D inputs, outside autocast's
// cast, so on a GPU in bf16 the bias went through a separate mixed-precision add over the
// whole output (6 ms of a GPT-2 small step's 25 ms forward on an H100) instead of the
// matmul's fused epilogue.
torch::Tensor ColumnParallelLinearImpl::forward(const torch::Tensor& x) {
  return dtrain::linear(copy_to_tensor_region(x, tensor_), weight, bias);
}

RowParallelLinearImpl::RowParallelLinearImpl(const ParallelLinearOptions& opts,
                                             std::shared_ptr<Comm> tensor)
    : opts_(opts), tensor_(std::move(tensor)) {
  const int64_t in = opts.in / parts_dividing(tensor_, opts.in, "input features");
  weight = register_parameter("weight", torch::empty({opts.out, in}, opts.options));
  if (opts.bias) bias = register_parameter("bias", torch::empty({opts.out}, opts.options));
}

Placement RowParallelLinearImpl::placement_of(const std::string& param) const {
  if (param == "bias") return Placement::replicated();  // added once, after the sum
  return Placement::split(/*dim=*/1, tensor_->size());
}

torch::Tensor RowParallelLinearImpl::forward(const torch::Tensor& x) {
  // One rank: the fused addmm of an unsplit layer.
  if (tensor_->size() == 1) return dtrain::linear(x, weight, bias);
  auto y = reduce_from_tensor_region(dtrain::linear(x, weight), tensor_);
  // In the sum's dtype, as the unsplit layer's fused bias is under autocast: an fp32 bias
  // would promote the output to fp32, and what follows it (a ReLU's output, a dropout's
  // mask, the next layer's cast of it) would be kept in 4 bytes a value, not 2.
  return bias.defined() ? y + bias.to(y.scalar_type()) : y;
}

}  // namespace dtrain

