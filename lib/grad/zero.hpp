// ZeRO's layout of the flat buffers over the data ranks (zero.cpp): the one place that
// decides which shard a rank updates (the optimizer and the gradient sync agree on it).
#pragma once
#include <cstdint>
#include <functional>
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
// A fault-tolerant job's replicas, each of whose data ranks shard ZeRO's state (HSDP:
// shard within a replica, replicate across). Once a rank's shard of the gradient is reduced
// inside its replica, it is summed over `replicas` (the group of the ranks at its place in
// every replica, comm/replica_set.hpp), and each micro-batch's loss is scaled by `share()`,
// this rank's share of the global batch (however the survivors deal it), instead of by the
// data ranks: the sum is the global batch's mean.
struct AcrossReplicas {
  std::shared_ptr<Comm> replicas;  // null: one replica, the whole data group
  std::function<double()> share;
};
// ZeRO-1 (parallel.zero 1), 2 or 3's gradient sync over `mesh`'s data group.
std::unique_ptr<GradSync> make_zero_sync(const ParallelConfig& cfg, const Mesh& mesh,
                                         FlatParams& params, int64_t micro_batches, Tied tied,
                                         AcrossReplicas across = {});

}  // namespace dtrain
