// Vocabulary parallelism (Megatron's): the token embedding, and the LM head tied to it,
// split by rows over the tensor group, so each rank holds and multiplies by V / T of the
// vocabulary; the cross-entropy is computed from the split logits without gathering them.
// At GPT-2's shape the head is a third of the model's FLOPs: replicated, every tensor rank
// would repeat it.
#pragma once
#include <memory>

#include <torch/nn/module.h>

#include "comm/comm.hpp"
#include "parallel/flat_params.hpp"

namespace dtrain {

// Embedding rows [rank * V/T, (rank + 1) * V/T) on each rank; a lookup is summed over the
// group (each token's row lives on exactly one rank). Created uninitialised, where
// `options` says: the model's rule fills it (models/init.hpp).
class VocabParallelEmbeddingImpl : public torch::nn::Module, public PlacedModule {
 public:
  VocabParallelEmbeddingImpl(int64_t vocab, int64_t dim, std::shared_ptr<Comm> tensor,
                             torch::TensorOptions options = {});
  torch::Tensor forward(const torch::Tensor& ids);
  // This rank's logits [..., V / T] for hidden states x [..., dim]: the tied LM head.
  torch::Tensor logits(const torch::Tensor& x);
  Placement placement_of(const std::string& param) const override;

  torch::Tensor weight;

 private:
  int64_t vocab_;
  std::shared_ptr<Comm> tensor_;
};
TORCH_MODULE(VocabParallelEmbedding);

// Per-item cross-entropy [n], in fp32, from logits split over the vocabulary (this rank's
// [n, V / T] in any floating type, covering ids [rank * V/T, (rank + 1) * V/T)) and
// targets [n]; every rank gets the full result. With one rank, torch's log-softmax and NLL.
torch::Tensor vocab_parallel_cross_entropy(const torch::Tensor& local_logits,
                                           const torch::Tensor& targets, Comm& tensor);

}  // namespace dtrain
