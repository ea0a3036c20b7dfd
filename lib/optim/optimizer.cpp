#include "optim/optimizer.hpp"

#include <algorithm>
#include <cmath>
#include <utility>

#include <fmt/format.h>
#include <torch/torch.h>

#include <ATen/ops/_fused_adamw.h>
#include <ATen/ops/_fused_sgd.h>

#include "comm/comm.hpp"
#include "util/error.hpp"

namespace dtrain {
namespace {

torch::Tensor scalar_named(const NamedTensors& state, const std::string& name) {
  for (const auto& [n, t] : state)
    if (n == name) return t;
  throw CheckpointError(fmt::format("optimizer state has no '{}'", name));
}


// What both optimizers share: the shard's views of the parameters and gradients, the
// weight-decay groups, named slot buffers, and the lists the fused kernels take.
class FlatOptimizer : public Optimizer {
 public:
  FlatOptimizer(const OptimizerConfig& cfg, FlatParams& params, Shard shard,
                std::vector<std::string> slot_names)
      : cfg_(cfg), params_(params) {
    const int64_t total = params.numel();
    shard_ = {shard.offset, shard.numel < 0 ? total - shard.offset : shard.numel};
    // Views of the shard: the buffers never move, so they are taken once.
    p_ = params.data_of(shard_);
    g_ = params.grad_of(shard_);
    for (auto& s : slot_names) slots_.emplace_back(s, torch::zeros_like(p()));
    if (has_fused_kernel(p_.device())) {
      group_for_fused();  // none when the shard holds nothing: then the (empty) unfused update
      return;             // the groups carry the decay
    }
    // The decay group as runs of the shard (no more: under ZeRO the rest is another
    // rank's), neighbours merged: a mask would take a buffer the size of the shard.
    if (cfg.weight_decay == 0) return;
    const int64_t lo = shard_.offset, hi = shard_.offset + shard_.numel;
    for (const auto& e : params.entries()) {
      const int64_t from = std::max(lo, e.offset), to = std::min(hi, e.offset + e.numel);
      if (from >= to || !decays(cfg, e.full_shape)) continue;
      if (!decayed_.empty() && decayed_.back().second == from - lo)
        decayed_.back().second = to - lo;
      else
        decayed_.emplace_back(from - lo, to - lo);
    }
  }
  bool fused() const override { return !groups_.empty(); }
  Shard shard() const override { return shard_; }
  NamedTensors slots() const override { return slots_; }
  NamedTensors scalars() const override {
    // The fused step counts on the device (a skipped step does not count): read it here.
    const int64_t steps = fused() ? int64_t(fused_steps_.item<double>()) : steps_;
    return {{"steps", torch::tensor({steps}, torch::kInt64)}};
  }
  void load_scalars(const NamedTensors& s) override {
    steps_ = scalar_named(s, "steps").item<int64_t>();
    if (fused()) fused_steps_.fill_(double(steps_));
  }

 protected:
  // The unfused update, a piece of the shard at a time (update_piece): elementwise ops, so
  // the pieces compute what the whole would. `update(at, n, part, scratch)`: `part` cuts
  // the piece out of a shard-sized buffer; `scratch` is n values for a temporary, one
  // buffer kept for every step (fresh temporaries of a few MiB each step leave glibc's heap
  // holding more than they take).
  template <typename F>
  void by_piece(F&& update) {
    if (!scratch_.defined())
      scratch_ = torch::empty({std::min(update_piece(shard_.numel), shard_.numel)}, p_.options());
    for_each_piece(shard_.numel, [&](int64_t at, int64_t n) {
      update(at, n, [at, n](const torch::Tensor& t) { return t.narrow(0, at, n); }, scratch_.narrow(0, 0, n));
    });
  }
  // `apply` on each part of [at, at + n) where weight decay applies, as offsets in it.
  template <typename F>
  void decayed_in(int64_t at, int64_t n, F&& apply) const {
    for (const auto& [from, to] : decayed_) {
      const int64_t a = std::max(from, at), b = std::min(to, at + n);
      if (a < b) apply(a - at, b - a);
    }
  }
  torch::Tensor& p() { return p_; }
  torch::Tensor& g() { return g_; }
  torch::Tensor& slot(size_t i) { return slots_[i].second; }
  // The unfused update reads `skip` on the host (on the CPU that costs nothing).
  static bool skipped(const torch::Tensor& skip) {
    return skip.defined() && skip.item<float>() != 0;
  }

  // The fused kernels take lists of tensors and one weight decay: each entry's part of the
  // shard, in a group that decays and one that does not.
  struct Group {
    std::vector<torch::Tensor> p, g;
    std::vector<std::vector<torch::Tensor>> slots;  // per slot, the same parts
    std::vector<torch::Tensor> steps;               // AdamW: the count, once per part
    double weight_decay;
  };
  // The fused step count: one more, unless `skip` is 1 (on the device, unread).
  void count_fused(const torch::Tensor& skip) {
    fused_steps_.add_(1);
    if (skip.defined()) fused_steps_.sub_(skip);
  }

  OptimizerConfig cfg_;
  FlatParams& params_;
  Shard shard_;
  torch::Tensor p_, g_;
  NamedTensors slots_;
  std::vector<std::pair<int64_t, int64_t>> decayed_;  // [from, to) in the shard (unfused)
  torch::Tensor scratch_;                              // a piece's temporary (unfused)
  int64_t steps_ = 0;  // updates made (unfused)
  std::vector<Group> groups_;  // empty: the unfused update
  torch::Tensor fused_steps_;  // updates made (fused): a float (exact to 2^24) on the device

 private:
  // Each group's parts are runs of the shard, neighbours of a group merged: without weight
  // decay one run, the whole shard. On a CPU the kernel parallelises each part on its own,
  // so a part per parameter cost an OpenMP region each (the MLP's update 0.33 ms in six
  // parts against 0.08 ms in one, on 2 cores).
  void group_for_fused() {
    fused_steps_ = torch::zeros({}, p().options());
    std::vector<std::pair<int64_t, int64_t>> runs[2];  // [from, to) in the shard: plain, decayed
    const int64_t lo = shard_.offset, hi = shard_.offset + shard_.numel;
    for (const auto& e : params_.entries()) {
      const int64_t from = std::max(lo, e.offset), to = std::min(hi, e.offset + e.numel);
      if (from >= to) continue;  // not in this shard
      auto& mine = runs[cfg_.weight_decay != 0 && decays(cfg_, e.full_shape)];
      if (!mine.empty() && mine.back().second == from - lo)
        mine.back().second = to - lo;
      else
        mine.emplace_back(from - lo, to - lo);
    }
    for (int decayed : {1, 0}) {
      if (runs[decayed].empty()) continue;
      Group grp{{}, {}, std::vector<std::vector<torch::Tensor>>(slots_.size()), {},
                decayed ? cfg_.weight_decay : 0.0};
      for (const auto& [from, to] : runs[decayed]) {
        auto part = [&](const torch::Tensor& t) { return t.narrow(0, from, to - from); };
        grp.p.push_back(part(p())), grp.g.push_back(part(g()));
        for (size_t i = 0; i < slots_.size(); ++i) grp.slots[i].push_back(part(slot(i)));
        grp.steps.push_back(fused_steps_);
      }
      groups_.push_back(std::move(grp));
    }
  }
};

// torch.optim.SGD: d = g + wd*p; buf = m*buf + d (buf = d on the first step);
// d = nesterov ? d + m*buf : buf; p -= lr*d.
class Sgd : public FlatOptimizer {
 public:
  Sgd(const OptimizerConfig& cfg, FlatParams& params, Shard shard)
      : FlatOptimizer(cfg, params, shard, slot_names(cfg)) {}

  void step(double lr, const torch::Tensor& skip) override {
    torch::NoGradGuard no_grad;
    if (fused()) return fused_step(lr, skip);
    if (skipped(skip)) return;
    by_piece([&](int64_t at, int64_t n, auto part, torch::Tensor scratch) {
      auto w = part(p());
      torch::Tensor d = part(g());  // the gradient itself stays as backward left it
      bool copied = false;
      auto own = [&] { if (!std::exchange(copied, true)) d = scratch.copy_(d); };
      decayed_in(at, n, [&](int64_t from, int64_t len) {
        own();
        d.narrow(0, from, len).add_(w.narrow(0, from, len), cfg_.weight_decay);
      });
      if (cfg_.momentum != 0) {
        auto buf = part(slot(0));
        if (steps_ == 0) buf.copy_(d); else buf.mul_(cfg_.momentum).add_(d);
        if (cfg_.nesterov) own(), d.add_(buf, cfg_.momentum); else d = buf;
      }
      w.add_(d, -lr);
    });
    ++steps_;
  }

 private:
  // The buffer starts at zero, so m*buf + d is d on the first step: the kernel's
  // is_first_step copy is not needed, and the first step may be a skipped one.
  void fused_step(double lr, const torch::Tensor& skip) {
    count_fused(skip);
    for (auto& grp : groups_) {
      const auto& buf = cfg_.momentum != 0 ? grp.slots[0] : std::vector<torch::Tensor>{};
      if (skip.defined())
        at::_fused_sgd_(grp.p, grp.g, buf, grp.weight_decay, cfg_.momentum, lr, /*dampening=*/0,
                        cfg_.nesterov, /*maximize=*/false, /*is_first_step=*/false,
                        /*grad_scale=*/{}, /*found_inf=*/skip);
      else
        at::_fused_sgd_(grp.p, grp.g, buf, grp.weight_decay, cfg_.momentum, lr, 0, cfg_.nesterov,
                        false, false);
    }
  }
};

// torch.optim.AdamW: p *= 1 - lr*wd; m = b1*m + (1-b1)*g; v = b2*v + (1-b2)*g^2;
// p -= lr/(1-b1^t) * m / (sqrt(v)/sqrt(1-b2^t) + eps).
// The same update runs as LibTorch's fused kernel where has_fused_kernel says so
// (torch.optim's fused=True): one pass over the parameters, gradients and both moments
// instead of ~10.
class AdamW : public FlatOptimizer {
 public:
  AdamW(const OptimizerConfig& cfg, FlatParams& params, Shard shard)
      : FlatOptimizer(cfg, params, shard, slot_names(cfg)) {}

  void step(double lr, const torch::Tensor& skip) override {
    torch::NoGradGuard no_grad;
    if (fused()) return fused_step(lr, skip);
    if (skipped(skip)) return;
    ++steps_;
    const double bc1 = 1 - std::pow(cfg_.beta1, steps_);
    const double bc2 = 1 - std::pow(cfg_.beta2, steps_);
    by_piece([&](int64_t at, int64_t n, auto part, torch::Tensor denom) {
      auto w = part(p()), grad = part(g()), m = part(slot(0)), v = part(slot(1));
      decayed_in(at, n, [&](int64_t from, int64_t len) {
        w.narrow(0, from, len).mul_(1 - lr * cfg_.weight_decay);
      });
      m.mul_(cfg_.beta1).add_(grad, 1 - cfg_.beta1);
      v.mul_(cfg_.beta2).addcmul_(grad, grad, 1 - cfg_.beta2);
      torch::sqrt_out(denom, v).div_(std::sqrt(bc2)).add_(cfg_.eps);
      w.addcdiv_(m, denom, -lr / bc1);
    });
  }

 private:
  void fused_step(double lr, const torch::Tensor& skip) {
    count_fused(skip);  // the kernel reads the count the step makes
    for (auto& grp : groups_) {
      if (skip.defined())
        at::_fused_adamw_(grp.p, grp.g, grp.slots[0], grp.slots[1], /*max_exp_avg_sqs=*/{},
                          grp.steps, lr, cfg_.beta1, cfg_.beta2, grp.weight_decay, cfg_.eps,
                          /*amsgrad=*/false, /*maximize=*/false, /*grad_scale=*/{},
                          /*found_inf=*/skip);
      else
        at::_fused_adamw_(grp.p, grp.g, grp.slots[0], grp.slots[1], {}, grp.steps, lr,
                          cfg_.beta1, cfg_.beta2, grp.weight_decay, cfg_.eps, false, false);
    }
  }
};

}  // namespace

std::vector<std::string> slot_names(const OptimizerConfig& cfg) {
  if (cfg.name == "adamw") return {"exp_avg", "exp_avg_sq"};
  // Without momentum there is no buffer (torch.optim.SGD keeps none either).
  if (cfg.momentum != 0) return {"momentum_buffer"};
  return {};
}

bool has_fused_kernel(const c10::Device& device) {
  return device.is_cuda() || device.is_cpu();  // SGD's and AdamW's, on both, since 2.4
}

bool keeps_shard(const Optimizer& opt, const FlatParams& params) {
  return opt.shard().numel != params.numel();
}

NamedTensors optimizer_state(const Optimizer& opt, const FlatParams& params, int64_t tensor_rank,
                             PartsOf& parts, RangesOf& ranges) {
  NamedTensors out = opt.scalars();
  const bool shard = keeps_shard(opt, params);
  for (const auto& [slot, part] : opt.slots()) {
    auto named = shard ? params.owned_range(part, opt.shard(), "." + slot, tensor_rank, parts, ranges)
                       : params.owned(part, "." + slot, tensor_rank, parts);
    for (auto& n : named) out.push_back(std::move(n));
  }
  return out;
}

void load_optimizer_state(Optimizer& opt, const FlatParams& params, const SavedTensors& saved,
                          int64_t tensor_rank) {
  for (auto& [slot, part] : opt.slots()) {
    if (keeps_shard(opt, params))
      params.scatter_range(part, opt.shard(), "." + slot, saved, tensor_rank);
    else
      params.scatter_full(part, "." + slot, saved, tensor_rank);
  }
  NamedTensors scalars;  // the ones this optimizer keeps, at the shapes it keeps them
  for (const auto& [name, t] : opt.scalars()) scalars.emplace_back(name, saved.at(name, t.sizes().vec()));
  opt.load_scalars(scalars);
}

void load_optimizer_state(Optimizer& opt, const FlatParams& params, const NamedTensors& state,
                          int64_t tensor_rank, const std::string& origin) {
  load_optimizer_state(opt, params, SavedTensors(state, origin), tensor_rank);
}

int64_t optimizer_state_bytes(const Optimizer& opt) {
  int64_t bytes = 0;
  for (const auto& [name, t] : opt.slots()) bytes += t.numel() * t.element_size();
  return bytes;
}

int64_t update_piece(int64_t numel) {
  constexpr int64_t kUnit = int64_t(1) << 20, kMost = 64;
  const int64_t units = (numel + kUnit * kMost - 1) / (kUnit * kMost);
  return std::max<int64_t>(1, std::min(numel, units * kUnit));
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
