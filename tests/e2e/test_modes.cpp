// Training modes beyond lock-step through `dtrain run --nproc N` (run/mode.hpp). Local
// SGD: averaging every step with the optimizer state is synchronous SGD step for step (a
// property of the arithmetic, not of the code: the mean of the replicas' momentum updates
// is the update of the mean gradient); apart between averages, the ranks meet, evaluate,
// checkpoint and stop only at averages, and a checkpoint resumes bit for bit with each
// replica's own optimizer state; on Fashion-MNIST it trains to sync's accuracy.
#include <doctest/doctest.h>

#include <csignal>
#include <filesystem>
#include <set>

#include <fmt/format.h>
#include <torch/torch.h>

#include "checkpoint/checkpoint.hpp"
#include "util/safetensors.hpp"
#include "run.hpp"

namespace e2e::modes_tests {

namespace {


// Synthetic data, the MLP, 2 ranks; a schedule independent of max_steps.
std::string job(const std::string& dir, const std::string& optimizer) {
  Job j = ranks_job("modes-check", 11);
  j.optimizer = optimizer;
  j.schedule = "{decay: step, step_size: 10}";
  j.max_steps = 24, j.eval_every = 0;
  return j.write(dir);
}

std::set<int64_t> checkpoint_steps(const std::string& run_dir) {
  std::set<int64_t> out;
  for (const auto& e : std::filesystem::directory_iterator(run_dir + "/checkpoints"))
    if (e.path().filename().string().rfind("step-", 0) == 0 &&
        std::filesystem::exists(e.path() / "manifest.json"))
      out.insert(std::stoll(e.path().filename().string().substr(5)));
  return out;
}

// MNIST-shaped images in which a few samples have one bright pixel, and an MLP whose first
// layer's weights on that pixel are `weight`: those samples make about one step in three
// non-finite on some replica, and the replicas skip apart between averages. 3e38 makes
// the loss not finite; 1e30 keeps it finite and makes the gradient's norm overflow, which
// each replica sees alone even where they meet (their gradients are their own). Returns
// the job file and the --set that starts from those weights.
std::pair<std::string, std::string> bright_pixel_job(const std::string& dir, float weight) {
  auto idx = [&](const std::string& name, const torch::Tensor& bytes) {
    std::string out{'\0', '\0', '\x08', char(bytes.dim())};
    for (int64_t d : bytes.sizes())
      for (int shift : {24, 16, 8, 0}) out += char((uint32_t(d) >> shift) & 0xff);
    const auto c = bytes.contiguous();
    out.append(static_cast<const char*>(c.data_ptr()), size_t(c.numel()));
    std::ofstream(dir + "/" + name, std::ios::binary) << out;
  };
  torch::manual_seed(1);
  auto images = torch::randint(0, 100, {256, 28, 28}, torch::kUInt8);
  images.select(2, 0).select(1, 0).zero_();
  for (int64_t k = 0; k < 256; k += 11) images[k][0][0] = 255;
  const auto labels = torch::randint(0, 10, {256}, torch::kUInt8);
  idx("train-images-idx3-ubyte", images);
  idx("train-labels-idx1-ubyte", labels);
  idx("t10k-images-idx3-ubyte", images.narrow(0, 0, 64));
  idx("t10k-labels-idx1-ubyte", labels.narrow(0, 0, 64));
  Job j;
  j.name = "nonfinite", j.seed = 3;
  j.data = "{dataset: mnist, path: " + dir + ", batch_size: 16, workers: 1}";
  j.model = "{arch: mlp, hidden: [16]}";
  j.optimizer = "{name: sgd, lr: 0.01, momentum: 0}";
  j.schedule = "{decay: constant}";
  j.max_steps = 40, j.eval_every = std::nullopt, j.train = "on_nonfinite: skip";
  j.parallel = "{mode: local_sgd, average_every: 4}";
  j.dist = "{timeout_s: 20}";
  const auto path = j.write(dir);
  run_ok("run " + path + " --run-dir " + dir + "/init --set train.max_steps=1"
         " --set parallel.mode=sync");
  auto weights = dtrain::load_checkpoint(dir + "/init/checkpoints/step-00000001").model;
  for (auto& [name, t] : weights)
    if (name == "1.weight") t.select(1, 0).fill_(weight);  // the bright pixel's column
  dtrain::write_safetensors(dir + "/huge.safetensors", weights);
  return {path, " --set model.init_from=" + dir + "/huge.safetensors"};
}

}  // namespace

TEST_SUITE("modes") {
  TEST_CASE("local_sgd averaging every step, optimizer state too, is synchronous SGD") {
    auto dir = temp_dir("modes-every1");
    const auto path = job(dir, "{name: sgd, lr: 0.05, momentum: 0.9, weight_decay: 0.01}");
    run_ok("run " + path + " --nproc 2 --run-dir " + dir + "/sync");
    run_ok("run " + path + " --nproc 2 --run-dir " + dir + "/local --set parallel.mode=local_sgd"
        " --set parallel.average_every=1 --set parallel.average_optimizer=true");
    check_losses_close(train_losses(dir + "/sync"), train_losses(dir + "/local"), 1e-5,
                       "local_sgd every 1");
    // Without momentum nothing else is carried between steps: equal too.
    const auto plain = job(dir, "{name: sgd, lr: 0.1}");
    run_ok("run " + plain + " --nproc 2 --run-dir " + dir + "/sync-plain");
    run_ok("run " + plain + " --nproc 2 --run-dir " + dir + "/local-plain"
        " --set parallel.mode=local_sgd --set parallel.average_every=1");
    check_losses_close(train_losses(dir + "/sync-plain"), train_losses(dir + "/local-plain"), 1e-5,
                       "local_sgd every 1, plain SGD");
  }

  TEST_CASE("local_sgd: apart between averages, checkpoints only where they meet, exact resume") {
    auto dir = temp_dir("modes-resume");
    const auto path = job(dir, "{name: adamw, lr: 0.003, weight_decay: 0.01}");
    // Synchronous steps 1-2, then averages after steps 6, 10, 14, 18, 22 and the last, 24.
    const std::string local = " --set parallel.mode=local_sgd --set parallel.average_every=4"
                              " --set parallel.local_after=2 --set checkpoint.every_steps=5"
                              " --set checkpoint.keep_last=10";
    run_ok("run " + path + " --nproc 2 --run-dir " + dir + "/whole" + local);
    run_ok("run " + path + " --nproc 2 --run-dir " + dir + "/sync");
    const auto whole = train_losses(dir + "/whole"), sync = train_losses(dir + "/sync");
    REQUIRE(whole.size() == 24);
    CHECK(whole.at(1) == sync.at(1));
    CHECK(whole.at(2) == sync.at(2));
    CHECK(whole.at(4) != sync.at(4));  // replica 0's own loss, on its half of the batch
    // Checkpoints asked for every 5 steps wait for the next average.
    CHECK(checkpoint_steps(dir + "/whole") == std::set<int64_t>{6, 10, 18, 22, 24});
    // Each replica's Adam state is its own, in its own file.
    {
      dtrain::CheckpointReader reader(dir + "/whole/checkpoints/step-00000010");
      REQUIRE(reader.has("sync.dp0"));
      REQUIRE(reader.has("sync.dp1"));
      auto named = [&](const std::string& kind) {
        for (auto& [name, t] : reader.all(kind))
          if (name == "1.weight.local_exp_avg") return t;
        FAIL("no 1.weight.local_exp_avg in " << kind);
        return torch::Tensor();
      };
      const auto a = named("sync.dp0"), b = named("sync.dp1");
      CHECK(a.sizes() == torch::IntArrayRef{64, 64});
      CHECK(!torch::equal(a, b));
    }
    // Stopped at step 10 (an average) and resumed: bit for bit.
    const auto legs = dir + "/legs";
    run_ok("run " + path + " --nproc 2 --run-dir " + legs + local + " --set train.max_steps=10");
    const auto second = e2e::dtrain("run " + path + " --nproc 2 --run-dir " + legs +
                                    " --resume auto" + local + kQuiet);
    INFO(second.err);
    REQUIRE(second.code == 0);
    CHECK(second.err.find("starts from data rank 0's") == std::string::npos);
    const auto got = train_losses(legs);
    REQUIRE(got.size() == 24);
    for (const auto& [step, loss] : whole) {
      INFO("step " << step);
      CHECK(got.at(step) == loss);
    }
    // At another data size each replica's state means nothing: data rank 0's, and said so.
    const auto other = e2e::dtrain("run " + path + " --nproc 4 --run-dir " + dir + "/whole"
                                   " --resume auto" + local + " --set train.max_steps=30" + kQuiet);
    INFO(other.err);
    CHECK(other.code == 0);
    CHECK(other.err.find("each data replica's optimizer state starts from data rank 0's (the "
                         "checkpoint was written at data size 2") != std::string::npos);
  }

  // DiLoCo: where the replicas meet, an outer Nesterov step along (last meeting's parameters
  // - the average). Its arithmetic is the unit test's (tests/unit/run/test_outer_step.cpp);
  // here: it changes the run from the first average on, and its momentum is in the
  // checkpoint, so a resume is exact.
  TEST_CASE("local_sgd with DiLoCo's outer step: apart from the plain average, its momentum resumed exactly") {
    auto dir = temp_dir("modes-diloco");
    const auto path = job(dir, "{name: adamw, lr: 0.003, weight_decay: 0.01}");
    const std::string local = " --set parallel.mode=local_sgd --set parallel.average_every=4"
                              " --set parallel.local_after=2 --set checkpoint.every_steps=5"
                              " --set checkpoint.keep_last=10" + std::string(kQuiet);
    const std::string diloco = local + " --set parallel.outer_lr=0.7 --set parallel.outer_momentum=0.9";
    run_ok("run " + path + " --nproc 2 --run-dir " + dir + "/plain" + local);
    run_ok("run " + path + " --nproc 2 --run-dir " + dir + "/whole" + diloco);
    const auto plain = train_losses(dir + "/plain"), whole = train_losses(dir + "/whole");
    REQUIRE(whole.size() == 24);
    for (int64_t step = 1; step <= 6; ++step) CHECK(whole.at(step) == plain.at(step));  // the first average is after 6
    CHECK(whole.at(7) != plain.at(7));
    {
      dtrain::CheckpointReader reader(dir + "/whole/checkpoints/step-00000010");
      bool held = false;
      for (auto& [name, t] : reader.all("optimizer")) held = held || name == "1.weight.outer_momentum";
      CHECK(held);
    }
    const auto legs = dir + "/legs";
    run_ok("run " + path + " --nproc 2 --run-dir " + legs + diloco + " --set train.max_steps=10");
    const auto second = e2e::dtrain("run " + path + " --nproc 2 --run-dir " + legs + " --resume auto" + diloco);
    INFO(second.err);
    REQUIRE(second.code == 0);
    CHECK(second.err.find("outer momentum") == std::string::npos);  // no warning: it was there
    const auto got = train_losses(legs);
    REQUIRE(got.size() == 24);
    for (const auto& [step, loss] : whole) {
      INFO("step " << step);
      CHECK(got.at(step) == loss);
    }
  }

  TEST_CASE("local_sgd on a GPT at data 2 x pipeline 2 x tensor 2: sync at every step, exact resume") {
    REQUIRE_MESSAGE(std::filesystem::exists("/usr/share/games/fortunes"), "apt-get install fortunes");
    auto dir = temp_dir("modes-gpt");
    auto gpt = [&](const std::string& optimizer) {
      Job j;
      j.name = "modes-gpt", j.seed = 5;
      j.data = "{dataset: text, path: /usr/share/games/fortunes, batch_size: 8, seq_len: 32,"
               " workers: 1}";
      j.model = "{arch: gpt, layers: 2, heads: 4, dim: 32, seq_len: 32}";
      j.optimizer = optimizer;
      j.schedule = "{decay: step, step_size: 10}";
      j.max_steps = 16, j.eval_every = 8, j.train = "eval_samples: 256";
      j.checkpoint = "{every_steps: 8}";
      j.parallel = "{pipeline: 2, tensor: 2}";
      j.dist = "{timeout_s: 60}";
      return j.write(dir, "gpt.yaml");
    };
    // Momentum SGD without clipping is linear in the gradient: averaging the replicas'
    // parameters and momentum every step is the synchronous step (the tied embedding and
    // head summed over their stages either way).
    const auto linear = gpt("{name: sgd, lr: 0.1, momentum: 0.9, grad_clip: 0}");
    run_ok("run " + linear + " --nproc 8 --run-dir " + dir + "/sync");
    run_ok("run " + linear + " --nproc 8 --run-dir " + dir + "/every1 --set parallel.mode=local_sgd"
        " --set parallel.average_every=1 --set parallel.average_optimizer=true");
    check_losses_close(train_losses(dir + "/sync"), train_losses(dir + "/every1"), 1e-5,
                       "3-D local_sgd every 1");
    // Apart for 4 steps at a time, each replica's AdamW state split over tensor ranks.
    const auto adam = gpt("{name: adamw, lr: 0.003, weight_decay: 0.1}");
    const std::string local = " --set parallel.mode=local_sgd --set parallel.average_every=4";
    check_same_trajectory(train_whole_and_in_legs(dir, adam, 8, " --nproc 8" + local), 16);
  }

  TEST_CASE("local_sgd: a replica's divergence ends the run where the replicas meet, exit 3") {
    auto dir = temp_dir("modes-diverge");
    const auto path = job(dir, "{name: sgd, lr: 1e6}");
    auto r = e2e::dtrain("run " + path + " --nproc 2 --run-dir " + dir + "/a"
                         " --set parallel.mode=local_sgd --set parallel.average_every=8"
                         " --set checkpoint.every_steps=1" + kQuiet);
    INFO(r.err);
    CHECK(r.code == 3);
    CHECK(r.err.find("between averages of the data replicas (parallel.mode: local_sgd), found "
                     "where they met after step 8") != std::string::npos);
    const auto s = metrics(dir + "/a").back();
    CHECK(s["status"] == "diverged");
    CHECK(s["diverged_step"] == 8);
    CHECK((!std::filesystem::exists(dir + "/a/checkpoints") ||
           checkpoint_steps(dir + "/a").empty()));
  }

  TEST_CASE("local_sgd: SIGTERM stops every rank where they meet, with a checkpoint there") {
    auto dir = temp_dir("modes-stop");
    const auto path = job(dir, "{name: sgd, lr: 0.05, momentum: 0.9}");
    // Rank 1 is slow: between averages rank 0 runs ahead and waits for it where they meet.
    auto bg = start_dtrain("run " + path + " --run-dir " + dir + "/a --nproc 2"
                           " --set train.max_steps=100000 --set train.log_every=10"
                           " --set parallel.mode=local_sgd --set parallel.average_every=8"
                           " --set train.debug_slow_rank=1 --set train.debug_slow_ms=2" + kQuiet);
    REQUIRE(wait_for_step(dir + "/a", 30, std::chrono::seconds(60)));
    ::kill(bg.pid, SIGTERM);
    const int code = wait_for(bg.pid, std::chrono::seconds(30));
    INFO(slurp(bg.err));
    CHECK(code == 143);
    const auto summary = metrics(dir + "/a").back();
    CHECK(summary["status"] == "stopped");
    const int64_t at = summary["steps"];
    CHECK(at % 8 == 0);
    CHECK(checkpoint_steps(dir + "/a") == std::set<int64_t>{at});
  }

  TEST_CASE("local_sgd: Fashion-MNIST MLP and CNN within 2 points of sync, fewer bytes") {
    auto dir = temp_dir("modes-accuracy");
    struct Case {
      std::string config, steps;
    };
    // (The sync runs are the ones async_ps and compression compare with: sync_reference.)
    for (const Case& k : {Case{"fashion_mnist_mlp.yaml", "937"}, Case{"fashion_mnist_cnn.yaml", "400"}}) {
      CAPTURE(k.config);
      std::map<std::string, nlohmann::json> summary;
      summary["sync"] = metrics(sync_reference(k.config, k.steps)).back();
      const auto out = dir + "/" + k.config + "-local_sgd";
      run_ok("run " + config(k.config) + " --nproc 2 --run-dir " + out + " --set train.max_steps=" +
             k.steps + " --set train.log_every=100 --set parallel.mode=local_sgd");
      summary["local_sgd"] = metrics(out).back();
      const double sync = summary["sync"]["final_accuracy"], local = summary["local_sgd"]["final_accuracy"];
      INFO("accuracy: sync " << sync << ", local_sgd " << local);
      CHECK(sync > 0.8);
      CHECK(local > sync - 0.02);
      // Parameters and momentum every 8 steps against the gradient every step: 8x fewer
      // (a parameter is a gradient's size; the momentum stays with its replica).
      const double ratio = summary["sync"]["comm_bytes_per_sample"].get<double>() /
                           summary["local_sgd"]["comm_bytes_per_sample"].get<double>();
      CHECK(ratio == doctest::Approx(8.0).epsilon(0.05));
    }
  }

  TEST_CASE("local_sgd with transient non-finite steps: each replica skips, all judge alike") {
    auto dir = temp_dir("modes-nonfinite");
    const auto [path, init] = bright_pixel_job(dir, 3e38f);
    // Skipped apart, the run goes on and completes.
    run_ok("run " + path + " --nproc 2 --run-dir " + dir + "/skip" + init);
    const auto done = metrics(dir + "/skip").back();
    CHECK(done["status"] == "completed");
    CHECK(done["skipped_steps"].get<int64_t>() > 0);
    // Two in a row on one replica and one on the other, the second where they meet: the
    // longest run counts on every rank, and all end together (exit 3), none waiting for a
    // peer that already left.
    auto r = e2e::dtrain("run " + path + " --nproc 2 --run-dir " + dir + "/limit" + init +
                         " --set train.max_skipped=2" + kQuiet);
    INFO(r.err);
    CHECK(r.code == 3);
    CHECK(r.err.find("closed its connection") == std::string::npos);
    CHECK(r.err.find("timed out") == std::string::npos);
    CHECK(metrics(dir + "/limit").back()["status"] == "diverged");
  }

  TEST_CASE("local_sgd: a gradient norm that overflows on one replica where they meet is skipped by all") {
    // A finite loss, an infinite norm on one replica only, at steps where the replicas
    // average: they must still agree the step is skipped, or one waits in a reduction the
    // other never makes (issue 56: every rank blocked at the average after it). Over seeds
    // and averaging periods, so that such a step falls on and beside an average.
    auto dir = temp_dir("modes-overflow");
    const auto [path, init] = bright_pixel_job(dir, 1e30f);
    int64_t skipped = 0;
    for (int every : {2, 3, 5})
      for (int seed : {2, 3}) {
        const auto run = fmt::format("{}/run-{}-{}", dir, every, seed);
        run_ok(fmt::format("run {} --nproc 2 --run-dir {}{} --set parallel.average_every={} --set seed={} "
                           "--set train.max_skipped=40", path, run, init, every, seed));
        const auto done = metrics(run).back();
        CHECK(done["status"] == "completed");
        skipped += done["skipped_steps"].get<int64_t>();
      }
    CHECK(skipped > 0);
  }

  TEST_CASE("modes: what local_sgd cannot combine with is refused, naming the keys") {
    auto dir = temp_dir("modes-refuse");
    const auto path = job(dir, "{name: sgd, lr: 0.05}");
    for (const auto& [sets, says] : std::vector<std::pair<std::string, std::string>>{
             {" --set parallel.zero=1", "parallel.mode: local_sgd with parallel.zero 1 is not supported"},
             {" --set parallel.compression=sign", "with parallel.compression sign is not supported"},
             {" --set parallel.local_after=-1", "parallel.local_after"}}) {
      auto r = e2e::dtrain("validate " + path + " --nproc 2 --set parallel.mode=local_sgd" + sets);
      INFO(sets << ": " << r.err);
      CHECK(r.code == 2);
      CHECK(r.err.find(says) != std::string::npos);
    }
  }
}

}  // namespace e2e::modes_tests
