#include "optim/optimizer.hpp"

#include <cmath>

#include <fmt/format.h>
#include <torch/torch.h>

#include "util/compat.hpp"
#include "util/error.hpp"

#if DTRAIN_HAS_FUSED_ADAMW
#include <ATen/ops/_fused_adamw.h>
#endif

namespace dtrain {
namespace {

torch::Tensor scalar_named(const NamedTensors& state, const std::string& name) {
  for (const auto& [n, t] : state)
    if (n == name) return t;
  throw CheckpointError(fmt::format("optimizer state has no '{}'", name));
}

// What both optimizers share: the shard's views of the parameters and gradients, the
// weight-decay groups, and named slot buffers.
class FlatOptimizer : public Optimizer {
 public:
  FlatOptimizer(const OptimizerConfig& cfg, FlatParams& params, Shard shard,
                std::vector<std::string> slot_names)
      : cfg_(cfg), params_(params) {
    const int64_t total = params.data().numel();
    shard_ = {shard.offset, shard.numel < 0 ? total - shard.offset : shard.numel};
    // Views of the shard: the buffers never move, so they are taken once.
    p_ = params.data().narrow(0, shard_.offset, shard_.numel);
    g_ = params.grad().narrow(0, shard_.offset, shard_.numel);
    for (auto& s : slot_names) slots_.emplace_back(s, torch::zeros_like(p()));
    // Decay groups as a 0/1 mask over the shard, only when they differ.
    if (cfg.weight_decay != 0) {
      auto mask = torch::zeros({total}, params.data().options());
      bool all = true, none = true;
      for (const auto& e : params.entries()) {
        const bool d = decays(cfg, e.full_shape);
        mask.narrow(0, e.offset, e.numel).fill_(d ? 1.0 : 0.0);
        all = all && d, none = none && !d;
      }
      decay_ = none ? Decay::kNone : all ? Decay::kAll : Decay::kMasked;
      if (decay_ == Decay::kMasked) mask_ = mask.narrow(0, shard_.offset, shard_.numel);
    }
  }
  NamedTensors slots() const override { return slots_; }
  NamedTensors scalars() const override {
    return {{"steps", torch::tensor({steps_}, torch::kInt64)}};
  }
  void load_scalars(const NamedTensors& s) override {
    steps_ = scalar_named(s, "steps").item<int64_t>();
  }

 protected:
  enum class Decay { kNone, kAll, kMasked };
  torch::Tensor& p() { return p_; }
  torch::Tensor& g() { return g_; }
  torch::Tensor& slot(size_t i) { return slots_[i].second; }

  OptimizerConfig cfg_;
  FlatParams& params_;
  Shard shard_;
  torch::Tensor p_, g_;
  NamedTensors slots_;
  Decay decay_ = Decay::kNone;
  torch::Tensor mask_;  // 1 where weight decay applies (kMasked only)
  int64_t steps_ = 0;
};

// torch.optim.SGD: d = g + wd*p; buf = m*buf + d (buf = d on the first step);
// d = nesterov ? d + m*buf : buf; p -= lr*d.
class Sgd : public FlatOptimizer {
 public:
  Sgd(const OptimizerConfig& cfg, FlatParams& params, Shard shard)
      : FlatOptimizer(cfg, params, shard, {"momentum_buffer"}) {}

  void step(double lr) override {
    torch::NoGradGuard no_grad;
    auto& w = p();
    torch::Tensor d = g();
    if (decay_ == Decay::kAll) d = d.add(w, cfg_.weight_decay);
    if (decay_ == Decay::kMasked) d = torch::addcmul(d, w, mask_, cfg_.weight_decay);
    if (cfg_.momentum != 0) {
      auto& buf = slot(0);
      if (steps_ == 0) buf.copy_(d); else buf.mul_(cfg_.momentum).add_(d);
      d = cfg_.nesterov ? d.add(buf, cfg_.momentum) : buf;
    }
    w.add_(d, -lr);
    ++steps_;
  }
};

// torch.optim.AdamW: p *= 1 - lr*wd; m = b1*m + (1-b1)*g; v = b2*v + (1-b2)*g^2;
// p -= lr/(1-b1^t) * m / (sqrt(v)/sqrt(1-b2^t) + eps).
// On CUDA (LibTorch 2.x) the same update runs as LibTorch's fused kernel (torch.optim's
// fused=True): one pass over the parameters, gradients and both moments instead of ~10.
class AdamW : public FlatOptimizer {
 public:
  AdamW(const OptimizerConfig& cfg, FlatParams& params, Shard shard)
      : FlatOptimizer(cfg, params, shard, {"exp_avg", "exp_avg_sq"}) {
#if DTRAIN_HAS_FUSED_ADAMW
    if (p().is_cuda() && shard_.offset == 0 && shard_.numel == params.data().numel())
      group_for_fused();
#endif
  }

  void step(double lr) override {
    torch::NoGradGuard no_grad;
    ++steps_;
    if (!groups_.empty()) return fused_step(lr);
    auto& w = p();
    const auto& grad = g();
    if (decay_ == Decay::kAll) w.mul_(1 - lr * cfg_.weight_decay);
    if (decay_ == Decay::kMasked) w.addcmul_(w, mask_, -lr * cfg_.weight_decay);
    auto& m = slot(0);
    auto& v = slot(1);
    m.mul_(cfg_.beta1).add_(grad, 1 - cfg_.beta1);
    v.mul_(cfg_.beta2).addcmul_(grad, grad, 1 - cfg_.beta2);
    const double bc1 = 1 - std::pow(cfg_.beta1, steps_);
    const double bc2 = 1 - std::pow(cfg_.beta2, steps_);
    auto denom = (v.sqrt() / std::sqrt(bc2)).add_(cfg_.eps);
    w.addcdiv_(m, denom, -lr / bc1);
  }

 private:
  // The fused kernel takes lists of tensors and one weight decay: each entry's slice of
  // the flat buffers, in a group that decays and one that does not.
  struct Group {
    std::vector<torch::Tensor> p, g, m, v, steps;
    double weight_decay;
  };
  void group_for_fused() {
    step_ = torch::zeros({}, p().options());
    Group decayed{{}, {}, {}, {}, {}, cfg_.weight_decay}, plain{{}, {}, {}, {}, {}, 0.0};
    for (const auto& e : params_.entries()) {
      auto& grp = decays(cfg_, e.full_shape) ? decayed : plain;
      auto part = [&](const torch::Tensor& flat) { return flat.narrow(0, e.offset, e.numel); };
      grp.p.push_back(part(p())), grp.g.push_back(part(g()));
      grp.m.push_back(part(slot(0))), grp.v.push_back(part(slot(1)));
      grp.steps.push_back(step_);
    }
    for (auto* grp : {&decayed, &plain})
      if (!grp->p.empty()) groups_.push_back(std::move(*grp));
  }
  void fused_step(double lr) {
#if DTRAIN_HAS_FUSED_ADAMW
    step_.fill_(double(steps_));
    for (auto& grp : groups_)
      at::_fused_adamw_(grp.p, grp.g, grp.m, grp.v, /*max_exp_avg_sqs=*/at::TensorList(), grp.steps,
                        lr, cfg_.beta1, cfg_.beta2, grp.weight_decay, cfg_.eps,
                        /*amsgrad=*/false, /*maximize=*/false);
#else
    (void)lr;
#endif
  }

  std::vector<Group> groups_;  // empty: the unfused update
  torch::Tensor step_;         // the step count the kernel reads (a float on the device)
};

}  // namespace

NamedTensors optimizer_state(const Optimizer& opt, const FlatParams& params, Comm& tensor) {
  NamedTensors out = opt.scalars();
  for (const auto& [slot, flat] : opt.slots())
    for (auto& named : params.gather_full(flat, "." + slot, tensor)) out.push_back(std::move(named));
  return out;
}

void load_optimizer_state(Optimizer& opt, const FlatParams& params, const NamedTensors& state,
                          int64_t tensor_rank, const std::string& origin) {
  const SavedTensors saved(state, origin);
  for (auto& [slot, flat] : opt.slots()) params.scatter_full(flat, "." + slot, saved, tensor_rank);
  opt.load_scalars(state);
}

bool decays(const OptimizerConfig& cfg, const std::vector<int64_t>& full_shape) {
  return cfg.decay_1d || full_shape.size() >= 2;
}

std::unique_ptr<Optimizer> make_optimizer(const OptimizerConfig& cfg, FlatParams& params,
                                          Shard shard) {
  if (cfg.name == "sgd") return std::make_unique<Sgd>(cfg, params, shard);
  if (cfg.name == "adamw") return std::make_unique<AdamW>(cfg, params, shard);
  throw ConfigError(fmt::format("optimizer.name: unknown optimizer '{}'", cfg.name));
}

}  // namespace dtrain
