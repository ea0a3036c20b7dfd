// ZeRO's layout of the flat buffers over the data ranks (zero.cpp): the one place that
// decides which shard a rank updates (the optimizer and the gradient sync agree on it).
#pragma once
#include <cstdint>
#include <memory>

#include "grad/grad_sync.hpp"
#include "parallel/dims.hpp"

namespace dtrain {

// Shards start at a multiple of this many elements (64 bytes in fp32): aligned for the
// vectorised update.
constexpr int64_t kShardAlign = 16;
// ZeRO-2's (and 3's) buckets reduced at once: the gradient takes the shard plus these.
constexpr int64_t kZeroInFlight = 4;

// The flat buffers' options under parallel.zero: padded so that they cut into equal
// shards, and under ZeRO-2 the gradient held for this rank's shard only.
void shard_flat(const ParallelConfig& cfg, const ParallelDims& dims, const Coord& at,
                FlatOptions& opts);
// The part of the flat buffers the rank at `at` updates: the whole without ZeRO, else its
// data rank's equal shard.
Shard update_shard(const ParallelConfig& cfg, const ParallelDims& dims, const Coord& at,
                   const FlatParams& params);
// ZeRO-1 (parallel.zero 1) or ZeRO-2's gradient sync over `mesh`'s data group.
std::unique_ptr<GradSync> make_zero_sync(const ParallelConfig& cfg, const Mesh& mesh,
                                         FlatParams& params, int64_t micro_batches, Tied tied);

}  // namespace dtrain
