#include "run/run_log.hpp"

#include <algorithm>
#include <chrono>
#include <csignal>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <sys/resource.h>

#include "launch/requeue.hpp"
#include "run/signals.hpp"
#include "util/clock.hpp"
#include "util/error.hpp"

namespace dtrain {

void Window::add(const StepStats& s) {
  steps += 1;
  batches += s.batch_scale;
  data_wait_ms += s.data_wait_ms;
  forward_ms += s.forward_ms;
  backward_ms += s.backward_ms;
  comm_ms += s.comm_ms;
  optim_ms += s.optim_ms;
  step_ms += s.step_ms;
  comm_bytes += s.comm_bytes;
  busy.add(s.rank_busy_ms);
}

void RankTimes::add(const std::vector<double>& busy_ms) {
  if (sum.size() < busy_ms.size()) sum.resize(busy_ms.size()), steps.resize(busy_ms.size());
  for (size_t r = 0; r < busy_ms.size(); ++r)
    if (busy_ms[r] > 0) sum[r] += busy_ms[r], steps[r] += 1;
}

void RankTimes::describe(nlohmann::json& out) const {
  std::vector<std::pair<double, int64_t>> mean;  // (ms, rank)
  for (size_t r = 0; r < sum.size(); ++r)
    if (steps[r] > 0) mean.emplace_back(sum[r] / double(steps[r]), int64_t(r));
  if (mean.size() < 2) return;
  std::sort(mean.begin(), mean.end());
  out["slowest_rank"] = mean.back().second;
  out["slowest_busy_ms"] = mean.back().first;
  const size_t mid = mean.size() / 2;  // the median of the ranks' means
  out["median_busy_ms"] = mean.size() % 2 ? mean[mid].first : (mean[mid - 1].first + mean[mid].first) / 2;
}

namespace {
// This process's peak resident memory so far (the kernel's high-water mark).
double peak_rss_mb() {
  rusage u{};
  ::getrusage(RUSAGE_SELF, &u);
  return double(u.ru_maxrss) / 1024.0;  // KiB on Linux
}
}  // namespace

RunLog::RunLog(const JobConfig& cfg, const Task& task, RunFacts facts, bool root,
               Progress* progress)
    : cfg_(cfg), task_(task), facts_(std::move(facts)), root_(root), progress_(progress) {}

void RunLog::record(int64_t n, const StepStats& s, bool logged,
                    const nlohmann::json& extra) {
  last_read_ = n;
  if (!s.nonfinite) state_.skipped_in_a_row = 0, state_.last_loss = s.loss;
  stop_ = stop_ || s.stop;
  window_.add(s);
  busy_.add(s.rank_busy_ms);
  step_ms_.push_back(s.step_ms);
  step_batches_.push_back(s.batch_scale);
  data_wait_ms_ += s.data_wait_ms;
  state_.bytes_sent += s.comm_bytes;
  if (logged) {
    auto line = train_line(n, s);
    line.update(extra);
    rate_ = line["samples_per_s"].get<double>();
    if (metrics_) metrics_->write(line);
    window_ = Window{};
  }
  if (root_) progress_->step(n, state_.last_loss, s.lr, rate_, logged);
}

std::optional<Divergence> RunLog::nonfinite(int64_t n, const Culprit& c, bool meets) {
  auto& st = state_;
  const bool skip = cfg_.train.on_nonfinite == "skip" && c.apart.empty();
  if (skip) {
    st.skipped_in_a_row = std::max(st.skipped_in_a_row, c.peers_in_a_row);
    ++st.skipped, ++st.skipped_in_a_row;
    say(fmt::format("warning: {} skipped: non-finite loss or gradient ({}); {} in a row", c.what,
                    c.who, st.skipped_in_a_row));
    if (st.skipped_in_a_row < cfg_.train.max_skipped) return std::nullopt;
  }
  if (!meets) {
    if (st.diverged_at == 0) st.diverged_at = n;
    return std::nullopt;
  }
  const std::string why =
      !c.apart.empty()
          ? fmt::format("non-finite loss or gradient on {} {}, found where they met after step "
                        "{}; nothing from it on was checkpointed", c.who, c.apart, n)
      : skip ? fmt::format("{} {} in a row had a non-finite loss or gradient (train.max_skipped), "
                           "the last at step {} ({})", st.skipped_in_a_row, c.unit, n, c.who)
             : fmt::format("non-finite loss or gradient at step {} ({}); nothing from it on was "
                           "checkpointed", n, c.who);
  return Divergence{n, c.rank, why};
}

void RunLog::diverge(const Divergence& d) {
  auto summary = this->summary("diverged");
  summary["diverged_step"] = d.step;
  summary["diverged_rank"] = d.rank;
  summary["reason"] = d.why;
  write_summary(summary);
  throw DivergedError("training diverged: " + d.why);
}

void RunLog::branched(const Branch& b) {
  if (metrics_)
    metrics_->write({{"kind", "branch"},
                     {"step", b.step},
                     {"from", b.resumed},
                     {"same_line", b.on_line},
                     {"set_aside", b.set_aside},
                     {"kept_in", b.kept_in},
                     {"time", unix_time()}});
  say(fmt::format("new branch after step {} of {}{}", b.step, b.resumed,
                  b.kept_in.empty()
                      ? ""
                      : fmt::format("; the checkpoints of step{} {} (and their metrics lines) are "
                                    "kept aside in {}", b.set_aside.size() > 1 ? "s" : "",
                                    fmt::join(b.set_aside, ", "), b.kept_in)));
}

void RunLog::eval(int64_t n, const EvalResult& e, double eval_ms) {
  auto& st = state_;
  st.last_eval = e;
  if (std::isfinite(e.metric) && (!std::isfinite(st.best_metric) || task_.better(e.metric, st.best_metric)))
    st.best_metric = e.metric, st.best_step = n;
  if (metrics_)
    metrics_->write({{"kind", "eval"},
                     {"step", n},
                     {"epoch", (n - 1) / facts_.steps_per_epoch},
                     {"loss", e.loss},
                     {task_.metric(), e.metric},
                     {"ranks", e.ranks},
                     {"eval_ms", eval_ms},
                     {"time", unix_time()}});
  say(fmt::format("eval at step {}: loss {:.4f}, {} {:.4f}", n, e.loss, task_.metric(), e.metric));
}

RunResult RunLog::completed(const std::string& detail) {
  auto summary = this->summary("completed");
  write_summary(summary);
  const auto& st = state_;
  say(fmt::format("done: {} steps{}, final loss {:.4f}, {:.0f} samples/s{}{}", st.step, detail,
                  st.last_loss, summary["samples_per_s"].get<double>(),
                  facts_.items_per_sample > 1
                      ? fmt::format(" ({:.0f} tokens/s)", summary["tokens_per_s"].get<double>())
                      : "",
                  st.last_eval ? fmt::format(", eval {} {:.4f} (best {:.4f} at step {})",
                                             task_.metric(), st.last_eval->metric,
                                             st.best_metric, st.best_step)
                               : ""));
  return {0, summary};
}

RunResult RunLog::stopped(int sig, const std::string& requeue_job) {
  auto summary = this->summary("stopped");
  summary["signal"] = sig;
  say(fmt::format("stopped by signal {} after step {}; checkpoint saved", sig, state_.step));
  // SLURM's warning signal: put the job back in the queue; it resumes from here.
  if (root() && sig == SIGUSR1 && !requeue_job.empty()) {
    const auto why_not = requeue_slurm_job(requeue_job, std::chrono::seconds(60));
    summary["requeued"] = why_not.empty();
    say(why_not.empty() ? fmt::format("requeued SLURM job {}; it resumes from step {}",
                                      requeue_job, state_.step)
                        : "warning: not requeued: " + why_not);
  }
  write_summary(summary);
  return {exit_code_for_signal(sig), summary};
}

void RunLog::failed(const std::string& reason) {
  auto summary = this->summary("failed");
  summary["reason"] = reason;
  write_summary(summary);
}

void RunLog::write_summary(const nlohmann::json& summary) const {
  if (!metrics_) return;
  progress_->finish();  // the display ends first, so the two never interleave
  metrics_->write(summary);
}

nlohmann::json RunLog::train_line(int64_t n, const StepStats& last) const {
  const Window& w = window_;
  const double steps = double(w.steps);
  const double samples_per_s = w.batches * double(cfg_.data.batch_size) / (w.step_ms / 1000);
  // The phases: the window's means, or on a GPU the logged step's own (only it waited for
  // the device; the others' phase times are the host's launch times).
  auto phase = [&](double window_sum, double last_step) {
    return last.device_timed ? last_step : window_sum / steps;
  };
  nlohmann::json line{{"kind", "train"},
                      {"step", n},
                      {"epoch", (n - 1) / facts_.steps_per_epoch},
                      {"loss", finite_or_null(last.loss)},
                      {"lr", last.lr},
                      {"grad_norm", finite_or_null(last.grad_norm)},
                      {"samples_per_s", samples_per_s},
                      {"step_ms", w.step_ms / steps},
                      {"data_wait_ms", w.data_wait_ms / steps},
                      {"forward_ms", phase(w.forward_ms, last.forward_ms)},
                      {"backward_ms", phase(w.backward_ms, last.backward_ms)},
                      {"optim_ms", phase(w.optim_ms, last.optim_ms)},
                      {"checkpoint_stall_ms", w.checkpoint_stall_ms},
                      {"peak_rss_mb", peak_rss_mb()},
                      {"time", unix_time()}};
  if (facts_.items_per_sample > 1) line["tokens_per_s"] = samples_per_s * double(facts_.items_per_sample);
  if (facts_.loss_scaled) {
    line["loss_scale"] = last.loss_scale;
    line["overflow_steps"] = last.overflow_steps;
  }
  if (!last.stage_bubble.empty()) {
    // Each pipeline rank's share of this step spent waiting for its neighbours, and the
    // most memory its micro-batches in flight held (MiB above the step's start).
    line["bubble"] = last.stage_bubble;
    line["activation_mb"] = last.stage_activation_mb;
  }
  if (facts_.communicates) {
    line["comm_ms"] = phase(w.comm_ms, last.comm_ms);
    line["comm_bytes"] = w.comm_bytes / w.steps;  // per step: local SGD sends every few
    w.busy.describe(line);
  }
  return line;
}

nlohmann::json RunLog::summary(const std::string& status) const {
  // Steady state: leave out the first steps of this process (allocator and cache warm-up).
  const size_t n = step_ms_.size();
  const size_t warm = std::min<size_t>(20, n / 5);
  double ms = 0;
  double batches = 0;  // in data.batch_size's (a batch that shrank with its replicas counts less)
  for (size_t i = warm; i < n; ++i) ms += step_ms_[i], batches += step_batches_[i];
  const double batch = double(cfg_.data.batch_size);
  const double steady = ms > 0 ? batches * batch / (ms / 1000) : 0;
  std::vector<double> sorted(step_ms_.begin() + long(warm), step_ms_.end());
  std::sort(sorted.begin(), sorted.end());
  const auto& st = state_;
  nlohmann::json s{
      {"kind", "summary"},
      {"status", status},
      {"steps", st.step},
      {"epochs", double(st.step) / double(facts_.steps_per_epoch)},
      {"final_loss", finite_or_null(st.last_loss)},
      {"samples_per_s", steady},
      {"step_ms_median", sorted.empty() ? 0.0 : sorted[sorted.size() / 2]},
      {"data_wait_ms_mean", n ? data_wait_ms_ / double(n) : 0.0},
      {"checkpoint_stall_ms", stall_ms_},
      {"task", task_.name()},
      {"skipped_steps", st.skipped},
      {"peak_rss_mb", peak_rss_mb()},
      // what this rank sent per sample of the global batch, over this process's steps
      {"comm_bytes_per_sample", n ? double(st.bytes_sent) / (double(n) * batch) : 0.0},
      {"time", unix_time()}};
  if (facts_.items_per_sample > 1) s["tokens_per_s"] = steady * double(facts_.items_per_sample);
  busy_.describe(s);  // over this process's steps
  const std::string metric = task_.metric();
  if (std::isfinite(st.best_metric)) {
    s["best_" + metric] = st.best_metric;
    s["best_step"] = st.best_step;
  }
  if (st.last_eval) {
    s["final_" + metric] = st.last_eval->metric;
    s["final_eval_loss"] = st.last_eval->loss;
  }
  for (const auto& more : more_summary_) more(s);
  if (cfg_.parallel.auto_layout) {  // what parallel.auto chose, besides the mesh's sizes
    const auto& p = cfg_.parallel;
    auto& layout = s["layout"];
    layout["zero"] = p.zero, layout["schedule"] = p.schedule, layout["balance"] = p.balance;
    layout["virtual_stages"] = p.virtual_stages, layout["grad_accum"] = cfg_.train.grad_accum;
    layout["recompute"] = cfg_.train.recompute, layout["chosen_by"] = "parallel.auto";
  }
  return s;
}

}  // namespace dtrain
