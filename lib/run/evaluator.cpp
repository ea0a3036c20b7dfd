#include "run/evaluator.hpp"

#include <torch/torch.h>

#include "run/run.hpp"
#include "util/clock.hpp"

namespace dtrain {

namespace {

// Part `part` of `parts` of `test` scored on this rank: its loss, item count and correct
// items, summed over the mesh's data ranks.
torch::Tensor scored(MicroBatchRunner& runner, const ModelParts& model, const Dataset& test,
                     const Mesh& mesh, int64_t part, int64_t parts, int64_t batch_size,
                     const c10::Device& device) {
  const int64_t lo = test.size() * part / parts, hi = test.size() * (part + 1) / parts;
  const Task& task = model.task();
  EvalSums sums;
  // Every data rank runs as many batches (a rank whose share is done runs its first
  // sample again, uncounted): under ZeRO-3 each forward gathers over the data group.
  const int64_t most = (test.size() + parts - 1) / parts;
  for (int64_t start = lo; start < lo + most; start += batch_size) {
    const bool counted = start < hi;
    const int64_t from = counted ? start : std::min(lo, test.size() - 1);
    const int64_t n = counted ? std::min(batch_size, hi - start) : 1;
    Batch b = to_device(test.gather(torch::arange(from, from + n, torch::kInt64)), device);
    auto out = runner.infer(b.x);
    if (out.defined() && counted) task.accumulate(out, b, sums, *mesh.tensor());  // the last stage
  }
  auto t = torch::tensor({sums.loss, sums.count, sums.correct}, torch::kFloat64);
  mesh.data()->all_reduce(t);
  return t;
}

}  // namespace

EvalResult evaluate(MicroBatchRunner& runner, const ModelParts& model, const Dataset& test,
                    const Mesh& mesh, int64_t batch_size, const c10::Device& device,
                    const EvalSplit& split) {
  torch::NoGradGuard no_grad;
  model.set_training(false);
  int64_t parts = split.parts;
  auto t = scored(runner, model, test, mesh, split.part, parts, batch_size, device);
  if (split.across) {
    // Over the other replicas. Where that failed (a replica died), the replica's ranks
    // all score its share of the whole set again, together: ZeRO-3's forwards gather.
    auto failed = torch::tensor({split.across(t) ? 0.0 : 1.0}, torch::kFloat64);
    mesh.world()->all_reduce(failed, ReduceOp::kMax);
    if (failed.item<double>() > 0) {
      parts = mesh.dims().data;
      t = scored(runner, model, test, mesh, mesh.coord().data, parts, batch_size, device);
    }
  }
  model.set_training(true);
  // Over the pipeline's stages: only the last has sums.
  if (mesh.pipeline()->size() > 1) mesh.pipeline()->all_reduce(t);
  const Task& task = model.task();
  EvalSums total{t[0].item<double>(), t[1].item<double>(), t[2].item<double>()};
  return {total.loss / total.count, task.metric_value(total), parts};
}

void evaluate_and_report(Run& run, int64_t n) {
  const auto t0 = Clock::now();
  const EvalResult eval = evaluate(*run.runner, run.model, *run.data.test, run.mesh(),
                                   run.cfg.train.eval_batch_size, run.device(),
                                   run.mode->eval_split(n));
  run.log->eval(n, eval, ms_since(t0));
}

}  // namespace dtrain
