#include "models/recompute.hpp"

#include <optional>

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include "models/dropout.hpp"
#include "util/compat.hpp"

namespace dtrain::detail {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The generators a forward on `device` draws from: the CPU's, and the GPU's on a GPU.
std::vector<at::Generator> generators(const c10::Device& device) {
  std::vector<at::Generator> gens{at::detail::getDefaultCPUGenerator()};
  if (device.is_cuda()) gens.push_back(at::globalContext().defaultGenerator(device));
  return gens;
}

std::vector<torch::Tensor> states(const std::vector<at::Generator>& gens) {
  std::vector<torch::Tensor> out;
  for (const auto& g : gens) out.push_back(g.get_state());
  return out;
}

void set_states(std::vector<at::Generator>& gens, const std::vector<torch::Tensor>& s) {
  for (size_t i = 0; i < gens.size(); ++i) {
    std::lock_guard<std::mutex> lock(gens[i].mutex());
    gens[i].set_state(s[i]);
  }
}

struct Recompute : torch::autograd::Function<Recompute> {
  static torch::Tensor forward(AutogradContext* ctx, torch::Tensor x, int64_t run, int64_t module) {
    const auto type = x.device().type();
    ctx->saved_data["run"] = run;
    ctx->saved_data["module"] = module;
    ctx->saved_data["autocast"] = at::autocast::is_autocast_enabled(type);
    ctx->saved_data["autocast_dtype"] = int64_t(at::autocast::get_autocast_dtype(type));
    ctx->saved_data["rng"] = states(generators(x.device()));
    const DropoutDraw* d = current_dropout_draw();
    if (d && d->positions.defined()) {  // what the masks hash, for the rerun
      ctx->saved_data["dropout_seed"] = int64_t(d->seed);
      ctx->saved_data["dropout_step"] = d->step;
      ctx->saved_data["dropout_positions"] = d->positions;
    }
    ctx->save_for_backward({x});
    // Function::apply runs this without recording a graph: the module's activations are
    // freed as it goes.
    return reinterpret_cast<RunFn>(run)(reinterpret_cast<void*>(module), x);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto x = ctx->get_saved_variables()[0].detach().requires_grad_(true);
    const auto type = x.device().type();
    auto gens = generators(x.device());
    const auto now = states(gens);  // the draws made since go on from here afterwards
    set_states(gens, ctx->saved_data["rng"].toTensorVector());
    const bool autocast = ctx->saved_data["autocast"].toBool();
    const bool was = at::autocast::is_autocast_enabled(type);
    const auto was_dtype = at::autocast::get_autocast_dtype(type);
    compat::set_autocast(type, autocast, static_cast<c10::ScalarType>(ctx->saved_data["autocast_dtype"].toInt()));
    torch::Tensor y;
    {
      torch::AutoGradMode grad(true);
      std::optional<DropoutScope> draw;  // backward may run on another thread (a GPU's)
      if (ctx->saved_data.count("dropout_step"))
        draw.emplace(DropoutDraw{uint64_t(ctx->saved_data["dropout_seed"].toInt()),
                                 ctx->saved_data["dropout_step"].toInt(),
                                 ctx->saved_data["dropout_positions"].toTensor()});
      y = reinterpret_cast<RunFn>(ctx->saved_data["run"].toInt())(
          reinterpret_cast<void*>(ctx->saved_data["module"].toInt()), x);
    }
    compat::set_autocast(type, was, was_dtype);
    if (autocast) at::autocast::clear_cache();
    set_states(gens, now);
    // The parameters' gradients accumulate here, as in a plain backward (their hooks fire).
    torch::autograd::backward({y}, {grads[0]});
    return {x.grad(), torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace

torch::Tensor recompute(RunFn run, void* module, const torch::Tensor& x) {
  return Recompute::apply(x, reinterpret_cast<int64_t>(run), reinterpret_cast<int64_t>(module));
}

}  // namespace dtrain::detail
