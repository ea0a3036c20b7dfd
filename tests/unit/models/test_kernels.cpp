// The kernels each part's cost sheet says its forward launches (PartCost::kernels and, under
// 16-bit autocast, its casts: what the plan's host-launch time of a GPU step counts),
// against the operators LibTorch dispatches when the part runs on the CPU: each operator
// with a kernel of its own is one (dropout's mask too: a record function of dtrain's), a
// view none, a composite operator what it calls. The reference is LibTorch's dispatcher,
// not the sheets: a model that changes its forward changes what the test counts.
#include <doctest/doctest.h>

#include <algorithm>
#include <set>
#include <string>
#include <vector>

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/record_function.h>
#include <fmt/format.h>
#include <torch/torch.h>

#include "comm/comm.hpp"
#include "config/config.hpp"
#include "models/dropout.hpp"
#include "models/model.hpp"
#include "models/task.hpp"
#include "precision/autocast.hpp"
#include "models/parts.hpp"

namespace unit_models_kernels {

using namespace dtrain;
using test::Model;
using test::build_part;
using test::random_samples;
using test::SilentComm;

namespace {

// Operators with a kernel of their own that only describe memory anew or allocate (no
// device work).
const std::set<std::string> kViews{
    "aten::view", "aten::_unsafe_view", "aten::_reshape_alias", "aten::t", "aten::transpose",
    "aten::permute", "aten::expand", "aten::as_strided", "aten::slice", "aten::select",
    "aten::unsqueeze", "aten::squeeze", "aten::detach", "aten::alias", "aten::split",
    "aten::split_with_sizes", "aten::unbind", "aten::empty", "aten::empty_like",
    "aten::empty_strided", "aten::resize_", "aten::lift_fresh", "aten::unfold"};

// Whether LibTorch implements `fn`'s operator by other operators (CompositeImplicitAutograd:
// no kernel of its own, e.g. linear, layer_norm).
bool composite(const at::RecordFunction& fn) {
  const auto name = fn.operator_name();
  if (!name) return false;
  const auto op = c10::Dispatcher::singleton().findOp(*name);
  return op && op->hasKernelForDispatchKey(c10::DispatchKey::CompositeImplicitAutograd);
}

// The operators a forward called, as a tree.
struct Call {
  std::string name;
  bool composite = false;
  std::vector<Call> inner;
  double values = 0;  // what its tensor outputs hold
  bool low = false;   // an input or output in 16 bits
};
bool low(const c10::IValue& v) {
  return v.isTensor() && v.toTensor().defined() &&
         (v.toTensor().scalar_type() == torch::kBFloat16 || v.toTensor().scalar_type() == torch::kHalf);
}
thread_local std::vector<Call*>* t_open = nullptr;

// The kernels under `c`, in order: an operator with a kernel of its own is one (what a CPU
// kernel calls inside itself, a GPU kernel does within its one launch), a view none; a
// composite one, a wrapper that calls its own operator again (autocast casting the
// arguments first), or one of autograd's steps in backward, is what it calls.
void kernels_of(const Call& c, std::vector<const Call*>& out) {
  const bool wraps = std::any_of(c.inner.begin(), c.inner.end(),
                                 [&](const Call& i) { return i.name == c.name; });
  if (c.composite || wraps) {
    for (const auto& i : c.inner) kernels_of(i, out);
  } else if (!kViews.count(c.name)) {
    out.push_back(&c);
  }
}

// The operators `run` calls on this thread, as a tree under a composite root.
template <class Run>
Call calls_in(Run run) {
  Call root;
  root.composite = true;
  std::vector<Call*> open{&root};
  t_open = &open;
  auto handle = at::addThreadLocalCallback(
      at::RecordFunctionCallback(
          [](const at::RecordFunction& fn) -> std::unique_ptr<at::ObserverContext> {
            auto& inner = t_open->back()->inner;
            // autograd's steps in backward call the operators that do their work
            const bool step = fn.scope() == at::RecordScope::BACKWARD_FUNCTION ||
                              std::string(fn.name()).rfind("autograd::", 0) == 0;
            inner.push_back(Call{fn.name(), step || composite(fn), {}});
            for (const auto& i : fn.inputs()) inner.back().low |= low(i);
            t_open->push_back(&inner.back());
            return nullptr;
          },
          [](const at::RecordFunction& fn, at::ObserverContext*) {
            for (const auto& o : fn.outputs()) {
              if (o.isTensor() && o.toTensor().defined()) t_open->back()->values += double(o.toTensor().numel());
              t_open->back()->low |= low(o);
            }
            t_open->pop_back();
          })
          .needsIds(false)
          .needsInputs(true)
          .needsOutputs(true)
          .scopes({at::RecordScope::FUNCTION, at::RecordScope::BACKWARD_FUNCTION}));
  run();
  at::removeCallback(handle);
  t_open = nullptr;
  return root;
}

// The kernels `run` dispatches on this thread, by name in order.
template <class Run>
std::vector<std::string> dispatched(Run run) {
  const Call root = calls_in(run);
  std::vector<const Call*> kernels;
  kernels_of(root, kernels);
  std::vector<std::string> out;
  for (const Call* k : kernels) out.push_back(k->name);
  return out;
}

std::string joined(const std::vector<std::string>& v) {
  std::string s;
  for (const auto& x : v) s += x + " ";
  return s;
}

// Small shapes of each model (the CNN with and without batch norm). The kernel counts do
// not depend on the sizes; the values do, and these keep their terms apart (a GPT's s d,
// its heads' a s^2 and s v differ), so that a term counted for another fails.
std::vector<Model> small_models() {
  Model gpt;
  gpt.cfg.arch = "gpt";
  gpt.cfg.layers = 1, gpt.cfg.heads = 2, gpt.cfg.dim = 24, gpt.cfg.vocab = 40, gpt.cfg.seq_len = 8;
  gpt.sample = {8}, gpt.vocab = 40;
  Model mlp;
  mlp.cfg.arch = "mlp";
  mlp.cfg.hidden = {16, 8};
  mlp.sample = {1, 4, 4}, mlp.classes = 4;
  Model cnn;
  cnn.cfg.arch = "cnn";
  cnn.cfg.channels = {4, 8};
  cnn.cfg.fc = {16};
  cnn.sample = {1, 8, 8}, cnn.classes = 4;
  Model cnn_bn = cnn;
  cnn_bn.cfg.batch_norm = true;
  return {gpt, mlp, cnn, cnn_bn};
}

// Each part's kernels in its forward (the last part's with the loss), in `dtype` with
// `dropout`.
std::vector<std::vector<std::string>> part_kernels(Model m, double dropout, const std::string& dtype) {
  m.cfg.dropout = dropout;
  const int64_t parts = model_spec(m.cfg.arch).parts(m.cfg);
  auto [x, batch, task] = random_samples(m, 2);
  auto comm = make_local_comm();
  DropoutScope scope(DropoutDraw{1, 1, torch::arange(2)});
  std::vector<std::vector<std::string>> out;
  for (int64_t part = 0; part < parts; ++part) {
    auto net = build_part(m, part, comm);
    torch::Tensor y;
    auto forward = [&] {
      AutocastGuard autocast(dtype, torch::kCPU);
      y = net->forward(x);
      if (part + 1 == parts) task->loss(y, batch, *comm);
    };
    forward();  // once before: the first builds what later ones reuse (dropout's unit hashes)
    out.push_back(dispatched(forward));
    x = y.detach();
  }
  return out;
}

}  // namespace

TEST_CASE("models: each part's forward launches the kernels its cost sheet counts") {
  for (const auto& m : small_models())
    for (double dropout : {0.0, 0.1})
      for (const std::string dtype : {"fp32", "bf16"}) {
        auto cfg = m.cfg;
        cfg.dropout = dropout;
        const auto costs = model_spec(cfg.arch).costs(cfg, SizeContext{m.sample, m.classes, 1});
        const auto kernels = part_kernels(m, dropout, dtype);
        REQUIRE(kernels.size() == costs.size());
        for (size_t p = 0; p < costs.size(); ++p) {
          const std::string what = fmt::format("{}{} dropout {} {} part {}: {}", cfg.arch,
                                               cfg.batch_norm ? " batch_norm" : "", dropout, dtype,
                                               p, joined(kernels[p]));
          CAPTURE(what);
          CHECK(double(kernels[p].size()) == costs[p].kernels + (dtype == "fp32" ? 0 : costs[p].casts));
        }
      }
}

namespace {

// The values a run's kernels write, by the cost sheet's kinds: products' (their flops are
// counted instead; fused attention's too) aside, those through exp, log or tanh, the casts
// to 16 bits, the rest. dtrain's dropout mask reports no output: it writes as many as the product that
// applies it, next.
PartCost::Values values_of(const Call& root) {
  static const std::set<std::string> products{"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm",
                                              "aten::convolution", "aten::convolution_backward",
                                              "aten::_scaled_dot_product_flash_attention_for_cpu",
                                              "aten::_scaled_dot_product_flash_attention_for_cpu_backward"};
  static const std::set<std::string> transcendental{"aten::gelu", "aten::gelu_backward", "aten::_softmax",
                                                    "aten::_log_softmax", "aten::_log_softmax_backward_data",
                                                    "aten::exp", "aten::log"};
  std::vector<const Call*> kernels;
  kernels_of(root, kernels);
  PartCost::Values v;
  for (size_t i = 0; i < kernels.size(); ++i) {
    const Call& k = *kernels[i];
    const double values = k.name == "dtrain::dropout_mask" && i + 1 < kernels.size() ? kernels[i + 1]->values : k.values;
    if (products.count(k.name)) continue;
    if (transcendental.count(k.name)) v.transcendental += values;
    else if (k.name == "aten::_to_copy" && k.low) v.casts_16 += values;
    else v.plain += values;
  }
  return v;
}

// The kernels under `root` with the values each writes, to read where a count differs.
std::string listed(const Call& root) {
  std::vector<const Call*> kernels;
  kernels_of(root, kernels);
  std::string s;
  for (const Call* k : kernels) s += fmt::format("{}={} ", k->name, k->values);
  return s;
}

// Each part's values in forward (the last part's with the loss) and in backward, per
// sample, on `tensor`'s rank: the difference between batches of 4 and 2 rows, halved (what
// a micro-batch writes once, the causal mask or a weight's gradient, cancels); and the
// kernels of 4 rows.
struct PartValues {
  PartCost::Values forward, backward;
  std::string kernels;
  int64_t all_reduces = 0, all_reduces_back = 0;  // the tensor group's, per micro-batch
};
std::vector<PartValues> part_values(const Model& m, const std::string& dtype, const std::shared_ptr<Comm>& tensor) {
  const int64_t parts = model_spec(m.cfg.arch).parts(m.cfg);
  std::vector<PartValues> out(static_cast<size_t>(parts));
  auto* silent = dynamic_cast<SilentComm*>(tensor.get());  // counts the all-reduces
  for (const int64_t rows : {2, 4}) {
    const double sign = rows == 4 ? 0.5 : -0.5;
    auto [x, batch, task] = random_samples(m, rows);
    DropoutScope scope(DropoutDraw{1, 1, torch::arange(rows)});
    for (int64_t part = 0; part < parts; ++part) {
      auto net = build_part(m, part, tensor);
      // The input's gradient as a model's inner part takes it; the data's none.
      const torch::Tensor in = x.is_floating_point() ? x.detach().requires_grad_(part > 0) : x;
      torch::Tensor y, loss;
      auto forward = [&] {
        AutocastGuard autocast(dtype, torch::kCPU);
        y = net->forward(in);
        loss = part + 1 == parts ? task->loss(y, batch, *tensor) : y.sum();
      };
      forward();  // once before: the first builds what later ones reuse (dropout's unit hashes)
      const int64_t before = silent ? silent->all_reduces : 0;
      const Call forward_calls = calls_in(forward);
      const int64_t between = silent ? silent->all_reduces : 0;
      const Call backward_calls = calls_in([&] { loss.backward(); });
      const auto f = values_of(forward_calls), b = values_of(backward_calls);
      PartValues& here = out[size_t(part)];
      here.kernels = "forward: " + listed(forward_calls) + "\nbackward: " + listed(backward_calls);
      if (silent) {
        here.all_reduces = between - before;
        here.all_reduces_back = silent->all_reduces - between;
      }
      for (auto [into, from] : {std::pair{&here.forward, &f}, std::pair{&here.backward, &b}}) {
        into->plain += sign * from->plain;
        into->transcendental += sign * from->transcendental;
        into->casts_16 += sign * from->casts_16;
      }
      x = y.detach();
    }
  }
  return out;
}

// Checks each part's values on `tensor`'s rank against its cost sheet over `tensor` ranks.
void check_values(const Model& m, const std::string& dtype, const std::shared_ptr<Comm>& tensor) {
  const auto costs = model_spec(m.cfg.arch).costs(m.cfg, SizeContext{m.sample, m.classes, tensor->size()});
  const auto measured = part_values(m, dtype, tensor);
  REQUIRE(measured.size() == costs.size());
  const bool low = dtype != "fp32";
  for (size_t p = 0; p < costs.size(); ++p) {
    CAPTURE(m.cfg.arch);
    CAPTURE(m.cfg.batch_norm);
    CAPTURE(m.cfg.dropout);
    CAPTURE(dtype);
    CAPTURE(tensor->rank());
    CAPTURE(tensor->size());
    CAPTURE(p);
    const auto& [fwd, back, kernels, reductions, reductions_back] = measured[p];
    CAPTURE(kernels);
    CHECK(reductions == costs[p].reductions);  // none at tensor 1
    CHECK(reductions_back == costs[p].reductions_back);
    CHECK(fwd.plain == doctest::Approx(costs[p].values.plain));
    CHECK(fwd.transcendental == doctest::Approx(costs[p].values.transcendental));
    CHECK(fwd.casts_16 == doctest::Approx(low ? costs[p].values.casts_16 : 0));
    CHECK(back.plain == doctest::Approx(costs[p].values_back.plain));
    CHECK(back.transcendental == doctest::Approx(costs[p].values_back.transcendental));
    CHECK(back.casts_16 == doctest::Approx(low ? costs[p].values_back.casts_16 : 0));
  }
}

}  // namespace

TEST_CASE("models: each part's kernels write the elementwise values its cost sheet counts") {
  for (auto m : small_models())
    for (double dropout : {0.0, 0.1})
      for (const std::string dtype : {"fp32", "bf16"}) {
        m.cfg.dropout = dropout;
        check_values(m, dtype, make_local_comm());
      }
}

TEST_CASE("models: each tensor rank's kernels write the values its cost sheet counts") {
  // The models whose layers split (the CNN's do not): a rank's share of the split layers,
  // and what splitting adds (vocab-parallel's masks and its loss's pieces).
  auto models = small_models();
  models.push_back(models[0]);  // the GPT with two heads a rank, laid out by copies
  models.back().cfg.heads = 4;
  models.push_back(models[1]);  // the MLP with a column-parallel layer past the data
  models.back().cfg.hidden = {16, 8, 8};
  for (auto m : models)
    if (m.cfg.arch != "cnn")
      for (double dropout : {0.0, 0.1})
        for (const std::string dtype : {"fp32", "bf16"})
          for (int64_t rank = 0; rank < 2; ++rank) {
            m.cfg.dropout = dropout;
            check_values(m, dtype, std::make_shared<SilentComm>(rank, 2));
          }
}

}  // namespace unit_models_kernels
