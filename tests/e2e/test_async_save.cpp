// checkpoint.async: checkpoints written by a background thread while training goes on.
// They must be the checkpoints a synchronous run writes, byte for byte, on one process and
// on every layout that writes parts; a crash while one is written must leave the previous
// one as `latest` (and the run resume from it on the uninterrupted trajectory); a stop must
// wait for the write in flight and then save at once; a write that fails must stop every
// rank as a synchronous save's does. checkpoint.debug_write_delay_ms holds each background
// write back, so that a save is in flight when the test acts.
#include <doctest/doctest.h>

#include <csignal>
#include <map>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <sys/mount.h>

#include "run.hpp"

namespace e2e::async_save_tests {

namespace fs = std::filesystem;

namespace {

// Checkpoints every 5 steps, all kept; AdamW, so that the optimizer's files hold moments.
Job saving_job() {
  Job job;
  job.name = "async-save";
  job.optimizer = "{name: adamw, lr: 0.01}";
  job.max_steps = 20;
  job.checkpoint = "{every_steps: 5, keep_last: 10}";
  return job;
}

const char* kAsync = " --set checkpoint.async=true";

std::string folder(const std::string& run, int64_t step) {
  return run + "/checkpoints/" + fmt::format("step-{:08d}", step);
}

// The step `latest` names, or -1.
int64_t latest_step(const std::string& run) {
  auto text = slurp(run + "/checkpoints/latest");
  if (text.rfind("step-", 0) != 0) return -1;
  return std::stoll(text.substr(5));
}

// Every file of checkpoint `step` that holds tensors or the trainer's state, with its bytes
// (not the manifest, whose time differs, nor config.yaml, which names checkpoint.async).
std::map<std::string, std::string> state_files(const std::string& run, int64_t step) {
  std::map<std::string, std::string> out;
  for (const auto& e : fs::directory_iterator(folder(run, step))) {
    const auto name = e.path().filename().string();
    if (name != "manifest.json" && name != "config.yaml") out[name] = slurp(e.path().string());
  }
  return out;
}

}  // namespace

TEST_SUITE("async_save") {
  TEST_CASE("checkpoint.async writes the synchronous run's checkpoints, on one process and on parts") {
    auto dir = temp_dir("async-same");
    const auto job = saving_job().write(dir);
    for (const std::string layout : {std::string(""), std::string(" --nproc 2 --set parallel.zero=1"),
                                     std::string(" --nproc 2 --set parallel.pipeline=2"),
                                     std::string(" --nproc 2 --set parallel.tensor=2")}) {
      INFO("layout:" << layout);
      const auto sync = dir + "/sync", async = dir + "/async";
      std::system(("rm -rf '" + sync + "' '" + async + "'").c_str());
      run_ok("run " + job + " --run-dir " + sync + layout);
      run_ok("run " + job + " --run-dir " + async + layout + kAsync +
             " --set checkpoint.debug_write_delay_ms=150");
      CHECK(train_losses(async) == train_losses(sync));
      for (int64_t step : {5, 10, 15, 20}) {
        INFO("step " << step);
        const auto want = state_files(sync, step), got = state_files(async, step);
        CHECK(got.size() == want.size());
        for (const auto& [name, bytes] : want) {
          INFO(name);
          CHECK((got.count(name) && got.at(name) == bytes));
        }
        CHECK(dtrain("inspect " + folder(async, step)).code == 0);
      }
      CHECK(latest_step(async) == 20);
      // The time saves held training up: on every train line (each its window's) and in
      // the summary (the run's, the last step's save included).
      const auto lines = metrics(async);
      double stalled = 0;
      for (const auto& l : of_kind(lines, "train")) stalled += l.at("checkpoint_stall_ms").get<double>();
      const auto summary = lines.back();
      REQUIRE(summary["kind"] == "summary");
      CHECK(stalled > 0);
      CHECK(stalled <= summary["checkpoint_stall_ms"].get<double>() + 1e-6);
    }
  }

  TEST_CASE("a crash while a checkpoint is written leaves the previous one latest; the run resumes from it") {
    auto dir = temp_dir("async-crash");
    auto spec = saving_job();
    spec.max_steps = 40;
    const auto job = spec.write(dir);
    const auto whole = dir + "/whole", run = dir + "/run";
    run_ok("run " + job + " --run-dir " + whole);
    // Each background write waits 3 s: once `latest` names step 5, the save of step 10 has
    // begun (it waited for step 5's) and has 3 s to go.
    auto bg = start_dtrain("run " + job + " --run-dir " + run + kAsync +
                           " --set checkpoint.debug_write_delay_ms=3000" + kQuiet);
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
    while (latest_step(run) < 5 && std::chrono::steady_clock::now() < deadline)
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    ::kill(bg.pid, SIGKILL);
    CHECK(wait_for(bg.pid, std::chrono::seconds(30)) == 128 + SIGKILL);
    REQUIRE(latest_step(run) == 5);
    CHECK(!fs::exists(folder(run, 10)));  // begun, never committed
    // The resume takes step 5, discards what the killed save left, and trains on to the
    // uninterrupted run's losses.
    run_ok("run " + job + " --run-dir " + run + " --resume auto" + kAsync);
    for (const auto& e : fs::directory_iterator(run + "/checkpoints"))
      CHECK(e.path().filename().string().rfind(".tmp-", 0) != 0);
    const auto want = train_losses(whole), got = train_losses(run);
    for (int64_t step = 6; step <= 40; ++step) {
      INFO("step " << step);
      CHECK(got.at(step) == want.at(step));
    }
    CHECK(state_files(run, 40) == state_files(whole, 40));
  }

  TEST_CASE("a stop waits for the write in flight, then saves its own step at once") {
    auto dir = temp_dir("async-stop");
    auto spec = saving_job();
    spec.max_steps = 100000;
    spec.train = "grad_accum: 2, debug_slow_rank: 0, debug_slow_ms: 20";
    const auto job = spec.write(dir);
    const auto run = dir + "/run";
    for (const std::string how : {std::string(""), std::string(" --nproc 2")}) {
      INFO("how:" << how);
      std::system(("rm -rf '" + run + "'").c_str());
      auto bg = start_dtrain("run " + job + " --run-dir " + run + how + kAsync +
                             " --set checkpoint.debug_write_delay_ms=1500" + kQuiet);
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
      while (latest_step(run) < 5 && std::chrono::steady_clock::now() < deadline)
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      REQUIRE(latest_step(run) >= 5);
      ::kill(bg.pid, SIGTERM);
      CHECK(wait_for(bg.pid, std::chrono::seconds(60)) == 128 + SIGTERM);
      INFO(slurp(bg.err));
      const auto summary = metrics(run).back();
      REQUIRE(summary["kind"] == "summary");
      CHECK(summary["status"] == "stopped");
      // The stop's step is saved and is `latest`; the save that was in flight was finished
      // first (every fifth step up to it is there).
      const int64_t stopped_at = summary["steps"];
      CHECK(latest_step(run) == stopped_at);
      CHECK(dtrain("inspect " + folder(run, stopped_at)).code == 0);
      CHECK(fs::exists(folder(run, (stopped_at - 1) / 5 * 5)));
    }
  }

  TEST_CASE("a background write that fails stops every rank with its reason; earlier checkpoints stay") {
    auto dir = temp_dir("async-full");
    // Only the checkpoints on the small disk: the logs' writes, on a disk that fills while
    // the checkpoint is written, could otherwise fail first (seen in the Debian 13 root).
    const auto run = dir + "/run", disk = run + "/checkpoints";
    auto spec = saving_job();
    spec.model = "{arch: mlp, hidden: [2048]}";  // ~1.7 MB a checkpoint: one fits in 3 MB
    spec.optimizer = "{name: adamw, lr: 0.001}";
    spec.max_steps = 30;
    spec.checkpoint = "{every_steps: 10, keep_last: 5}";
    const auto job = spec.write(dir);
    for (const std::string how : {std::string(""), std::string(" --nproc 2")}) {
      INFO("how:" << how);
      std::system(("rm -rf '" + run + "'").c_str());
      fs::create_directories(disk);
      if (::mount("tmpfs", disk.c_str(), "tmpfs", 0, "size=3m") != 0) {
        MESSAGE("skipped: mounting a tmpfs needs root");
        return;
      }
      auto r = dtrain("run " + job + " --run-dir " + run + how + kAsync + kQuiet);
      // Read before the small disk goes: step 10 whole and still `latest`.
      const bool kept = dtrain("inspect " + folder(run, 10)).code == 0;
      const int64_t latest = latest_step(run);
      ::umount2(disk.c_str(), MNT_DETACH);
      INFO(r.err);
      CHECK(r.code == 3);
      CHECK(kept);
      CHECK(latest == 10);
      CHECK(r.err.find("cannot write the checkpoint of step 20") != std::string::npos);
      CHECK(r.err.find("No space left on device") != std::string::npos);
      if (!how.empty())
        CHECK(r.err.find("[rank 1] dtrain: error: rank 0 could not write the checkpoint of step 20 "
                         "(see rank 0)") != std::string::npos);
    }
  }

  TEST_CASE("validate refuses checkpoint.async under async_ps, naming both") {
    auto dir = temp_dir("async-ps");
    const auto job = saving_job().write(dir);
    auto r = dtrain("validate " + job + " --nproc 3 --set parallel.mode=async_ps" + kAsync);
    INFO(r.err);
    CHECK(r.code == 2);
    CHECK(r.err.find("parallel.mode: async_ps with checkpoint.async is not supported") !=
          std::string::npos);
  }
}

}  // namespace e2e::async_save_tests
