// The run's record, the one place for the rules every training mode follows: what a read
// step adds to its logging window and when its line is written (metrics.jsonl, progress),
// what a non-finite loss or gradient means (train.on_nonfinite), the evaluation's line and
// the best metric, and how a run ends: completed (the "done" line), stopped by a signal,
// diverged or failed, each with its summary line. Every key of every kind of line is
// written here and nowhere else (the contract: docs/contract.md, "metrics.jsonl"); a mode
// adds its own fields through `extra` and extend_summary.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "checkpoint/timeline.hpp"
#include "config/config.hpp"
#include "logging/metrics.hpp"
#include "models/task.hpp"

namespace dtrain {

// How this rank's run ended.
struct RunResult {
  int exit_code = 0;          // 0, or 128 + signal after a preemption checkpoint
  nlohmann::json summary;     // the summary line written to metrics.jsonl (rank 0)
};

struct EvalResult {
  double loss = 0;    // mean per item (sample or token)
  double metric = 0;  // the task's metric
  int64_t ranks = 1;  // the data ranks the held-out set was split among
};

// What the log keeps from step to step. step, last_loss and the best are saved with a
// checkpoint (RunStateSaver, run/saved_state.hpp); the rest is this process's.
struct RunState {
  int64_t step = 0;                    // optimizer steps done
  double last_loss = std::nan("");
  double best_metric = std::nan("");   // NaN until the first evaluation
  int64_t best_step = 0;
  std::optional<EvalResult> last_eval;
  int64_t last_saved = -1;             // the step of the newest checkpoint (-1: none)
  int64_t skipped_in_a_row = 0;        // train.on_nonfinite: skip
  int64_t skipped = 0;
  // A non-finite step that ends the run, seen where the ranks do not meet (local SGD
  // between averages): remembered, and acted on where they next meet, all together.
  int64_t diverged_at = 0;
  int64_t bytes_sent = 0;              // by this process since it started
};

// One step's figures (run/step.cpp, or a parameter server's pushes), milliseconds unless
// named otherwise.
struct StepStats {
  double loss = 0;             // mean over the global batch
  // The step's global batch against data.batch_size: below 1 after a failure under
  // fault_tolerance.batch: shrink.
  double batch_scale = 1;
  double lr = 0;               // the learning rate its update used (the schedule's, scaled)
  double grad_norm = 0;        // NaN when not computed this step
  double data_wait_ms = 0, forward_ms = 0, backward_ms = 0, comm_ms = 0, optim_ms = 0;
  int64_t comm_bytes = 0;      // what this rank sent for the step
  // Wall time from the previous step's reading to this one's (evaluations and checkpoints
  // left out): what the step cost, waits for the device included.
  double step_ms = 0;
  bool stop = false;           // some rank was asked to stop: all stop after this step
  bool nonfinite = false;      // some rank saw a non-finite loss or gradient
  int64_t nonfinite_rank = -1; // the lowest rank that saw it
  // The most non-finite steps in a row before this one on any rank that agreed on it: where
  // replicas skipped apart (local SGD), the count they meet with, so all judge alike.
  int64_t peers_in_a_row = 0;
  bool replica_diverged = false;  // a replica diverged since the ranks last met
  bool overflow = false;       // fp16: the scaled gradient overflowed; skipped, scale lowered
  double loss_scale = 0;       // fp16: the scale after this step, and the overflows so far
  int64_t overflow_steps = 0;
  bool device_timed = false;   // a GPU step that waited for the device at each phase's end
  // A pipeline's: this rank's share of the step spent waiting for its neighbours (the
  // bubble) and the most memory its in-flight micro-batches held; then, once read, every
  // pipeline rank's (each the mean over its data and tensor ranks).
  double bubble = 0, activation_mb = 0;
  std::vector<double> stage_bubble, stage_activation_mb;
  // The time this rank was busy with the step before its gradient sync could finish: its
  // data wait and its own work, the sync's waits for the others left out (on a GPU the
  // host's, but at a logged step). Then, once read, every world rank's (0 for one that did
  // not agree on the step): the slowest names a straggler.
  double busy_ms = 0;
  std::vector<double> rank_busy_ms;
};

// Each world rank's busy time (StepStats::busy_ms) added up over steps, and the slowest
// rank against the others: who holds the step up, and by how much.
struct RankTimes {
  std::vector<double> sum;     // per world rank
  std::vector<int64_t> steps;  // the steps it agreed on
  void add(const std::vector<double>& busy_ms);
  // "slowest_rank", "slowest_busy_ms" and "median_busy_ms" (the ranks' means), where
  // there are two ranks or more.
  void describe(nlohmann::json& out) const;
};

// Sums over one logging window of steps.
struct Window {
  int64_t steps = 0;
  double batches = 0;  // the steps' global batches, in data.batch_size's
  double data_wait_ms = 0, forward_ms = 0, backward_ms = 0, comm_ms = 0, optim_ms = 0,
         step_ms = 0;
  int64_t comm_bytes = 0;
  double checkpoint_stall_ms = 0;  // checkpoints' hold-ups since the window began (a total)
  RankTimes busy;                  // each rank's busy time
  void add(const StepStats& s);
};

// What the lines need to know of the run, once.
struct RunFacts {
  int64_t steps_per_epoch = 1, total_steps = 0;
  int64_t items_per_sample = 1;  // a window's tokens, or 1 (tokens/s)
  bool communicates = false;     // more than one rank: comm_ms and comm_bytes
  bool loss_scaled = false;      // fp16: loss_scale and overflow_steps
};

// Where a non-finite loss or gradient came from, in the messages.
struct Culprit {
  std::string what;            // what was skipped: "step 12", "a push at step 12"
  std::string who;             // "rank 3", or a parameter server's "worker 1 (rank 3)"
  int64_t rank = 0;            // the summary's diverged_rank
  std::string unit = "steps";  // what train.max_skipped counts
  // Non-empty when found where the ranks met after steps apart: how they were apart.
  std::string apart;
  // The most steps in a row any rank that agreed on this one had skipped before it.
  int64_t peers_in_a_row = 0;
};

// Why a run diverged (RunLog::nonfinite), for RunLog::diverge.
struct Divergence {
  int64_t step = 0, rank = 0;
  std::string why;
};

class RunLog {
 public:
  // `root`: rank 0 of the ranks that hold the run, the one that says and writes; its
  // metrics file comes once the run directory is open (attach).
  RunLog(const JobConfig& cfg, const Task& task, RunFacts facts, bool root, Progress* progress);
  void attach(MetricsLog* metrics) { metrics_ = metrics; }
  // This rank says and writes from now on (a fault-tolerant job's writing replica failed):
  // its lines go to `metrics` and `progress`.
  void take_over(MetricsLog* metrics, Progress* progress) {
    root_ = true, metrics_ = metrics, progress_ = progress;
  }
  // The last step recorded (read), 0 before any; for a replica that joined a running job
  // at step n, at least n - 1 (the lines before are the others': a takeover keeps them).
  int64_t last_read() const { return last_read_; }
  void joined_at(int64_t n) { last_read_ = std::max(last_read_, n - 1); }

  RunState& state() { return state_; }
  const RunState& state() const { return state_; }

  // A step's figures, read (every rank, every step, in order): the window, the line when
  // `logged` (with `extra` fields), progress, and the loss it ends at. A step whose
  // figures are not finite is nonfinite()'s first.
  void record(int64_t n, const StepStats& s, bool logged,
              const nlohmann::json& extra = nlohmann::json::object());
  // train.on_nonfinite for a non-finite step n: skip goes on until train.max_skipped in a
  // row; stop ends the run. Where the ranks do not meet after n (`meets` false) a step that
  // would end it is remembered (state().diverged_at) and nothing happens yet. Returns why
  // the run ends, or nothing to go on; the caller tidies up, then calls diverge().
  std::optional<Divergence> nonfinite(int64_t n, const Culprit& c, bool meets);
  // The summary ("diverged") and DivergedError: nothing from that step on was checkpointed.
  [[noreturn]] void diverge(const Divergence& d);
  // The ranks went back to step n (PendingStep::back_to): the steps after it, discarded,
  // are trained again; a divergence remembered among them is forgotten.
  void went_back(int64_t n) {
    state_.step = n;
    if (state_.diverged_at > n) state_.diverged_at = 0;
  }
  // Whether a read step said some rank was asked to stop.
  bool stop_voted() const { return stop_; }

  // Time a checkpoint held up training (taking the state, writing it or waiting for the
  // one in flight): the next train line's and the summary's checkpoint_stall_ms.
  void checkpoint_stalled(double ms) { window_.checkpoint_stall_ms += ms, stall_ms_ += ms; }

  // A resume that started a new branch of the run's timeline: its line (the branch point)
  // and the message.
  void branched(const Branch& b);

  // An evaluation after step n: the best so far, its line, the message.
  void eval(int64_t n, const EvalResult& e, double eval_ms);

  // The end. Each writes the summary (rank 0) and returns the run's result.
  RunResult completed(const std::string& detail = "");
  // After the stop's checkpoint: under SLURM's warning signal (SIGUSR1) the job is put
  // back in the queue (`requeue_job`, "" = not).
  RunResult stopped(int sig, const std::string& requeue_job);
  // A checkpoint that could not be written, a peer that failed: the record says so (the
  // caller rethrows).
  void failed(const std::string& reason);
  nlohmann::json summary(const std::string& status) const;
  // More of the summary's fields: the run's (world size, layout, device, memory), what a
  // mode counts as it runs.
  void extend_summary(std::function<void(nlohmann::json&)> more) {
    more_summary_.push_back(std::move(more));
  }

  // A line for the user, on rank 0.
  void say(const std::string& line) const {
    if (root_) progress_->print(line);
  }
  bool root() const { return root_; }

 private:
  nlohmann::json train_line(int64_t n, const StepStats& last) const;
  void write_summary(const nlohmann::json& summary) const;

  const JobConfig& cfg_;
  const Task& task_;
  RunFacts facts_;
  std::vector<std::function<void(nlohmann::json&)>> more_summary_;
  bool root_;
  MetricsLog* metrics_ = nullptr;
  Progress* progress_;
  RunState state_;
  Window window_;
  std::vector<double> step_ms_;  // this process's steps, for the steady-state rate
  std::vector<double> step_batches_;  // and their batches (StepStats::batch_scale)
  RankTimes busy_;               // this process's steps, each rank's busy time
  double data_wait_ms_ = 0;
  double stall_ms_ = 0;          // checkpoint_stalled's, over the run
  double rate_ = 0;              // the last line's samples/s, for progress
  bool stop_ = false;
  int64_t last_read_ = 0;
};

}  // namespace dtrain
