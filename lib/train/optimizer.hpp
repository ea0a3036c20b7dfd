// SGD and AdamW over FlatParams, with the update rules of torch.optim.SGD and
// torch.optim.AdamW (tested against them). Owning the state as flat buffers keeps the
// update to a handful of large ops and makes the state easy to checkpoint and to shard.
#pragma once
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "config/config.hpp"
#include "train/flat_params.hpp"

namespace dtrain {

using NamedTensors = std::vector<std::pair<std::string, torch::Tensor>>;

class Optimizer {
 public:
  virtual ~Optimizer() = default;
  // One update of params.data() from params.grad() at learning rate `lr`.
  virtual void step(double lr) = 0;
  // The state, one tensor per parameter and slot ("fc.weight.exp_avg"), plus scalars.
  virtual NamedTensors state() const = 0;
  // Restores what state() returned; throws CheckpointError on a missing or misshapen tensor.
  virtual void load_state(const NamedTensors& state) = 0;
};

std::unique_ptr<Optimizer> make_optimizer(const OptimizerConfig& cfg, FlatParams& params);

}  // namespace dtrain
