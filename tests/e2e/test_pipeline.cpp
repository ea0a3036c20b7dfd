// Pipeline parallelism through the dtrain binary: checkpoints written by the stages resume
// on other layouts, 1F1B holds fewer micro-batches than GPipe, a killed stage ends the job
// like any rank, and jobs the model cannot be split for are refused. (Every schedule and
// hybrid layout against one process: test_layouts.cpp.)
#include <doctest/doctest.h>

#include <map>
#include <thread>

#include <torch/torch.h>

#include "checkpoint/checkpoint.hpp"
#include "run.hpp"

namespace e2e::pipeline_tests {

namespace {

// An MLP of 4 parts (3 hidden layers and the classifier), 4 micro-batches a step.
std::string mlp_job(const std::string& dir) {
  Job j = ranks_job("pp-mlp", 11);
  j.model = "{arch: mlp, hidden: [32, 32, 16], dropout: 0.1}";
  j.optimizer = "{name: sgd, lr: 0.05, momentum: 0.9, weight_decay: 0.001, grad_clip: 0.5}";
  j.schedule = "{warmup_steps: 5, decay: step, step_size: 20}";
  j.max_steps = 30, j.eval_every = 15, j.train = "grad_accum: 4";
  return j.write(dir, "mlp.yaml");
}

// A 4-layer GPT (6 parts: embeddings, 4 blocks, head) on synthetic tokens: its tied
// embedding and head end up on the first and the last stage.
std::string gpt_job(const std::string& dir) {
  Job j = ranks_job("pp-gpt", 5);
  j.data = "{dataset: synthetic_tokens, samples: 512, test_samples: 32, batch_size: 8, workers: 1}";
  j.model = "{arch: gpt, layers: 4, heads: 2, dim: 32, vocab: 64, seq_len: 16, dropout: 0.1}";
  j.optimizer = "{name: adamw, lr: 0.003, weight_decay: 0.1, grad_clip: 1.0}";
  j.schedule = "{warmup_steps: 5, decay: step, step_size: 20}";
  j.max_steps = 30, j.eval_every = 15, j.train = "grad_accum: 4";
  j.checkpoint = "{every_steps: 10}";
  return j.write(dir, "gpt.yaml");
}

std::map<std::string, torch::Tensor> weights(const std::string& run_dir, int64_t step) {
  char name[32];
  std::snprintf(name, sizeof name, "step-%08ld", long(step));
  auto state = dtrain::load_checkpoint(run_dir + "/checkpoints/" + name);  // every part
  return {state.model.begin(), state.model.end()};
}

}  // namespace

TEST_SUITE("pipeline") {
  TEST_CASE("pipeline: checkpoints written by the stages resume on other layouts") {
    auto dir = temp_dir("pp-resume");
    const auto job = gpt_job(dir);
    auto full = e2e::dtrain("run " + job + " --run-dir " + dir + "/full --set train.max_steps=14" +
                            kQuiet);
    REQUIRE(full.code == 0);
    const auto ref = train_losses(dir + "/full");
    // Written at step 10 by each layout, resumed on another for steps 11 to 14.
    const std::vector<std::tuple<std::string, std::string, std::string>> moves = {
        {"pipeline 2 -> data 2", "--nproc 2 --set parallel.pipeline=2",
         "--nproc 2 --set parallel.data=2"},
        {"pipeline 2 x tensor 2 -> 1 process",
         "--nproc 4 --set parallel.pipeline=2 --set parallel.tensor=2", ""},
        {"1 process -> data 2 x pipeline 2 x tensor 2", "",
         "--nproc 8 --set parallel.data=2 --set parallel.pipeline=2 --set parallel.tensor=2"}};
    for (size_t i = 0; i < moves.size(); ++i) {
      const auto& [what, before, after] = moves[i];
      CAPTURE(what);
      const auto run = dir + "/move" + std::to_string(i);
      auto a = e2e::dtrain("run " + job + " --run-dir " + run + " --set train.max_steps=10 " +
                           before + kQuiet);
      INFO(a.err);
      REQUIRE(a.code == 0);
      auto b = e2e::dtrain("run " + job + " --run-dir " + run + " --resume auto"
                           " --set train.max_steps=14 " + after + kQuiet);
      INFO(b.err);
      REQUIRE(b.code == 0);
      const auto got = train_losses(run);
      for (int64_t step = 11; step <= 14; ++step) {
        INFO("step " << step);
        REQUIRE(got.count(step));
        CHECK(std::abs(got.at(step) - ref.at(step)) <= 1e-5 * ref.at(step));
      }
    }
    // The stages wrote their parts; the manifest lists them, and inspect and export read
    // them whole.
    const auto folder = dir + "/move0/checkpoints/step-00000010";
    const auto manifest = nlohmann::json::parse(slurp(folder + "/manifest.json"));
    std::vector<std::string> files;
    for (const auto& f : manifest["files"]) files.push_back(f["name"]);
    CHECK(files == std::vector<std::string>{"config.yaml", "model.pp0.safetensors",
                                            "model.pp1.safetensors", "optimizer.pp0.safetensors",
                                            "optimizer.pp1.safetensors", "trainer.json"});
    auto ins = e2e::dtrain("inspect " + folder);
    CHECK(ins.code == 0);
    CHECK(ins.out.find("ln_f.weight") != std::string::npos);
    CHECK(ins.out.find("wte.weight") != std::string::npos);
    auto ex = e2e::dtrain("export " + folder + " " + dir + "/w.safetensors");
    INFO(ex.err);
    CHECK(ex.code == 0);
    CHECK(dtrain::read_safetensors(dir + "/w.safetensors").tensors.size() ==
          weights(dir + "/full", 10).size());
    // A checkpoint missing a stage's part does not verify: --resume auto falls back to the
    // one before, with a warning.
    const std::string p2 = " --nproc 2 --set parallel.pipeline=2 --set checkpoint.every_steps=5";
    REQUIRE(e2e::dtrain("run " + job + " --run-dir " + dir + "/partial --set train.max_steps=10" +
                        p2 + kQuiet).code == 0);
    std::filesystem::remove(dir + "/partial/checkpoints/step-00000010/model.pp1.safetensors");
    auto c = e2e::dtrain("run " + job + " --run-dir " + dir + "/partial --resume auto"
                         " --set train.max_steps=12" + p2 + kQuiet);
    INFO(c.err);
    CHECK(c.code == 0);
    CHECK(c.err.find("is missing model.pp1.safetensors") != std::string::npos);
    CHECK(c.err.find("resumed at step 5") != std::string::npos);
  }

  TEST_CASE("pipeline: 1F1B holds at most as many micro-batches as stages, GPipe all of them") {
    // 8 micro-batches over 2 stages: GPipe's first stage holds 8 micro-batches'
    // activations at its peak, 1F1B's 2 (the simulation in test_schedule_pipeline.cpp
    // counts them); the measured memory follows.
    auto dir = temp_dir("pp-memory");
    Job wide;
    wide.name = "pp-memory", wide.seed = 3;
    wide.data = "{dataset: synthetic, samples: 4096, test_samples: 64, input_shape: [1, 32, 32],"
                " classes: 10, batch_size: 512, workers: 1}";
    wide.model = "{arch: mlp, hidden: [1024, 1024, 1024]}";
    wide.optimizer = "{name: sgd, lr: 0.01}";
    wide.schedule = "";
    wide.max_steps = 4, wide.log_every = 2, wide.threads = std::nullopt, wide.eval_every = 1000;
    wide.train = "grad_accum: 8";
    wide.checkpoint = "{every_steps: 1000}";
    wide.dist = "";
    const auto path = wide.write(dir, "wide.yaml");
    std::map<std::string, double> first_stage_mb;
    for (const char* schedule : {"gpipe", "1f1b"}) {
      auto r = e2e::dtrain("run " + path + " --run-dir " + dir + "/" + schedule +
                           " --nproc 2 --set parallel.pipeline=2 --set parallel.schedule=" +
                           schedule + kQuiet);
      INFO(r.err);
      REQUIRE(r.code == 0);
      first_stage_mb[schedule] = of_kind(metrics(dir + "/" + schedule), "train").back()["activation_mb"][0];
    }
    INFO("gpipe " << first_stage_mb["gpipe"] << " MiB, 1f1b " << first_stage_mb["1f1b"] << " MiB");
    CHECK(first_stage_mb["1f1b"] > 0);
    CHECK(first_stage_mb["gpipe"] > 2.5 * first_stage_mb["1f1b"]);  // 4x in theory
  }

  TEST_CASE("recompute: bit-identical losses with dropout, less activation memory per stage") {
    // Each block reruns in backward under the random state its forward saw: with dropout on
    // the losses match a plain run's bit for bit, on one process and on a pipeline.
    auto dir = temp_dir("recompute");
    const auto job = gpt_job(dir);
    const std::string dropout = " --set model.dropout=0.1 --set train.max_steps=12" +
                                std::string(kQuiet);
    std::map<std::string, std::map<int64_t, double>> losses;
    std::map<std::string, double> first_stage_mb;
    for (const char* layout : {"one", "pipeline"})
      for (const char* mode : {"none", "blocks"}) {
        const std::string run = dir + "/" + layout + "-" + mode;
        const std::string sets = std::string(layout) == "one"
                                     ? ""
                                     : " --nproc 2 --set parallel.pipeline=2 --set data.batch_size=64"
                                       " --set train.grad_accum=8";
        auto r = e2e::dtrain("run " + job + " --run-dir " + run + " --set train.recompute=" +
                             mode + sets + dropout);
        INFO(layout << " " << mode << ": " << r.err);
        REQUIRE(r.code == 0);
        losses[std::string(layout) + mode] = train_losses(run);
        if (std::string(layout) == "pipeline")
          first_stage_mb[mode] = of_kind(metrics(run), "train").back()["activation_mb"][0];
      }
    CHECK(losses["onenone"] == losses["oneblocks"]);
    CHECK(losses["pipelinenone"] == losses["pipelineblocks"]);
    INFO("first stage: " << first_stage_mb["none"] << " MiB without, " << first_stage_mb["blocks"]
                         << " MiB with recompute");
    CHECK(first_stage_mb["blocks"] < 0.5 * first_stage_mb["none"]);
  }

  TEST_CASE("pipeline: a killed stage ends the job with exit 4; --max-restarts 1 completes it") {
    auto dir = temp_dir("pp-kill");
    auto job = mlp_job(dir);
    const std::string common = " --nproc 2 --set parallel.pipeline=2 --set train.log_every=10"
                               " --set checkpoint.every_steps=50 --set train.eval_every=100000" +
                               std::string(kQuiet);
    // The last stage killed: the job ends.
    auto a = kill_worker_at("run " + job + " --run-dir " + dir + "/a --set train.max_steps=100000" +
                                common, dir + "/a", 20, /*rank=*/1, std::chrono::seconds(40));
    INFO(a.err);
    CHECK(a.code == 4);
    CHECK(a.err.find("dtrain: error: rank 1 was killed by signal 9") != std::string::npos);
    // The first stage killed, one restart allowed: the job comes back from its checkpoint
    // and ends at max_steps.
    auto b = kill_worker_at("run " + job + " --run-dir " + dir + "/b --max-restarts 1"
                            " --set train.max_steps=300" + common,
                            dir + "/b", 80, /*rank=*/0, std::chrono::seconds(120));
    INFO(b.err);
    CHECK(b.code == 0);
    CHECK(b.err.find("restarting all 2 workers") != std::string::npos);
    CHECK(metrics(dir + "/b").back()["steps"] == 300);
  }

  TEST_CASE("pipeline: splits the model cannot take are refused, naming the key") {
    auto dir = temp_dir("pp-refuse");
    const auto job = mlp_job(dir);  // 4 parts
    struct Case {
      std::string sets, must_contain;
    };
    const std::vector<Case> cases = {
        {"--nproc 8 --set parallel.pipeline=8", "parallel.pipeline: 8 stage(s)"},
        {"--nproc 2 --set parallel.pipeline=2 --set parallel.stages=[1,1]", "parallel.stages: [1, 1]"},
        {"--nproc 2 --set parallel.pipeline=2 --set parallel.schedule=interleaved_1f1b"
         " --set parallel.virtual_stages=2 --set train.grad_accum=1",
         "train.grad_accum: 1 micro-batches"},
        {"--nproc 2 --set parallel.virtual_stages=2 --set parallel.schedule=interleaved_1f1b",
         "parallel.virtual_stages: 2 chunks per rank need a pipeline"},
        {"--nproc 2 --set parallel.pipeline=2 --set parallel.micro_batches=8",
         "train.grad_accum"},
        {"--set train.recompute=blocks", "train.recompute: blocks recomputes a GPT's"}};
    for (const auto& c : cases) {
      CAPTURE(c.sets);
      auto r = e2e::dtrain("validate " + job + " " + c.sets);
      CHECK(r.code == 2);
      CHECK(r.err.find(c.must_contain) != std::string::npos);
      CHECK(std::count(r.err.begin(), r.err.end(), '\n') == 1);
    }
  }
}

}  // namespace e2e::pipeline_tests
