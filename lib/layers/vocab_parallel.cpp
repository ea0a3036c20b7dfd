#include "layers/vocab_parallel.hpp"

#include <fmt/format.h>
#include <torch/torch.h>

#include "layers/tensor_parallel.hpp"
#include "layers/linear.hpp"
#include "util/error.hpp"

namespace dtrain {
namespace F = torch::nn::functional;

VocabParallelEmbeddingImpl::VocabParallelEmbeddingImpl(int64_t vocab, int64_t dim,
                                                       std::shared_ptr<Comm> tensor,
                                                       torch::TensorOptions options)
    : vocab_(vocab), tensor_(std::move(tensor)) {
  fail_if<ConfigError>(vocab % tensor_->size() != 0, "model.vocab: {} does not split over "
                       "parallel.tensor {}", vocab, tensor_->size());
  weight = register_parameter("weight", torch::empty({vocab / tensor_->size(), dim}, options));
}

Placement VocabParallelEmbeddingImpl::placement_of(const std::string&) const {
  return Placement::split(/*dim=*/0, tensor_->size());
}

torch::Tensor VocabParallelEmbeddingImpl::forward(const torch::Tensor& ids) {
  if (tensor_->size() == 1) return F::embedding(ids, weight);
  const int64_t rows = weight.size(0), first = tensor_->rank() * rows;
  auto mine = (ids >= first).logical_and(ids < first + rows);
  auto local = (ids - first).masked_fill(mine.logical_not(), 0);
  auto e = F::embedding(local, weight).masked_fill(mine.logical_not().unsqueeze(-1), 0.0);
  return reduce_from_tensor_region(e, tensor_);
}

torch::Tensor VocabParallelEmbeddingImpl::logits(const torch::Tensor& x) {
  return dtrain::linear(copy_to_tensor_region(x, tensor_), weight);
}

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Megatron's formulation: the global max and the global sum of exponentials by two small
// all-reduces, the target's logit from the rank that holds it by a third.
struct VocabParallelCrossEntropy : torch::autograd::Function<VocabParallelCrossEntropy> {
  static torch::Tensor forward(AutogradContext* ctx, torch::Tensor logits, torch::Tensor targets,
                               Comm* group) {
    auto& comm = *group;
    const int64_t rows = logits.size(1), first = comm.rank() * rows;
    auto max = std::get<0>(logits.max(1)).contiguous();
    comm.all_reduce(max, ReduceOp::kMax);
    auto shifted = logits - max.unsqueeze(1);
    auto mine = (targets >= first).logical_and(targets < first + rows);
    auto local = (targets - first).masked_fill(mine.logical_not(), 0);
    auto picked = shifted.gather(1, local.unsqueeze(1)).squeeze(1).masked_fill(mine.logical_not(), 0.0)
                      .contiguous();
    auto exp = shifted.exp();
    auto sum_exp = exp.sum(1).contiguous();
    comm.all_reduce(picked);
    comm.all_reduce(sum_exp);
    ctx->save_for_backward({exp.div_(sum_exp.unsqueeze(1)), local, mine});  // softmax
    return sum_exp.log() - picked;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    auto grad = saved[0].clone();  // softmax - one-hot(target) on the rank holding it
    grad.scatter_add_(1, saved[1].unsqueeze(1), saved[2].to(grad.dtype()).neg().unsqueeze(1));
    grad.mul_(grads[0].unsqueeze(1));
    return {grad, torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace

torch::Tensor vocab_parallel_cross_entropy(const torch::Tensor& local_logits,
                                           const torch::Tensor& targets, Comm& tensor) {
  // In fp32 whatever the logits' precision (as Megatron-LM and torchtitan take it; PyTorch's
  // autocast leaves it in bf16). With one rank, fp16 logits on CUDA go straight into
  // LibTorch's half-to-float log-softmax, with no fp32 copy of the [tokens, vocabulary]
  // logits; bf16 ones (LibTorch has no such kernel for them) are cast first.
  if (tensor.size() == 1)
    return F::nll_loss(torch::log_softmax(local_logits, 1, torch::kFloat32), targets,
                       F::NLLLossFuncOptions().reduction(torch::kNone));
  return VocabParallelCrossEntropy::apply(local_logits.to(torch::kFloat32), targets, &tensor);
}

}  // namespace dtrain
