// fault_tolerance: replicas through `dtrain run --nproc N`: a replica killed mid-run (the
// writing one among them) and the others finish without a restart, every step's loss the
// one-process run's (the step in flight trained again on the same global batch, no sample
// lost or seen twice), every metrics line written; and what it refuses.
#include <doctest/doctest.h>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <thread>

#include "run.hpp"

namespace e2e::fault_tests {

namespace {

// Synthetic data, the MLP, one thread a rank, 24 steps with an evaluation half-way;
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

// ft_job under local SGD, averaged every 4 steps with the optimizer's state: 16 steps,
// every one logged, an evaluation at 8; `more`: further parallel keys (", key: value").
Job local_sgd_job(const std::string& more = "") {
  Job j = ft_job(24);
  j.optimizer = "{name: adamw, lr: 0.01}";
  j.max_steps = 16, j.eval_every = 8, j.log_every = 1;
  j.parallel = "{mode: local_sgd, average_every: 4, average_optimizer: true" + more + "}";
  return j;
}

// The small GPT with dropout, on text: a model of many parameters for its few values.
constexpr const char* kSmallGpt = "{arch: gpt, layers: 2, heads: 4, dim: 32, seq_len: 32, dropout: 0.1}";
void small_gpt(Job& j) {
  j.model = kSmallGpt;
  j.data = "{dataset: text, path: /usr/share/games/fortunes, batch_size: 12, seq_len: 32,"
           " workers: 1}";
}

// `j` written as NAME.yaml in `dir` and run twice: on one process without fault tolerance
// (NAME-one), then on `replicas` processes whose rank `rank` kills itself at `step` (NAME-ft;
// `how`: more of the kill's keys, " --set KEY=VALUE").
struct Killed {
  std::string one, ft;
  Result r;
};
Killed run_killed(const std::string& dir, const std::string& name, const Job& j, int replicas,
                  int rank, int step, const std::string& how = "") {
  const auto job = j.write(dir, name + ".yaml");
  Killed k{dir + "/" + name + "-one", dir + "/" + name + "-ft", {}};
  run_ok("run " + job + " --run-dir " + k.one + " --set fault_tolerance.mode=off");
  k.r = e2e::dtrain(fmt::format(
      "run {} --nproc {} --run-dir {} --set fault_tolerance.debug_kill_rank={} --set "
      "fault_tolerance.debug_kill_step={}{}{}", job, replicas, k.ft, rank, step, how, kQuiet));
  return k;
}

// A job of replicas of two ranks each (`procs` of them in all, `args` making the replica's
// layout) whose rank `rank` is killed at `step`: its replica stopped, and where `restart`
// started again to rejoin (200 steps, every step 20 ms longer so that the run outlasts the
// new processes' start; else 24). Checks the supervisor's words, the join, one process's
// losses on every logged step and the run's completion; returns the run's directory.
std::string kill_a_pair(const std::string& dir, Job j, int procs, const std::string& args,
                        int rank, int step, bool restart) {
  const std::string name = fmt::format("p{}-k{}-s{}{}", procs, rank, step, restart ? "-join" : "");
  CAPTURE(name);
  j.max_steps = restart ? 200 : 24, j.eval_every = restart ? 100 : 12;
  j.log_every = restart ? 10 : 1;
  j.extra = "fault_tolerance: {mode: replicas}\n";
  const auto job = j.write(dir, name + ".yaml");
  const auto one = dir + "/" + name + "-one", ft = dir + "/" + name + "-ft";
  run_ok("run " + job + " --run-dir " + one + " --set fault_tolerance.mode=off");
  const auto r = e2e::dtrain(
      fmt::format("run {} --nproc {} {} --run-dir {} --set fault_tolerance.debug_kill_rank={} "
                  "--set fault_tolerance.debug_kill_step={}{}{}",
                  job, procs, args, ft, rank, step,
                  restart ? " --max-restarts 1 --set train.debug_slow_rank=0 --set "
                            "train.debug_slow_ms=20" : "",
                  kQuiet),
      restart ? kExec : "");
  INFO(r.err);
  REQUIRE(r.code == 0);
  const int replica = rank / 2;
  CHECK(r.err.find(fmt::format("rank {} was killed by signal 9 (Killed); replica {} (ranks {} "
                               "to {}) is stopped and the other replicas go on without it",
                               rank, replica, 2 * replica, 2 * replica + 1)) != std::string::npos);
  if (restart) {
    CHECK(r.err.find(fmt::format("replica(s) {} joined at step", replica)) != std::string::npos);
    CHECK(r.err.find("no checkpoint read") != std::string::npos);
  }
  const auto got = train_losses(ft);
  REQUIRE(got.size() == (restart ? 20u : 24u));
  check_losses_close(train_losses(one), got, 1e-5, name);
  CHECK(metrics(ft).back()["status"] == "completed");
  return ft;
}

// The step replica `replica` joined at, as the writer said it (0: it did not join).
int joined_at(const std::string& err, int replica) {
  const std::string said = fmt::format("replica(s) {} joined at step ", replica);
  const auto at = err.find(said);
  return at == std::string::npos ? 0 : std::atoi(err.c_str() + at + said.size());
}

// The run's last checkpoint (after 24 steps, or 200 where restarted).
std::string last_checkpoint(const std::string& run, bool restart) {
  return fmt::format("{}/checkpoints/step-{:08d}", run, restart ? 200 : 24);
}

}  // namespace

TEST_SUITE("faults") {
  TEST_CASE("replicas: a replica killed mid-run and the others finish on one process's losses") {
    const auto dir = temp_dir("ft-kill");
    struct Case {
      int replicas, batch, rank, step;
      std::string model = "";  // the MLP without dropout
      int accum = 1;           // train.grad_accum
    };
    // The writer (rank 0) and another, early and late, at 2, 3 and 4 replicas: one
    // survivor of 2 takes all 32, two of 3 share 30 as 15 and 15, three of 4 share 32
    // unevenly, as 11, 11 and 10. With dropout too, whose masks follow each sample's place
    // in the global batch however it is dealt: the MLP's, and a small GPT's on text.
    const std::string gpt = kSmallGpt;
    for (const Case& c : {Case{2, 32, 1, 5}, Case{3, 30, 0, 4}, Case{4, 32, 2, 9}, Case{4, 32, 0, 17},
                          Case{4, 32, 1, 7, "{arch: mlp, hidden: [64, 32], dropout: 0.2}"},
                          Case{3, 12, 2, 6, gpt},
                          // Micro-batches of an uneven share: 11 as 6 and 5, 10 as 5 and 5.
                          Case{4, 32, 2, 9, "", 2}}) {
      const std::string name = fmt::format("r{}-b{}-k{}-s{}{}-a{}", c.replicas, c.batch, c.rank,
                                           c.step, c.model.empty() ? "" : "-dropout", c.accum);
      CAPTURE(name);
      Job j = ft_job(c.batch);
      if (!c.model.empty()) j.model = c.model;
      j.train = fmt::format("grad_accum: {}", c.accum);
      if (c.model == gpt) small_gpt(j);
      const auto [one, ft, r] = run_killed(dir, name, j, c.replicas, c.rank, c.step);
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

  // Killed inside its reduction, its first bucket posted: the others are waiting in
  // several buckets' all-reduces at once, which Gloo cannot abort. They must give up on
  // them when the supervisor's word comes (not wait for dist.timeout_s: the hang report,
  // at 10 s here, would name the wait), and the step trained again must not take what
  // the abandoned all-reduces may still write (staged copies): one process's losses.
  TEST_CASE("replicas: a replica killed inside its reduction, many buckets in flight: no wait for the timeout, one process's losses") {
    const auto dir = temp_dir("ft-reduce");
    struct Case {
      int replicas, rank, step;
      bool gpt;
    };
    for (const Case& c : {Case{3, 1, 5, true}, Case{4, 3, 8, true}, Case{4, 0, 3, true},
                          Case{2, 1, 6, false}}) {
      const std::string name = fmt::format("r{}-k{}-s{}-{}", c.replicas, c.rank, c.step,
                                           c.gpt ? "gpt" : "mlp");
      CAPTURE(name);
      Job j = ft_job(12);
      j.train = "grad_accum: 1";
      j.dist = "{timeout_s: 20}";
      j.parallel = "{bucket_mb: 0.01}";  // a few thousand values a bucket: many in flight
      if (c.gpt) small_gpt(j);
      const auto [one, ft, r] = run_killed(dir, name, j, c.replicas, c.rank, c.step,
                                           " --set fault_tolerance.debug_kill_in=reduce");
      INFO(r.err);
      REQUIRE(r.code == 0);
      CHECK(r.err.find(fmt::format("rank {} was killed by signal 9", c.rank)) != std::string::npos);
      CHECK(r.err.find(" has waited ") == std::string::npos);
      CHECK(r.err.find("dist.timeout_s") == std::string::npos);
      const auto got = train_losses(ft);
      REQUIRE(got.size() == 24);
      check_losses_close(train_losses(one), got, 1e-5, name);
      CHECK(metrics(ft).back()["status"] == "completed");
      CHECK(metrics(ft).back()["layout"]["data"] == c.replicas - 1);
    }
  }

  // The failed replica restarted (exec'd: kExec runs the binary itself, whose
  // /proc/self/exe the supervisor starts again) joins the others at a step boundary with
  // their state, taken over the group with no checkpoint read, and hashed alike.
  TEST_CASE("replicas: a killed replica restarts and joins with its peers' state; losses stay one process's") {
    const auto dir = temp_dir("ft-join");
    struct Case {
      int replicas, batch, rank, step;
    };
    for (const Case c : {Case{3, 30, 1, 6}, Case{4, 32, 0, 5}}) {
      const std::string name = fmt::format("r{}-k{}-s{}", c.replicas, c.rank, c.step);
      CAPTURE(name);
      Job j = ft_job(c.batch);
      j.max_steps = 300, j.eval_every = 150, j.log_every = 10;
      const auto job = j.write(dir, name + ".yaml");
      const auto one = dir + "/" + name + "-one", ft = dir + "/" + name + "-ft";
      run_ok("run " + job + " --run-dir " + one + " --set fault_tolerance.mode=off");
      // One survivor's step made 50 ms longer (the others wait for it): the run outlasts a
      // restarted process's start on a slow machine, and that rank is named the slowest
      // (by a margin that a compile beside the test does not bridge: at 20 ms it once did).
      const int slow = c.rank == 0 ? 1 : 0;
      const auto r = e2e::dtrain(fmt::format(
          "run {} --nproc {} --max-restarts 1 --run-dir {} --set fault_tolerance.debug_kill_rank={} "
          "--set fault_tolerance.debug_kill_step={} --set train.debug_slow_rank={} --set "
          "train.debug_slow_ms=50{}", job, c.replicas, ft, c.rank, c.step, slow, kQuiet), kExec);
      INFO(r.err);
      REQUIRE(r.code == 0);
      CHECK(r.err.find(fmt::format("rank {} was killed by signal 9 (Killed); the other replicas go "
                                   "on without it, and it restarts to join them (restart 1 of 1)",
                                   c.rank)) != std::string::npos);
      CHECK(r.err.find(fmt::format("replica(s) {} joined at step", c.rank)) != std::string::npos);
      CHECK(r.err.find("no checkpoint read") != std::string::npos);
      const auto got = train_losses(ft);
      REQUIRE(got.size() == 30);
      check_losses_close(train_losses(one), got, 1e-5, name);
      CHECK(metrics(ft).back()["layout"]["data"] == c.replicas);  // all of them again
      // Every rank of every replica has its busy time in the figures: the slow one is
      // named across replicas, in each train line and the summary.
      for (const auto& line : of_kind(metrics(ft), "train")) CHECK(line["slowest_rank"] == slow);
      CHECK(metrics(ft).back()["slowest_rank"] == slow);
      CHECK(metrics(ft).back()["slowest_busy_ms"].get<double>() >= 20);
    }
  }

  // The held-out set is split over every replica's data ranks (the eval line's `ranks`)
  // and the sums added across the replicas: the evaluation a 3-rank job's without fault
  // tolerance. A replica that dies during one, its part scored, leaves the survivors to
  // score the whole set each; the next step, whose collectives the failure skipped, is
  // trained again, and the run goes on as one process's, its evaluations split among the
  // two.
  TEST_CASE("replicas: the evaluation is split over the replicas; one a replica dies in is scored again whole") {
    const auto dir = temp_dir("ft-eval");
    Job j = ft_job(24);
    j.max_steps = 12, j.eval_every = 4, j.log_every = 1;
    const auto job = j.write(dir);
    const std::string off = " --set fault_tolerance.mode=off" + std::string(kQuiet);
    run_ok(fmt::format("run {} --nproc 3 --run-dir {}/sync{}", job, dir, off));
    run_ok(fmt::format("run {} --run-dir {}/one{}", job, dir, off));
    const auto r = e2e::dtrain(fmt::format(
        "run {} --nproc 3 --run-dir {}/ft --set fault_tolerance.debug_kill_rank=1 --set "
        "fault_tolerance.debug_kill_step=8 --set fault_tolerance.debug_kill_in=eval{}", job,
        dir, kQuiet));
    INFO(r.err);
    REQUIRE(r.code == 0);
    CHECK(r.err.find("rank 1 was killed by signal 9") != std::string::npos);
    check_losses_close(train_losses(dir + "/one"), train_losses(dir + "/ft"), 1e-5, "losses");
    const auto got = of_kind(metrics(dir + "/ft"), "eval"), sync = of_kind(metrics(dir + "/sync"), "eval"),
               one = of_kind(metrics(dir + "/one"), "eval");
    REQUIRE(got.size() == 3);
    REQUIRE(sync.size() == 3);
    REQUIRE(one.size() == 3);
    const int ranks[] = {3, 1, 2};  // split, scored again whole, split among the survivors
    for (size_t i = 0; i < 3; ++i) {
      CAPTURE(i);
      CHECK(got[i]["ranks"] == ranks[i]);
      CHECK(sync[i]["ranks"] == 3);
      const auto& ref = i == 0 ? sync[i] : one[i];
      const double rtol = i == 0 ? 1e-12 : 1e-5;
      CHECK(got[i]["loss"].get<double>() == doctest::Approx(ref["loss"].get<double>()).epsilon(rtol));
      CHECK(got[i]["accuracy"].get<double>() ==
            doctest::Approx(ref["accuracy"].get<double>()).epsilon(rtol));
    }
    CHECK(metrics(dir + "/ft").back()["layout"]["data"] == 2);
  }

  // Tensor parallelism inside each replica (a small GPT with dropout, 2 replicas of 2
  // ranks): a rank's death takes its replica's other rank down with it (the supervisor
  // stops it), and the other replica goes on alone on one process's losses; restarted, the
  // replica joins again, each of its ranks taking its place's part of the state.
  TEST_CASE("replicas: tensor 2 inside each replica: a rank killed stops its replica; the other finishes, or it rejoins") {
    const auto dir = temp_dir("ft-tensor");
    struct Case {
      int rank, step;
      bool restart;
    };
    // The writing replica's second rank, the other's second, the other's first restarted.
    for (const Case c : {Case{1, 5, false}, Case{3, 6, false}, Case{2, 6, true}}) {
      Job j = gpt_text_job("ft", 11);
      j.optimizer = "{name: sgd, lr: 0.05, momentum: 0.9, weight_decay: 0.001}";
      j.schedule = "{warmup_steps: 3, decay: cosine}";
      const auto ft = kill_a_pair(dir, j, 4, "--set parallel.tensor=2", c.rank, c.step, c.restart);
      const auto end = metrics(ft).back();
      CHECK(end["layout"]["data"] == (c.restart ? 2 : 1));
      CHECK(end["layout"]["tensor"] == 2);
      const auto last = last_checkpoint(ft, c.restart);
      CHECK(std::filesystem::exists(last + "/model.tp0.safetensors"));
      CHECK(std::filesystem::exists(last + "/model.tp1.safetensors"));
    }
  }

  // Pipeline stages inside each replica (a small GPT with dropout, its embedding tied to its
  // head across the stages, 2 micro-batches a step): a stage's death stops its replica and
  // the others finish on one process's losses. Three replicas of 18 samples leave two
  // survivors 9 each, which the stages cut into micro-batches of 5 and 4 rows alike.
  // Restarted, the replica's stages rejoin, each taking its part (the last stage the tied
  // head's copy too) from the stage at its place.
  TEST_CASE("replicas: pipeline stages inside each replica: a stage killed stops its replica; the others finish, or it rejoins") {
    const auto dir = temp_dir("ft-pipeline");
    struct Case {
      int replicas, batch, rank, step;
      bool restart;
    };
    // The writing replica's last stage; replica 1's last stage of three (uneven shares);
    // replica 1's first stage, restarted.
    for (const Case c : {Case{2, 12, 1, 5, false}, Case{3, 18, 3, 6, false}, Case{2, 12, 2, 6, true}}) {
      Job j = gpt_text_job("ft", 11);
      j.data = fmt::format("{{dataset: text, path: /usr/share/games/fortunes, batch_size: {}, "
                           "seq_len: 32, workers: 1}}", c.batch);
      j.optimizer = "{name: sgd, lr: 0.05, momentum: 0.9, weight_decay: 0.001}";
      j.schedule = "{warmup_steps: 3, decay: cosine}";
      j.train = "grad_accum: 2";
      const auto ft = kill_a_pair(dir, j, 2 * c.replicas, "--set parallel.pipeline=2", c.rank,
                                  c.step, c.restart);
      const auto end = metrics(ft).back();
      CHECK(end["layout"]["data"] == (c.restart ? c.replicas : c.replicas - 1));
      CHECK(end["layout"]["pipeline"] == 2);
      const auto last = last_checkpoint(ft, c.restart);
      CHECK(std::filesystem::exists(last + "/model.pp0.safetensors"));
      CHECK(std::filesystem::exists(last + "/model.pp1.safetensors"));
    }
  }

  // ZeRO inside each replica (HSDP: 2 replicas of 2 data ranks that shard the optimizer's
  // state, under ZeRO-2 the gradient, under 3 the weights, between them; the MLP with
  // dropout): a rank's death stops its replica, the other finishes alone on one process's
  // losses, its two ranks now taking the whole batch; restarted, the replica rejoins, each
  // rank taking its shard from the rank at its place (AdamW's moments and its step count),
  // hashed alike.
  TEST_CASE("replicas: ZeRO inside each replica: a replica killed, the other finishes; restarted, it rejoins with its shards") {
    const auto dir = temp_dir("ft-zero");
    struct Case {
      int zero, rank, step;
      bool restart;
    };
    // The writing replica's second rank, the other's (restarted or not), under ZeRO-1, 2
    // and 3 (whose weights are sharded too, and handed over shard by shard).
    for (const Case c : {Case{1, 1, 5, false}, Case{2, 2, 6, true}, Case{2, 3, 7, false},
                         Case{1, 3, 6, true}, Case{3, 1, 6, false}, Case{3, 2, 5, true}}) {
      CAPTURE(c.zero);
      Job j = ft_job(32);
      j.model = "{arch: mlp, hidden: [64, 32], dropout: 0.2}";
      j.optimizer = "{name: adamw, lr: 0.01, weight_decay: 0.01}";
      const auto ft = kill_a_pair(dir, j, 4,
                                  fmt::format("--set parallel.zero={} --set "
                                              "fault_tolerance.replica_data=2", c.zero),
                                  c.rank, c.step, c.restart);
      CHECK(metrics(ft).back()["layout"]["data"] == (c.restart ? 4 : 2));  // the data ranks at the end
      const auto last = last_checkpoint(ft, c.restart);
      CHECK(std::filesystem::exists(last + "/optimizer.dp0.safetensors"));
      CHECK(std::filesystem::exists(last + "/optimizer.dp1.safetensors"));
      CHECK(e2e::dtrain("inspect " + last).code == 0);  // verified, every shard's ranges read
    }
  }

  // Compression over the replicas: lossy, so no run of another layout is its reference
  // after a failure; before it, the run is the same layout's without fault tolerance, and
  // through it (its residuals put back as the discarded step found them) it completes.
  TEST_CASE("replicas: with compression, the run is the compressed one's until a kill and completes after it") {
    const auto dir = temp_dir("ft-compress");
    for (const std::string how : {"sign", "powersgd"}) {
      CAPTURE(how);
      Job j = ft_job(30);
      j.log_every = 1;
      j.parallel = "{compression: " + how + ", compression_warmup: 2}";
      const auto job = j.write(dir, how + ".yaml");
      const auto plain = dir + "/" + how + "-plain", ft = dir + "/" + how + "-ft";
      run_ok("run " + job + " --nproc 3 --run-dir " + plain + " --set fault_tolerance.mode=off" + kQuiet);
      const auto r = e2e::dtrain(fmt::format(
          "run {} --nproc 3 --run-dir {} --set fault_tolerance.debug_kill_rank=1 --set "
          "fault_tolerance.debug_kill_step=9{}", job, ft, kQuiet));
      INFO(r.err);
      REQUIRE(r.code == 0);
      CHECK(r.err.find("rank 1 was killed by signal 9") != std::string::npos);
      const auto ref = train_losses(plain), got = train_losses(ft);
      REQUIRE(got.size() == 24);
      check_losses_close({ref.begin(), ref.find(9)}, got, 1e-6, how);  // steps 1 to 8
      for (const auto& [step, loss] : got) CHECK(std::isfinite(loss));
      CHECK(got.rbegin()->second < got.begin()->second);
      CHECK(metrics(ft).back()["layout"]["data"] == 2);
    }
  }

  // fault_tolerance.batch: shrink: each survivor keeps its own share, so the global batch
  // loses the failed replica's and the learning rate shrinks with it. Killed at the first
  // step, the run is a one-process run of the smaller batch at the scaled rate from the
  // start (the learning rate's schedule is linear in its base, and the sampler deals the
  // smaller batches from the epoch's start); killed later, it is the job's run until then
  // and trains at the scaled rate after.
  TEST_CASE("replicas: batch shrink: the survivors keep their shares; the batch and the learning rate shrink") {
    const auto dir = temp_dir("ft-shrink");
    Job j = ft_job(24);
    j.extra = "fault_tolerance: {mode: replicas, batch: shrink}\n";
    const auto job = j.write(dir);
    const std::string one = " --set fault_tolerance.mode=off --set fault_tolerance.batch=keep";
    // At step 1: against one process at batch 16 and 2/3 of the learning rate.
    run_ok("run " + job + " --run-dir " + dir + "/small" + one +
           " --set data.batch_size=16 --set optimizer.lr=0.033333333333333333");
    auto r = e2e::dtrain(fmt::format("run {} --nproc 3 --run-dir {}/first --set "
                                     "fault_tolerance.debug_kill_rank=2 --set "
                                     "fault_tolerance.debug_kill_step=1{}", job, dir, kQuiet));
    INFO(r.err);
    REQUIRE(r.code == 0);
    check_losses_close(train_losses(dir + "/small"), train_losses(dir + "/first"), 1e-5, "at step 1");
    // At step 9: the job's run until then, 2/3 of its learning rate after.
    run_ok("run " + job + " --run-dir " + dir + "/whole" + one);
    r = e2e::dtrain(fmt::format("run {} --nproc 3 --run-dir {}/later --set "
                                "fault_tolerance.debug_kill_rank=1 --set "
                                "fault_tolerance.debug_kill_step=9{}", job, dir, kQuiet));
    INFO(r.err);
    REQUIRE(r.code == 0);
    auto ref = train_losses(dir + "/whole");
    const auto got = train_losses(dir + "/later");
    REQUIRE(got.size() == 24);
    check_losses_close({ref.begin(), ref.find(9)}, got, 1e-5, "before the kill");
    const auto lines = of_kind(metrics(dir + "/later"), "train"),
               whole = of_kind(metrics(dir + "/whole"), "train");
    for (size_t i = 0; i < lines.size(); ++i) {
      const int64_t step = lines[i]["step"].get<int64_t>();
      CAPTURE(step);
      const double want = whole[i]["lr"].get<double>() * (step < 9 ? 1.0 : 2.0 / 3.0);
      CHECK(lines[i]["lr"].get<double>() == doctest::Approx(want).epsilon(1e-9));
    }
    CHECK(metrics(dir + "/later").back()["layout"]["data"] == 2);
    // The course its batches take is in the checkpoint: a resume goes on from there.
    const auto trainer = nlohmann::json::parse(
        slurp(dir + "/later/checkpoints/step-00000024/trainer.json"));
    CHECK(trainer["data_course"]["step"] == 8);
    CHECK(trainer["data_course"]["global_batch"] == 16);
    CHECK(trainer["data_course"]["position"] == 8 * 24);
  }

  // A joiner brings its share back: the batch and the learning rate are the job's again.
  TEST_CASE("replicas: batch shrink: a restarted replica's join restores the batch") {
    const auto dir = temp_dir("ft-shrink-join");
    Job j = ft_job(16);
    j.max_steps = 200, j.eval_every = 100, j.log_every = 10;
    j.extra = "fault_tolerance: {mode: replicas, batch: shrink}\n";
    const auto job = j.write(dir);
    run_ok("run " + job + " --run-dir " + dir + "/one --set fault_tolerance.mode=off --set "
           "fault_tolerance.batch=keep");
    const auto r = e2e::dtrain(fmt::format(
        "run {} --nproc 2 --max-restarts 1 --run-dir {}/ft --set fault_tolerance.debug_kill_rank=1 "
        "--set fault_tolerance.debug_kill_step=6 --set train.debug_slow_rank=0 --set "
        "train.debug_slow_ms=20{}", job, dir, kQuiet), kExec);
    INFO(r.err);
    REQUIRE(r.code == 0);
    const int joined = joined_at(r.err, 1);
    REQUIRE(joined > 0);
    const auto got = of_kind(metrics(dir + "/ft"), "train"), one = of_kind(metrics(dir + "/one"), "train");
    REQUIRE(got.size() == 20);
    for (size_t i = 0; i + 1 < got.size(); ++i) {  // the last step's rate is 0
      const int64_t step = got[i]["step"].get<int64_t>();
      CAPTURE(step);
      const double scale = step >= 6 && step < joined ? 0.5 : 1.0;
      CHECK(got[i]["lr"].get<double>() == doctest::Approx(one[i]["lr"].get<double>() * scale).epsilon(1e-9));
    }
    CHECK(metrics(dir + "/ft").back()["layout"]["data"] == 2);
  }

  // Local SGD over the replicas: they vote where they meet, so a replica that dies between
  // averages takes the interval since the last one with it, and the survivors train it
  // again from that average. The reference is local SGD itself without fault tolerance: at
  // the job's replicas up to that average, then resumed from its checkpoint at one replica
  // fewer (the checkpoint holds the averaged optimizer state too, so the resume is exact).
  TEST_CASE("replicas: local SGD: an interval a replica died in is trained again from the last average, as by a smaller world") {
    const auto dir = temp_dir("ft-local");
    struct Case {
      int replicas, rank, step, local_after, back_to;
      bool gpt = false;     // 2 replicas of tensor 2, a small GPT with dropout
      bool diloco = false;  // DiLoCo's outer step: its momentum put back with the rest
    };
    // Mid-interval, the writer as an average's step starts, in the synchronous start (the
    // step alone trained again, as the sync mode does), 4 replicas, tensor 2 inside each,
    // DiLoCo (a failure after two outer steps: their momentum put back with the rest).
    for (const Case& c : {Case{3, 2, 6, 0, 4}, Case{3, 0, 8, 0, 4}, Case{3, 1, 3, 4, 2},
                          Case{4, 3, 10, 0, 8}, Case{2, 2, 7, 0, 4, true},
                          Case{3, 2, 10, 0, 8, false, true}}) {
      const std::string name = fmt::format("r{}-k{}-s{}-l{}{}{}", c.replicas, c.rank, c.step,
                                           c.local_after, c.gpt ? "-gpt" : "",
                                           c.diloco ? "-diloco" : "");
      CAPTURE(name);
      Job j = local_sgd_job(fmt::format(", local_after: {}{}{}", c.local_after,
                                        c.gpt ? ", tensor: 2" : "",
                                        c.diloco ? ", outer_lr: 0.7, outer_momentum: 0.9" : ""));
      j.checkpoint = "{every_steps: 2, keep_last: 20}";
      if (c.gpt) small_gpt(j);
      const auto job = j.write(dir, name + ".yaml");
      const int per = c.gpt ? 2 : 1;  // ranks per replica
      const auto ft = dir + "/" + name + "-ft", ref = dir + "/" + name + "-ref",
                 smaller = dir + "/" + name + "-smaller";
      const auto r = e2e::dtrain(fmt::format(
          "run {} --nproc {} --run-dir {} --set fault_tolerance.debug_kill_rank={} --set "
          "fault_tolerance.debug_kill_step={}{}", job, c.replicas * per, ft, c.rank, c.step, kQuiet));
      INFO(r.err);
      REQUIRE(r.code == 0);
      const bool interval = c.step > c.local_after;
      CHECK((r.err.find(fmt::format("steps {} to {} discarded: a replica failed before the "
                                    "replicas met (local SGD)", c.back_to + 1,
                                    (c.step - 1) / 4 * 4 + 4)) != std::string::npos) == interval);
      const std::string plain = " --set fault_tolerance.mode=off" + std::string(kQuiet);
      run_ok(fmt::format("run {} --nproc {} --run-dir {}{}", job, c.replicas * per, ref, plain));
      std::filesystem::copy(ref, smaller, std::filesystem::copy_options::recursive);
      run_ok(fmt::format("run {} --nproc {} --run-dir {} --resume {}/checkpoints/step-{:08d}{}", job,
                         (c.replicas - 1) * per, smaller, smaller, c.back_to, plain));
      const auto got = train_losses(ft);
      auto before = train_losses(ref), after = train_losses(smaller);
      before.erase(before.upper_bound(c.back_to), before.end());
      after.erase(after.begin(), after.upper_bound(c.back_to));
      check_losses_close(before, got, 1e-6, name + " before");
      check_losses_close(after, got, 1e-6, name + " after");
      CHECK(of_kind(metrics(ft), "train").size() == 16);  // each step's line once, as it stood
      CHECK(metrics(ft).back()["status"] == "completed");
      CHECK(metrics(ft).back()["layout"]["data"] == c.replicas - 1);
    }
  }

  // Local SGD: the replicas vote where they meet, so a stop signal at step 5 is a notice at
  // the average after step 8 and the replica leaves after the one after step 12, its
  // interval kept: plain local SGD of 3 up to there, then of 2 resumed from that average.
  TEST_CASE("replicas: local SGD: a stop signal's replica leaves at the second average after it") {
    const auto dir = temp_dir("ft-local-leave");
    Job j = local_sgd_job();
    j.checkpoint = "{every_steps: 4, keep_last: 20}";
    const auto job = j.write(dir);
    const auto r = e2e::dtrain(fmt::format(
        "run {} --nproc 3 --run-dir {}/ft --set fault_tolerance.debug_kill_rank=2 --set "
        "fault_tolerance.debug_kill_step=5 --set fault_tolerance.debug_kill_signal=TERM{}",
        job, dir, kQuiet));
    INFO(r.err);
    REQUIRE(r.code == 0);
    CHECK(r.err.find("replica 2 leaves the job after step 12") != std::string::npos);
    const std::string plain = " --set fault_tolerance.mode=off" + std::string(kQuiet);
    run_ok(fmt::format("run {} --nproc 3 --run-dir {}/ref{}", job, dir, plain));
    std::filesystem::copy(dir + "/ref", dir + "/smaller", std::filesystem::copy_options::recursive);
    run_ok(fmt::format("run {} --nproc 2 --run-dir {}/smaller --resume {}/smaller/checkpoints/"
                       "step-00000012{}", job, dir, dir, plain));
    const auto got = train_losses(dir + "/ft");
    REQUIRE(got.size() == 16);
    auto before = train_losses(dir + "/ref"), after = train_losses(dir + "/smaller");
    before.erase(before.upper_bound(12), before.end());
    after.erase(after.begin(), after.upper_bound(12));
    check_losses_close(before, got, 1e-6, "before");
    check_losses_close(after, got, 1e-6, "after");
    CHECK(metrics(dir + "/ft").back()["layout"]["data"] == 2);
  }

  // Local SGD under fault_tolerance.batch: shrink: the survivors keep their shares and
  // their rate (a local step is on the replica's own share, which does not change), the
  // global batch loses the failed replica's. Killed in the first interval, the run is plain
  // local SGD at one replica fewer and the smaller global batch from the start, at the
  // job's rate; killed later, it is the job's run up to the last average and keeps its
  // rate after, its course from that average in the checkpoint.
  TEST_CASE("replicas: local SGD with batch shrink: the survivors keep their shares and their rate") {
    const auto dir = temp_dir("ft-local-shrink");
    Job j = local_sgd_job();
    j.extra = "fault_tolerance: {mode: replicas, batch: shrink}\n";
    const auto job = j.write(dir);
    const std::string plain = " --set fault_tolerance.mode=off --set fault_tolerance.batch=keep" +
                              std::string(kQuiet);
    run_ok(fmt::format("run {} --nproc 2 --run-dir {}/small --set data.batch_size=16{}", job, dir, plain));
    run_ok(fmt::format("run {} --nproc 3 --run-dir {}/whole{}", job, dir, plain));
    const auto whole = train_losses(dir + "/whole");
    for (const int step : {3, 6}) {
      CAPTURE(step);
      const auto ft = fmt::format("{}/ft-{}", dir, step);
      const auto r = e2e::dtrain(fmt::format(
          "run {} --nproc 3 --run-dir {} --set fault_tolerance.debug_kill_rank=2 --set "
          "fault_tolerance.debug_kill_step={}{}", job, ft, step, kQuiet));
      INFO(r.err);
      REQUIRE(r.code == 0);
      const int back_to = step < 4 ? 0 : 4;
      CHECK(r.err.find(fmt::format("steps {} to {} discarded", back_to + 1, back_to + 4)) !=
            std::string::npos);
      const auto got = train_losses(ft);
      REQUIRE(got.size() == 16);
      if (back_to == 0) check_losses_close(train_losses(dir + "/small"), got, 1e-6, "killed at 3");
      else check_losses_close({whole.begin(), whole.upper_bound(back_to)}, got, 1e-6, "before");
      const auto lines = of_kind(metrics(ft), "train"), job_lines = of_kind(metrics(dir + "/whole"), "train");
      for (size_t i = 0; i < lines.size(); ++i)
        CHECK(lines[i]["lr"].get<double>() == doctest::Approx(job_lines[i]["lr"].get<double>()).epsilon(1e-9));
      CHECK(metrics(ft).back()["layout"]["data"] == 2);
      const auto trainer = nlohmann::json::parse(
          slurp(ft + "/checkpoints/step-00000016/trainer.json"));
      CHECK(trainer["data_course"]["step"] == back_to);
      CHECK(trainer["data_course"]["global_batch"] == 16);
      CHECK(trainer["data_course"]["position"] == back_to * 24);
    }
  }

  // Restarted, the replica joins where the others meet, with their average.
  TEST_CASE("replicas: local SGD: a killed replica restarts and joins at an average with its peers' state") {
    const auto dir = temp_dir("ft-local-join");
    Job j = ft_job(24);
    j.max_steps = 200, j.eval_every = 100, j.log_every = 10;
    j.parallel = "{mode: local_sgd, average_every: 4}";
    const auto job = j.write(dir);
    const auto ft = dir + "/ft";
    const auto r = e2e::dtrain(fmt::format(
        "run {} --nproc 3 --max-restarts 1 --run-dir {} --set fault_tolerance.debug_kill_rank=1 "
        "--set fault_tolerance.debug_kill_step=6 --set train.debug_slow_rank=0 --set "
        "train.debug_slow_ms=20{}", job, ft, kQuiet), kExec);
    INFO(r.err);
    REQUIRE(r.code == 0);
    CHECK(r.err.find("steps 5 to 8 discarded") != std::string::npos);
    const int joined = joined_at(r.err, 1);
    CHECK(joined > 8);
    CHECK((joined - 1) % 4 == 0);  // after an average
    CHECK(r.err.find("no checkpoint read") != std::string::npos);
    CHECK(of_kind(metrics(ft), "train").size() == 20);
    CHECK(metrics(ft).back()["status"] == "completed");
    CHECK(metrics(ft).back()["layout"]["data"] == 3);
  }

  TEST_CASE("replicas: a stopped replica (SIGSTOP) is killed within its heartbeat's timeout and replaced") {
    const auto dir = temp_dir("ft-stop");
    Job j = ft_job(30);
    j.max_steps = 100000, j.log_every = 1000, j.eval_every = 0;
    j.checkpoint = "{every_steps: 100000}";
    const auto job = j.write(dir);
    const auto run = dir + "/run";
    // In the background, bounded; rank 2 stopped once it trains, then the job stopped by
    // SIGTERM once rank 2 has joined again.
    const auto log = dir + "/log";
    std::system(fmt::format("timeout -s TERM 120 {} run {} --nproc 3 --max-restarts 1 --run-dir {} "
                            "--set fault_tolerance.heartbeat_s=3{} > {} 2>&1 &",
                            DTRAIN_BIN, job, run, kQuiet, log).c_str());
    auto wait_for = [&](const std::string& text, int seconds) {
      for (int i = 0; i < seconds * 10; ++i) {
        if (slurp(log).find(text) != std::string::npos) return true;
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
      }
      return false;
    };
    REQUIRE(wait_for("[rank 0] dtrain", 60));
    std::this_thread::sleep_for(std::chrono::seconds(1));
    // This job's rank 2 (its workers are forked: their name says their rank), not another
    // test's.
    const auto ours = fmt::format("pgrep -f -- '--run-dir {}'", run);
    REQUIRE(std::system(fmt::format("for p in $({}); do [ \"$(cat /proc/$p/comm)\" = 'dtrain rank 2' ] "
                                    "&& kill -STOP $p; done; true", ours).c_str()) == 0);
    CHECK(wait_for("dtrain: rank 2 stopped answering (its heartbeat is stale, the process stopped): "
                   "killing it", 30));
    CHECK(wait_for("replica(s) 2 joined at step", 60));
    std::system(fmt::format("pkill -TERM -f -- '--run-dir {}'", run).c_str());
    CHECK(wait_for("checkpoint saved", 60));
    for (int i = 0; i < 600 && std::system((ours + " > /dev/null").c_str()) == 0; ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    const auto end = metrics(run).back();
    CHECK(end["status"] == "stopped");
    CHECK(end["layout"]["data"] == 3);
  }

  // A stop signal to one replica's rank (SIGTERM at step 5, as a launcher stopping its
  // workers would send it): a step's notice, then the replica leaves after step 6 and the
  // others train on without it, the batch dealt among them; the supervisor restarts
  // nothing. The writer among them (rank 0), and a replica of two tensor ranks of which one
  // was reached (both leave).
  TEST_CASE("replicas: a stop signal to one replica: it leaves after a step's notice; the others finish on one process's losses") {
    const auto dir = temp_dir("ft-leave");
    struct Case {
      int procs, rank, replica;
      std::string args;
    };
    for (const Case& c : {Case{3, 0, 0, ""}, Case{4, 3, 1, "--set parallel.tensor=2"}}) {
      const std::string name = fmt::format("p{}-r{}", c.procs, c.rank);
      CAPTURE(name);
      const auto job = ft_job(30).write(dir, name + ".yaml");
      const auto one = dir + "/" + name + "-one", ft = dir + "/" + name + "-ft";
      run_ok("run " + job + " --run-dir " + one + " --set fault_tolerance.mode=off");
      const auto r = e2e::dtrain(fmt::format(
          "run {} --nproc {} {} --max-restarts 1 --run-dir {} --set fault_tolerance.debug_kill_rank={} "
          "--set fault_tolerance.debug_kill_step=5 --set fault_tolerance.debug_kill_signal=TERM{}",
          job, c.procs, c.args, ft, c.rank, kQuiet));
      INFO(r.err);
      REQUIRE(r.code == 0);
      CHECK(r.err.find(fmt::format("replica {} leaves the job after step 6 (a stop signal came to "
                                   "it); the others go on without it", c.replica)) != std::string::npos);
      CHECK(r.err.find(fmt::format("replica(s) {} left the job after step 6", c.replica)) !=
            std::string::npos);
      CHECK(r.err.find("restarts to join") == std::string::npos);
      const auto got = train_losses(ft);
      REQUIRE(got.size() == 24);
      check_losses_close(train_losses(one), got, 1e-5, name);
      const auto end = metrics(ft).back();
      CHECK(end["status"] == "completed");
      CHECK(end["layout"]["data"] == (c.procs == 3 ? 2 : 1));
      CHECK(std::filesystem::exists(last_checkpoint(ft, false) + "/manifest.json"));
    }
  }

  TEST_CASE("replicas: what it does not run yet is refused before any worker starts") {
    const auto dir = temp_dir("ft-refuse");
    const auto job = ft_job(32).write(dir);
    const std::string with = "fault_tolerance.mode: replicas with ";
    const std::vector<std::pair<std::string, std::string>> cases{
        {"--nproc 2 --set parallel.zero=1", "parallel.zero 1 with fault_tolerance.mode: replicas "
                                            "shards ZeRO's state over the data ranks inside a replica"},
        {"--nproc 4 --set fault_tolerance.replica_data=2", "without parallel.zero each data rank "
                                                           "is a replica of its own"},
        {"--nproc 4 --set parallel.zero=1 --set fault_tolerance.replica_data=3",
         "fault_tolerance.replica_data: 3 does not divide the 4 data-parallel ranks"},
        {"--set fault_tolerance.mode=off --set fault_tolerance.batch=shrink",
         "fault_tolerance.batch: shrink says what a replica's failure does to the batch: it needs "
         "fault_tolerance.mode: replicas"},
        {"--nproc 2 --set parallel.mode=async_ps --set parallel.servers=1",
         with + "parallel.mode async_ps: its workers never wait for one another"},
    };
    for (const auto& [args, says] : cases) {
      CAPTURE(args);
      const auto r = e2e::dtrain("run " + job + " " + args + " --run-dir " + dir + "/run" + kQuiet);
      CHECK(r.code == 2);
      CHECK(r.err.find(says) != std::string::npos);
      CHECK(!std::filesystem::exists(dir + "/run"));
    }
  }
}

}  // namespace e2e::fault_tests
