#include "train/evaluator.hpp"

#include <chrono>

#include <fmt/format.h>
#include <torch/torch.h>

#include "train/report.hpp"

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

void evaluate_and_report(Context& c) {
  using Clock = std::chrono::steady_clock;
  auto& st = c.state;
  const auto t0 = Clock::now();
  const EvalResult eval = evaluate(c);
  st.last_eval = eval;
  if (std::isfinite(eval.metric) &&
      (!std::isfinite(st.best_metric) || c.task->better(eval.metric, st.best_metric)))
    st.best_metric = eval.metric, st.best_step = st.step;
  const double ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
  if (c.root()) c.metrics->write(eval_line(c, eval, ms));
  c.say(fmt::format("eval at step {}: loss {:.4f}, {} {:.4f}", st.step, eval.loss,
                    c.task->metric(), eval.metric));
}

}  // namespace dtrain
