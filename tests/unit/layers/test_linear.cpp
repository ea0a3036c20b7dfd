// The dense layers' product (layers/linear.hpp): oneDNN's forward and backward against the
// same product in fp64 (ATen's), ATen's unchanged, and the choice train.cpu_matmul makes.
#include <doctest/doctest.h>

#include <string>
#include <vector>

#include <torch/torch.h>

#include "layers/linear.hpp"
#include "util/compat.hpp"
#include "util/error.hpp"

namespace unit_layers_linear {

using namespace dtrain;

namespace {

// Restores ATen's product when a case ends: the choice is the process's.
struct Choice {
  explicit Choice(const std::string& kernel) { taken = use_cpu_matmul(kernel); }
  ~Choice() { use_cpu_matmul("aten"); }
  std::string taken;
};

struct Grads {
  torch::Tensor y, x, w, b;
};

// y = linear(x, w, b) and the gradients of sum(y * probe), by `product`, in x's dtype.
template <class F>
Grads run(F product, const torch::Tensor& x0, const torch::Tensor& w0, const torch::Tensor& b0,
          const torch::Tensor& probe, bool input_grad) {
  auto x = x0.clone().requires_grad_(input_grad);
  auto w = w0.clone().requires_grad_(true);
  auto b = b0.defined() ? b0.clone().requires_grad_(true) : torch::Tensor();
  auto y = product(x, w, b);
  (y * probe.to(y.scalar_type())).sum().backward();
  return {y.detach(), input_grad ? x.grad() : torch::Tensor(), w.grad(), b.defined() ? b.grad() : torch::Tensor()};
}

void check_close(const torch::Tensor& got, const torch::Tensor& want, const char* what) {
  INFO(what);
  REQUIRE(got.defined() == want.defined());
  if (!got.defined()) return;
  CHECK((got.scalar_type() == torch::kFloat32));
  CHECK(got.sizes().vec() == want.sizes().vec());
  const double scale = want.abs().max().item<double>() + 1e-30;
  CHECK((got.to(torch::kFloat64) - want).abs().max().item<double>() / scale < 1e-5);
}

}  // namespace

TEST_CASE("linear: oneDNN's forward and gradients equal the fp64 product, any rank of input") {
  if (!onednn_matmul_available()) {
    // The pinned LibTorch (2.15) has it; a distribution's may be built without oneDNN.
    CHECK(TORCH_VERSION_MAJOR * 100 + TORCH_VERSION_MINOR < 215);
    return;
  }
  Choice onednn("onednn");
  CHECK(onednn.taken == "oneDNN");
  torch::manual_seed(3);
  struct Case {
    std::vector<int64_t> x;
    int64_t out;
    bool bias, input_grad;
  };
  for (const Case& c : {Case{{64, 784}, 512, true, false}, Case{{5, 7, 33}, 17, true, true},
                        Case{{3, 1, 8}, 256, false, true}, Case{{1, 9}, 1, true, true}}) {
    CAPTURE(c.out);
    const int64_t in = c.x.back();
    const auto x = torch::randn(c.x), w = torch::randn({c.out, in}) / std::sqrt(double(in));
    const auto b = c.bias ? torch::randn({c.out}) : torch::Tensor();
    auto out_shape = c.x;
    out_shape.back() = c.out;
    const auto probe = torch::randn(out_shape);
    const auto got = run([](auto& x, auto& w, auto& b) { return dtrain::linear(x, w, b); }, x, w, b, probe,
                         c.input_grad);
    const auto want = run([](auto& x, auto& w, auto& b) { return torch::linear(x, w, b); },
                          x.to(torch::kFloat64), w.to(torch::kFloat64),
                          b.defined() ? b.to(torch::kFloat64) : b, probe, c.input_grad);
    check_close(got.y, want.y, "output");
    check_close(got.x, want.x, "input's gradient");
    check_close(got.w, want.w, "weight's gradient");
    check_close(got.b, want.b, "bias's gradient");
  }
}

TEST_CASE("linear: a hook on the output fires in backward though an in-place op followed") {
  // ZeRO-3 gathers a unit's weights again from a hook on its output; the MLP's ReLU runs
  // in place on the linear's output. A view's hook is lost there (its history moves).
  // ATen's own linear returns a view for a 3-D input on LibTorch 2.6 (not on 2.15): its
  // 2-D case is checked, oneDNN's every one.
  for (const std::string kernel : {"aten", "onednn"}) {
    if (kernel == "onednn" && !onednn_matmul_available()) continue;
    CAPTURE(kernel);
    Choice choice(kernel);
    for (const auto& shape : {std::vector<int64_t>{4, 6}, std::vector<int64_t>{2, 3, 6}}) {
      if (kernel == "aten" && shape.size() > 2) continue;
      auto w = torch::randn({5, 6}).requires_grad_(true);
      auto y = dtrain::linear(torch::randn(shape), w, torch::randn({5}));
      int fired = 0;
      y.register_hook([&](const torch::Tensor&) { ++fired; });
      torch::relu_(y);
      y.sum().backward();
      CHECK(fired == 1);
      CHECK(w.grad().defined());
    }
  }
}

TEST_CASE("linear: ATen's product is torch::linear's, bit for bit; autocast and fp64 stay ATen's") {
  torch::manual_seed(4);
  const auto x = torch::randn({6, 40}), w = torch::randn({24, 40}), b = torch::randn({24});
  const auto want = torch::linear(x, w, b);
  {
    Choice aten("aten");
    CHECK(aten.taken == "ATen's");
    CHECK(torch::equal(dtrain::linear(x, w, b), want));
  }
  if (!onednn_matmul_available()) return;
  Choice onednn("onednn");
  // fp64 is ATen's whatever the choice.
  const auto xd = x.to(torch::kFloat64), wd = w.to(torch::kFloat64), bd = b.to(torch::kFloat64);
  CHECK(torch::equal(dtrain::linear(xd, wd, bd), torch::linear(xd, wd, bd)));
  // Under autocast the product is ATen's, in bf16, as before.
  compat::set_autocast(c10::DeviceType::CPU, true, torch::kBFloat16);
  const auto cast = dtrain::linear(x, w, b);
  const auto cast_want = torch::linear(x, w, b);
  compat::set_autocast(c10::DeviceType::CPU, false, torch::kBFloat16);
  CHECK((cast.scalar_type() == torch::kBFloat16));
  CHECK(torch::equal(cast, cast_want));
}

TEST_CASE("linear: train.cpu_matmul auto takes oneDNN on AMD CPUs only; onednn without it is refused") {
  {
    Choice automatic("auto");
    CHECK(automatic.taken == (amd_cpu() && onednn_matmul_available() ? "oneDNN" : "ATen's"));
  }
  if (!onednn_matmul_available()) CHECK_THROWS_AS(use_cpu_matmul("onednn"), ConfigError);
}

}  // namespace unit_layers_linear
