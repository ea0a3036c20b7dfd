// Data parallelism through `dtrain run --nproc N`: accumulation and tiny buckets against one
// process, resuming at another size, and what happens when a worker dies or stalls. (Every
// model at data 2 and 4 against one process: test_layouts.cpp.)
#include <doctest/doctest.h>

#include <algorithm>
#include <csignal>
#include <sstream>

#include <torch/torch.h>

#include "util/safetensors.hpp"
#include "run.hpp"

namespace e2e::parallel_tests {

namespace {

// Whether process `pid` ignores SIGPIPE (/proc's SigIgn mask, signal N at bit N - 1).
bool ignores_sigpipe(pid_t pid) {
  std::istringstream status(slurp("/proc/" + std::to_string(pid) + "/status"));
  for (std::string line; std::getline(status, line);)
    if (line.rfind("SigIgn:", 0) == 0)
      return (std::stoull(line.substr(7), nullptr, 16) >> (SIGPIPE - 1)) & 1;
  return false;
}

// Synthetic data, no dropout, one thread per rank: what 1, 2 and 4 ranks must agree on.
Job dp_job() {
  Job j = ranks_job("dp-check", 11);
  j.optimizer = "{name: sgd, lr: 0.05, momentum: 0.9, weight_decay: 0.001}";
  j.schedule = "{warmup_steps: 5, decay: cosine}";
  j.max_steps = 60, j.eval_every = 30;
  return j;
}

// Runs the job at each size and checks every step's loss and the final weights against
// the one-process run, to 1e-5 relative.
void check_equivalent(const std::string& dir, const std::string& job, const std::string& extra,
                      std::vector<int> sizes) {
  std::map<int, std::map<int64_t, double>> runs;
  std::map<int, dtrain::SafetensorsFile> weights;
  for (int n : sizes) {
    auto run = dir + "/n" + std::to_string(n);
    auto r = e2e::dtrain("run " + job + " --nproc " + std::to_string(n) + " --run-dir " + run + extra + kQuiet);
    INFO("nproc " << n << ": " << r.err);
    REQUIRE(r.code == 0);
    runs[n] = train_losses(run);
    REQUIRE(runs[n].size() == 60);
    weights[n] = dtrain::read_safetensors(run + "/checkpoints/step-00000060/model.safetensors");
    CHECK(metrics(run).back()["world_size"] == n);
  }
  const auto& ref = runs[sizes[0]];
  for (int n : sizes) {
    check_losses_close(ref, runs[n], 1e-5, "nproc " + std::to_string(n));
    REQUIRE(weights[n].tensors.size() == weights[sizes[0]].tensors.size());
    for (size_t i = 0; i < weights[n].tensors.size(); ++i) {
      const auto& [name, t] = weights[n].tensors[i];
      const auto& ref_t = weights[sizes[0]].tensors[i].second;
      INFO("nproc " << n << " tensor " << name);
      CHECK(torch::allclose(t, ref_t, /*rtol=*/1e-5, /*atol=*/1e-6));
    }
  }
}
// A run stopped by a signal: its summary says so, and the step it stopped at was saved.
void check_stopped_with_checkpoint(const std::string& run_dir) {
  const auto summary = metrics(run_dir).back();
  CHECK(summary["status"] == "stopped");
  const int64_t at = summary["steps"];
  CHECK(std::filesystem::exists(run_dir + "/checkpoints/" + fmt::format("step-{:08d}", at) +
                                "/manifest.json"));
}
}  // namespace

TEST_SUITE("data_parallel") {
  TEST_CASE("MLP: 2 ranks with gradient accumulation equal 1 rank without") {
    auto dir = temp_dir("dp-accum");
    auto job = dp_job().write(dir, "dp.yaml");
    // 1 rank x 32 samples in one pass vs 2 ranks x 2 micro-batches of 8.
    auto one = e2e::dtrain("run " + job + " --run-dir " + dir + "/one" + kQuiet);
    REQUIRE(one.code == 0);
    auto two = e2e::dtrain("run " + job + " --nproc 2 --run-dir " + dir + "/two --set train.grad_accum=2" + kQuiet);
    INFO(two.err);
    REQUIRE(two.code == 0);
    auto a = train_losses(dir + "/one"), b = train_losses(dir + "/two");
    check_losses_close(a, b, 1e-5, "2 ranks x 2 micro-batches");
  }

  TEST_CASE("a checkpoint written by 2 ranks resumes on 1 on the same trajectory") {
    auto dir = temp_dir("dp-relayout");
    auto dp = dp_job();
    dp.checkpoint = "{every_steps: 30}";
    auto job = dp.write(dir, "dp.yaml");
    // A schedule that does not depend on max_steps, so the 30-step first leg follows the
    // 60-step run's learning rates.
    const std::string quiet = std::string(kQuiet) + " --set schedule.decay=step";
    auto one = e2e::dtrain("run " + job + " --run-dir " + dir + "/one" + quiet);
    REQUIRE(one.code == 0);
    auto first = e2e::dtrain("run " + job + " --nproc 2 --run-dir " + dir + "/mixed --set train.max_steps=30" + quiet);
    REQUIRE(first.code == 0);
    auto second = e2e::dtrain("run " + job + " --run-dir " + dir + "/mixed --resume auto" + quiet);
    INFO(second.err);
    REQUIRE(second.code == 0);
    auto a = train_losses(dir + "/one"), b = train_losses(dir + "/mixed");
    REQUIRE(b.size() == 60);
    check_losses_close(a, b, 1e-5, "resumed on 1 process");
  }

  TEST_CASE("a bucket smaller than one parameter still averages everything") {
    auto dir = temp_dir("dp-buckets");
    auto job = dp_job().write(dir, "dp.yaml");
    check_equivalent(dir, job, " --set parallel.bucket_mb=0.001", {1, 2});
  }

  TEST_CASE("a rank that holds the others up is named in the train lines and the summary") {
    auto dir = temp_dir("dp-straggler");
    auto job = dp_job().write(dir, "dp.yaml");
    // Rank 2 of 3 sleeps 60 ms before each step: its busy time is the sleep and its own
    // work; the others' leave out their wait for it in the gradient sync.
    auto r = e2e::dtrain("run " + job + " --nproc 3 --run-dir " + dir + "/run --set data.batch_size=30 --set train.max_steps=12"
                         " --set train.log_every=4 --set train.debug_slow_rank=2"
                         " --set train.debug_slow_ms=60" + kQuiet);
    INFO(r.err);
    REQUIRE(r.code == 0);
    const auto lines = metrics(dir + "/run");
    const auto train = of_kind(lines, "train");
    REQUIRE(train.size() == 3);
    for (const auto& line : train) {
      CHECK(line["slowest_rank"] == 2);
      CHECK(line["slowest_busy_ms"].get<double>() >= 60);
      CHECK(line["median_busy_ms"].get<double>() < line["slowest_busy_ms"].get<double>());
    }
    const auto& summary = lines.back();
    CHECK(summary["slowest_rank"] == 2);
    CHECK(summary["slowest_busy_ms"].get<double>() >= 60);
    // One process has no one to name.
    auto one = e2e::dtrain("run " + job + " --run-dir " + dir + "/one --set train.max_steps=4" + kQuiet);
    REQUIRE(one.code == 0);
    CHECK_FALSE(metrics(dir + "/one").back().contains("slowest_rank"));
  }
}

TEST_SUITE("failures") {
  TEST_CASE("SIGKILL to a worker ends the job with exit 4 naming the rank; --max-restarts recovers") {
    auto dir = temp_dir("kill");
    auto job = dp_job().write(dir, "dp.yaml");
    const std::string common = " --nproc 2 --set train.max_steps=100000 --set train.log_every=10"
                               " --set checkpoint.every_steps=50" + std::string(kQuiet);
    {
      auto bg = start_dtrain("run " + job + " --run-dir " + dir + "/a" + common);
      REQUIRE(wait_for_step(dir + "/a", 20, std::chrono::seconds(60)));
      pid_t victim = worker_pid(bg.pid, 1);
      REQUIRE(victim > 0);
      // The survivor ignores SIGPIPE: its next write to the dead peer fails as an error it
      // reports. (Killed by it instead, it was blamed for the job's end, now and then.)
      CHECK(ignores_sigpipe(worker_pid(bg.pid, 0)));
      const auto t0 = std::chrono::steady_clock::now();
      ::kill(victim, SIGKILL);
      int code = wait_for(bg.pid, std::chrono::seconds(30 + 10));
      const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      auto err = slurp(bg.err);
      INFO(err);
      CHECK(code == 4);
      CHECK(took < 40);
      CHECK(err.find("dtrain: error: rank 1 was killed by signal 9") != std::string::npos);
      // Rank 0 saw a closed connection, not a timeout, and says so where it could before
      // the supervisor stopped it: on Debian 13's LibTorch 2.6 under a loaded machine a
      // survivor's Gloo op now and then (1 kill in 25 here) waits on the dead peer without an
      // error until it is stopped; the job's end and the line naming rank 1 are the same.
      if (err.find("[rank 0] dtrain: error:") != std::string::npos)
        CHECK(err.find("a peer rank closed its connection") != std::string::npos);
      CHECK(err.find("no answer within") == std::string::npos);
    }
    {
      // The same with one restart allowed: the job comes back from its checkpoint and ends
      // at max_steps.
      auto bg = start_dtrain("run " + job + " --run-dir " + dir + "/b --max-restarts 1" + common +
                             " --set train.max_steps=400");
      REQUIRE(wait_for_step(dir + "/b", 120, std::chrono::seconds(60)));
      pid_t victim = worker_pid(bg.pid, 0);
      REQUIRE(victim > 0);
      ::kill(victim, SIGKILL);
      int code = wait_for(bg.pid, std::chrono::seconds(120));
      auto err = slurp(bg.err);
      INFO(err);
      CHECK(code == 0);
      CHECK(err.find("restarting all 2 workers") != std::string::npos);
      auto lines = metrics(dir + "/b");
      CHECK(lines.back()["kind"] == "summary");
      CHECK(lines.back()["steps"] == 400);
    }
    {
      // Killed again after its one restart: the job ends, and says the restarts ran out.
      auto bg = start_dtrain("run " + job + " --run-dir " + dir + "/c --max-restarts 1" + common);
      REQUIRE(wait_for_step(dir + "/c", 60, std::chrono::seconds(60)));
      const pid_t first = worker_pid(bg.pid, 1);
      REQUIRE(first > 0);
      ::kill(first, SIGKILL);
      // The restarted workers announce the step they resumed at once they are training.
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
      while (slurp(bg.err).find("resumed at step") == std::string::npos &&
             std::chrono::steady_clock::now() < deadline)
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
      pid_t victim = worker_pid(bg.pid, 1);
      REQUIRE(victim > 0);
      ::kill(victim, SIGKILL);
      int code = wait_for(bg.pid, std::chrono::seconds(60));
      auto err = slurp(bg.err);
      INFO(err);
      CHECK(code == 4);
      CHECK(err.find("no restarts left (--max-restarts 1 used)") != std::string::npos);
    }
  }

  TEST_CASE("a stalled worker (SIGSTOP) makes the others fail with the timeout, not hang") {
    auto dir = temp_dir("stall");
    auto job = dp_job().write(dir, "dp.yaml");
    auto bg = start_dtrain("run " + job + " --run-dir " + dir + "/a --nproc 2 --set dist.timeout_s=5"
                           " --set train.max_steps=100000 --set train.log_every=10" + kQuiet);
    REQUIRE(wait_for_step(dir + "/a", 20, std::chrono::seconds(60)));
    pid_t victim = worker_pid(bg.pid, 1);
    REQUIRE(victim > 0);
    ::kill(victim, SIGSTOP);
    int code = wait_for(bg.pid, std::chrono::seconds(5 + 25));
    if (code == -1) ::kill(bg.pid, SIGKILL), ::kill(victim, SIGKILL);
    auto err = slurp(bg.err);
    INFO(err);
    CHECK(code == 4);
    CHECK(err.find("[rank 0] dtrain: error: rank 0:") != std::string::npos);
    CHECK(err.find("no answer within dist.timeout_s = 5 s") != std::string::npos);
    // Named while it happened: half the timeout (dist.hang_report_s is longer) into the wait.
    CHECK(err.find("[rank 0] dtrain: rank 0: ") != std::string::npos);
    CHECK(err.find("of the world group") != std::string::npos);
    CHECK(err.find("rank 1: silent for ") != std::string::npos);
    // And the supervisor, which hosts the store, drew the whole job.
    CHECK(err.find("dtrain: the job now (from each rank's heartbeat):\n  rank 0: at step ") != std::string::npos);
    // The supervisor blames the rank that stalled, not the one that noticed.
    CHECK(err.find("dtrain: error: rank 1 was stopped (SIGSTOP or a debugger) and rank 0 gave up "
                   "waiting for it") != std::string::npos);
  }

  TEST_CASE("SIGTERM to --nproc: every rank stops at the same step, rank 0 checkpoints, exit 143") {
    auto dir = temp_dir("preempt-dp");
    auto job = dp_job().write(dir, "dp.yaml");
    auto bg = start_dtrain("run " + job + " --run-dir " + dir + "/a --nproc 2"
                           " --set train.max_steps=100000 --set train.log_every=10" + kQuiet);
    REQUIRE(wait_for_step(dir + "/a", 20, std::chrono::seconds(60)));
    ::kill(bg.pid, SIGTERM);
    int code = wait_for(bg.pid, std::chrono::seconds(30));
    auto err = slurp(bg.err);
    INFO(err);
    CHECK(code == 143);
    check_stopped_with_checkpoint(dir + "/a");
  }

  TEST_CASE("SIGTERM to one worker (a user's kill, an OOM killer): the job stops, exit 143") {
    auto dir = temp_dir("preempt-one");
    auto job = dp_job().write(dir, "dp.yaml");
    auto bg = start_dtrain("run " + job + " --run-dir " + dir + "/a --nproc 2"
                           " --set train.max_steps=100000 --set train.log_every=10" + kQuiet);
    REQUIRE(wait_for_step(dir + "/a", 20, std::chrono::seconds(60)));
    const pid_t victim = worker_pid(bg.pid, 1);
    REQUIRE(victim > 0);
    ::kill(victim, SIGTERM);
    int code = wait_for(bg.pid, std::chrono::seconds(60));
    auto err = slurp(bg.err);
    INFO(err);
    CHECK(code == 143);
    CHECK(err.find("the other ranks were stopped") == std::string::npos);
    check_stopped_with_checkpoint(dir + "/a");
  }

  TEST_CASE("a worker that cannot read its data ends the job with exit 3, not a restart") {
    auto dir = temp_dir("baddata-dp");
    auto r = e2e::dtrain("run " + config("fashion_mnist_mlp.yaml") + " --nproc 2 --max-restarts 3"
                         " --run-dir " + dir + "/a --set data.path=" + dir + "/nowhere" + kQuiet);
    INFO(r.err);
    CHECK(r.code == 3);
    CHECK(r.err.find("dataset-fashion-mnist") != std::string::npos);
    CHECK(r.err.find("restarting") == std::string::npos);
  }
}

}  // namespace e2e::parallel_tests
