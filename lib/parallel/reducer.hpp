// Data-parallel gradient averaging. The flat gradient buffer is cut into buckets of up to
// parallel.bucket_mb, from its end (the order backward produces gradients) to its start. An
// autograd post-hook on each parameter's AccumulateGrad node counts down the buckets it
// touches; a bucket whose gradients are all final is all-reduced at once, asynchronously,
// so the communication overlaps the rest of backward. Buckets are launched strictly in
// order, so every rank issues the same sequence of collectives.
#pragma once
#include <memory>
#include <vector>

#include <torch/torch.h>

#include "dist/comm.hpp"
#include "train/flat_params.hpp"

namespace dtrain {

class GradReducer {
 public:
  GradReducer(torch::nn::Module& model, FlatParams& params, std::shared_ptr<Comm> comm,
              double bucket_mb);

  // Gradient accumulation: micro-steps before the last do not communicate.
  void set_sync(bool on) { sync_ = on; }
  // Launches buckets no hook completed (parameters unused this step), waits for all, and
  // leaves the sum over ranks in params.grad() (the trainer scales each rank's loss by
  // 1 / ranks, so the sum is the average).
  void finalize();

  int64_t bytes_per_step() const { return params_.grad().numel() * params_.grad().element_size(); }

 private:
  struct Bucket {
    int64_t offset, numel;
    int64_t params;      // how many parameters overlap it
    int64_t remaining;   // hooks still to fire this step
  };
  void on_grad_ready(size_t bucket);
  void launch_ready();

  FlatParams& params_;
  std::shared_ptr<Comm> comm_;
  std::vector<Bucket> buckets_;  // in launch order (highest offsets first)
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators_;  // hooks live on these
  std::vector<std::unique_ptr<Pending>> inflight_;
  size_t next_launch_ = 0;
  bool sync_ = true;
};

}  // namespace dtrain
