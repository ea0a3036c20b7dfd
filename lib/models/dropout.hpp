// Dropout whose mask does not depend on the layout. A unit's keep/drop is a hash of the
// job's seed, the step, the dropout site (its place in the whole model), the sample's
// position in the step's global batch and the unit's place in the whole layer. So one
// process and any data x tensor x pipeline layout draw the same masks, a resumed run draws
// what an uninterrupted one would (no random state to save), and recompute reruns them.
// Drawing from one generator (torch::dropout) gives every data rank the same masks for
// different samples and ties a mask to how a layer is split.
//
// The trainer says where the rows of a forward sit (DropoutScope); a model's dropout sites
// say where their part sits in the layer (SeededDropout).
#pragma once
#include <cstdint>

#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>
#include <torch/types.h>

namespace dtrain {

// What the masks of one forward depend on besides the site: the seed, the optimizer step
// (from 1) and each row's position in that step's global batch ([rows] int64, on the
// forward's device).
struct DropoutDraw {
  uint64_t seed = 0;
  int64_t step = 0;
  torch::Tensor positions;
};

// The draw of the forwards this thread runs until the scope ends (the previous one is
// restored then). A training forward with dropout on outside any scope is a logic error.
class DropoutScope {
 public:
  explicit DropoutScope(DropoutDraw draw);
  ~DropoutScope();
  DropoutScope(const DropoutScope&) = delete;
  DropoutScope& operator=(const DropoutScope&) = delete;

 private:
  DropoutDraw previous_;
  bool had_;
};

// The current draw, if any (recompute saves it with the forward it reruns).
const DropoutDraw* current_dropout_draw();

// How this rank's part of a tensor [rows, d1, ..., dk] sits in the whole layer: dimension
// `dim` (1..k) is split into `parts` equal parts and this rank holds part `index`; parts == 1
// means it holds the whole.
struct LayerSlice {
  int64_t dim = 1, index = 0, parts = 1;
};

// x with each unit kept with probability 1 - p (scaled by 1 / (1 - p)) or zeroed, by the
// hash above. `site` names the dropout's place in the model, the same on every layout.
torch::Tensor seeded_dropout(const torch::Tensor& x, double p, uint64_t site,
                             const LayerSlice& slice = {});

// The module form, for layer stacks: a no-op in eval mode.
class SeededDropoutImpl : public torch::nn::Module {
 public:
  SeededDropoutImpl(double p, uint64_t site, LayerSlice slice = {})
      : p_(p), site_(site), slice_(slice) {}
  torch::Tensor forward(const torch::Tensor& x) {
    return is_training() && p_ > 0 ? seeded_dropout(x, p_, site_, slice_) : x;
  }

 private:
  double p_;
  uint64_t site_;
  LayerSlice slice_;
};
TORCH_MODULE(SeededDropout);

// A site id from the model's name for the place ("h.7.attn.weights"): a stable hash.
uint64_t dropout_site(const std::string& name);

}  // namespace dtrain
