// Megatron-style tensor parallelism: one layer's weights split over the tensor group.
//
// A column-parallel linear layer splits its output features: each rank computes a slice of
// the output from the whole input. A row-parallel layer splits its input features: each
// rank multiplies its slice of the input by its slice of the weight, and the partial
// products are summed. Paired (column then row), as in a transformer's MLP or attention,
// they need one all-reduce forward and one backward:
//   f = copy_to_tensor_region     identity forward, all-reduce of the gradient backward
//   g = reduce_from_tensor_region all-reduce forward, identity backward
// Everything outside the pair (norms, embeddings, residuals) is replicated and gets the
// same gradient on every tensor rank, because f sums the gradient that flows back into it.
//
// The layers create their part of the weights uninitialised: the model's rule fills them by
// name, each rank its part of the whole tensor (models/init.hpp), so tensor N starts from
// exactly the model one process trains.
#pragma once
#include <functional>
#include <memory>

#include <torch/nn/module.h>

#include "comm/comm.hpp"
#include "parallel/flat_params.hpp"

namespace dtrain {

torch::Tensor copy_to_tensor_region(const torch::Tensor& x, const std::shared_ptr<Comm>& tensor);
torch::Tensor reduce_from_tensor_region(const torch::Tensor& x,
                                        const std::shared_ptr<Comm>& tensor);

struct ParallelLinearOptions {
  int64_t in, out;
  bool bias = true;
  // Column-parallel: the output is `blocks` equal blocks split separately (fused QKV: 3).
  int64_t blocks = 1;
  // Where the weights are created: the CPU, a GPU, or the meta device for a model built
  // for its shapes only.
  torch::TensorOptions options = {};
};

// y[..., out / T] = x[..., in] W^T + b, with W split along its rows (output features).
class ColumnParallelLinearImpl : public torch::nn::Module, public PlacedModule, public CastModule {
 public:
  ColumnParallelLinearImpl(const ParallelLinearOptions& opts, std::shared_ptr<Comm> tensor);
  torch::Tensor forward(const torch::Tensor& x);
  Placement placement_of(const std::string& param) const override;
  // Both: torch::linear takes them (autocast casts all of its inputs).
  bool cast_by_autocast(const std::string&) const override { return true; }

  torch::Tensor weight, bias;

 private:
  ParallelLinearOptions opts_;
  std::shared_ptr<Comm> tensor_;
};
TORCH_MODULE(ColumnParallelLinear);

// y[..., out] = sum over ranks of x[..., in / T] W_r^T, + b; W split along its columns.
class RowParallelLinearImpl : public torch::nn::Module, public PlacedModule, public CastModule {
 public:
  RowParallelLinearImpl(const ParallelLinearOptions& opts, std::shared_ptr<Comm> tensor);
  torch::Tensor forward(const torch::Tensor& x);
  Placement placement_of(const std::string& param) const override;
  // The weight; the bias only on one rank, where torch::linear takes it (over several it
  // is added after the sum, in the output's dtype against its own).
  bool cast_by_autocast(const std::string& param) const override {
    return param == "weight" || tensor_->size() == 1;
  }

  torch::Tensor weight, bias;

 private:
  ParallelLinearOptions opts_;
  std::shared_ptr<Comm> tensor_;
};
TORCH_MODULE(RowParallelLinear);

}  // namespace dtrain
