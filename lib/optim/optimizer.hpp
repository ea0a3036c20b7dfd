// SGD and AdamW over a FlatParams shard, with the update rules of torch.optim.SGD and
// torch.optim.AdamW (tested against them). Owning the state as flat buffers keeps the
// update to a handful of large ops and makes the state easy to checkpoint and to shard.
//
// Parameter groups: weight decay applies to parameters of two or more dimensions (weights,
// embeddings), not to biases and norm gains, unless optimizer.decay_1d says so (the
// GPT-2 / nanoGPT convention; decaying a LayerNorm gain towards 0 fights the norm).
#pragma once
#include <algorithm>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "config/config.hpp"
#include "parallel/flat_params.hpp"

namespace dtrain {

class Optimizer {
 public:
  virtual ~Optimizer() = default;
  // One update of the shard of params.data() from params.grad() at learning rate `lr`.
  // `skip`, when given, is a one-element float tensor on the parameters' device: 1 makes
  // the step no update at all (no moment, decay or count changes). LibTorch's fused
  // kernels read it on the device, so a GPU step need not wait for it.
  virtual void step(double lr, const torch::Tensor& skip = {}) = 0;
  // The state: per-parameter slots as flat buffers over the shard ("exp_avg" -> buffer),
  // and scalars ("steps").
  virtual NamedTensors slots() const = 0;
  virtual NamedTensors scalars() const = 0;
  // Restores scalars; slots are restored in place through slots() (the buffers are views).
  virtual void load_scalars(const NamedTensors& scalars) = 0;
  // The part of the flat buffers it updates (the slots hold that part only): the whole of
  // them, or one data rank's shard (ZeRO).
  virtual Shard shard() const = 0;
};

// The gradient's norm goes over `numel` elements this many at a time: its temporary (the
// squares) takes a piece, not the shard (under ZeRO-0 the whole model). A multiple of 2^20
// elements (4 MiB in fp32), at most 64 pieces: a large shard on a GPU is not a thousand
// kernels.
int64_t update_piece(int64_t numel);
// fn(at, n) for each piece [at, at + n) of [0, numel), in order.
template <typename F>
void for_each_piece(int64_t numel, F&& fn) {
  const int64_t piece = update_piece(numel);
  for (int64_t at = 0; at < numel; at += piece) fn(at, std::min(piece, numel - at));
}

std::unique_ptr<Optimizer> make_optimizer(const OptimizerConfig& cfg, FlatParams& params,
                                          Shard shard = {});

// What tensor rank `tensor_rank` writes of the state into a checkpoint: per parameter and
// slot ("fc.weight.exp_avg"), split parameters' slots as this rank's part (noted in
// `parts`), replicated ones on tensor rank 0 only; and the scalars. A sharded optimizer
// (ZeRO) writes only its shard, nothing gathered: each slot cut at the parameters' bounds,
// the pieces' places noted in `ranges` (every data rank writes its own). Loaded (every
// part and range merged, checkpoint.hpp) it is the state at full logical shapes.
NamedTensors optimizer_state(const Optimizer& opt, const FlatParams& params, int64_t tensor_rank,
                             PartsOf& parts, RangesOf& ranges, bool every = false);
// Whether the optimizer keeps a shard of the state (ZeRO), not all of it.
bool keeps_shard(const Optimizer& opt, const FlatParams& params);
// Restores what optimizer_state() returned, each rank taking its part (of a shard, the
// shard's part, read a tensor at a time); throws CheckpointError (naming `origin`) on a missing or misshapen tensor.
// The state is independent of the layout, so it restores at any data size.
void load_optimizer_state(Optimizer& opt, const FlatParams& params, const NamedTensors& state,
                          int64_t tensor_rank, const std::string& origin);
void load_optimizer_state(Optimizer& opt, const FlatParams& params, const SavedTensors& saved,
                          int64_t tensor_rank);
// The state the optimizer of `cfg` keeps, a flat buffer over its shard each (its slots):
// the optimizers make them by it and the planner counts them.
std::vector<std::string> slot_names(const OptimizerConfig& cfg);
// The bytes of state this rank keeps (its slots), for the summary.
int64_t optimizer_state_bytes(const Optimizer& opt);

// Whether weight decay applies to the parameter with this full shape.
bool decays(const OptimizerConfig& cfg, const std::vector<int64_t>& full_shape);

}  // namespace dtrain
