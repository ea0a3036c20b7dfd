// The loop: the cadence of steps, logs, evaluation, checkpoints and stopping. What happens
// inside a step is step.cpp's; what a line holds is report.cpp's.
#include <chrono>
#include <csignal>
#include <deque>

#include <fmt/format.h>

#include "data/loader.hpp"
#include "launch/requeue.hpp"
#include "optim/schedule.hpp"
#include "train/context.hpp"
#include "train/evaluator.hpp"
#include "train/report.hpp"
#include "train/signals.hpp"
#include "train/state.hpp"
#include "train/step.hpp"
#include "train/trainer.hpp"
#include "util/error.hpp"

namespace dtrain {
namespace {

// The run's last line: the progress display ends first, so the two never interleave.
void write_summary(const Context& c, const nlohmann::json& summary) {
  if (!c.root()) return;
  c.progress->finish();
  c.metrics->write(summary);
}

// A step with a non-finite loss or gradient. train.on_nonfinite: stop ends the run;
// skip goes on (the step made no update) unless train.max_skipped steps in a row were
// skipped. Either way nothing non-finite is checkpointed: the last good checkpoint stays
// the newest.
void handle_nonfinite(Context& c, const StepStats& s, int64_t step,
                      const std::vector<double>& step_ms, double data_wait_ms) {
  auto& st = c.state;
  const bool skip = c.cfg.train.on_nonfinite == "skip";
  if (skip) {
    ++st.skipped, ++st.skipped_in_a_row;
    c.say(fmt::format("warning: step {} skipped: non-finite loss or gradient (rank {}); {} in a "
                      "row", step, s.nonfinite_rank, st.skipped_in_a_row));
    if (st.skipped_in_a_row < c.cfg.train.max_skipped) return;
  }
  const std::string why =
      skip ? fmt::format("{} steps in a row had a non-finite loss or gradient (train.max_skipped), "
                         "the last at step {} (rank {})", st.skipped_in_a_row, step,
                         s.nonfinite_rank)
           : fmt::format("non-finite loss or gradient at step {} (rank {}); nothing from it on "
                         "was checkpointed", step, s.nonfinite_rank);
  auto summary = summary_line(c, "diverged", step_ms, data_wait_ms);
  summary["diverged_step"] = step;
  summary["diverged_rank"] = s.nonfinite_rank;
  summary["reason"] = why;
  write_summary(c, summary);
  throw DivergedError("training diverged: " + why);
}

// Steps are read this many steps after they were queued (train/step.hpp): on a GPU their
// figures have reached the host by then, so reading them never empties the device's queue.
// Two, not one, leaves room for a step that the host queues faster than the one before.
constexpr size_t kReadLag = 2;

}  // namespace

RunResult run_training(const JobConfig& cfg, const ParallelDims& dims, const RunOptions& opts,
                       const WorldInfo& world, std::shared_ptr<Comm> comm) {
  install_stop_signals();  // before setup: a stop during loading still ends with a checkpoint
  Context c(cfg, dims, opts, world, std::move(comm));
  setup(c);
  auto& st = c.state;
  if (c.finished) {
    c.say(fmt::format("nothing to train: the checkpoint is at step {} and the job ends at step {} "
                      "(train.max_steps, or train.epochs x {} steps); checkpoints and logs unchanged",
                      st.step, c.total_steps, c.steps_per_epoch()));
    return {0, nlohmann::json()};
  }
  Loader loader(*c.data.train, *c.sampler, st.step, c.total_steps, cfg.data.workers,
                cfg.data.prefetch, /*pin=*/c.device().is_cuda());
  const int64_t spe = c.steps_per_epoch();
  std::vector<double> step_ms;  // this process's steps, for the steady-state rate
  double data_wait_ms = 0;
  Window window;
  double rate = 0;
  bool stop = false;  // a read step says some rank was asked to stop
  std::deque<PendingStep> pending;  // queued, not read yet: oldest first
  auto is_log_step = [&](int64_t step) {
    return step % cfg.train.log_every == 0 || step == c.total_steps;
  };
  // A step's time is the wall time between readings, evaluations and checkpoints left
  // out: the host's time inside train_step is only its queueing, and the wait for the
  // device happens here. Over a run the times add up to the training's wall time.
  using Clock = std::chrono::steady_clock;
  auto mark = Clock::now();  // the last reading, moved on past evaluations and checkpoints
  auto not_training = [&](auto&& what) {
    const auto t0 = Clock::now();
    what();
    mark += Clock::now() - t0;
  };
  // Reads the oldest pending step: what a non-finite step means, its line and progress.
  auto read_oldest = [&] {
    PendingStep p = std::move(pending.front());
    pending.pop_front();
    StepStats s = read_step(c, p);
    const auto now = Clock::now();
    s.step_ms = std::chrono::duration<double, std::milli>(now - mark).count();
    mark = now;
    if (s.nonfinite) {
      handle_nonfinite(c, s, p.step, step_ms, data_wait_ms);
    } else {
      st.skipped_in_a_row = 0;
      st.last_loss = s.loss;
    }
    stop = stop || s.stop;
    window.add(s);
    step_ms.push_back(s.step_ms);
    data_wait_ms += s.data_wait_ms;
    const double lr = lr_at(cfg.schedule, cfg.optimizer.lr, p.step, c.total_steps);  // it used
    const bool log_now = is_log_step(p.step);
    if (log_now) {
      auto line = train_line(c, p.step, s, window, lr);
      rate = line["samples_per_s"].get<double>();
      if (c.root()) c.metrics->write(line);
      window = Window{};
    }
    if (c.root()) c.progress->step(p.step, st.last_loss, lr, rate, log_now);
  };
  auto read_all = [&] {
    while (!pending.empty()) read_oldest();
  };
  try {
    while (st.step < c.total_steps) {
      const int64_t n = st.step + 1;  // this step
      const bool epoch_end = n % spe == 0, last = n == c.total_steps;
      const bool eval_now =
          (cfg.train.eval_every > 0 ? n % cfg.train.eval_every == 0 : epoch_end) || last;
      const bool save_now =
          (cfg.checkpoint.every_steps > 0 ? n % cfg.checkpoint.every_steps == 0 : epoch_end) ||
          last;
      pending.push_back(train_step(c, loader, is_log_step(n), eval_now || save_now));
      while (pending.size() > kReadLag) read_oldest();
      // Every step is read before anything that must not see a non-finite one: an
      // evaluation, a checkpoint, the end.
      if (eval_now || save_now || stop) read_all();
      std::optional<EvalResult> eval;
      if (eval_now) not_training([&] {
        const auto t0 = Clock::now();
        eval = evaluate(c);
        st.last_eval = eval;
        if (std::isfinite(eval->metric) &&
            (!std::isfinite(st.best_metric) || c.task->better(eval->metric, st.best_metric)))
          st.best_metric = eval->metric, st.best_step = st.step;
        const double ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
        if (c.root()) c.metrics->write(eval_line(c, *eval, ms));
        c.say(fmt::format("eval at step {}: loss {:.4f}, {} {:.4f}", st.step, eval->loss,
                          c.task->metric(), eval->metric));
      });
      if (save_now) not_training([&] { save_checkpoint(c, eval); });

      if (stop) {
        if (st.last_saved != st.step) save_checkpoint(c, std::nullopt);
        const int sig = stop_signal() ? stop_signal() : SIGTERM;  // a peer's signal
        auto summary = summary_line(c, "stopped", step_ms, data_wait_ms);
        summary["signal"] = sig;
        c.say(fmt::format("stopped by signal {} after step {}; checkpoint saved", sig, st.step));
        // SLURM's warning signal: put the job back in the queue; it resumes from here.
        if (c.root() && sig == SIGUSR1 && !c.opts.requeue_job.empty()) {
          const auto why_not = requeue_slurm_job(c.opts.requeue_job, std::chrono::seconds(60));
          summary["requeued"] = why_not.empty();
          c.say(why_not.empty() ? fmt::format("requeued SLURM job {}; it resumes from step {}",
                                              c.opts.requeue_job, st.step)
                                : "warning: not requeued: " + why_not);
        }
        if (c.root()) c.metrics->write(summary);
        return {exit_code_for_signal(sig), summary};
      }
    }
  } catch (const DivergedError&) {
    throw;  // its summary is written
  } catch (const Error& e) {
    // A checkpoint that could not be written, a peer that failed: the record says so.
    auto summary = summary_line(c, "failed", step_ms, data_wait_ms);
    summary["reason"] = first_line(e.what());
    write_summary(c, summary);
    throw;
  }
  auto summary = summary_line(c, "completed", step_ms, data_wait_ms);
  write_summary(c, summary);
  c.say(fmt::format("done: {} steps, final loss {:.4f}, {:.0f} samples/s{}{}", st.step,
                    st.last_loss, summary["samples_per_s"].get<double>(),
                    c.items_per_sample() > 1
                        ? fmt::format(" ({:.0f} tokens/s)", summary["tokens_per_s"].get<double>())
                        : "",
                    st.last_eval ? fmt::format(", eval {} {:.4f} (best {:.4f} at step {})",
                                               c.task->metric(), st.last_eval->metric,
                                               st.best_metric, st.best_step)
                                 : ""));
  return {0, summary};
}

}  // namespace dtrain
