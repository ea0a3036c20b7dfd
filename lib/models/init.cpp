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

}  // namespace

Init torch_default_init(const std::string& name, const std::vector<int64_t>& shape,
                        const ShapeOf& shape_of) {
  if (shape.size() >= 2) return Init::uniform(1 / std::sqrt(fan_in(shape)));
  if (!ends_with(name, "bias")) return Init::constant(1);  // a norm's gain
  const auto weight = shape_of(name.substr(0, name.size() - 4) + "weight");
  if (weight.size() < 2) return Init::constant(0);  // a norm's bias, or no weight
  return Init::uniform(1 / std::sqrt(fan_in(weight)));
}

uint64_t parameter_seed(uint64_t seed, const std::string& name) {
  return mix_seed(seed, fnv1a(name));
}

void init_parameter(const Init& how, uint64_t seed, const std::string& name,
                    const std::vector<int64_t>& full_shape, const Placement& placement,
                    int64_t rank, const torch::Tensor& local) {
  torch::NoGradGuard no_grad;
  if (how.kind == Init::kConstant) {
    local.fill_(how.a);
    return;
  }
  // Drawn in place where the parameter is whole, contiguous and on the CPU; else whole on
  // the CPU (the draws follow memory order) and this rank's part copied in.
  const bool in_place = !placement.is_split() && local.is_cpu() && local.is_contiguous();
  torch::Tensor full = in_place ? local : torch::empty(full_shape, torch::kFloat32);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(parameter_seed(seed, name));
  if (how.kind == Init::kNormal) full.normal_(how.a, how.b, gen);
  else full.uniform_(how.a, how.b, gen);
  if (!in_place) local.copy_(placement.is_split() ? placement.shard(full, rank) : full);
}

namespace {

// A parameter to initialise: this rank's part `local` of `name`.
struct Target {
  std::string name;
  std::vector<int64_t> full_shape;
  Placement placement;
  torch::Tensor local;
};

// Looks up a full shape by name among `shapes` (empty for a name not there).
ShapeOf shape_lookup(std::map<std::string, std::vector<int64_t>> shapes) {
  return [shapes = std::move(shapes)](const std::string& name) {
    auto it = shapes.find(name);
    return it == shapes.end() ? std::vector<int64_t>{} : it->second;
  };
}

// Each target drawn by its rule; `shape_of` answers for every parameter of the model.
void init_all(const std::vector<Target>& targets, const InitRule& rule, uint64_t seed,
              int64_t rank, const ShapeOf& shape_of) {
  for (const auto& t : targets)
    init_parameter(rule(t.name, t.full_shape, shape_of), seed, t.name, t.full_shape, t.placement,
                   rank, t.local);
}

}  // namespace

void init_parameters(FlatParams& params, const InitRule& rule, uint64_t seed, int64_t rank) {
  std::map<std::string, std::vector<int64_t>> shapes;
  for (const auto& e : params.entries()) shapes[e.name] = e.full_shape;
  const ShapeOf shape_of = shape_lookup(std::move(shapes));
  params.write_whole([&](size_t first, size_t last) {  // under ZeRO-3 a unit at a time
    std::vector<Target> targets;
    for (size_t i = first; i < last; ++i) {
      const auto& e = params.entries()[i];
      targets.push_back({e.name, e.full_shape, e.placement, params.value(i)});
    }
    init_all(targets, rule, seed, rank, shape_of);
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
  init_all(targets, rule, seed, rank, shape_lookup(std::move(shapes)));
}

}  // namespace dtrain
