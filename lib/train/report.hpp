// The lines of metrics.jsonl: every key of every kind of line is written here and nowhere
// else (the contract: docs/contract.md, "metrics.jsonl").
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "train/context.hpp"

namespace dtrain {

// One step's figures (train/step.cpp), milliseconds unless named otherwise.
struct StepStats {
  double loss = 0;             // mean over the global batch
  double grad_norm = 0;        // NaN when not computed this step
  double data_wait_ms = 0, forward_ms = 0, backward_ms = 0, comm_ms = 0, optim_ms = 0;
  int64_t comm_bytes = 0;      // what this rank sent for the step's gradient sync
  // Wall time from the previous step's reading to this one's (evaluations and checkpoints
  // left out): what the step cost, waits for the device included (train/loop.cpp).
  double step_ms = 0;
  bool stop = false;           // some rank was asked to stop: all stop after this step
  bool nonfinite = false;      // some rank saw a non-finite loss or gradient
  int64_t nonfinite_rank = -1; // the lowest world rank that saw it
  bool replica_diverged = false;  // local SGD: a replica diverged since the ranks last met
  bool overflow = false;       // fp16: the scaled gradient overflowed; skipped, scale lowered
  double loss_scale = 0;       // fp16: the scale after this step, and the overflows so far
  int64_t overflow_steps = 0;
  bool device_timed = false;   // a GPU step that waited for the device at each phase's end
  // A pipeline's: this rank's share of the step spent waiting for its neighbours (the
  // bubble) and the most memory its in-flight micro-batches held, measured by the runner;
  // then, once read, every pipeline rank's (each the mean over its data and tensor ranks).
  double bubble = 0, activation_mb = 0;
  std::vector<double> stage_bubble, stage_activation_mb;
};

// Sums over one logging window of steps.
struct Window {
  int64_t steps = 0;
  double data_wait_ms = 0, forward_ms = 0, backward_ms = 0, comm_ms = 0, optim_ms = 0,
         step_ms = 0;
  int64_t comm_bytes = 0;
  void add(const StepStats& s);
};

// The line of step `step`, the last of window `w`, trained at learning rate `lr`.
nlohmann::json train_line(const Context& c, int64_t step, const StepStats& last, const Window& w,
                          double lr);
nlohmann::json eval_line(const Context& c, const EvalResult& e, double eval_ms);
// `step_ms`: this process's step times, for the steady-state rate.
nlohmann::json summary_line(const Context& c, const std::string& status,
                            const std::vector<double>& step_ms, double data_wait_total_ms);
// The run's last line (rank 0): the progress display ends first, so the two never
// interleave.
void write_summary(const Context& c, const nlohmann::json& summary);

}  // namespace dtrain
