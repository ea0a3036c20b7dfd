#include "layers/sync_batchnorm.hpp"

namespace dtrain {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Sums over every dimension but the channel one, for [N, C, ...] inputs.
std::vector<int64_t> reduce_dims(const torch::Tensor& x) {
  std::vector<int64_t> dims{0};
  for (int64_t d = 2; d < x.dim(); ++d) dims.push_back(d);
  return dims;
}

torch::Tensor per_channel(const torch::Tensor& v, const torch::Tensor& x) {
  std::vector<int64_t> shape(size_t(x.dim()), 1);
  shape[1] = v.size(0);
  return v.view(shape);
}

struct SyncBNFunction : public torch::autograd::Function<SyncBNFunction> {
  // Returns the normalised output; also reports the global mean and biased variance and the
  // global element count per channel through `stats` for the running statistics.
  static torch::Tensor forward(AutogradContext* ctx, torch::Tensor x, torch::Tensor weight,
                               torch::Tensor bias, double eps, Comm* comm, torch::Tensor stats) {
    const auto dims = reduce_dims(x);
    const int64_t channels = x.size(1);
    const double local_count = double(x.numel() / channels);
    auto packed = torch::cat({x.sum(dims), (x * x).sum(dims),
                              torch::full({1}, local_count, x.options())});
    comm->all_reduce(packed);
    const double count = packed[2 * channels].item<double>();
    auto mean = packed.narrow(0, 0, channels) / count;
    auto var = (packed.narrow(0, channels, channels) / count - mean * mean).clamp_min(0);
    auto invstd = (var + eps).rsqrt();
    auto xhat = (x - per_channel(mean, x)) * per_channel(invstd, x);
    stats.copy_(torch::cat({mean, var, torch::full({1}, count, x.options())}));
    ctx->save_for_backward({xhat, weight, invstd});
    ctx->saved_data["comm"] = comm_handle(comm);
    ctx->saved_data["count"] = count;
    return xhat * per_channel(weight, x) + per_channel(bias, x);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    auto xhat = saved[0], weight = saved[1], invstd = saved[2];
    auto* comm = comm_from_handle(ctx->saved_data["comm"].toInt());
    const double count = ctx->saved_data["count"].toDouble();
    auto dy = grads[0].contiguous();
    const auto dims = reduce_dims(dy);
    const int64_t channels = dy.size(1);
    // Local sums give the parameter gradients (averaged later with all the others);
    // their global totals give the input gradient.
    auto sum_dy = dy.sum(dims);
    auto sum_dy_xhat = (dy * xhat).sum(dims);
    auto packed = torch::cat({sum_dy, sum_dy_xhat});
    comm->all_reduce(packed);
    auto mean_dy = packed.narrow(0, 0, channels) / count;
    auto mean_dy_xhat = packed.narrow(0, channels, channels) / count;
    auto dx = (dy - per_channel(mean_dy, dy) - xhat * per_channel(mean_dy_xhat, dy)) *
              per_channel(invstd * weight, dy);
    return {dx, sum_dy_xhat, sum_dy, torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace

SyncBatchNorm2dImpl::SyncBatchNorm2dImpl(int64_t channels, std::shared_ptr<Comm> comm,
                                         torch::TensorOptions options, double eps, double momentum)
    : channels_(channels), comm_(std::move(comm)), options_(options), eps_(eps), momentum_(momentum) {
  reset();
}

void SyncBatchNorm2dImpl::reset() {
  weight = register_parameter("weight", torch::ones({channels_}, options_));
  bias = register_parameter("bias", torch::zeros({channels_}, options_));
  running_mean = register_buffer("running_mean", torch::zeros({channels_}, options_));
  running_var = register_buffer("running_var", torch::ones({channels_}, options_));
  num_batches_tracked =
      register_buffer("num_batches_tracked", torch::zeros({}, options_.dtype(torch::kInt64)));
}

torch::Tensor SyncBatchNorm2dImpl::forward(const torch::Tensor& x) {
  if (!is_training())
    return torch::batch_norm(x, weight, bias, running_mean, running_var, /*training=*/false,
                             momentum_, eps_, /*cudnn_enabled=*/false);
  // The statistics in fp32 whatever autocast made of the input: in fp16 a count of 100k
  // elements or a sum of squares overflows, and bf16 rounds the count.
  auto xf = x.to(torch::kFloat);
  auto stats = torch::empty({2 * channels_ + 1}, xf.options().requires_grad(false));
  auto y = SyncBNFunction::apply(xf, weight, bias, eps_, comm_.get(), stats);
  torch::NoGradGuard no_grad;
  const double count = stats[2 * channels_].item<double>();
  auto unbiased = stats.narrow(0, channels_, channels_) * (count / std::max(1.0, count - 1));
  running_mean.mul_(1 - momentum_).add_(stats.narrow(0, 0, channels_), momentum_);
  running_var.mul_(1 - momentum_).add_(unbiased, momentum_);
  num_batches_tracked.add_(1);
  return y;
}

}  // namespace dtrain
