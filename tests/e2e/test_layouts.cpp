// Every model on every layout it can take reproduces one process on the same global batch:
// one table of models x layouts (data, tensor, pipeline under each schedule, and their
// products), each run's per-step losses and final full tensors against one process's.
// The reference is one process: nothing of a parallel layout's machinery (sharded
// samplers, bucketed all-reduce, split layers, stage schedules, tied copies) runs there.
// Dropout is on (its masks are the same on every layout); SGD with momentum, weight
// decay and clipping for the image models, AdamW for the GPT.
#include <doctest/doctest.h>

#include <map>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <torch/torch.h>

#include "checkpoint/checkpoint.hpp"
#include "run.hpp"

namespace e2e::layouts_tests {

namespace {

struct Layout {
  int nproc;
  std::string sets;  // --set options
};

struct Case {
  std::string name;
  Job job;
  std::vector<Layout> layouts;
  double atol;  // on the final weights: AdamW magnifies near-zero gradients' rounding
};

const std::string kSgd = "{name: sgd, lr: 0.05, momentum: 0.9, weight_decay: 0.001, grad_clip: 0.5}";

std::vector<Case> table() {
  Job mlp;
  mlp.model = "{arch: mlp, hidden: [32, 32, 16], dropout: 0.1}";
  mlp.optimizer = kSgd;
  Job cnn = mlp;
  cnn.model = "{arch: cnn, channels: [4, 8], fc: [16], dropout: 0.1}";
  Job bn = cnn;
  bn.model = "{arch: cnn, channels: [4, 8], fc: [16], batch_norm: true}";
  bn.parallel = "{sync_batchnorm: true}";
  Job gpt;
  gpt.data = "{dataset: synthetic_tokens, samples: 256, test_samples: 32, batch_size: 8, workers: 1}";
  gpt.model = "{arch: gpt, layers: 4, heads: 2, dim: 32, vocab: 64, seq_len: 16, dropout: 0.1}";
  gpt.optimizer = "{name: adamw, lr: 0.003, weight_decay: 0.1, grad_clip: 1.0}";
  const std::string p2 = " --set parallel.pipeline=2", t2 = " --set parallel.tensor=2",
                    d2 = " --set parallel.data=2";
  const std::string interleaved = " --set parallel.schedule=interleaved_1f1b"
                                  " --set parallel.virtual_stages=2";
  const std::string flops = " --set parallel.balance=flops";
  Job big_vocab = gpt;
  big_vocab.model = "{arch: gpt, layers: 3, heads: 2, dim: 32, vocab: 2048, seq_len: 16, dropout: 0.1}";
  // SGD: most of the 2048 embedding rows get only the head's tiny gradients, whose
  // rounding AdamW's normalisation would magnify past the weights' tolerance.
  big_vocab.optimizer = kSgd;
  return {
      {"mlp", mlp,
       {{2, ""}, {4, ""}, {2, t2}, {2, p2 + " --set parallel.schedule=gpipe"}, {2, p2},
        {2, p2 + interleaved}, {4, " --set parallel.pipeline=4"}, {4, t2}, {4, p2 + d2},
        {4, p2 + t2}, {8, p2 + t2 + d2}},
       1e-6},
      {"cnn", cnn,
       {{2, ""}, {4, ""}, {2, p2 + " --set parallel.schedule=gpipe"}, {2, p2},
        {2, p2 + " --set parallel.stages=[1,3]"}, {2, p2 + interleaved}, {4, p2 + d2}},
       1e-6},
      {"cnn with SyncBatchNorm", bn, {{2, ""}, {4, ""}, {2, p2}, {4, p2 + d2}}, 1e-6},
      {"gpt", gpt,
       {{2, ""}, {2, t2}, {2, p2}, {2, p2 + interleaved}, {4, t2}, {4, p2 + t2}, {4, p2 + d2},
        {8, p2 + t2 + d2 + " --set parallel.stages=[2,4]"}},
       1e-5},
      // A vocabulary that outweighs the blocks: split by parameters stage 0 holds the
      // embedding alone, by FLOPs the head is stage 1's alone (tests/unit/models).
      {"gpt split by flops", big_vocab,
       {{2, p2 + flops}, {4, p2 + t2 + flops}, {4, p2 + d2 + flops + " --set parallel.zero=1"}},
       1e-5},
  };
}

std::map<std::string, torch::Tensor> final_weights(const std::string& run_dir, int64_t step) {
  const auto model = dtrain::load_checkpoint(run_dir + fmt::format("/checkpoints/step-{:08d}", step)).model;
  return {model.begin(), model.end()};
}

void check_case(const Case& c) {
  const auto dir = temp_dir("layouts");
  const auto job = c.job.write(dir);
  run_ok("run " + job + " --run-dir " + dir + "/one");
  const auto ref = train_losses(dir + "/one");
  const int64_t steps = int64_t(ref.size());
  REQUIRE(steps == *c.job.max_steps);
  const auto ref_w = final_weights(dir + "/one", steps);
  for (size_t i = 0; i < c.layouts.size(); ++i) {
    const auto& [n, sets] = c.layouts[i];
    const std::string what = fmt::format("{} on {} processes{}", c.name, n, sets);
    const auto run = dir + "/layout" + std::to_string(i);
    run_ok(fmt::format("run {} --nproc {} --run-dir {}{}", job, n, run, sets));
    check_losses_close(ref, train_losses(run), 1e-5, what);
    const auto lines = metrics(run);
    const auto& summary = lines.back();
    CHECK_MESSAGE(summary["world_size"] == n, what);
    const auto& layout = summary["layout"];
    CHECK_MESSAGE(layout["data"].get<int>() * layout["tensor"].get<int>() *
                          layout["pipeline"].get<int>() == n, what);
    // The held-out evaluation is the same model's, and a pipeline reports each stage's
    // bubble and activation memory.
    CHECK_MESSAGE(of_kind(lines, "eval").back()["loss"].get<double>() ==
                      doctest::Approx(of_kind(metrics(dir + "/one"), "eval").back()["loss"].get<double>())
                          .epsilon(1e-5),
                  what);
    const auto train = of_kind(lines, "train").back();
    if (layout["pipeline"].get<int>() > 1) {
      CHECK_MESSAGE(train["bubble"].size() == layout["pipeline"].get<size_t>(), what);
      CHECK_MESSAGE(train["activation_mb"].size() == layout["pipeline"].get<size_t>(), what);
    }
    const auto w = final_weights(run, steps);
    REQUIRE_MESSAGE(w.size() == ref_w.size(), what);  // a tied weight saved once
    for (const auto& [name, t] : ref_w) {
      INFO(what << ": " << name);
      REQUIRE(w.count(name));
      REQUIRE(w.at(name).sizes() == t.sizes());  // full logical shapes, not a rank's part
      auto got = w.at(name), want = t;
      if (name.find("attn.c_attn.bias") != std::string::npos) {
        // The key bias has no effect on the output (softmax ignores a shift common to all
        // keys): its gradient is zero up to rounding, which AdamW's normalisation turns
        // into updates of either sign. Compare the query and value biases.
        got = torch::cat({got.chunk(3)[0], got.chunk(3)[2]});
        want = torch::cat({want.chunk(3)[0], want.chunk(3)[2]});
      }
      CHECK(torch::allclose(got, want, /*rtol=*/1e-4, c.atol));
    }
  }
}

}  // namespace

TEST_SUITE("layouts") {
  TEST_CASE("every model on every layout it takes reproduces one process") {
    for (const auto& c : table()) {
      CAPTURE(c.name);
      check_case(c);
    }
  }
}

TEST_SUITE("layouts") {
  TEST_CASE("comm_bytes counts the tensor layers' all-reduces and the stages' activations") {
    // The default Job's MLP, 64 -> 32 -> 16 -> 4, 16 samples a step in 2 micro-batches.
    const auto dir = temp_dir("layouts-bytes");
    const auto job = Job{}.write(dir);
    auto last_bytes = [&](const std::string& name, const std::string& sets) {
      run_ok("run " + job + " --nproc 2 --run-dir " + dir + "/" + name + sets);
      return of_kind(metrics(dir + "/" + name), "train").back()["comm_bytes"].get<double>();
    };
    // Tensor 2: the row-parallel layer's output, [8 rows, 16] fp32, all-reduced over 2
    // ranks after each micro-batch's forward (2 x 512 x 1/2 bytes sent each); the first
    // layer's input needs no gradient. Besides: the step's figures and the norm, < 256.
    const double tensor = last_bytes("t2", " --set parallel.tensor=2");
    CHECK(tensor >= 2 * 512);
    CHECK(tensor < 2 * 512 + 256);
    // Pipeline 2: stage 0 (the first layer, the most parameters) sends each micro-batch's
    // [8, 32] activation to stage 1: 2 x 1024 bytes. Its gradients come back from rank 1.
    const double pipeline = last_bytes("p2", " --set parallel.pipeline=2");
    CHECK(pipeline >= 2 * 1024);
    CHECK(pipeline < 2 * 1024 + 256);
  }
}

}  // namespace e2e::layouts_tests
