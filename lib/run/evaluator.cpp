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
  // Every data rank runs as many batches (a rank whose share is done runs its first
  // sample again, uncounted): under ZeRO-3 each forward gathers over the data group.
  const int64_t most = (test.size() + ranks - 1) / ranks;
  for (int64_t start = lo; start < lo + most; start += batch_size) {
    const bool counted = start < hi;
    const int64_t from = counted ? start : std::min(lo, test.size() - 1);
    const int64_t n = counted ? std::min(batch_size, hi - start) : 1;
    Batch b = to_device(test.gather(torch::arange(from, from + n, torch::kInt64)), device);
    auto out = runner.infer(b.x);
    if (out.defined() && counted) task.accumulate(out, b, sums, *mesh.tensor());  // the last stage
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
