// fault_tolerance: replicas through `dtrain run --nproc N`: a replica killed mid-run (the
// writing one among them) and the others finish without a restart, every step's loss the
// one-process run's (the step in flight trained again on the same global batch, no sample
// lost or seen twice), every metrics line written; and what it refuses.
#include <doctest/doctest.h>

#include "run.hpp"

namespace e2e::fault_tests {

namespace {

// Synthetic data, no dropout, one thread a rank, 24 steps with an evaluation half-way;
// `batch`: the global batch, which the replicas that start must divide (the survivors'
// shares need not).
Job ft_job(int64_t batch) {
  Job j = ranks_job("ft", 11);
  j.data = "{dataset: synthetic, samples: 2048, test_samples: 256, input_shape: [1, 8, 8],"
           " classes: 4, batch_size: " + std::to_string(batch) + ", workers: 1}";
  j.optimizer = "{name: sgd, lr: 0.05, momentum: 0.9, weight_decay: 0.001}";
  j.schedule = "{warmup_steps: 3, decay: cosine}";
  j.max_steps = 24, j.eval_every = 12;
  j.extra = "fault_tolerance: {mode: replicas}\n";
  return j;
}

}  // namespace

TEST_SUITE("faults") {
  TEST_CASE("replicas: a replica killed mid-run and the others finish on one process's losses") {
    const auto dir = temp_dir("ft-kill");
    struct Case {
      int replicas, batch, rank, step;
    };
    // The writer (rank 0) and another, early and late, at 2, 3 and 4 replicas: one
    // survivor of 2 takes all 32, two of 3 share 30 as 15 and 15, three of 4 share 32
    // unevenly, as 11, 11 and 10.
    for (const Case c : {Case{2, 32, 1, 5}, Case{3, 30, 0, 4}, Case{4, 32, 2, 9}, Case{4, 32, 0, 17}}) {
      const std::string name = fmt::format("r{}-b{}-k{}-s{}", c.replicas, c.batch, c.rank, c.step);
      CAPTURE(name);
      const auto job = ft_job(c.batch).write(dir, name + ".yaml");
      const auto one = dir + "/" + name + "-one", ft = dir + "/" + name + "-ft";
      run_ok("run " + job + " --run-dir " + one + " --set fault_tolerance.mode=off");
      const auto r = e2e::dtrain(fmt::format(
          "run {} --nproc {} --run-dir {} --set fault_tolerance.debug_kill_rank={} --set "
          "fault_tolerance.debug_kill_step={}{}", job, c.replicas, ft, c.rank, c.step, kQuiet));
      INFO(r.err);
      REQUIRE(r.code == 0);
      CHECK(r.err.find(fmt::format("rank {} was killed by signal 9 (Killed); the other replicas "
                                   "go on without it", c.rank)) != std::string::npos);
      const auto ref = train_losses(one), got = train_losses(ft);
      REQUIRE(got.size() == 24);  // every line, the writer's death or not
      check_losses_close(ref, got, 1e-5, name);
      const auto end = metrics(ft).back();
      CHECK(end["status"] == "completed");
      CHECK(end["layout"]["data"] == c.replicas - 1);
      CHECK(end["world_size"] == c.replicas);
      CHECK(std::filesystem::exists(ft + "/checkpoints/step-00000024/model.safetensors"));
    }
  }

  TEST_CASE("replicas: what it does not run yet is refused before any worker starts") {
    const auto dir = temp_dir("ft-refuse");
    const auto job = ft_job(32).write(dir);
    const std::vector<std::pair<std::string, std::string>> cases{
        {"--nproc 4 --set parallel.tensor=2", "replicas of several processes"},
        {"--nproc 2 --set parallel.zero=1", "ZeRO"},
        {"--nproc 2 --set parallel.compression=sign", "parallel.compression"},
        {"--nproc 2 --set parallel.mode=async_ps --set parallel.servers=1",
         "its workers never wait for one another"},
        {"--nproc 2 --set model.dropout=0.1", "model.dropout"},
    };
    for (const auto& [args, says] : cases) {
      CAPTURE(args);
      const auto r = e2e::dtrain("run " + job + " " + args + " --run-dir " + dir + "/run" + kQuiet);
      CHECK(r.code == 2);
      CHECK(r.err.find("fault_tolerance.mode: replicas with") != std::string::npos);
      CHECK(r.err.find(says) != std::string::npos);
      CHECK(!std::filesystem::exists(dir + "/run"));
    }
  }
}

}  // namespace e2e::fault_tests
