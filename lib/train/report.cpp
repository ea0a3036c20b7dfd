#include "train/report.hpp"

#include <algorithm>

#include <sys/resource.h>

namespace dtrain {
void Window::add(const StepStats& s) {
  steps += 1;
  data_wait_ms += s.data_wait_ms;
  forward_ms += s.forward_ms;
  backward_ms += s.backward_ms;
  comm_ms += s.comm_ms;
  optim_ms += s.optim_ms;
  step_ms += s.step_ms;
  comm_bytes += s.comm_bytes;
}

namespace {
// This process's peak resident memory so far (the kernel's high-water mark).
double peak_rss_mb() {
  rusage u{};
  ::getrusage(RUSAGE_SELF, &u);
  return double(u.ru_maxrss) / 1024.0;  // KiB on Linux
}
}  // namespace

nlohmann::json train_line(const Context& c, int64_t step, const StepStats& last, const Window& w,
                          double lr) {
  const double n = double(w.steps);
  const double samples_per_s = n * double(c.cfg.data.batch_size) / (w.step_ms / 1000);
  // The phases: the window's means, or on a GPU the logged step's own (only it waited for
  // the device; the others' phase times are the host's launch times).
  auto phase = [&](double window_sum, double last_step) {
    return last.device_timed ? last_step : window_sum / n;
  };
  nlohmann::json line{{"kind", "train"},
                      {"step", step},
                      {"epoch", (step - 1) / c.steps_per_epoch()},
                      {"loss", finite_or_null(last.loss)},
                      {"lr", lr},
                      {"grad_norm", finite_or_null(last.grad_norm)},
                      {"samples_per_s", samples_per_s},
                      {"step_ms", w.step_ms / n},
                      {"data_wait_ms", w.data_wait_ms / n},
                      {"forward_ms", phase(w.forward_ms, last.forward_ms)},
                      {"backward_ms", phase(w.backward_ms, last.backward_ms)},
                      {"optim_ms", phase(w.optim_ms, last.optim_ms)},
                      {"peak_rss_mb", peak_rss_mb()},
                      {"time", unix_time()}};
  if (c.items_per_sample() > 1) line["tokens_per_s"] = samples_per_s * double(c.items_per_sample());
  if (c.scaler) {
    line["loss_scale"] = last.loss_scale;
    line["overflow_steps"] = last.overflow_steps;
  }
  if (!last.stage_bubble.empty()) {
    // Each pipeline rank's share of this step spent waiting for its neighbours, and the
    // most memory its micro-batches in flight held (MiB above the step's start).
    line["bubble"] = last.stage_bubble;
    line["activation_mb"] = last.stage_activation_mb;
  }
  if (c.mesh.world()->size() > 1) {
    line["comm_ms"] = phase(w.comm_ms, last.comm_ms);
    line["comm_bytes"] = w.comm_bytes / w.steps;  // per step: local SGD sends every few
  }
  return line;
}

void write_summary(const Context& c, const nlohmann::json& summary) {
  if (!c.root()) return;
  c.progress->finish();
  c.metrics->write(summary);
}

nlohmann::json eval_line(const Context& c, const EvalResult& e, double eval_ms) {
  const int64_t step = c.state.step;
  return {{"kind", "eval"},
          {"step", step},
          {"epoch", (step - 1) / c.steps_per_epoch()},
          {"loss", e.loss},
          {c.task->metric(), e.metric},
          {"eval_ms", eval_ms},
          {"time", unix_time()}};
}

nlohmann::json summary_line(const Context& c, const std::string& status,
                            const std::vector<double>& step_ms, double data_wait_total_ms) {
  // Steady state: leave out the first steps of this process (allocator and cache warm-up).
  const size_t n = step_ms.size();
  const size_t warm = std::min<size_t>(20, n / 5);
  double ms = 0;
  for (size_t i = warm; i < n; ++i) ms += step_ms[i];
  const double steady = ms > 0 ? double(n - warm) * double(c.cfg.data.batch_size) / (ms / 1000) : 0;
  std::vector<double> sorted(step_ms.begin() + long(warm), step_ms.end());
  std::sort(sorted.begin(), sorted.end());
  const auto& d = c.mesh.dims();
  const auto& st = c.state;
  nlohmann::json s{
      {"kind", "summary"},
      {"status", status},
      {"steps", st.step},
      {"epochs", double(st.step) / double(c.steps_per_epoch())},
      {"final_loss", finite_or_null(st.last_loss)},
      {"samples_per_s", steady},
      {"step_ms_median", sorted.empty() ? 0.0 : sorted[sorted.size() / 2]},
      {"data_wait_ms_mean", n ? data_wait_total_ms / double(n) : 0.0},
      {"world_size", c.mesh.job()->size()},
      {"layout", {{"data", d.data}, {"tensor", d.tensor}, {"pipeline", d.pipeline}}},
      {"task", c.task->name()},
      {"skipped_steps", st.skipped},
      {"device", c.device().str()},
      {"peak_rss_mb", peak_rss_mb()},
      // rank 0's: under ZeRO each data rank keeps about 1 / data of it
      {"optimizer_state_mb", double(optimizer_state_bytes(*c.optimizer)) / (1024.0 * 1024.0)},
      {"gradient_mb", double(c.params->grad().numel() * c.params->grad().element_size()) /
                          (1024.0 * 1024.0)},
      // what this rank sent per sample of the global batch, over this process's steps
      {"comm_bytes_per_sample",
       n ? double(st.bytes_sent) / (double(n) * double(c.cfg.data.batch_size)) : 0.0},
      {"time", unix_time()}};
  if (c.scaler) {
    s["loss_scale"] = c.scaler->scale();
    s["overflow_steps"] = c.scaler->overflows();
  }
  if (c.items_per_sample() > 1) s["tokens_per_s"] = steady * double(c.items_per_sample());
  const std::string metric = c.task->metric();
  if (std::isfinite(st.best_metric)) {
    s["best_" + metric] = st.best_metric;
    s["best_step"] = st.best_step;
  }
  if (st.last_eval) {
    s["final_" + metric] = st.last_eval->metric;
    s["final_eval_loss"] = st.last_eval->loss;
  }
  return s;
}

}  // namespace dtrain
