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
};
thread_local std::vector<Call*>* t_open = nullptr;

// The kernels under `c`, in order: an operator with a kernel of its own is one (what a CPU
// kernel calls inside itself, a GPU kernel does within its one launch), a view none; a
// composite one, or a wrapper that calls its own operator again (autocast casting the
// arguments first), is what it calls.
void kernels_of(const Call& c, std::vector<std::string>& out) {
  const bool wraps = std::any_of(c.inner.begin(), c.inner.end(),
                                 [&](const Call& i) { return i.name == c.name; });
  if (c.composite || wraps) {
    for (const auto& i : c.inner) kernels_of(i, out);
  } else if (!kViews.count(c.name)) {
    out.push_back(c.name);
  }
}

// The kernels `run` dispatches on this thread, by name in order.
template <class Run>
std::vector<std::string> dispatched(Run run) {
  Call root;
  root.composite = true;
  std::vector<Call*> open{&root};
  t_open = &open;
  auto handle = at::addThreadLocalCallback(
      at::RecordFunctionCallback(
          [](const at::RecordFunction& fn) -> std::unique_ptr<at::ObserverContext> {
            auto& inner = t_open->back()->inner;
            inner.push_back(Call{fn.name(), composite(fn), {}});
            t_open->push_back(&inner.back());
            return nullptr;
          },
          [](const at::RecordFunction&, at::ObserverContext*) { t_open->pop_back(); })
          .needsIds(false)
          .scopes({at::RecordScope::FUNCTION}));
  run();
  at::removeCallback(handle);
  t_open = nullptr;
  std::vector<std::string> out;
  kernels_of(root, out);
  return out;
}

std::string joined(const std::vector<std::string>& v) {
  std::string s;
  for (const auto& x : v) s += x + " ";
  return s;
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
  // Small shapes of each model and its options; the counts do not depend on the sizes.
  Model gpt;
  gpt.cfg.arch = "gpt";
  gpt.cfg.layers = 2, gpt.cfg.heads = 2, gpt.cfg.dim = 16, gpt.cfg.vocab = 32, gpt.cfg.seq_len = 8;
  gpt.sample = {8}, gpt.vocab = 32;
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
  for (const auto& m : {gpt, mlp, cnn, cnn_bn})
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

}  // namespace unit_models_kernels
