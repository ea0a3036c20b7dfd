// Gradient synchronisation across the data-parallel group: one interface, one file per
// strategy. The strategy owns what the gradient means: the factor each micro-batch's loss
// is multiplied by, chosen so that once finish() returns, grad() holds the mean over the
// global batch (whatever the number of ranks and micro-batches).
//   NoSync              one data-parallel rank: 1 / micro-batches, nothing to send
//   BucketedAllReduce   buckets all-reduced from backward's hooks (bucketed_allreduce.cpp)
// Later strategies (ZeRO-1's reduce-scatter, compression, local SGD) implement the same.
#pragma once
#include <cstdint>
#include <memory>

#include <torch/nn/module.h>

namespace dtrain {

class FlatParams;
class Mesh;
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
  // Bytes this rank sends per step (for the comm_bytes figure); 0 without communication.
  virtual int64_t bytes_per_step() const { return 0; }
};

// The strategy for this job: NoSync with one data-parallel rank, else bucketed all-reduce.
std::unique_ptr<GradSync> make_grad_sync(const ParallelConfig& cfg, const Mesh& mesh,
                                         FlatParams& params, int64_t micro_batches);

}  // namespace dtrain
