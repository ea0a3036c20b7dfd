#include "models/task.hpp"

#include <cmath>

#include <torch/torch.h>

#include "layers/vocab_parallel.hpp"

namespace dtrain {
namespace {
namespace F = torch::nn::functional;

class Classification : public Task {
 public:
  const char* name() const override { return "classification"; }
  const char* metric() const override { return "accuracy"; }
  bool higher_is_better() const override { return true; }
  bool on_tokens() const override { return false; }
  int64_t items_per_sample(const Ints&) const override { return 1; }
  torch::Tensor loss(const torch::Tensor& out, const Batch& b, Comm&,
                     double label_smoothing) const override {
    return F::cross_entropy(out.to(torch::kFloat32), b.y,
                            F::CrossEntropyFuncOptions().label_smoothing(label_smoothing));
  }
  void accumulate(const torch::Tensor& out, const Batch& b, EvalSums& s, Comm&) const override {
    auto logits = out.to(torch::kFloat32);
    s.loss += F::cross_entropy(logits, b.y, F::CrossEntropyFuncOptions().reduction(torch::kSum))
                  .item<double>();
    s.correct += double(logits.argmax(1).eq(b.y).sum().item<int64_t>());
    s.count += double(b.y.size(0));
  }
  double metric_value(const EvalSums& s) const override { return s.correct / s.count; }
};

class LanguageModel : public Task {
 public:
  const char* name() const override { return "language_model"; }
  const char* metric() const override { return "perplexity"; }
  bool higher_is_better() const override { return false; }
  bool on_tokens() const override { return true; }
  int64_t items_per_sample(const Ints& sample_shape) const override { return sample_shape.at(0); }
  torch::Tensor loss(const torch::Tensor& out, const Batch& b, Comm& tensor,
                     double /*label_smoothing: refused*/) const override {
    return per_token(out, b, tensor).mean();
  }
  void accumulate(const torch::Tensor& out, const Batch& b, EvalSums& s,
                  Comm& tensor) const override {
    s.loss += per_token(out, b, tensor).sum().item<double>();
    s.count += double(b.y.numel());
  }
  double metric_value(const EvalSums& s) const override { return std::exp(s.loss / s.count); }

 private:
  static torch::Tensor per_token(const torch::Tensor& out, const Batch& b, Comm& tensor) {
    return vocab_parallel_cross_entropy(out.reshape({-1, out.size(-1)}), b.y.reshape(-1), tensor);
  }
};

}  // namespace

const Task& classification_task() {
  static const Classification task;
  return task;
}
const Task& language_model_task() {
  static const LanguageModel task;
  return task;
}

}  // namespace dtrain
