// The lock-step loop and the run log with a stand-in body (no setup(), no model): which
// steps it runs and in what order, where it evaluates and checkpoints, what a non-finite
// step and a stop vote do, and what the lines and the summary say. The expected steps are
// worked out by hand from the job's cadence.
#include <doctest/doctest.h>

#include <cmath>
#include <csignal>
#include <fstream>
#include <map>
#include <vector>

#include "config/config.hpp"
#include "logging/metrics.hpp"
#include "models/task.hpp"
#include "run/loop.hpp"
#include "temp_dir.hpp"
#include "util/error.hpp"

namespace unit_run_loop {

using namespace dtrain;

namespace {

// A body whose step n has loss 1/n, unless told otherwise; it records what it was asked.
class StandIn : public LoopBody {
 public:
  std::vector<int64_t> stepped, read_steps, evaluated;
  std::vector<std::pair<int64_t, bool>> saved;
  std::vector<std::string> saves;  // under checkpoint.async: "bgN", "syncN", "pollN", "wait"
  std::map<int64_t, double> loss;  // steps with another loss (NaN: non-finite)
  int64_t stop_vote_at = 0;        // a step whose figures say a rank was asked to stop
  int64_t leave_at = 0;            // a step after which this replica leaves (fault tolerance)
  int64_t job_stop_at = 0;         // a step whose vote stops the job (fault tolerance)
  std::map<int64_t, int64_t> back; // a meeting's step that sends the ranks back (once) to a step
  int stopped_with = 0;
  RunState* state = nullptr;       // given: each save sets its last_saved, as a run's does

  PendingStep step(int64_t n, bool /*logged*/, bool /*kept*/) override {
    stepped.push_back(n);
    PendingStep p;
    p.step = n;
    p.leaves = n == leave_at;
    p.stats.stop = n == job_stop_at;
    if (const auto it = back.find(n); it != back.end()) {
      p.discarded = true, p.back_to = it->second;
      back.erase(it);
    }
    return p;
  }
  bool may_go_back() const override { return true; }
  StepStats read(PendingStep& p) override {
    read_steps.push_back(p.step);
    StepStats s;
    s.loss = loss.count(p.step) ? loss.at(p.step) : 1.0 / double(p.step);
    s.grad_norm = 1;
    s.nonfinite = !std::isfinite(s.loss);
    s.nonfinite_rank = s.nonfinite ? 1 : -1;
    s.stop = p.stats.stop || p.step == stop_vote_at;
    s.comm_bytes = 100;
    s.lr = 0.1;  // the job's constant rate, as a step's update would say it
    return s;
  }
  Culprit culprit(int64_t n, const StepStats& s) const override {
    return {"step " + std::to_string(n), "rank " + std::to_string(s.nonfinite_rank), s.nonfinite_rank};
  }
  void evaluate(int64_t n) override { evaluated.push_back(n); }
  void save(int64_t n, bool with_eval, bool background) override {
    saved.emplace_back(n, with_eval);
    saves.push_back((background ? "bg" : "sync") + std::to_string(n));
    if (state) state->last_saved = n;
  }
  void poll_save(int64_t n) override { saves.push_back("poll" + std::to_string(n)); }
  void finish_save() override { saves.push_back("wait"); }
  RunResult stop(int sig) override {
    stopped_with = sig;
    return {128 + sig, nlohmann::json()};
  }
};

JobConfig job(int64_t log_every, int64_t eval_every, int64_t save_every) {
  JobConfig cfg;
  cfg.data.batch_size = 8;
  cfg.optimizer.lr = 0.1;
  cfg.schedule.decay = "constant";
  cfg.train.log_every = log_every;
  cfg.train.eval_every = eval_every;
  cfg.checkpoint.every_steps = save_every;
  return cfg;
}

std::vector<nlohmann::json> lines(const std::string& path) {
  std::vector<nlohmann::json> out;
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) out.push_back(nlohmann::json::parse(line));
  return out;
}

// A run log that writes its lines to `dir`/metrics.jsonl.
struct Logged {
  Logged(const JobConfig& cfg, const std::string& dir, int64_t total)
      : progress("off", total), metrics(dir + "/metrics.jsonl", std::nullopt),
        log(cfg, classification_task(), facts(total), /*root=*/true, &progress) {
    log.attach(&metrics);
    log.extend_summary([](nlohmann::json& s) { s["world_size"] = 2; });
  }
  static RunFacts facts(int64_t total) {
    RunFacts f;
    f.steps_per_epoch = 100;
    f.total_steps = total;
    f.communicates = true;
    return f;
  }
  Progress progress;
  MetricsLog metrics;
  RunLog log;
};

}  // namespace

TEST_CASE("loop: every step once, in order, evaluated and saved at the cadence, completed") {
  test::TempDir dir;
  const auto cfg = job(/*log_every=*/3, /*eval_every=*/4, /*save_every=*/5);
  Logged l(cfg, dir.path().string(), 10);
  StandIn body;
  const Cadence cadence{cfg, 100, 10};
  const auto result = lockstep_loop(body, l.log, cadence, 10, cfg);
  const std::vector<int64_t> all{1, 2, 3, 4, 5, 6, 7, 8, 9, 10};
  CHECK(body.stepped == all);
  CHECK(body.read_steps == all);
  CHECK(body.evaluated == std::vector<int64_t>{4, 8, 10});  // and the last step
  CHECK(body.saved == std::vector<std::pair<int64_t, bool>>{{5, false}, {10, true}});
  CHECK(l.log.state().step == 10);
  CHECK(result.exit_code == 0);
  CHECK(result.summary["status"] == "completed");
  CHECK(result.summary["steps"] == 10);
  CHECK(result.summary["final_loss"].get<double>() == doctest::Approx(0.1));
  CHECK(result.summary["world_size"] == 2);  // the run's own facts
  const auto written = lines(dir.path().string() + "/metrics.jsonl");
  std::vector<int64_t> logged;
  for (const auto& line : written)
    if (line["kind"] == "train") logged.push_back(line["step"]);
  CHECK(logged == std::vector<int64_t>{3, 6, 9, 10});
  CHECK(written.back()["kind"] == "summary");
  CHECK(written[0]["comm_bytes"] == 100);  // per step, over the window
  CHECK(written[0]["lr"].get<double>() == doctest::Approx(0.1));
}

TEST_CASE("loop: a resumed run starts after its step; where the ranks do not meet, nothing is due") {
  test::TempDir dir;
  const auto cfg = job(1, 4, 0);
  Logged l(cfg, dir.path().string(), 12);
  l.log.state().step = 5;  // as restored from a checkpoint
  StandIn body;
  // Ranks that meet only every third step (local SGD's averages): the evaluations due at
  // 4 and 8 wait for 6 and 9.
  const Cadence cadence{cfg, 100, 12, [](int64_t n) { return n % 3 == 0; }};
  lockstep_loop(body, l.log, cadence, 12, cfg);
  CHECK(body.stepped == std::vector<int64_t>{6, 7, 8, 9, 10, 11, 12});
  CHECK(body.evaluated == std::vector<int64_t>{6, 9, 12});
  CHECK(body.saved == std::vector<std::pair<int64_t, bool>>{{12, true}});
}

TEST_CASE("loop: a meeting that sends the ranks back: the steps since the last one trained again, each line once") {
  test::TempDir dir;
  const auto cfg = job(/*log_every=*/1, /*eval_every=*/0, /*save_every=*/4);
  Logged l(cfg, dir.path().string(), 12);
  StandIn body;
  body.back = {{8, 4}, {12, 8}};  // local SGD's averages at 4, 8, 12: two of them fail once
  const Cadence cadence{cfg, 100, 12, [](int64_t n) { return n % 4 == 0; }};
  lockstep_loop(body, l.log, cadence, 12, cfg);
  CHECK(body.stepped == std::vector<int64_t>{1, 2, 3, 4, 5, 6, 7, 8, 5, 6, 7, 8, 9, 10, 11, 12,
                                             9, 10, 11, 12});
  // Nothing of a discarded interval is saved or recorded: the lines hold steps 1 to 12 once.
  CHECK(body.saved == std::vector<std::pair<int64_t, bool>>{{4, false}, {8, false}, {12, true}});
  std::vector<int64_t> train;
  for (const auto& line : lines(dir.path().string() + "/metrics.jsonl"))
    if (line["kind"] == "train") train.push_back(line["step"].get<int64_t>());
  CHECK(train == std::vector<int64_t>{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12});
  CHECK(l.log.state().step == 12);
}

TEST_CASE("loop: train.on_nonfinite: skip goes on, stop ends the run with its summary") {
  test::TempDir dir;
  auto cfg = job(1, 0, 2);
  cfg.train.on_nonfinite = "skip";
  {
    Logged l(cfg, dir.path().string(), 6);
    StandIn body;
    body.loss[3] = NAN;
    const auto result = lockstep_loop(body, l.log, Cadence{cfg, 100, 6}, 6, cfg);
    CHECK(result.summary["status"] == "completed");
    CHECK(result.summary["skipped_steps"] == 1);
    CHECK(l.log.state().skipped == 1);
  }
  cfg.train.on_nonfinite = "stop";
  Logged l(cfg, dir.path().string(), 6);
  StandIn body;
  body.loss[3] = NAN;
  try {
    lockstep_loop(body, l.log, Cadence{cfg, 100, 6}, 6, cfg);
    FAIL("a non-finite step under on_nonfinite: stop was not the end");
  } catch (const DivergedError& e) {
    CHECK(std::string(e.what()).find("step 3 (rank 1)") != std::string::npos);
  }
  // Nothing from the bad step on was saved: the checkpoint due after step 4 never came.
  CHECK(body.saved == std::vector<std::pair<int64_t, bool>>{{2, false}});
  const auto summary = lines(dir.path().string() + "/metrics.jsonl").back();
  CHECK(summary["status"] == "diverged");
  CHECK(summary["diverged_step"] == 3);
  CHECK(summary["diverged_rank"] == 1);
}

TEST_CASE("loop: a stop vote is acted on where it is read: a checkpoint, then the stop") {
  test::TempDir dir;
  const auto cfg = job(1, 0, 100);
  Logged l(cfg, dir.path().string(), 20);
  StandIn body;
  body.stop_vote_at = 6;
  const auto result = lockstep_loop(body, l.log, Cadence{cfg, 100, 20}, 20, cfg);
  // Step 6's figures are read two steps later, as step 8 is queued: the steps queued are
  // read, the last one checkpointed, and the run stops there, on every rank alike.
  CHECK(body.stepped.back() == 8);
  CHECK(body.read_steps.back() == 8);
  CHECK(body.saved == std::vector<std::pair<int64_t, bool>>{{8, false}});
  CHECK(body.stopped_with == SIGTERM);  // a peer's vote: this process had no signal
  CHECK(result.exit_code == 128 + SIGTERM);
}

// Fault tolerance: the replicas' vote on a step says it at once, not two steps on.
TEST_CASE("loop: a replica that leaves ends after its step: lines read, the save in flight written, nothing of its own") {
  test::TempDir dir;
  auto cfg = job(1, 5, 3);
  cfg.checkpoint.async = true;
  Logged l(cfg, dir.path().string(), 20);
  StandIn body;
  body.state = &l.log.state();
  body.leave_at = 5;
  const auto result = lockstep_loop(body, l.log, Cadence{cfg, 100, 20}, 20, cfg);
  CHECK(body.stepped.back() == 5);
  CHECK(body.read_steps.back() == 5);
  CHECK(body.evaluated.empty());  // step 5's evaluation is the others'
  CHECK(body.saves == std::vector<std::string>{"bg3", "poll4", "wait"});
  CHECK(body.stopped_with == 0);
  CHECK(result.exit_code == 128 + SIGTERM);
  CHECK(lines(dir.path().string() + "/metrics.jsonl").back()["step"] == 5);  // no summary
}

TEST_CASE("loop: a job stop voted with its step is acted on at that step: evaluation, checkpoint, stop") {
  test::TempDir dir;
  const auto cfg = job(1, 5, 100);
  Logged l(cfg, dir.path().string(), 20);
  StandIn body;
  body.state = &l.log.state();
  body.job_stop_at = 5;
  lockstep_loop(body, l.log, Cadence{cfg, 100, 20}, 20, cfg);
  CHECK(body.stepped.back() == 5);
  CHECK(body.evaluated == std::vector<int64_t>{5});
  CHECK(body.saved == std::vector<std::pair<int64_t, bool>>{{5, false}});
  CHECK(body.stopped_with == SIGTERM);
}

TEST_CASE("loop: checkpoint.async saves in the background, polls where the ranks meet, waits at the end") {
  test::TempDir dir;
  auto cfg = job(1, 0, 3);
  cfg.checkpoint.async = true;
  {
    Logged l(cfg, dir.path().string(), 7);
    StandIn body;
    // Ranks that meet at every step but 5: no poll there (local SGD's steps apart).
    const Cadence cadence{cfg, 100, 7, [](int64_t n) { return n != 5; }};
    lockstep_loop(body, l.log, cadence, 7, cfg);
    // The last step's checkpoint is written at once, after the one in flight.
    CHECK(body.saves == std::vector<std::string>{"bg3", "poll4", "poll6", "bg6", "poll7",
                                                 "sync7", "wait"});
  }
  // A stop: the one in flight first, then the stop's own checkpoint, written at once.
  test::TempDir other;
  Logged l(cfg, other.path().string(), 20);
  StandIn body;
  body.state = &l.log.state();
  body.stop_vote_at = 4;  // read as step 6 is queued: the stop comes after step 6
  lockstep_loop(body, l.log, Cadence{cfg, 100, 20}, 20, cfg);
  CHECK(body.saves == std::vector<std::string>{"bg3", "poll4", "poll5", "poll6", "bg6", "wait"});
  // Step 6 was just saved (in the background): the stop waits for it and saves nothing more.
  CHECK(body.stopped_with == SIGTERM);
}

TEST_CASE("run log: the best metric follows the task's direction; the max_skipped rule") {
  test::TempDir dir;
  auto cfg = job(1, 0, 0);
  cfg.train.on_nonfinite = "skip";
  cfg.train.max_skipped = 2;
  Logged l(cfg, dir.path().string(), 10);
  l.log.eval(1, {0.5, 0.80}, 1);
  l.log.eval(2, {0.4, 0.75}, 1);  // accuracy: higher is better
  CHECK(l.log.state().best_metric == doctest::Approx(0.80));
  CHECK(l.log.state().best_step == 1);
  const Culprit who{"step 3", "rank 0", 0};
  CHECK(!l.log.nonfinite(3, who, true));
  const auto end = l.log.nonfinite(4, who, true);
  REQUIRE(end);
  CHECK(end->why.find("2 steps in a row") != std::string::npos);
  // Where the ranks do not meet, the end waits for the next meeting.
  auto stop_cfg = cfg;
  stop_cfg.train.on_nonfinite = "stop";
  test::TempDir other;
  Logged l2(stop_cfg, other.path().string(), 10);
  CHECK(!l2.log.nonfinite(5, who, /*meets=*/false));
  CHECK(l2.log.state().diverged_at == 5);
}

}  // namespace unit_run_loop
