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
#include "train/async_ps.hpp"
#include "train/cadence.hpp"
#include "train/evaluator.hpp"
#include "train/report.hpp"
#include "train/signals.hpp"
#include "train/state.hpp"
#include "train/step.hpp"
#include "train/trainer.hpp"
#include "util/error.hpp"

namespace dtrain {
namespace {

// A step with a non-finite loss or gradient. train.on_nonfinite: stop ends the run;
// skip goes on (the step made no update) unless train.max_skipped steps in a row were
// skipped. Either way nothing non-finite is checkpointed: the last good checkpoint stays
// the newest. Between local SGD's meetings the step is this replica's alone: what would end
// the run is remembered (state.diverged_at) and ends it where the ranks next meet, all
// together.
void handle_nonfinite(Context& c, const StepStats& s, int64_t step,
                      const std::vector<double>& step_ms, double data_wait_ms) {
  auto& st = c.state;
  const bool skip = c.cfg.train.on_nonfinite == "skip" && !s.replica_diverged;
  if (skip) {
    ++st.skipped, ++st.skipped_in_a_row;
    c.say(fmt::format("warning: step {} skipped: non-finite loss or gradient (rank {}); {} in a "
                      "row", step, s.nonfinite_rank, st.skipped_in_a_row));
    if (st.skipped_in_a_row < c.cfg.train.max_skipped) return;
  }
  if (!c.mode->meets(step)) {
    if (st.diverged_at == 0) st.diverged_at = step;
    return;
  }
  const std::string why =
      s.replica_diverged
          ? fmt::format("non-finite loss or gradient on rank {} between averages of the data "
                        "replicas (parallel.mode: local_sgd), found where they met after step "
                        "{}; nothing from it on was checkpointed", s.nonfinite_rank, step)
      : skip ? fmt::format("{} steps in a row had a non-finite loss or gradient (train.max_skipped), "
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

using Clock = std::chrono::steady_clock;

// The queued steps and what reading them adds up to: the train lines, progress, the step
// times for the summary, and whether some rank asked to stop. A step's time runs from the
// previous step's finish to its own, evaluations and checkpoints left out, so over a run
// the times add up to the training's wall time. A step finishes when the host first sees
// it done: on the CPU as train_step returns, on a GPU when its figures' event has fired
// (looked at, without waiting, each time a step is queued; at the latest when it is read).
class StepReader {
 public:
  StepReader(Context& c, const Cadence& cadence) : c_(c), cadence_(cadence) {}

  void queue(PendingStep p) {
    pending_.push_back(std::move(p));
    const auto now = Clock::now();
    for (auto& q : pending_)
      if (!q.finished_at && q.finished()) q.finished_at = now;
    while (pending_.size() > kReadLag) read_oldest();
  }
  // Every step is read before anything that must not see a non-finite one: an
  // evaluation, a checkpoint, the end.
  void read_all() {
    while (!pending_.empty()) read_oldest();
  }
  // Runs `what` (an evaluation, a checkpoint) outside every step's time.
  template <class F>
  void not_training(F&& what) {
    const auto t0 = Clock::now();
    what();
    mark_ += Clock::now() - t0;
  }
  bool stop() const { return stop_; }
  nlohmann::json summary(const std::string& status) const {
    return summary_line(c_, status, step_ms_, data_wait_ms_);
  }

 private:
  // The oldest pending step: what a non-finite step means, its line and progress.
  void read_oldest() {
    PendingStep p = std::move(pending_.front());
    pending_.pop_front();
    StepStats s = read_step(c_, p);
    const auto finished = p.finished_at.value_or(Clock::now());
    s.step_ms = std::chrono::duration<double, std::milli>(finished - mark_).count();
    mark_ = finished;
    auto& st = c_.state;
    if (s.nonfinite) {
      handle_nonfinite(c_, s, p.step, step_ms_, data_wait_ms_);
    } else {
      st.skipped_in_a_row = 0;
      st.last_loss = s.loss;
    }
    stop_ = stop_ || s.stop;
    window_.add(s);
    step_ms_.push_back(s.step_ms);
    data_wait_ms_ += s.data_wait_ms;
    st.bytes_sent += s.comm_bytes;
    const auto& cfg = c_.cfg;
    const double lr = lr_at(cfg.schedule, cfg.optimizer.lr, p.step, c_.total_steps);  // it used
    const bool log_now = cadence_.should_log(p.step);
    if (log_now) {
      auto line = train_line(c_, p.step, s, window_, lr);
      rate_ = line["samples_per_s"].get<double>();
      if (c_.root()) c_.metrics->write(line);
      window_ = Window{};
    }
    if (c_.root()) c_.progress->step(p.step, st.last_loss, lr, rate_, log_now);
  }

  Context& c_;
  const Cadence& cadence_;
  std::deque<PendingStep> pending_;  // queued, not read yet: oldest first
  std::vector<double> step_ms_;      // this process's steps, for the steady-state rate
  double data_wait_ms_ = 0;
  Window window_;
  double rate_ = 0;
  bool stop_ = false;                // a read step says some rank was asked to stop
  Clock::time_point mark_ = Clock::now();  // the last step's finish, moved on past the rest
};

// A stop signal (here or on a peer), acted on at a step boundary: a checkpoint, the
// summary, and under SLURM's warning signal a requeue. Returns the run's result.
RunResult stop_run(Context& c, const StepReader& reader) {
  auto& st = c.state;
  if (st.last_saved != st.step) save_checkpoint(c, std::nullopt);
  const int sig = stop_signal() ? stop_signal() : SIGTERM;  // a peer's signal
  auto summary = reader.summary("stopped");
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

}  // namespace

RunResult run_training(const JobConfig& cfg, const ParallelDims& dims, const RunOptions& opts,
                       const WorldInfo& world, std::shared_ptr<Comm> comm) {
  install_stop_signals();
  set_setting_up(true);  // a stop before the first step: nothing to save, exit at once
  Context c(cfg, dims, opts, world, std::move(comm));
  setup(c);
  set_setting_up(false);
  auto& st = c.state;
  if (c.finished)  // rank 0 knows it (under async_ps, server 0: it tells the workers)
    c.say(fmt::format("nothing to train: the checkpoint is at step {} and the job ends at step {} "
                      "(train.max_steps, or train.epochs x {} steps); checkpoints and logs unchanged",
                      st.step, c.total_steps, c.steps_per_epoch()));
  if (c.mesh.role() != Role::kTrainer) return run_async_ps(c);  // a loop of its own
  if (c.finished) return {0, nlohmann::json()};
  Loader loader(*c.data.train, *c.sampler, st.step, c.total_steps, cfg.data.workers,
                cfg.data.prefetch, /*pin=*/c.device().is_cuda(),
                Augment{cfg.data.augment, cfg.data.crop_padding, uint64_t(cfg.seed)});
  const Cadence cadence{cfg, *c.mode, c.steps_per_epoch(), c.total_steps};
  StepReader reader(c, cadence);
  try {
    while (st.step < c.total_steps) {
      const int64_t n = st.step + 1;  // this step
      const bool eval_now = cadence.should_eval(n), save_now = cadence.should_save(n);
      if (cadence.rejoins(n)) reader.read_all();
      reader.queue(train_step(c, loader, cadence.should_log(n), eval_now || save_now));
      if (eval_now || save_now || reader.stop() || cadence.parts(n)) reader.read_all();
      if (eval_now) reader.not_training([&] { evaluate_and_report(c); });
      if (save_now)
        reader.not_training([&] { save_checkpoint(c, eval_now ? st.last_eval : std::nullopt); });
      if (reader.stop()) return stop_run(c, reader);
    }
  } catch (const DivergedError&) {
    throw;  // its summary is written
  } catch (const Error& e) {
    // A checkpoint that could not be written, a peer that failed: the record says so.
    auto summary = reader.summary("failed");
    summary["reason"] = first_line(e.what());
    write_summary(c, summary);
    throw;
  }
  auto summary = reader.summary("completed");
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
