// What a gradient sync keeps and sends on one data rank in a step, declared beside the
// code that keeps and sends it (grad_sync.cpp, zero.cpp; each compression's bytes in
// compression.cpp), so that the planner (plan/) adds it up and names no strategy. The
// padding and the shards come from the functions that lay out the flat buffers
// (shard_flat, flat_sizes), the same ones a run allocates by.
#pragma once
#include <cstdint>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "config/config.hpp"

namespace dtrain {

// A pipeline rank's parameters as FlatParams lays them out, shapes only (the planner builds
// them from the model's outline): its chunks' in order, each once; ZeRO-3's units over
// them and forward's uses of the units.
struct FlatShape {
  struct Entry {
    std::string name;
    std::vector<int64_t> shape;
    int64_t numel = 0;
    int64_t offset = 0;
    // Bytes a value takes once cast for compute: autocast's 16-bit copy of a weight it
    // casts, and ZeRO-3's gathers of it (FlatOptions::compute_dtype); 4 where it stays fp32.
    int64_t gathered = 4;
  };
  struct Unit {
    int64_t offset = 0, numel = 0;
    size_t chunk = 0;
    std::vector<size_t> entries;
    double bytes = 0;          // gathered
    std::set<int64_t> dtypes;  // its entries' gathered sizes: a broadcast each
  };
  std::vector<Entry> entries;
  std::vector<Unit> units;
  std::vector<std::vector<std::vector<size_t>>> uses;  // per chunk: the units each use gathers
  int64_t total = 0;       // parameters
  int64_t tied = 0;        // of them, a weight tied across stages (summed over the pipeline)
  std::vector<std::pair<int64_t, int64_t>> tied_at;  // its [begin, end) in the flat buffer
  bool first = false, last = false;  // holds the model's first / last part
};

// Where the rank syncs: its data group and its step's passes over its chunks.
struct DataGroup {
  int64_t ranks = 1, rank = 0;
  int64_t micro = 1;          // micro-batches a step
  bool sums_16bit = false;    // the backend sums fp16 and bf16 itself (NCCL; Gloo does not)
  // The step's forward and backward passes in the order the runner makes them: (chunk,
  // forward?) (ZeRO-3 gathers a chunk's units at each).
  std::vector<std::pair<size_t, bool>> passes;
};

struct SyncCost {
  int64_t numel = 0;             // the flat buffers' length, padded
  int64_t shard = 0;             // the values this rank updates (its optimizer state's)
  double params = 0, grads = 0;  // bytes it keeps of the two buffers
  // What else the gradient's path holds at its peak: autograd's gradient of the parameter
  // backward is finishing, autocast's 16-bit copies of the weights it casts (where they are
  // not the held ones), buckets in flight, gathered units, micro-batches' sums, a residual.
  double buffers = 0;
  std::optional<double> bytes;  // sent a step over the data group (nullopt: no estimate)
  double ops = 0;               // the collectives that takes (each pays the link's latency)
};

// The gradient sync make_grad_sync chooses for `cfg` (grad_sync.hpp): none at one data
// rank, ZeRO's under parallel.zero, else parallel.compression's (`none`: all-reduce).
SyncCost grad_sync_cost(const ParallelConfig& cfg, const FlatShape& shape, const DataGroup& group);
// The buffers' cost with nothing sharded, padded to `pad_to`: what every rank of a data
// group holds without ZeRO (also a mode's own layout: a parameter server's).
SyncCost unsharded_cost(const FlatShape& shape, int64_t pad_to = 1);
// ZeRO's (zero.cpp), at more than one data rank.
SyncCost zero_sync_cost(const ParallelConfig& cfg, const FlatShape& shape, const DataGroup& group);
// Autograd's gradient of the largest parameter before it goes into the flat gradient (in
// the gathered dtype where `gathered`: ZeRO-3's compute-dtype weights), and autocast's
// 16-bit copies of the weights it casts, bytes: what the gradient's path holds besides
// the sync's own buffers.
struct GradientPath {
  double largest = 0, copies = 0;
};
GradientPath gradient_path(const FlatShape& shape, bool gathered);
// Buckets of parallel.bucket_mb a flat gradient of `numel` fp32 values takes.
double buckets_of(const ParallelConfig& cfg, int64_t numel);

}  // namespace dtrain
