// What a model is trained for: its loss, its evaluation metric and which way is better.
// The trainer, the best checkpoint and the summary ask the task; none of them knows
// "accuracy" or "perplexity".
//   classification   x: samples, y: [n] class ids; cross-entropy; accuracy, higher is better
//   language_model   x, y: [n, seq] token ids, y = x shifted by one; token cross-entropy
//                    (from logits split over the tensor group's ranks by vocabulary);
//                    perplexity = exp(mean token loss), lower is better
#pragma once
#include <string>

#include <torch/types.h>

#include "comm/comm.hpp"
#include "config/config.hpp"
#include "data/dataset.hpp"

namespace dtrain {

// Sums over evaluation batches, reduced over the data-parallel group before use.
struct EvalSums {
  double loss = 0;     // summed per-item loss
  double count = 0;    // items (samples or tokens)
  double correct = 0;  // classification only
};

class Task {
 public:
  virtual ~Task() = default;
  virtual const char* name() const = 0;    // "classification" | "language_model"
  virtual const char* metric() const = 0;  // "accuracy" | "perplexity"
  virtual bool higher_is_better() const = 0;
  // What it trains on: token windows (a language model) or labelled samples.
  virtual bool on_tokens() const = 0;
  // The items a sample counts for the throughput: a window's tokens, or 1.
  virtual int64_t items_per_sample(const Ints& sample_shape) const = 0;
  // The mean loss over one micro-batch, in fp32: what training differentiates. `tensor`
  // is the group a language model's vocabulary (its logits) is split over;
  // `label_smoothing` (classification only, validated) softens the targets.
  virtual torch::Tensor loss(const torch::Tensor& out, const Batch& batch, Comm& tensor,
                             double label_smoothing = 0) const = 0;
  virtual void accumulate(const torch::Tensor& out, const Batch& batch, EvalSums& sums,
                          Comm& tensor) const = 0;
  virtual double metric_value(const EvalSums& sums) const = 0;
  bool better(double a, double b) const { return higher_is_better() ? a > b : a < b; }
};

const Task& classification_task();
const Task& language_model_task();

}  // namespace dtrain
