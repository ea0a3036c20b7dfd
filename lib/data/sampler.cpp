// Deterministic shuffling with our own generator, so the order is the same for every
// LibTorch version and standard library (std::shuffle's algorithm is unspecified).
#include "data/sampler.hpp"

#include <numeric>

#include "util/error.hpp"

namespace dtrain {

namespace {
// splitmix64: a small, well-mixed generator with a fixed, documented output.
struct SplitMix64 {
  uint64_t state;
  uint64_t next() {
    uint64_t z = (state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  // Unbiased integer in [0, bound) by rejection.
  uint64_t below(uint64_t bound) {
    const uint64_t limit = UINT64_MAX - UINT64_MAX % bound;
    uint64_t x;
    do x = next(); while (x >= limit);
    return x % bound;
  }
};
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

std::vector<int64_t> ShardedSampler::epoch_order(int64_t epoch) const {
  std::vector<int64_t> order(size_);
  std::iota(order.begin(), order.end(), 0);
  if (!shuffle_) return order;
  SplitMix64 rng{seed_ * 0x100000001B3ull + static_cast<uint64_t>(epoch) + 1};
  for (int64_t i = size_ - 1; i > 0; --i)  // Fisher-Yates
    std::swap(order[i], order[rng.below(static_cast<uint64_t>(i) + 1)]);
  return order;
}

torch::Tensor ShardedSampler::rank_indices(const std::vector<int64_t>& order, int64_t step) const {
  auto out = torch::empty({rank_batch()}, torch::kInt64);
  auto* p = out.data_ptr<int64_t>();
  const int64_t base = step * global_batch_;
  for (int64_t i = 0; i < rank_batch(); ++i) p[i] = order[base + rank_ + i * ranks_];
  return out;
}

}  // namespace dtrain
