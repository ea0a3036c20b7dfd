#include "run/run.hpp"

#include <filesystem>

#include <torch/torch.h>

#include "config/schema.hpp"
#include "run/evaluator.hpp"
#include "util/clock.hpp"

namespace dtrain {
namespace fs = std::filesystem;

NamedTensors ModelParts::buffers() const {
  NamedTensors out;
  for (const auto& chunk : chunks)
    for (const auto& b : chunk->named_buffers()) out.emplace_back(b.key(), b.value());
  return out;
}

std::vector<torch::Tensor> ModelParts::float_buffers() const {
  std::vector<torch::Tensor> out;
  for (const auto& [name, b] : buffers())
    if (b.is_floating_point()) out.push_back(b);
  return out;
}

std::vector<Stateful*> Run::stateful() const {
  std::vector<Stateful*> out;
  for (const auto& s : savers) out.push_back(s.get());
  out.push_back(sync.get());
  if (auto* own = mode->state()) out.push_back(own);
  return out;
}

nlohmann::json Mode::layout() const {
  const auto& d = mesh().dims();
  return {{"data", d.data}, {"tensor", d.tensor}, {"pipeline", d.pipeline}};
}

TrainParts train_parts(Run& run) {
  return {run.cfg, *run.job, run.model, *run.params, *run.optimizer, *run.sync, *run.runner,
          run.scaler.get(), *run.data.train, *run.sampler, *run.log, run.total_steps,
          run.steps_per_epoch, run.finished, run.device(), run.opts.requeue_job,
          [&run](int64_t n) { evaluate_and_report(run, n); },
          [&run](int64_t n, bool evaluated, bool background) {
            save_checkpoint(run, n, evaluated, background);
          },
          [&run](bool wait) { checkpoint_progress(run, wait); },
          [&run] { take_over_files(run); },
          [&run](Comm& group, int64_t source, bool receive) {
            run.sync->settle();  // ZeRO's parameters, still on their way (as for a checkpoint)
            return hand_over(run.stateful(), group, source, receive, run.mesh().dims(),
                             to_yaml(run.cfg), run.device());
          }};
}

// The writing replica failed: this one locks the run directory, keeps the metrics lines
// through the last step it has read (the lines after it are its own to write) and says
// and writes from here on.
void take_over_files(Run& run) {
  const auto& cfg = run.cfg;
  run.checkpointer->take_over(std::chrono::seconds(cfg.dist.timeout_s));
  if (run.mesh().world()->rank() != 0) return;  // the replica's rank 0 says and writes
  run.metrics = std::make_unique<MetricsLog>(
      (fs::path(cfg.run_dir) / "metrics.jsonl").string(), run.log->last_read(),
      cfg.logging.tensorboard ? (fs::path(cfg.run_dir) / "tb").string() : "");
  run.progress = std::make_unique<Progress>(cfg.logging.progress, run.total_steps);
  run.log->take_over(run.metrics.get(), run.progress.get());
}

void save_checkpoint(Run& run, int64_t n, bool evaluated, bool background) {
  const auto t0 = Clock::now();
  run.sync->settle();  // ZeRO's parameters, still on their way to every rank
  const auto& st = run.state();
  std::optional<Metric> metric;
  const Task& task = run.model.task();
  if (evaluated && st.last_eval)
    metric = Metric{task.metric(), st.last_eval->metric, task.higher_is_better()};
  run.checkpointer->save(n, n / run.steps_per_epoch, metric, to_yaml(run.cfg), run.stateful(),
                         background);
  run.state().last_saved = n;
  run.log->checkpoint_stalled(ms_since(t0));
}

void checkpoint_progress(Run& run, bool wait) {
  if (!run.checkpointer->in_flight()) return;
  const auto t0 = Clock::now();
  if (wait)
    run.checkpointer->finish();
  else
    run.checkpointer->poll();
  run.log->checkpoint_stalled(ms_since(t0));
}

}  // namespace dtrain
