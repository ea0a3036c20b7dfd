// Gradient synchronisation across the data-parallel group: one interface, strategies
// composed of two pieces. The strategy owns what the gradient means: the factor each
// micro-batch's loss is multiplied by, chosen so that once finish() returns, grad() holds
// the mean over the global batch (whatever the number of ranks and micro-batches).
//   NoSync         one data-parallel rank: 1 / micro-batches, nothing to send
//   BucketedSync   GradBuckets (grad_buckets.hpp) says which slice of the flat gradient is
//                  final, in launch order, from backward's hooks; a Reduction decides what
//                  goes on the wire for it (AllReduce today; a reduce-scatter or a
//                  compressed exchange are other Reductions)
// (grad_sync.cpp)
#pragma once
#include <cstdint>
#include <memory>

#include <torch/types.h>

namespace dtrain {

class FlatParams;
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
  // Bytes this rank sends per step (for the comm_bytes figure); 0 without communication.
  virtual int64_t bytes_per_step() const { return 0; }
};

// What goes on the wire for a final slice of the flat gradient.
class Reduction {
 public:
  virtual ~Reduction() = default;
  // Starts reducing `slice` (a view of the flat gradient) over the data group; the slice
  // holds the sum over the group once the returned Pending has been waited for.
  virtual std::unique_ptr<Pending> start(torch::Tensor slice) = 0;
  // Bytes this rank sends to reduce `numel` values of `element_size` bytes.
  virtual int64_t wire_bytes(int64_t numel, int64_t element_size) const = 0;
};

// The strategy for this job: NoSync with one data-parallel rank, else bucketed all-reduce.
std::unique_ptr<GradSync> make_grad_sync(const ParallelConfig& cfg, const Mesh& mesh,
                                         FlatParams& params, int64_t micro_batches);

}  // namespace dtrain
