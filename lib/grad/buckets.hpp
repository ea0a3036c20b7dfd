// Which slices of the flat gradient are final during backward, in launch order. The buffer
// is cut into buckets of up to parallel.bucket_mb from its end (the order backward produces
// gradients) to its start; an autograd post-hook on each parameter's AccumulateGrad node
// counts down the buckets it overlaps. A bucket is handed out (`ready`) as soon as it and
// every bucket before it are final, so every rank hands out the same sequence and a
// reduction launched from it overlaps the rest of backward. What is done with a ready
// slice (an all-reduce, a reduce-scatter, a compressed exchange) is the GradSync's.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <utility>
#include <vector>

#include <torch/csrc/autograd/function.h>

namespace dtrain {

class FlatParams;

// How many values a bucket of `bucket_mb` MiB holds (at least one).
int64_t bucket_numel(const FlatParams& params, double bucket_mb);

class GradBuckets {
 public:
  // `ready(offset, numel)`: a final slice of the flat gradient, in launch order.
  using Ready = std::function<void(int64_t offset, int64_t numel)>;
  // `arrived(entry)`: entry's gradient is final (called while armed, before the count; under
  // ZeRO-2 it is then copied out of the parameter's own gradient).
  using Arrived = std::function<void(size_t entry)>;
  GradBuckets(FlatParams& params, double bucket_mb, Ready ready, Arrived arrived = nullptr);
  GradBuckets(const GradBuckets&) = delete;  // the hooks point here
  GradBuckets& operator=(const GradBuckets&) = delete;

  // The hooks count only while armed: during the last micro-batch's backward of a step.
  void arm(bool on) { armed_ = on; }
  // Hands out every bucket not handed out yet (parameters unused this step), then starts
  // the next step's count.
  void flush();
  // The buckets as (offset, numel), in launch order.
  std::vector<std::pair<int64_t, int64_t>> slices() const;

 private:
  struct Bucket {
    int64_t offset, numel;
    int64_t params;     // how many parameters overlap it
    int64_t remaining;  // hooks still to fire this step
  };
  void hand_out();

  Ready ready_;
  Arrived arrived_;
  std::vector<Bucket> buckets_;  // in launch order (highest offsets first)
  // A shared_ptr before LibTorch 2.15, an intrusive_ptr from then on: whichever it returns.
  using Accumulator = decltype(torch::autograd::impl::grad_accumulator(std::declval<torch::Tensor>()));
  std::vector<Accumulator> accumulators_;  // hooks live on these
  size_t next_ = 0;
  bool armed_ = true;
};

}  // namespace dtrain
