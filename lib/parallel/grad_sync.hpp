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
//                  parameters are all-gathered after the update (parallel.zero: 1)
// (grad_sync.cpp)
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include <torch/types.h>

#include "parallel/flat_params.hpp"

namespace dtrain {

class Mesh;
class Pending;
struct ParallelConfig;

class GradSync {
 public:
  virtual ~GradSync() = default;
  // The factor each micro-batch's loss is multiplied by before backward. It enters at the
  // root of the graph, so averaging costs no pass over the gradients.
  virtual double loss_factor() const = 0;
  // Before each micro-batch's backward; only the last one of a step communicates.
  virtual void begin_micro_batch(bool /*last*/) {}
  // After the last backward: the gradient is final when it returns.
  virtual void finish() {}
  // After the optimizer's update, before the next forward (where a strategy that shards
  // the update gathers the parameters back).
  virtual void after_update() {}
  // The part of the flat buffers whose gradient is final after finish(), which this rank
  // updates: all of them, or under ZeRO its shard (update_shard()).
  virtual Shard shard() const { return {}; }
  // Bytes this rank sends per step (for the comm_bytes figure); 0 without communication.
  virtual int64_t bytes_per_step() const { return 0; }
};

// What goes on the wire for a final slice of the flat gradient.
class Reduction {
 public:
  virtual ~Reduction() = default;
  // Starts reducing the slice [offset, offset + numel) of `grad` over the data group; once
  // the returned Pending has been waited for, the slice holds the sum over the group (on
  // the ranks that keep it: all, or each part's owner).
  virtual std::unique_ptr<Pending> start(const torch::Tensor& grad, int64_t offset,
                                         int64_t numel) = 0;
  // Bytes this rank sends to reduce all of `grad` once (Gloo's ring algorithms).
  virtual int64_t wire_bytes(const torch::Tensor& grad) const = 0;
};

// The part of the flat buffers this rank updates: the whole without ZeRO, else its data
// rank's equal shard. The one place that decides it (the optimizer and the sync agree).
Shard update_shard(const ParallelConfig& cfg, const Mesh& mesh, const FlatParams& params);
// What the flat buffers are padded to, so that they cut into equal shards.
int64_t shard_padding(const ParallelConfig& cfg, const Mesh& mesh);

// The strategy for this job: NoSync with one data-parallel rank, ZeroSync under ZeRO, else
// bucketed all-reduce. `whole`: entries every data rank needs reduced whole even under ZeRO
// (a tied weight whose copies are summed across stages after the sync).
std::unique_ptr<GradSync> make_grad_sync(const ParallelConfig& cfg, const Mesh& mesh,
                                         FlatParams& params, int64_t micro_batches,
                                         const std::vector<size_t>& whole = {});

}  // namespace dtrain
