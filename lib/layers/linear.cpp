#include "layers/linear.hpp"

#include <atomic>
#include <cstring>
#include <optional>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

#include <ATen/autocast_mode.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>

#include "util/error.hpp"

namespace dtrain {
namespace {

// mkldnn::_linear_pointwise(X, W, B?, attr, scalars, algorithm) = X W^T + B: oneDNN's
// matmul on strided CPU tensors, which LibTorch registers where it is built with oneDNN
// (Inductor's CPU kernels call it). Looked up once; none where this LibTorch lacks it.
using PointwiseFn = at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                               c10::string_view, c10::List<std::optional<at::Scalar>>,
                               std::optional<c10::string_view>);
const c10::TypedOperatorHandle<PointwiseFn>* pointwise_op() {
  static const auto handle = []() -> std::optional<c10::TypedOperatorHandle<PointwiseFn>> {
    const auto op = c10::Dispatcher::singleton().findSchema({"mkldnn::_linear_pointwise", ""});
    if (!op) return std::nullopt;
    try {
      return op->typed<PointwiseFn>();
    } catch (const c10::Error&) {  // another signature in this LibTorch
      return std::nullopt;
    }
  }();
  return handle ? &*handle : nullptr;
}

torch::Tensor onednn(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b = {}) {
  return pointwise_op()->call(x, w, b.defined() ? std::optional<at::Tensor>(b) : std::nullopt, "none",
                              c10::List<std::optional<at::Scalar>>(), std::nullopt);
}

// x [..., in], w [out, in]: forward x w^T + b as one [rows, in] product; backward go w
// (the input's gradient) and go^T x (the weight's), oneDNN's too, on transposed views (no
// copies); the bias's the column sums. No bias is an empty tensor (an autograd function's
// inputs are defined).
struct OneDnnLinear : torch::autograd::Function<OneDnnLinear> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x,
                               const torch::Tensor& w, const torch::Tensor& b) {
    ctx->save_for_backward({x, w});
    ctx->saved_data["bias"] = b.numel() > 0;
    return product(x, w, b.numel() > 0 ? b : torch::Tensor());
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto& x = saved[0];
    const auto& w = saved[1];
    // Contiguous: a sum's gradient arrives expanded.
    const auto go = grads[0].reshape({-1, w.size(0)}).contiguous();
    torch::Tensor gx, gw, gb;
    if (ctx->needs_input_grad(0)) gx = at::_unsafe_view(onednn(go, w.t()), x.sizes());
    if (ctx->needs_input_grad(1)) gw = onednn(go.t(), x.reshape({-1, x.size(-1)}).t());
    if (ctx->saved_data["bias"].toBool() && ctx->needs_input_grad(2)) gb = go.sum(0);
    return {gx, gw, gb};
  }
  // The product in x's shape. Not a view of the 2-D result (ATen's _unsafe_view, as its own
  // linear): autograd would see the output as a view, and an in-place op on it (a ReLU)
  // would move its history off the node a hook on it (ZeRO-3's gather) was put on.
  static torch::Tensor product(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b) {
    auto sizes = x.sizes().vec();
    sizes.back() = w.size(0);
    return at::_unsafe_view(onednn(x.reshape({-1, x.size(-1)}), w, b), sizes);
  }
};

std::atomic<bool> g_onednn{false};

// The products oneDNN takes: fp32 on the CPU, outside autocast (whose casts are ATen's).
bool takes(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b) {
  return g_onednn.load(std::memory_order_relaxed) && x.device().is_cpu() && w.device().is_cpu() &&
         x.scalar_type() == torch::kFloat32 && w.scalar_type() == torch::kFloat32 &&
         (!b.defined() || b.scalar_type() == torch::kFloat32) && x.numel() > 0 && x.dim() >= 1 &&
         !at::autocast::is_autocast_enabled(c10::DeviceType::CPU);
}

}  // namespace

torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias) {
  if (!takes(x, weight, bias)) return torch::linear(x, weight, bias);
  const bool graph = torch::GradMode::is_enabled() &&
                     (x.requires_grad() || weight.requires_grad() || (bias.defined() && bias.requires_grad()));
  if (!graph) return OneDnnLinear::product(x, weight, bias);
  static const auto no_bias = torch::empty({0});
  return OneDnnLinear::apply(x, weight, bias.defined() ? bias : no_bias);
}

bool onednn_matmul_available() { return pointwise_op() != nullptr; }

bool amd_cpu() {
#if defined(__x86_64__) || defined(__i386__)
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (!__get_cpuid(0, &eax, &ebx, &ecx, &edx)) return false;
  char vendor[13] = {};
  std::memcpy(vendor, &ebx, 4), std::memcpy(vendor + 4, &edx, 4), std::memcpy(vendor + 8, &ecx, 4);
  return std::strcmp(vendor, "AuthenticAMD") == 0;
#else
  return false;
#endif
}

std::string use_cpu_matmul(const std::string& choice) {
  fail_if<ConfigError>(choice == "onednn" && !onednn_matmul_available(),
                       "train.cpu_matmul: onednn, but this LibTorch has no oneDNN matmul "
                       "(mkldnn::_linear_pointwise); use auto or aten");
  const bool onednn = choice == "onednn" || (choice == "auto" && amd_cpu() && onednn_matmul_available());
  g_onednn.store(onednn);
  return onednn ? "oneDNN" : "ATen's";
}

}  // namespace dtrain
