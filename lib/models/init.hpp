// Initial weights that do not depend on the layout (torchtitan's init_weights, by name).
// Each parameter is drawn whole from a generator of its own, seeded by the job's seed and
// the parameter's name in the whole model ("h.7.mlp.c_fc.weight"), and a rank keeps its
// part of it. Every value is then a function of (seed, name, position in the whole tensor):
// one process and every data x tensor x pipeline layout start from the same weights, a
// rank creates only the parameters of the parts it holds, and a split parameter is whole
// only while it is drawn, one at a time.
//
// What each parameter is drawn from is its model's rule (ModelSpec::init): GPT-2's normal
// weights, or torch.nn's defaults for the MLP and CNN.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <torch/nn/module.h>
#include <torch/types.h>

#include "parallel/flat_params.hpp"

namespace dtrain {

struct Init {
  enum Kind { kNormal, kUniform, kConstant };
  Kind kind = kConstant;
  double a = 0, b = 0;  // normal: mean, std; uniform: low, high; constant: the value
  static Init normal(double std) { return {kNormal, 0.0, std}; }
  static Init uniform(double bound) { return {kUniform, -bound, bound}; }
  static Init constant(double value) { return {kConstant, value, 0.0}; }
};

// The full shape of another parameter of the model, by name (empty when it has none).
using ShapeOf = std::function<std::vector<int64_t>(const std::string& name)>;
// A model's rule: how parameter `name`, of full shape `shape`, starts.
using InitRule =
    std::function<Init(const std::string& name, const std::vector<int64_t>& shape, const ShapeOf& shape_of)>;

// torch.nn's own initialisation: Linear and Conv weights kaiming-uniform with a = sqrt(5),
// which is U(+-1 / sqrt(fan_in)), their biases U(+-1 / sqrt(the weight's fan_in)); a 1-D
// weight (a norm's gain) 1 and its bias 0.
Init torch_default_init(const std::string& name, const std::vector<int64_t>& shape,
                        const ShapeOf& shape_of);

// Every parameter of `params` (this rank's parts, laid out flat), tensor rank `rank`.
void init_parameters(FlatParams& params, const InitRule& rule, uint64_t seed, int64_t rank);
// Every parameter of `module` where it stands (no flat buffer: tests and tools); names
// relative to `module`, which must be the whole model's root.
void init_parameters(torch::nn::Module& module, const InitRule& rule, uint64_t seed, int64_t rank);

}  // namespace dtrain
