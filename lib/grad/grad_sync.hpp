// Gradient synchronisation across the data-parallel group: one interface, strategies
// composed of two pieces. The strategy owns what the gradient means: the factor each
// micro-batch's loss is multiplied by, chosen so that once finish() returns, grad() holds
// the mean over the global batch (whatever the number of ranks and micro-batches) on the
// part of it this rank updates (shard()).
//   NoSync         one data-parallel rank: 1 / micro-batches, nothing to send
//   BucketedSync   GradBuckets (grad_buckets.hpp) says which slice of the flat gradient is
//                  final, in launch order, from backward's hooks; a Reduction decides what
//                  goes on the wire for it: AllReduce (every rank gets the sum) or
//                  ReduceToOwners (ZeRO: each shard's sum to the rank that owns it)
//   ZeroSync       BucketedSync with ReduceToOwners; each rank updates its shard, and the
//                  parameters are all-gathered after the update, overlapping the next
//                  forward (parallel.zero: 1)
//   Zero2Sync      ZeroSync keeping only the shard of the gradient (parallel.zero: 2)
//   LocalSync      local SGD: a BucketedSync for the synchronous steps (local_after), then
//                  each replica's own gradient, the data group left alone (train/mode.hpp
//                  averages the replicas instead)
// (grad_sync.cpp)
#pragma once
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include <torch/nn/module.h>
#include <torch/types.h>

#include "config/config.hpp"
#include "parallel/flat_params.hpp"

namespace dtrain {

class Mesh;
class Pending;

// Tensors that belong to parameters, by their index in FlatParams::entries().
using PerEntry = std::vector<std::pair<size_t, torch::Tensor>>;

class GradSync {
 public:
  virtual ~GradSync() = default;
  // The factor each micro-batch's loss is multiplied by before backward. It enters at the
  // root of the graph, so averaging costs no pass over the gradients.
  virtual double loss_factor() const = 0;
  // Before the step's first forward (compression's warmup counts steps).
  virtual void begin_step(int64_t /*step*/) {}
  // Before each micro-batch's backward; only the last one of a step communicates.
  virtual void begin_micro_batch(bool /*last*/) {}
  // After the last backward: the gradient is final when it returns.
  virtual void finish() {}
  // The forward is about to run `module` (Network::before_use): its parameters must be
  // current. ZeRO's all-gather of the updated parameters, launched after the update, is
  // waited for here as far as they need, so it overlaps the forward of the layers before.
  virtual void before_use(const torch::nn::Module& /*module*/) {}
  // Every parameter current (before something reads them all: a checkpoint).
  virtual void settle() {}
  // After the optimizer's update, before the next forward (where a strategy that shards
  // the update gathers the parameters back).
  // `skip`, when defined, is the step's one-element skip flag on the device (1: the update
  // was not made, train.on_nonfinite: skip); state carried to the next step must not keep
  // what such a step computed.
  virtual void after_update(const torch::Tensor& /*skip*/) {}
  // What a strategy carries from step to step (error-feedback residuals), as buffers laid
  // out like the flat gradient, by name; saved with each checkpoint per data rank.
  virtual NamedTensors state() const { return {}; }
  // What it carries shaped otherwise, per parameter (PowerSGD's Q of each matrix, by entry
  // index): restored only at the same layout.
  virtual PerEntry factors() const { return {}; }
  // The part of the flat buffers whose gradient is final after finish(), which this rank
  // updates: all of them, or under ZeRO its shard (update_shard()).
  virtual Shard shard() const { return {}; }
  // Bytes this rank sent in the last step (the comm_bytes figure); 0 without communication.
  virtual int64_t bytes_per_step() const { return 0; }
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

// The part of the flat buffers this rank updates: the whole without ZeRO, else its data
// rank's equal shard; under async_ps a server's range (a worker updates nothing). The one
// place that decides it (the optimizer and the sync agree).
Shard update_shard(const ParallelConfig& cfg, const Mesh& mesh, const FlatParams& params);
// The flat buffers' options ZeRO sets: padded so that they cut into equal shards, and
// under ZeRO-2 the gradient held for this rank's shard only. Under async_ps, servers and
// workers pad alike, into one equal range per server.
void shard_flat(const ParallelConfig& cfg, const Mesh& mesh, FlatOptions& opts);

// Whether step n (from 1) steps each data replica on its own gradient: local SGD, past its
// synchronous start.
inline bool steps_locally(const ParallelConfig& cfg, int64_t n) {
  return cfg.mode == "local_sgd" && n > cfg.local_after;
}

// The strategy for this job: NoSync with one data-parallel rank, ZeroSync (Zero2Sync)
// under ZeRO, else bucketed all-reduce. `tied`: the entries of a weight tied across
// pipeline stages, whose copies finish() sums over the mesh's embedding group once the
// data group's sync is done (every data rank needs them whole, even under ZeRO).
std::unique_ptr<GradSync> make_grad_sync(const ParallelConfig& cfg, const Mesh& mesh,
                                         FlatParams& params, int64_t micro_batches,
                                         const std::vector<size_t>& tied = {});

}  // namespace dtrain
