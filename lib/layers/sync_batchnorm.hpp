// BatchNorm whose batch statistics cover the whole global batch: per-channel sums are
// all-reduced over the data-parallel ranks in forward, and the two sums the input gradient
// needs are all-reduced in backward (the formulation of torch.nn.SyncBatchNorm). Parameter
// and buffer names match torch::nn::BatchNorm2d, so checkpoints move between layouts.
#pragma once
#include <memory>

#include <torch/torch.h>

#include "comm/comm.hpp"

namespace dtrain {

class SyncBatchNorm2dImpl : public torch::nn::Cloneable<SyncBatchNorm2dImpl> {
 public:
  SyncBatchNorm2dImpl(int64_t channels, std::shared_ptr<Comm> comm,
                      torch::TensorOptions options = {}, double eps = 1e-5, double momentum = 0.1);
  void reset() override;
  torch::Tensor forward(const torch::Tensor& x);

  torch::Tensor weight, bias, running_mean, running_var, num_batches_tracked;

 private:
  int64_t channels_;
  std::shared_ptr<Comm> comm_;
  torch::TensorOptions options_;  // where it is built (the meta device: shapes only)
  double eps_, momentum_;
};
TORCH_MODULE(SyncBatchNorm2d);

}  // namespace dtrain
