#include "run/evaluator.hpp"

#include <torch/torch.h>

#include "run/run.hpp"
#include "util/clock.hpp"

namespace dtrain {

EvalResult evaluate(MicroBatchRunner& runner, const ModelParts& model, const Dataset& test,
                    const Mesh& mesh, int64_t batch_size, const c10::Device& device) {
  torch::NoGradGuard no_grad;
  model.set_training(false);
  const int64_t ranks = mesh.dims().data, r = mesh.coord().data;
  const int64_t lo = test.size() * r / ranks, hi = test.size() * (r + 1) / ranks;
  const Task& task = model.task();
  EvalSums sums;
  for (int64_t start = lo; start < hi; start += batch_size) {
    const int64_t n = std::min(batch_size, hi - start);
    Batch b = to_device(test.gather(torch::arange(start, start + n, torch::kInt64)), device);
    auto out = runner.infer(b.x);
    if (out.defined()) task.accumulate(out, b, sums, *mesh.tensor());  // the last stage
  }
  model.set_training(true);
  // Over the data-parallel replicas, then the pipeline's stages (only the last has sums).
  auto t = torch::tensor({sums.loss, sums.count, sums.correct}, torch::kFloat64);
  mesh.data()->all_reduce(t);
  if (mesh.pipeline()->size() > 1) mesh.pipeline()->all_reduce(t);
  EvalSums total{t[0].item<double>(), t[1].item<double>(), t[2].item<double>()};
  return {total.loss / total.count, task.metric_value(total)};
}

void evaluate_and_report(Run& run, int64_t n) {
  const auto t0 = Clock::now();
  const EvalResult eval = evaluate(*run.runner, run.model, *run.data.test, run.mesh(),
                                   run.cfg.train.eval_batch_size, run.device());
  run.log->eval(n, eval, ms_since(t0));
}

}  // namespace dtrain
