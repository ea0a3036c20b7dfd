// Which samples each rank takes at each step, designed for data parallelism: one global
// permutation per epoch from (seed, epoch); step s takes the global batch
// order[s*B, (s+1)*B); data-parallel rank r of D takes elements r, r+D, r+2D, ... of it.
// So D ranks together see exactly the batch one rank would, and any position
// (epoch, step) can be recomputed on resume without replaying the epoch.
#pragma once
#include <cstdint>
#include <vector>

#include <torch/types.h>

namespace dtrain {

class ShardedSampler {
 public:
  ShardedSampler(int64_t dataset_size, int64_t global_batch, bool shuffle, uint64_t seed,
                 int64_t rank = 0, int64_t ranks = 1);

  // Full global batches per epoch; the incomplete tail is dropped so every step has the
  // same global batch (the same gradient scale) on every layout.
  int64_t steps_per_epoch() const { return size_ / global_batch_; }
  int64_t rank_batch() const { return global_batch_ / ranks_; }

  // The epoch's order of sample indices (identical on every rank).
  std::vector<int64_t> epoch_order(int64_t epoch) const;
  // This rank's indices for `step` of the epoch whose order is given.
  torch::Tensor rank_indices(const std::vector<int64_t>& order, int64_t step) const;

 private:
  int64_t size_, global_batch_;
  bool shuffle_;
  uint64_t seed_;
  int64_t rank_, ranks_;
};

}  // namespace dtrain
