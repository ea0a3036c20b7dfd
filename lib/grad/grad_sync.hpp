// Gradient synchronisation across the data-parallel group: one interface, strategies
// composed of two pieces. The strategy owns what the gradient means: the factor each
// micro-batch's loss is multiplied by, chosen so that once finish() returns, grad() holds
// the mean over the global batch (whatever the number of ranks and micro-batches) on the
// part of it this rank updates (shard()).
//   NoSync         one data-parallel rank, or a gradient that stays this rank's own (local
//                  SGD between averages, a parameter server's worker): 1 / micro-batches,
//                  nothing sent
//   BucketedSync   GradBuckets (buckets.hpp) says which slice of the flat gradient is final,
//                  in launch order, from backward's hooks; a Reduction decides what goes on
//                  the wire for it: AllReduce (every rank gets the sum), a compression
//                  (compression.hpp), or ZeRO's reduction to each shard's owner (zero.hpp)
// A strategy that carries state from step to step (error feedback's residuals, PowerSGD's
// Q matrices) saves and loads it itself (checkpoint/stateful.hpp).
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <utility>
#include <vector>

#include <torch/nn/module.h>
#include <torch/types.h>

#include "checkpoint/stateful.hpp"
#include "config/config.hpp"
#include "parallel/flat_params.hpp"

namespace dtrain {

class Comm;
class Mesh;
class Pending;

// Tensors that belong to parameters, by their index in FlatParams::entries().
using PerEntry = std::vector<std::pair<size_t, torch::Tensor>>;

class GradSync : public Stateful {
 public:
  // The factor each micro-batch's loss is multiplied by before backward. It enters at the
  // root of the graph, so averaging costs no pass over the gradients.
  virtual double loss_factor() const = 0;
  // Before the step's first forward (compression's warmup counts steps).
  virtual void begin_step(int64_t /*step*/) {}
  // Before each micro-batch's backward; only the last one of a step communicates.
  virtual void begin_micro_batch(bool /*last*/) {}
  // After the last backward: the gradient is final when it returns.
  virtual void finish() {}
  // The forward is about to run `modules` (Network::UseHooks): their parameters must be
  // at hand. ZeRO-1/2's all-gather of the updated parameters, launched after the update,
  // is waited for here as far as they need, so it overlaps the forward of the layers
  // before; ZeRO-3 gathers the modules' units here, and starts the next one's.
  using Modules = std::vector<const torch::nn::Module*>;
  virtual void before_use(const Modules& /*modules*/) {}
  // They have run, making `out` (ZeRO-3 gathers them again before out's backward).
  virtual void after_use(const Modules& /*modules*/, const torch::Tensor& /*out*/) {}
  // Every parameter current (before something reads them all: a checkpoint).
  virtual void settle() {}
  // After the optimizer's update, before the next forward (where a strategy that shards
  // the update gathers the parameters back).
  // `skip`, when defined, is the step's one-element skip flag on the device (1: the update
  // was not made, train.on_nonfinite: skip); state carried to the next step must not keep
  // what such a step computed.
  virtual void after_update(const torch::Tensor& /*skip*/) {}
  // Instead of the update: the replicas discarded the step (fault tolerance), which is
  // trained again. What it changed of the state carried between steps is undone.
  virtual void discard() {}
  // The part of the flat buffers whose gradient is final after finish(), which this rank
  // updates: all of them, or under ZeRO its shard (update_shard()).
  virtual Shard shard() const { return {}; }
  // Bytes this rank sent in the last step (the comm_bytes figure); 0 without communication.
  virtual int64_t bytes_per_step() const { return 0; }
  // Nothing carried from step to step, unless a strategy says otherwise.
  void save(StateWriter& /*out*/) const override {}
  void load(const StateReader& /*in*/) override {}
};

// What goes on the wire for a final slice of the flat gradient.
class Reduction {
 public:
  virtual ~Reduction() = default;
  // Starts reducing `slice`, the gradient's values at [offset, offset + numel) of the flat
  // layout, over the data group, in place; once the returned Pending has been waited for,
  // it holds the sum over the group (on the ranks that keep it: all, or each part's owner).
  virtual std::unique_ptr<Pending> start(const torch::Tensor& slice, int64_t offset) = 0;
  // Error feedback's residuals (compression.hpp), laid out like the flat gradient.
  virtual NamedTensors state() const { return {}; }
  // PowerSGD's Q matrices, by entry index (GradSync::factors()).
  virtual PerEntry factors() const { return {}; }
  // After a step: a skipped step's residuals are dropped (a non-finite gradient must not
  // be carried into the next one).
  virtual void after_step(const torch::Tensor& /*skip*/) {}
  // The bytes this rank sent since the last call (by Gloo's ring algorithms: an all-reduce
  // of B bytes over D ranks sends 2B(D-1)/D, an all-gather B(D-1)).
  int64_t take_sent() { return std::exchange(sent_, 0); }

 protected:
  void count(int64_t bytes) { sent_ += bytes; }

 private:
  int64_t sent_ = 0;
};

// What one rank sends in a ring all-reduce of `bytes` over `ranks`: a reduce-scatter and an
// all-gather, each (D-1)/D of the data.
inline int64_t ring_all_reduce_bytes(int64_t bytes, int64_t ranks) {
  return 2 * bytes * (ranks - 1) / ranks;
}
// The same in fractions of a byte, for sums over a step (the plan's, a reduction's
// step_bytes); none over one rank.
inline double ring_all_reduce_share(double bytes, int64_t ranks) {
  return ranks > 1 ? 2 * bytes * double(ranks - 1) / double(ranks) : 0;
}

// A weight tied across pipeline stages (GPT's token embedding and its head): its entries,
// whose copies on the first and the last stage finish() sums over `group` once the data
// group's sync is done (every data rank needs them whole, even under ZeRO). `copy`: this
// rank holds the head's copy, whose state is saved under names of its own ("_copy").
struct Tied {
  std::shared_ptr<Comm> group;  // null without a tie across stages
  std::vector<size_t> entries;
  bool copy = false;
  void sum(const FlatParams& params) const;
  // `key` ("h.0.weight.residual") as this rank saves it.
  std::string saved_name(const FlatParams& params, const std::string& key) const;
  // What this rank saves of `flat`, a buffer laid out like the flat parameters: each
  // entry's part named entry + suffix (a split one's noted in `parts`), as saved_name says.
  NamedTensors owned(const FlatParams& params, const torch::Tensor& flat, const std::string& suffix,
                     int64_t tensor_rank, PartsOf& parts) const;
  // The reverse: each entry's part of `flat` from `saved`.
  void load(const FlatParams& params, const torch::Tensor& flat, const std::string& suffix,
            const SavedTensors& saved, int64_t tensor_rank) const;
};

// The gradient's sum over a fault-tolerant job's replicas (comm/replica_set.hpp), bucketed
// as the all-reduce's or compressed (parallel.compression, after its warm-up of
// compression_warmup_steps(cfg, total_steps)), each replica's loss scaled by its share of
// the global batch (`share()`: this replica's now), so that the sum is the global batch's
// mean however the survivors deal it out. A discarded step's changes to the compression's
// residuals and PowerSGD's factors are undone. `tensor_rank`: this rank's in its replica;
// `tied`: a weight tied across its pipeline stages, summed once the replicas' sum is done.
std::unique_ptr<GradSync> make_replica_sync(const ParallelConfig& cfg, std::shared_ptr<Comm> replicas,
                                            FlatParams& params, int64_t micro_batches,
                                            int64_t total_steps, int64_t tensor_rank,
                                            std::function<double()> share, Tied tied);

// The strategy for a data-parallel group of `mesh`: NoSync with one data-parallel rank,
// ZeRO's under parallel.zero (zero.hpp), a compression under parallel.compression, else
// bucketed all-reduce. `total_steps`: the run's length (compression_warmup_steps).
std::unique_ptr<GradSync> make_grad_sync(const ParallelConfig& cfg, const Mesh& mesh,
                                         FlatParams& params, int64_t micro_batches,
                                         int64_t total_steps, Tied tied = {});
// Bucketed all-reduce over `mesh`'s data group, whatever the job's strategy.
std::unique_ptr<GradSync> make_all_reduce_sync(const ParallelConfig& cfg, const Mesh& mesh,
                                               FlatParams& params, int64_t micro_batches, Tied tied);
// This rank's own gradient, nothing sent; `shard`: the part of the buffers it updates.
std::unique_ptr<GradSync> make_no_sync(const FlatParams& params, int64_t micro_batches, Tied tied,
                                       Shard shard = {});

}  // namespace dtrain
