// Which samples each rank takes at each step, designed for data parallelism: one global
// permutation per epoch from (seed, epoch); step s takes the global batch
// order[s*B, (s+1)*B); data-parallel rank r of D takes elements r, r+D, r+2D, ... of it.
// So D ranks together see exactly the batch one rank would, and any position
// (epoch, step) can be recomputed on resume without replaying the epoch.
//
// A fault-tolerant job whose batch shrinks with its replicas (fault_tolerance.batch:
// shrink) goes on from a step in batches of another size: the rest of that step's epoch in
// the new batches (a tail too small for one dropped, as an epoch's always is), then whole
// epochs of them (a course: ShardedSampler::continued). Each sample of an epoch is still
// taken once, and a step's place is still computed, not replayed.
#pragma once
#include <array>
#include <cstdint>
#include <vector>

#include <torch/types.h>

namespace dtrain {

// An epoch's order of sample indices: position -> sample, the same on every rank. Up to
// `listed_max` samples it is listed (Fisher-Yates on splitmix64, the order runs have
// always had); beyond, each position is computed (a keyed Feistel network over the next
// power of four, walked until it lands in range: a bijection of [0, size)), so a corpus of
// hundreds of millions of windows costs no memory and no start-up time for its order.
class EpochOrder {
 public:
  static constexpr int64_t kListedMax = int64_t(1) << 24;  // 128 MiB of indices
  EpochOrder(int64_t size, bool shuffle, uint64_t seed, int64_t epoch,
             int64_t listed_max = kListedMax);
  int64_t size() const { return size_; }
  int64_t at(int64_t position) const;

 private:
  uint64_t feistel(uint64_t x) const;
  int64_t size_;
  bool shuffle_;
  std::vector<int64_t> listed_;
  std::array<uint64_t, 6> keys_{};  // the computed order's round keys
  int half_bits_ = 0;
};

// Where a step's global batch lies: the epoch, and the place of its first sample in that
// epoch's order.
struct BatchAt {
  int64_t epoch = 0, position = 0;
};

// Where the sampler's global batches of its size begin: at (0-based) step `step`, at
// `at`. A job's sampler begins at step 0, at the start of epoch 0.
struct Course {
  int64_t step = 0;
  BatchAt at;
};

class ShardedSampler {
 public:
  ShardedSampler(int64_t dataset_size, int64_t global_batch, bool shuffle, uint64_t seed,
                 int64_t rank = 0, int64_t ranks = 1);

  // Full global batches per epoch; the incomplete tail is dropped so every step has the
  // same global batch (the same gradient scale) on every layout.
  int64_t steps_per_epoch() const { return size_ / global_batch_; }
  int64_t rank() const { return rank_; }
  int64_t ranks() const { return ranks_; }
  // This rank's share: elements rank, rank + ranks, ... of the global batch.
  int64_t rank_batch() const { return (global_batch_ - rank_ + ranks_ - 1) / ranks_; }
  // The same order dealt among `ranks` of which this is `rank`, where `ranks` need not
  // divide the global batch (a fault-tolerant job's surviving replicas, comm/quorum.hpp):
  // the first global_batch % ranks shares hold one sample more. Together they still take
  // exactly the global batch, each sample once.
  ShardedSampler reshared(int64_t rank, int64_t ranks) const;

  int64_t global_batch() const { return global_batch_; }
  // From (0-based) step `step` on, global batches of `global_batch` samples, the first at
  // this sampler's place for that step (the same shares: rank 0 of 1 until reshared).
  ShardedSampler continued(int64_t step, int64_t global_batch) const;
  const Course& course() const { return course_; }
  // The same order on the course `course` (a saved one), in batches of `global_batch`.
  ShardedSampler on_course(const Course& course, int64_t global_batch) const;
  // Whether `other` deals the same batches the same way (rank, ranks, batch, course).
  bool same_shares(const ShardedSampler& other) const;

  // Where (0-based) step `step`'s global batch lies.
  BatchAt at(int64_t step) const;
  // The epoch's order of sample indices (identical on every rank).
  EpochOrder epoch_order(int64_t epoch) const;
  // This rank's indices of the global batch at `position` of the epoch whose order is given.
  torch::Tensor rank_indices(const EpochOrder& order, int64_t position) const;

 private:
  int64_t size_, global_batch_;
  bool shuffle_;
  uint64_t seed_;
  int64_t rank_, ranks_;
  Course course_;
};

}  // namespace dtrain
