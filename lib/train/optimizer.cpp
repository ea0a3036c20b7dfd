#include "train/optimizer.hpp"

#include <cmath>
#include <map>

#include <fmt/format.h>
#include <torch/torch.h>

#include "util/error.hpp"
#include "util/shape.hpp"

namespace dtrain {
namespace {

// Named per-parameter slots over flat buffers, shared by both optimizers.
class SlotState {
 public:
  SlotState(FlatParams& params, std::vector<std::string> slots) : params_(params) {
    for (auto& s : slots) buffers_.emplace_back(s, torch::zeros_like(params.data()));
  }
  torch::Tensor& operator[](size_t i) { return buffers_[i].second; }

  NamedTensors save(NamedTensors scalars) const {
    NamedTensors out = std::move(scalars);
    for (const auto& [slot, flat] : buffers_)
      for (size_t i = 0; i < params_.entries().size(); ++i)
        out.emplace_back(params_.entries()[i].name + "." + slot, params_.view(flat, i));
    return out;
  }

  void load(const NamedTensors& state) {
    std::map<std::string, torch::Tensor> by_name(state.begin(), state.end());
    torch::NoGradGuard no_grad;
    for (auto& [slot, flat] : buffers_)
      for (size_t i = 0; i < params_.entries().size(); ++i) {
        const auto name = params_.entries()[i].name + "." + slot;
        auto it = by_name.find(name);
        if (it == by_name.end())
          throw CheckpointError(fmt::format("optimizer state has no '{}'", name));
        auto dst = params_.view(flat, i);
        if (it->second.sizes() != dst.sizes())
          throw CheckpointError(fmt::format("optimizer state '{}' has shape {}, the model {}",
                                            name, shape_str(it->second), shape_str(dst)));
        dst.copy_(it->second);
      }
  }

  static torch::Tensor scalar(const NamedTensors& state, const std::string& name) {
    for (const auto& [n, t] : state)
      if (n == name) return t;
    throw CheckpointError(fmt::format("optimizer state has no '{}'", name));
  }

 private:
  FlatParams& params_;
  NamedTensors buffers_;
};

// torch.optim.SGD: d = g + wd*p; buf = m*buf + d (buf = d on the first step);
// d = nesterov ? d + m*buf : buf; p -= lr*d.
class Sgd : public Optimizer {
 public:
  Sgd(const OptimizerConfig& cfg, FlatParams& params)
      : cfg_(cfg), params_(params), slots_(params, {"momentum_buffer"}) {}

  void step(double lr) override {
    torch::NoGradGuard no_grad;
    auto& p = params_.data();
    torch::Tensor d = params_.grad();
    if (cfg_.weight_decay != 0) d = d.add(p, cfg_.weight_decay);
    if (cfg_.momentum != 0) {
      auto& buf = slots_[0];
      if (steps_ == 0) buf.copy_(d); else buf.mul_(cfg_.momentum).add_(d);
      d = cfg_.nesterov ? d.add(buf, cfg_.momentum) : buf;
    }
    p.add_(d, -lr);
    ++steps_;
  }
  NamedTensors state() const override {
    return slots_.save({{"steps", torch::tensor({steps_}, torch::kInt64)}});
  }
  void load_state(const NamedTensors& state) override {
    steps_ = SlotState::scalar(state, "steps").item<int64_t>();
    slots_.load(state);
  }

 private:
  OptimizerConfig cfg_;
  FlatParams& params_;
  SlotState slots_;
  int64_t steps_ = 0;
};

// torch.optim.AdamW: p *= 1 - lr*wd; m = b1*m + (1-b1)*g; v = b2*v + (1-b2)*g^2;
// p -= lr/(1-b1^t) * m / (sqrt(v)/sqrt(1-b2^t) + eps).
class AdamW : public Optimizer {
 public:
  AdamW(const OptimizerConfig& cfg, FlatParams& params)
      : cfg_(cfg), params_(params), slots_(params, {"exp_avg", "exp_avg_sq"}) {}

  void step(double lr) override {
    torch::NoGradGuard no_grad;
    auto& p = params_.data();
    const auto& g = params_.grad();
    ++steps_;
    if (cfg_.weight_decay != 0) p.mul_(1 - lr * cfg_.weight_decay);
    auto& m = slots_[0];
    auto& v = slots_[1];
    m.mul_(cfg_.beta1).add_(g, 1 - cfg_.beta1);
    v.mul_(cfg_.beta2).addcmul_(g, g, 1 - cfg_.beta2);
    const double bc1 = 1 - std::pow(cfg_.beta1, steps_);
    const double bc2 = 1 - std::pow(cfg_.beta2, steps_);
    auto denom = (v.sqrt() / std::sqrt(bc2)).add_(cfg_.eps);
    p.addcdiv_(m, denom, -lr / bc1);
  }
  NamedTensors state() const override {
    return slots_.save({{"steps", torch::tensor({steps_}, torch::kInt64)}});
  }
  void load_state(const NamedTensors& state) override {
    steps_ = SlotState::scalar(state, "steps").item<int64_t>();
    slots_.load(state);
  }

 private:
  OptimizerConfig cfg_;
  FlatParams& params_;
  SlotState slots_;
  int64_t steps_ = 0;
};

}  // namespace

std::unique_ptr<Optimizer> make_optimizer(const OptimizerConfig& cfg, FlatParams& params) {
  if (cfg.name == "sgd") return std::make_unique<Sgd>(cfg, params);
  if (cfg.name == "adamw") return std::make_unique<AdamW>(cfg, params);
  throw ConfigError(fmt::format("optimizer.name: unknown optimizer '{}'", cfg.name));
}

}  // namespace dtrain
