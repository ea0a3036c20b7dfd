#include "train/evaluator.hpp"

#include <torch/torch.h>

namespace dtrain {

EvalResult evaluate(Context& c) {
  torch::NoGradGuard no_grad;
  c.set_training(false);
  const auto& test = *c.data.test;
  const int64_t ranks = c.mesh.dims().data, r = c.mesh.coord().data;
  const int64_t lo = test.size() * r / ranks, hi = test.size() * (r + 1) / ranks;
  EvalSums sums;
  for (int64_t start = lo; start < hi; start += c.cfg.train.eval_batch_size) {
    const int64_t n = std::min(c.cfg.train.eval_batch_size, hi - start);
    Batch b = to_device(test.gather(torch::arange(start, start + n, torch::kInt64)), c.device());
    auto out = c.runner->infer(b.x);
    if (out.defined()) c.task->accumulate(out, b, sums, *c.mesh.tensor());  // the last stage
  }
  c.set_training(true);
  // Over the data-parallel replicas, then the pipeline's stages (only the last has sums).
  auto t = torch::tensor({sums.loss, sums.count, sums.correct}, torch::kFloat64);
  c.mesh.data()->all_reduce(t);
  if (c.mesh.pipeline()->size() > 1) c.mesh.pipeline()->all_reduce(t);
  EvalSums total{t[0].item<double>(), t[1].item<double>(), t[2].item<double>()};
  return {total.loss / total.count, c.task->metric_value(total)};
}

}  // namespace dtrain
