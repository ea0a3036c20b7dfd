// Deterministic shuffling with our own generator, so the order is the same for every
// LibTorch version and standard library (std::shuffle's algorithm is unspecified).
#include "data/sampler.hpp"

#include <numeric>

#include "util/error.hpp"
#include "util/hash.hpp"

namespace dtrain {

namespace {
// Unbiased integer in [0, bound) by rejection.
uint64_t below(SplitMix64& rng, uint64_t bound) {
  const uint64_t limit = UINT64_MAX - UINT64_MAX % bound;
  uint64_t x;
  do x = rng.next(); while (x >= limit);
  return x % bound;
}
}  // namespace

ShardedSampler::ShardedSampler(int64_t dataset_size, int64_t global_batch, bool shuffle,
                               uint64_t seed, int64_t rank, int64_t ranks)
    : size_(dataset_size), global_batch_(global_batch), shuffle_(shuffle), seed_(seed),
      rank_(rank), ranks_(ranks) {
  fail_if<ConfigError>(global_batch > dataset_size,
                       "data.batch_size: {} is larger than the {} training samples",
                       global_batch, dataset_size);
  fail_if<ConfigError>(global_batch % ranks != 0,
                       "data.batch_size: {} does not divide into {} data-parallel ranks",
                       global_batch, ranks);
}

EpochOrder::EpochOrder(int64_t size, bool shuffle, uint64_t seed, int64_t epoch,
                       int64_t listed_max)
    : size_(size), shuffle_(shuffle) {
  if (!shuffle_) return;
  SplitMix64 rng{seed * 0x100000001B3ull + static_cast<uint64_t>(epoch) + 1};
  if (size_ <= listed_max) {
    listed_.resize(size_t(size_));
    std::iota(listed_.begin(), listed_.end(), 0);
    for (int64_t i = size_ - 1; i > 0; --i)  // Fisher-Yates
      std::swap(listed_[i], listed_[below(rng, static_cast<uint64_t>(i) + 1)]);
    return;
  }
  for (auto& k : keys_) k = rng.next();
  while ((uint64_t(1) << (2 * half_bits_)) < uint64_t(size_)) ++half_bits_;
}

int64_t EpochOrder::at(int64_t position) const {
  if (!shuffle_) return position;
  if (!listed_.empty()) return listed_[size_t(position)];
  uint64_t x = uint64_t(position);
  do x = feistel(x); while (x >= uint64_t(size_));  // under 4 rounds on average
  return int64_t(x);
}

// Six rounds over the two halves of a 2h-bit value, each round's function a splitmix64
// finalizer of the right half and the round's key: a permutation of [0, 4^h).
uint64_t EpochOrder::feistel(uint64_t x) const {
  const uint64_t mask = (uint64_t(1) << half_bits_) - 1;
  uint64_t left = x >> half_bits_, right = x & mask;
  for (uint64_t key : keys_) {
    const uint64_t next = left ^ (splitmix64_mix(right ^ key) & mask);
    left = right, right = next;
  }
  return (left << half_bits_) | right;
}

ShardedSampler ShardedSampler::reshared(int64_t rank, int64_t ranks) const {
  fail_if<std::logic_error>(rank < 0 || rank >= ranks || ranks > global_batch_,
                            "share {} of {} of a global batch of {}", rank, ranks, global_batch_);
  ShardedSampler out = *this;
  out.rank_ = rank, out.ranks_ = ranks;
  return out;
}

EpochOrder ShardedSampler::epoch_order(int64_t epoch) const {
  return EpochOrder(size_, shuffle_, seed_, epoch);
}

torch::Tensor ShardedSampler::rank_indices(const EpochOrder& order, int64_t position) const {
  auto out = torch::empty({rank_batch()}, torch::kInt64);
  auto* p = out.data_ptr<int64_t>();
  for (int64_t i = 0; i < rank_batch(); ++i) p[i] = order.at(position + rank_ + i * ranks_);
  return out;
}

BatchAt ShardedSampler::at(int64_t step) const {
  const int64_t i = step - course_.step;
  fail_if<std::logic_error>(i < 0, "step {} before the sampler's course (from step {})", step,
                            course_.step);
  // The whole batches left in the course's first epoch, then whole epochs of them.
  const int64_t first = (size_ - course_.at.position) / global_batch_;
  if (i < first) return {course_.at.epoch, course_.at.position + i * global_batch_};
  const int64_t later = i - first, per_epoch = steps_per_epoch();
  return {course_.at.epoch + 1 + later / per_epoch, (later % per_epoch) * global_batch_};
}

ShardedSampler ShardedSampler::continued(int64_t step, int64_t global_batch) const {
  return on_course({step, at(step)}, global_batch);
}

ShardedSampler ShardedSampler::on_course(const Course& course, int64_t global_batch) const {
  fail_if<std::logic_error>(global_batch < 1 || global_batch > size_,
                            "a global batch of {} over {} samples", global_batch, size_);
  ShardedSampler out = *this;
  out.global_batch_ = global_batch;
  out.rank_ = 0, out.ranks_ = 1;
  out.course_ = course;
  return out;
}

bool ShardedSampler::same_shares(const ShardedSampler& o) const {
  return rank_ == o.rank_ && ranks_ == o.ranks_ && global_batch_ == o.global_batch_ &&
         course_.step == o.course_.step && course_.at.epoch == o.course_.at.epoch &&
         course_.at.position == o.course_.at.position;
}

}  // namespace dtrain
