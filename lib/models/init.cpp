#include "models/init.hpp"

#include <map>

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include "util/hash.hpp"
#include "util/strings.hpp"

namespace dtrain {
namespace {

double fan_in(const std::vector<int64_t>& shape) {
  double n = 1;
  for (size_t d = 1; d < shape.size(); ++d) n *= double(shape[d]);
  return n;
}

// A parameter to initialise: this rank's part `local` of `name`.
struct Target {
  std::string name;
  std::vector<int64_t> full_shape;
  Placement placement;
  torch::Tensor local;
};

// Fills `t.local`, tensor rank `rank`'s part of it, as `how` says.
void init_parameter(const Init& how, uint64_t seed, const Target& t, int64_t rank) {
  torch::NoGradGuard no_grad;
  if (how.kind == Init::kConstant) {
    t.local.fill_(how.a);
    return;
  }
  // Drawn in place where the parameter is whole, contiguous and on the CPU; else whole on
  // the CPU (the draws follow memory order) and this rank's part copied in.
  const bool in_place = !t.placement.is_split() && t.local.is_cpu() && t.local.is_contiguous();
  torch::Tensor full = in_place ? t.local : torch::empty(t.full_shape, torch::kFloat32);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(mix_seed(seed, fnv1a(t.name)));
  if (how.kind == Init::kNormal) full.normal_(how.a, how.b, gen);
  else full.uniform_(how.a, how.b, gen);
  if (!in_place) t.local.copy_(t.placement.is_split() ? t.placement.shard(full, rank) : full);
}

// Each target drawn by its rule; `shapes` holds every parameter of the model's full shape.
void init_all(const std::vector<Target>& targets, const InitRule& rule, uint64_t seed,
              int64_t rank, const std::map<std::string, std::vector<int64_t>>& shapes) {
  const ShapeOf shape_of = [&](const std::string& name) {
    auto it = shapes.find(name);
    return it == shapes.end() ? std::vector<int64_t>{} : it->second;
  };
  for (const auto& t : targets) init_parameter(rule(t.name, t.full_shape, shape_of), seed, t, rank);
}

}  // namespace

Init torch_default_init(const std::string& name, const std::vector<int64_t>& shape,
                        const ShapeOf& shape_of) {
  if (shape.size() >= 2) return Init::uniform(1 / std::sqrt(fan_in(shape)));
  if (!ends_with(name, "bias")) return Init::constant(1);  // a norm's gain
  const auto weight = shape_of(name.substr(0, name.size() - 4) + "weight");
  if (weight.size() < 2) return Init::constant(0);  // a norm's bias, or no weight
  return Init::uniform(1 / std::sqrt(fan_in(weight)));
}

void init_parameters(FlatParams& params, const InitRule& rule, uint64_t seed, int64_t rank) {
  std::map<std::string, std::vector<int64_t>> shapes;
  for (const auto& e : params.entries()) shapes[e.name] = e.full_shape;
  params.write_whole([&](size_t first, size_t last) {  // under ZeRO-3 a unit at a time
    std::vector<Target> targets;
    for (size_t i = first; i < last; ++i) {
      const auto& e = params.entries()[i];
      targets.push_back({e.name, e.full_shape, e.placement, params.value(i)});
    }
    init_all(targets, rule, seed, rank, shapes);
  });
}

void init_parameters(torch::nn::Module& module, const InitRule& rule, uint64_t seed, int64_t rank) {
  const auto placements = placements_of(module);
  std::vector<Target> targets;
  for (const auto& p : module.named_parameters()) {
    auto it = placements.find(p.key());
    const Placement place = it == placements.end() ? Placement::replicated() : it->second;
    targets.push_back({p.key(), place.full_shape(p.value().sizes().vec()), place, p.value()});
  }
  std::map<std::string, std::vector<int64_t>> shapes;
  for (const auto& t : targets) shapes[t.name] = t.full_shape;
  init_all(targets, rule, seed, rank, shapes);
}

}  // namespace dtrain
