// `dtrain plan` against what runs of the same jobs measure: the parameters, gradients and
// optimizer state a rank keeps (the summary's), the bytes it sends per step (the train
// line's comm_bytes) on every kind of layout, its peak memory (peak_rss_mb) within a
// stated margin; the FLOPs against the published count for a GPT (6N + 12 L s d per token).
#include <doctest/doctest.h>

#include <cmath>
#include <fstream>
#include <set>

#include "run.hpp"

namespace e2e::plan_tests {

namespace {

Job gpt_job() {
  Job j;
  j.name = "plan-gpt";
  j.data = "{dataset: synthetic_tokens, samples: 256, test_samples: 32, batch_size: 8, workers: 1}";
  j.model = "{arch: gpt, layers: 2, heads: 2, dim: 32, vocab: 64, seq_len: 16}";
  j.optimizer = "{name: adamw, lr: 0.001}";
  j.train = "grad_accum: 2";
  return j;
}

Job cnn_job() {
  Job j;
  j.name = "plan-cnn";
  j.data = "{dataset: synthetic, samples: 256, test_samples: 32, input_shape: [1, 12, 12], classes: 4,"
           " batch_size: 16, workers: 1}";
  j.model = "{arch: cnn, channels: [4, 8], fc: [16], batch_norm: true}";
  j.train = "grad_accum: 2";
  return j;
}

// The plan's runtime memory is its own process's (run.hpp's kExec: not a fork's).
// A plan with the profile `sets` names, else none (whatever this machine's cache holds):
// its bubble is then the schedule played with each stage's FLOPs, and it has no time.
nlohmann::json plan_of(const std::string& job, int64_t nproc, const std::string& sets) {
  const bool profiled = sets.find("--profile") != std::string::npos;
  auto r = dtrain("plan " + job + " --json --nproc " + std::to_string(nproc) + sets +
                      (profiled ? "" : " --profile /nonexistent/dtrain-machine.json"),
                  kExec);
  INFO(r.err);
  REQUIRE(r.code == 0);
  return nlohmann::json::parse(r.out);
}

struct Case {
  const char* what;
  Job job;
  int64_t nproc;
  std::string sets;
};

}  // namespace

TEST_SUITE("plan") {
  TEST_CASE("plan: state and bytes sent equal a run's on every kind of layout") {
    auto dir = temp_dir("plan");
    Job mlp;
    mlp.name = "plan-mlp";
    mlp.optimizer = "{name: adamw, lr: 0.01}";
    mlp.model = "{arch: mlp, hidden: [64, 32, 16]}";
    const std::string warm = " --set parallel.compression_warmup=0";
    const std::vector<Case> cases = {
        {"mlp d2", mlp, 2, ""},
        {"mlp t2", mlp, 2, " --set parallel.tensor=2"},
        {"mlp p2 1f1b", mlp, 2, " --set parallel.pipeline=2 --set parallel.schedule=1f1b"},
        {"mlp d2 zero1", mlp, 2, " --set parallel.zero=1"},
        {"mlp d2 zero2", mlp, 2, " --set parallel.zero=2"},
        {"mlp d2 zero3", mlp, 2, " --set parallel.zero=3"},
        {"mlp d2 sign", mlp, 2, " --set parallel.compression=sign" + warm},
        {"mlp d2 topk", mlp, 2, " --set parallel.compression=topk" + warm},
        {"mlp d2 fp16", mlp, 2, " --set parallel.compression=fp16" + warm},
        {"mlp d2 local_sgd", mlp, 2, " --set parallel.mode=local_sgd --set parallel.average_every=2"},
        {"gpt t2", gpt_job(), 2, " --set parallel.tensor=2"},
        {"gpt p2 gpipe (tied head)", gpt_job(), 2, " --set parallel.pipeline=2 --set parallel.schedule=gpipe"},
        {"gpt d2 zero3", gpt_job(), 2, " --set parallel.zero=3"},
        {"gpt d2 zero3 bf16 (weights gathered in bf16)", gpt_job(), 2,
         " --set parallel.zero=3 --set precision.dtype=bf16"},
        {"gpt d2 powersgd", gpt_job(), 2, " --set parallel.compression=powersgd" + warm},
        {"gpt d2xt2 recompute", gpt_job(), 4, " --set parallel.tensor=2 --set train.recompute=blocks"},
        {"gpt p2xd2 zero2 interleaved", gpt_job(), 4,
         " --set parallel.pipeline=2 --set parallel.schedule=interleaved_1f1b"
         " --set parallel.virtual_stages=2 --set parallel.zero=2"},
        {"cnn p2", cnn_job(), 2, " --set parallel.pipeline=2"},
    };
    int n = 0;
    for (const auto& c : cases) {
      const std::string what = c.what;
      CAPTURE(what);
      const auto job = c.job.write(dir, "job" + std::to_string(n) + ".yaml");
      const std::string run_dir = dir + "/run" + std::to_string(n++);
      const std::string sets = c.sets + " --set train.max_steps=4 --set train.log_every=2";
      const auto plan = plan_of(job, c.nproc, sets);
      run_ok("run " + job + " --nproc " + std::to_string(c.nproc) + " --run-dir " + run_dir + sets,
             kExec);  // its peak_rss_mb is compared
      const auto lines = metrics(run_dir);
      const auto summary = of_kind(lines, "summary").at(0);
      const auto train = of_kind(lines, "train").back();
      // Rank 0 writes the lines: the plan's first rank.
      const auto& r = plan["ranks"][0];
      REQUIRE(r["rank"] == 0);
      const auto& m = r["memory_mb"];
      CHECK(m["params"].get<double>() == doctest::Approx(summary["parameters_mb"].get<double>()).epsilon(1e-9));
      CHECK(m["grads"].get<double>() == doctest::Approx(summary["gradient_mb"].get<double>()).epsilon(1e-9));
      CHECK(m["optimizer"].get<double>() ==
            doctest::Approx(summary["optimizer_state_mb"].get<double>()).epsilon(1e-9));
      // Bytes sent: within 0.5%, and a few hundred bytes for the scalars that travel besides
      // (the step's figures, the gradient norm) where a group is the whole world.
      const double sent = train["comm_bytes"].get<double>();
      CHECK(std::abs(r["comm_bytes"].get<double>() - sent) <= 0.005 * sent + 256);
      // Memory: the plan's total against the peak the process reached (its resident set).
      const double rss = train["peak_rss_mb"].get<double>(), total = m["total"].get<double>();
      CHECK(total > 0.8 * rss);
      CHECK(total < 1.25 * rss);
    }
    std::system(("rm -rf '" + dir + "'").c_str());
  }

  TEST_CASE("plan: a GPT's FLOPs are 6N + 12 L s d per token; the bubble is the schedule's, played") {
    auto dir = temp_dir("plan-flops");
    const auto job = gpt_job().write(dir);
    // Kaplan et al. / PaLM: N the parameters the matmuls use (each block's 12 d^2, the head's
    // d v), 12 L s d the attention scores, forward and backward, per token.
    const double L = 2, d = 32, v = 64, s = 16, tokens = 8 * s;
    const double expected = (6 * (12 * L * d * d + d * v) + 12 * L * s * d) * tokens;
    const auto one = plan_of(job, 1, "");
    CHECK(one["ranks"][0]["flops"].get<double>() == doctest::Approx(expected).epsilon(0.01));
    CHECK(one["ranks"][0]["bubble"] == 0.0);
    // Over tensor 2 each rank runs half of it; over data 2 half the batch.
    const auto t2 = plan_of(job, 2, " --set parallel.tensor=2");
    CHECK(t2["ranks"][0]["flops"].get<double>() == doctest::Approx(expected / 2).epsilon(0.02));
    // Pipeline 2 with 4 micro-batches under 1F1B: stage 0 holds the embedding (no FLOPs)
    // and a block, stage 1 a block and the head, a forward of f0 = 24 d^2 + 4 s d and f1 =
    // f0 + 2 d v a token (backward twice that). Stage 1 is the slower, so the step takes
    // stage 0's first forward, stage 1's four forwards and backwards, stage 0's last
    // backward: 3 f0 + 12 f1, of which stage 0 works 12 f0. (Equal stages would idle
    // theory's (p - 1) / (m + p - 1) = 1/5: tests/unit/pipeline/test_schedule.cpp.)
    const double f0 = 24 * d * d + 4 * s * d, f1 = f0 + 2 * d * v;
    const auto p2 = plan_of(job, 2, " --set parallel.pipeline=2 --set train.grad_accum=4");
    REQUIRE(p2["ranks"].size() == 2);
    CHECK(p2["ranks"][1]["rank"] == 1);
    const double bubble = p2["ranks"][0]["bubble"].get<double>();
    CHECK(bubble == doctest::Approx(1 - 12 * f0 / (3 * f0 + 12 * f1)).epsilon(0.01));
    // Stage 1 waits only for stage 0's first forward: f0 of its 12 f1 + f0.
    CHECK(p2["ranks"][1]["bubble"].get<double>() == doctest::Approx(f0 / (12 * f1 + f0)).epsilon(0.01));
    // Interleaved over 2 chunks each rank waits less.
    const auto p2i = plan_of(job, 2, " --set parallel.pipeline=2 --set train.grad_accum=4 --set "
                                     "parallel.schedule=interleaved_1f1b --set parallel.virtual_stages=2");
    CHECK(p2i["ranks"][0]["bubble"].get<double>() > 0.05);
    CHECK(p2i["ranks"][0]["bubble"].get<double>() < bubble);
    // The two stages' FLOPs add up to one process's.
    CHECK(p2["ranks"][0]["flops"].get<double>() + p2["ranks"][1]["flops"].get<double>() ==
          doctest::Approx(expected).epsilon(0.01));
    std::system(("rm -rf '" + dir + "'").c_str());
  }

  TEST_CASE("plan: parallel.balance: flops evens out the stages' FLOPs; --all lists both splits where they differ") {
    auto dir = temp_dir("plan-balance");
    // 3 blocks of d 32 and a vocabulary of 2048: the head's 2 d v = 131,072 FLOPs a token
    // forward outweigh the three blocks' 3 x (24 d^2 + 4 s d) = 79,872 (s 16), and the
    // embedding's 66k parameters the blocks' 3 x 12.7k.
    Job big = gpt_job();
    big.model = "{arch: gpt, layers: 3, heads: 2, dim: 32, vocab: 2048, seq_len: 16}";
    const auto job = big.write(dir);
    const std::string p2 = " --set parallel.pipeline=2 --set train.grad_accum=4";
    const auto by_params = plan_of(job, 2, p2), by_flops = plan_of(job, 2, p2 + " --set parallel.balance=flops");
    const double block = 24 * 32 * 32 + 4 * 16 * 32, head = 2 * 32 * 2048, tokens = 8 * 16;
    // By parameters stage 0 is the embedding alone (no FLOPs): it waits out the whole step.
    CHECK(by_params["ranks"][0]["flops"].get<double>() < 0.01 * block * tokens);
    CHECK(by_params["ranks"][0]["bubble"].get<double>() == doctest::Approx(1.0));
    // By FLOPs stage 0 runs the three blocks, stage 1 the head (forward and backward: 3x).
    CHECK(by_flops["ranks"][0]["flops"].get<double>() == doctest::Approx(3 * 3 * block * tokens).epsilon(0.01));
    CHECK(by_flops["ranks"][1]["flops"].get<double>() == doctest::Approx(3 * head * tokens).epsilon(0.01));
    CHECK(by_flops["ranks"][0]["bubble"].get<double>() < 0.6);
    // --all: each pipeline layout by both splits; gpt_job's splits agree, so it lists one.
    auto all = dtrain("plan " + job + " --all --nproc 2 --profile " + dir + "/none.json", kExec);
    INFO(all.err);
    REQUIRE(all.code == 0);
    CHECK(all.out.find("d1 x t1 x p2, zero 0, 1f1b, flops split, 4 micro-batch(es)") != std::string::npos);
    CHECK(all.out.find("d1 x t1 x p2, zero 0, 1f1b, 4 micro-batch(es)") != std::string::npos);
    const auto small = gpt_job().write(dir, "small.yaml");
    all = dtrain("plan " + small + " --all --nproc 2 --profile " + dir + "/none.json", kExec);
    REQUIRE(all.code == 0);
    CHECK(all.out.find("d1 x t1 x p2") != std::string::npos);
    CHECK(all.out.find("flops split") == std::string::npos);
    std::system(("rm -rf '" + dir + "'").c_str());
  }

  TEST_CASE("plan: the table, the JSON's fields, async_ps's servers and bad input") {
    auto dir = temp_dir("plan-cli");
    const auto job = gpt_job().write(dir);
    auto table = dtrain("plan " + job + " --nproc 4 --set parallel.pipeline=2 --set parallel.zero=1");
    INFO(table.out << table.err);
    REQUIRE(table.code == 0);
    CHECK(table.out.find("data 2 x tensor 1 x pipeline 2, zero 1") != std::string::npos);
    CHECK(table.out.find("stage 1 of 2") != std::string::npos);
    const auto j = plan_of(job, 4, " --set parallel.pipeline=2 --profile " + dir + "/none.json");
    for (const char* k : {"data", "tensor", "pipeline", "zero", "schedule", "grad_accum"})
      CHECK(j["layout"].contains(k));
    for (const char* k : {"params", "grads", "optimizer", "activations", "buffers", "runtime", "total"})
      CHECK(j["ranks"][0]["memory_mb"].contains(k));
    CHECK(j["step_s"].is_null());  // no machine profile there
    CHECK(j["ranks"][1]["rank"] == 2);  // stage 1's first rank (tensor, then data, then pipeline)
    // async_ps: the server has the optimizer state, the workers none; no byte estimate.
    const auto ps = plan_of(job, 3, " --set parallel.mode=async_ps");
    REQUIRE(ps["ranks"].size() == 2);
    CHECK(ps["ranks"][0]["role"] == "server");
    CHECK(ps["ranks"][0]["memory_mb"]["optimizer"].get<double>() > 0);
    CHECK(ps["ranks"][1]["memory_mb"]["optimizer"].get<double>() == 0);
    CHECK(ps["ranks"][1]["comm_bytes"].is_null());
    // Bad input: as validate says it, exit 2.
    auto bad = dtrain("plan " + job + " --nproc 3 --set parallel.tensor=2");
    CHECK(bad.code == 2);
    CHECK(bad.err.find("parallel.tensor") != std::string::npos);
    auto missing = dtrain("plan " + dir + "/nope.yaml");
    CHECK(missing.code == 2);
    std::system(("rm -rf '" + dir + "'").c_str());
  }


  TEST_CASE("plan and validate build no model for real: a CNN or GPT too wide to allocate is planned, or refused for memory") {
    // Under 3 GB of address space: a CNN of a million channels (its convolution's weights
    // 36 MB, its activations far more) and a GPT whose LayerNorms would take 4 MB a block.
    auto dir = temp_dir("plan-wide");
    const std::string limit = "ulimit -v 3000000 && timeout 300";
    std::ofstream(dir + "/cnn.yaml") << "name: wide\nmodel: {arch: cnn, channels: [1000000]}\n"
                                        "data: {dataset: synthetic, input_shape: [1, 28, 28], samples: 64}\n";
    std::ofstream(dir + "/gpt.yaml") << "name: wide\nmodel: {arch: gpt, layers: 2, heads: 1, dim: 262144, vocab: 256, "
                                        "seq_len: 8}\ndata: {dataset: synthetic_tokens, samples: 64, seq_len: 8}\n";
    for (const char* job : {"cnn", "gpt"}) {
      const std::string path = dir + "/" + job + ".yaml";
      auto plan = dtrain("plan " + path, limit);
      INFO(job << ": " << plan.err);
      CHECK(plan.code == 0);
      CHECK(plan.out.find("total MB") != std::string::npos);
      auto all = dtrain("plan " + path + " --all --nproc 2", limit);
      CHECK(all.code == 0);
      // validate refuses it for the memory a run would need: exit 2, not an allocation's.
      auto valid = dtrain("validate " + path, limit);
      CHECK(valid.code == 2);
      CHECK(valid.err.find("model: this job needs about") != std::string::npos);
    }
  }

  TEST_CASE("plan: under bf16 an MLP's activations are 16-bit and autocast's weight copies are counted; dropout's masks") {
    auto dir = temp_dir("plan-bf16");
    const auto job = Job().write(dir);  // 64-32-16-4, micro-batches of 8 samples
    const auto fp32 = plan_of(job, 1, "")["ranks"][0]["memory_mb"];
    const auto bf16 = plan_of(job, 1, " --set precision.dtype=bf16")["ranks"][0]["memory_mb"];
    // Kept a sample: each hidden layer's ReLU output, the logits and their log-softmax, 4
    // bytes a value in fp32 (4 (32 + 16) + 8 * 4); under bf16 the hidden ones 2 bytes, the
    // first layer's copy of the data too, the logits 2 and their log-softmax 4 (2 (32 + 16)
    // + 2 * 64 + 6 * 4). Backward's peak: in fp32 at the first layer, its ReLU output beside
    // its output's and ReLU's gradients (4 * 32 + 8 * 32); under bf16 there too, what the
    // first layer keeps (2 * 32 + 2 * 64) beside its two 16-bit gradients (4 * 32), above
    // the classifier's (all kept, its log-softmax's gradient and the 16-bit cast, 6 * 4,
    // its input's 2 * 16: 248 + 56, against 192 + 128).
    const double mib = 1 << 20;
    CHECK(fp32["activations"].get<double>() * mib == doctest::Approx(8 * (4 * 32 + 8 * 32)));
    CHECK(bf16["activations"].get<double>() * mib == doctest::Approx(8 * (2 * 32 + 2 * 64 + 4 * 32)));
    // bf16 copies of the three layers' weights and biases (torch::linear casts both),
    // kept for backward.
    CHECK((bf16["buffers"].get<double>() - fp32["buffers"].get<double>()) * mib ==
          doctest::Approx(2 * (64 * 32 + 32 + 32 * 16 + 16 + 16 * 4 + 4)));
    // Dropout after each hidden layer keeps its mask and its output, in the layer's dtype.
    // fp32: the peak moves to the second layer's backward, beside the first's 3 * 4 * 32
    // and its own 3 * 4 * 16, its two gradients (8 * 16). bf16: at the classifier now,
    // 2 * 2 (32 + 16) more kept beside its 56.
    const auto dropped = plan_of(job, 1, " --set model.dropout=0.1")["ranks"][0]["memory_mb"];
    CHECK(dropped["activations"].get<double>() * mib == doctest::Approx(8 * (12 * (32 + 16) + 8 * 16)));
    const auto dropped16 = plan_of(job, 1, " --set model.dropout=0.1 --set precision.dtype=bf16")["ranks"][0]["memory_mb"];
    CHECK(dropped16["activations"].get<double>() * mib ==
          doctest::Approx(8 * (2 * 3 * (32 + 16) + 2 * 64 + 6 * 4 + 6 * 4 + 2 * 16)));
    std::system(("rm -rf '" + dir + "'").c_str());
  }

  TEST_CASE("plan --device cuda: a GPU profile's step time, worked out by hand") {
    // A profile as a GPU machine's `plan --measure` writes it, with round numbers: every
    // product at 1 GFLOP/s (bf16's at 2), memory at 1 GB/s, the one GPU shared by local
    // ranks over Gloo (100 us a call, 1 GB/s).
    auto dir = temp_dir("plan-gpu");
    auto rate = [](double flops) { return nlohmann::json::array({{{"size", 64}, {"work", 1e6}, {"flops", flops}}}); };
    auto link = nlohmann::json::array({{{"ranks", 2}, {"latency_s", 1e-4}, {"bytes_per_s", 1e9}}});
    auto cpu = nlohmann::json::array({{{"size", 64}, {"one_thread_flops", 1e9}, {"all_threads_flops", 1e9}}});
    auto values = nlohmann::json{{"plain_one_thread_values_per_s", 1e9}, {"plain_all_threads_values_per_s", 1e9},
                                 {"transcendental_one_thread_values_per_s", 1e9},
                                 {"transcendental_all_threads_values_per_s", 1e9}};
    nlohmann::json profile{{"format", "dtrain-machine"}, {"version", 6}, {"host", "gpu-node"},
                           {"build", "test"}, {"cores", 1}, {"matmul_fp32", cpu}, {"matmul_bf16", cpu},
                           {"bmm_fp32", cpu}, {"bmm_bf16", cpu},
                           {"memory_one_thread_bytes_per_s", 1e9}, {"memory_all_threads_bytes_per_s", 1e9},
                           {"elementwise_fp32", values}, {"elementwise_bf16", values},
                           {"gloo_all_reduce", link}, {"gloo_send", link},
                           {"crowded", {{"ranks", 2}, {"handoff_s", 0}, {"all_reduce_s", 0}}}};
    profile["gpu"] = {{"name", "test GPU"}, {"count", 1}, {"memory_bytes", 80e9},
                      {"matmul", {{"fp32", rate(1e9)}, {"tf32", rate(1e9)}, {"bf16", rate(2e9)}}},
                      {"bmm", nlohmann::json::object()}, {"memory_bytes_per_s", 1e9},
                      {"launch_s", 1e-6}, {"backend", "gloo"}, {"all_reduce", link}, {"send", link}};
    auto write = [&](const nlohmann::json& p, const std::string& name) {
      std::ofstream(dir + "/" + name) << p.dump();
      return " --profile " + dir + "/" + name;
    };
    const auto gpu = write(profile, "gpu.json");
    Job job;
    job.data = "{dataset: synthetic, samples: 256, test_samples: 32, input_shape: [1, 8, 8], classes: 8,"
               " batch_size: 16, workers: 1}";
    job.model = "{arch: mlp, hidden: [32]}";
    job.optimizer = "{name: sgd, lr: 0.05, momentum: 0}";
    job.train = "";
    const auto path = job.write(dir);
    auto plan = [&](int64_t nproc, const std::string& args) { return plan_of(path, nproc, " --device cuda" + args); };
    // One process. The MLP 64-32-8 on 16 samples: its products' 2 (64 32 + 32 8) = 4608
    // flops a sample and its 32 + 2 * 8 fp32 activations (192 bytes) a sample, forward
    // and backward's two passes; SGD streams its 2344 parameters four times; the host
    // launches 25 kernels (the two layers' 2 + 3, three passes; four gradients; SGD's
    // four; the norm's two).
    const double compute = 3 * 16 * (4608 / 1e9 + 192 / 1e9), update = 4 * 4 * 2344 / 1e9;
    const auto one = plan(1, gpu);
    CHECK(one["device"] == "cuda");
    CHECK(one["ranks"][0]["memory_mb"]["runtime"].is_null());  // the host's, not the GPU's
    CHECK(one["step_s"].get<double>() == doctest::Approx(compute + update).epsilon(1e-9));
    // The host launching more slowly than the device computes: the step is the launches.
    auto slow = profile;
    slow["gpu"]["launch_s"] = 1e-4;
    CHECK(plan(1, write(slow, "slow.json"))["step_s"].get<double>() == doctest::Approx(25 * 1e-4).epsilon(1e-9));
    // Under bf16 autocast each forward casts too: the data, both weights and biases, and
    // the logits back to fp32 (six, three passes); with dropout the hidden layer draws a
    // mask and multiplies by it (two, three passes).
    CHECK(plan(1, " --set precision.dtype=bf16" + write(slow, "slow.json"))["step_s"].get<double>() ==
          doctest::Approx(43 * 1e-4).epsilon(1e-9));
    CHECK(plan(1, " --set model.dropout=0.1" + write(slow, "slow.json"))["step_s"].get<double>() ==
          doctest::Approx(31 * 1e-4).epsilon(1e-9));
    // bf16 autocast's products at bf16's rate, their activations in 2 bytes (the hidden
    // layer's 32 ReLUs and the data's 64 cast: 192 bytes; the logits' 8 in 2 and
    // log-softmax in 4: 48).
    CHECK(plan(1, " --set precision.dtype=bf16" + gpu)["step_s"].get<double>() ==
          doctest::Approx(3 * 16 * (4608 / 2e9 + 240 / 1e9) + update).epsilon(1e-9));
    // Two ranks sharing the one GPU: each computes its 8 samples in turn with the other,
    // and all-reduces the gradient (9376 bytes, ring: half each way twice) over Gloo.
    const auto two = plan(2, gpu);
    CHECK(two["step_s"].get<double>() ==
          doctest::Approx(2 * (3 * 8 * (4608 / 1e9 + 192 / 1e9) + update) + 1e-4 + 9376 / 1e9).epsilon(1e-9));
    // Two GPUs take NCCL, which this profile did not measure: no estimate rather than Gloo's.
    auto pair = profile;
    pair["gpu"]["count"] = 2;
    CHECK(plan(2, write(pair, "pair.json"))["step_s"].is_null());
    // A CPU machine's profile has no GPU: no time, and the table says why.
    auto cpu_only = profile;
    cpu_only.erase("gpu");
    const auto no_gpu = write(cpu_only, "cpu.json");
    CHECK(plan(1, no_gpu)["step_s"].is_null());
    auto table = dtrain("plan " + path + " --device cuda" + no_gpu);
    CHECK(table.out.find("the machine profile has no GPU") != std::string::npos);
    // --all on a GPU: the limit is the profile's device, less a tenth.
    auto all = dtrain("plan " + path + " --all --json --nproc 2 --device cuda" + gpu);
    INFO(all.err);
    REQUIRE(all.code == 0);
    CHECK(nlohmann::json::parse(all.out)["memory_limit_mb"].get<double>() == doctest::Approx(0.9 * 80e9 / (1 << 20)));
    // Two ranks on the one GPU need their memory twice over: a limit between once and twice
    // the largest rank fits where each has its GPU, not where they share one.
    auto fits_d2 = [&](const std::string& profile_args, double limit_mb) {
      auto r = dtrain("plan " + path + " --all --json --nproc 2 --device cuda --memory-gb " +
                      std::to_string(limit_mb / 1024) + profile_args);
      INFO(r.err);
      REQUIRE(r.code == 0);
      const auto listed = nlohmann::json::parse(r.out);
      for (const auto& l : listed["layouts"])
        if (l["label"] == "d2 x t1 x p1, zero 0, 1 micro-batch(es)")
          return std::pair{l["fits"].get<bool>(), l["largest_rank_mb"].get<double>()};
      FAIL("no d2 layout");
      return std::pair{false, 0.0};
    };
    const double largest = fits_d2(gpu, 1e6).second;
    CHECK_FALSE(fits_d2(gpu, 1.5 * largest).first);
    CHECK(fits_d2(write(pair, "pair.json"), 1.5 * largest).first);
    // A GPU section without fp32's rates is named; an auto job is planned where it runs.
    auto broken = profile;
    broken["gpu"]["matmul"].erase("fp32");
    auto bad = dtrain("plan " + path + " --device cuda" + write(broken, "broken.json"));
    CHECK(bad.code == 3);
    CHECK(bad.err.find("broken.json") != std::string::npos);
    auto chooses = dtrain("plan " + path + " --device cuda --set parallel.auto=true" + gpu);
    CHECK(chooses.code == 2);
    CHECK(chooses.err.find("plan --all --device cuda") != std::string::npos);
    // A job written for the GPU machine is planned from this one, which has no GPU (a login
    // node): its train.device, fp16, NCCL between the profile's two GPUs, its second GPU.
    const auto pair_gpus = write(pair, "pair.json");
    for (const std::string sets : {" --set train.device=cuda --set precision.dtype=fp16 --set dist.backend=nccl",
                                   " --set train.device=cuda:1"}) {
      CAPTURE(sets);
      CHECK(plan(2, sets + pair_gpus)["device"] == "cuda");
      auto listed = dtrain("plan " + path + " --all --json --nproc 2 --device cuda" + sets + pair_gpus);
      INFO(listed.err);
      REQUIRE(listed.code == 0);
      CHECK(nlohmann::json::parse(listed.out)["layouts"].size() >= 2);  // d2, and t2
    }
    // ...but not what that machine does not have: a third GPU; a job kept on its CPU.
    auto third = dtrain("plan " + path + " --device cuda --set train.device=cuda:2" + pair_gpus);
    CHECK(third.code == 2);
    CHECK(third.err.find("train.device: cuda:2") != std::string::npos);
    auto on_cpu = dtrain("plan " + path + " --device cuda --set train.device=cpu" + gpu);
    CHECK(on_cpu.code == 2);
    CHECK(on_cpu.err.find("plan --device cuda: train.device cpu") != std::string::npos);
    // CUDA's autocast keeps softmax's output in fp32: a GPT block with dropout (plain
    // attention) keeps its attention weights and their mask in 4 bytes and the product's
    // 16-bit copy, 10 bytes a weight where the CPU's keeps 6: 4 * 2 heads * 16^2 a block,
    // two blocks, 4 samples a micro-batch.
    const auto gpt = gpt_job().write(dir, "gpt.yaml");
    const std::string sixteen = " --set precision.dtype=bf16 --set model.dropout=0.1";
    const double on_gpu = plan_of(gpt, 1, " --device cuda" + sixteen)["ranks"][0]["memory_mb"]["activations"];
    const double here = plan_of(gpt, 1, sixteen)["ranks"][0]["memory_mb"]["activations"];
    CHECK((on_gpu - here) * (1 << 20) == doctest::Approx(4 * (4 * 2 * 16 * 16) * 2));
    std::system(("rm -rf '" + dir + "'").c_str());
  }
}

// Its own ctest entry with the machine to itself: it times this machine, then compares a
// run's step time with what the timing expects (tests/CMakeLists.txt).
TEST_SUITE("plan_measure") {
  TEST_CASE("plan: --measure keeps a profile the plan times steps with; --all ranks the layouts; parallel.auto takes the first") {
    auto dir = temp_dir("plan-measure");
    const std::string profile = dir + "/machine.json";
    auto m = dtrain("plan --measure --nproc 2 --profile " + profile);
    INFO(m.out << m.err);
    REQUIRE(m.code == 0);
    const auto p = nlohmann::json::parse(slurp(profile));
    CHECK(p["format"] == "dtrain-machine");
    REQUIRE(p["matmul_fp32"].size() >= 4);
    for (const auto& x : p["matmul_fp32"]) CHECK(x["one_thread_flops"].get<double>() > 1e6);
    REQUIRE(p["matmul_bf16"].size() == p["matmul_fp32"].size());
    for (const auto& x : p["matmul_bf16"]) CHECK(x["all_threads_flops"].get<double>() > 1e6);
    REQUIRE(p["bmm_fp32"].size() >= 3);  // attention's batched products
    REQUIRE(p["bmm_bf16"].size() == p["bmm_fp32"].size());
    for (const auto& x : p["bmm_fp32"]) CHECK(x["one_thread_flops"].get<double>() > 1e6);
    for (const char* dtype : {"elementwise_fp32", "elementwise_bf16"})  // a sum's and GELU's values/s
      for (const auto& [key, rate] : p[dtype].items()) CHECK(rate.get<double>() > 1e6);
    CHECK(p["gloo_all_reduce"][0]["bytes_per_s"].get<double>() > 1e6);
    CHECK(p["gloo_send"][0]["latency_s"].get<double>() >= 0);
    if (p["cores"].get<int64_t>() <= 8) {  // twice the cores' ranks, waiting on each other
      CHECK(p["crowded"]["ranks"] == 2 * p["cores"].get<int64_t>());
      CHECK(p["crowded"]["handoff_s"].get<double>() >= 0);
      CHECK(p["crowded"]["all_reduce_s"].get<double>() >= 0);
    }

    // A GPT at 2 data ranks: its expected step.
    auto job = gpt_job();
    job.model = "{arch: gpt, layers: 2, heads: 4, dim: 128, vocab: 256, seq_len: 64}";
    job.data = "{dataset: synthetic_tokens, samples: 512, test_samples: 32, batch_size: 16, workers: 1}";
    job.threads = std::nullopt;  // the default: the cores shared among the processes
    const auto path = job.write(dir);
    const auto plan = nlohmann::json::parse(
        dtrain("plan " + path + " --json --nproc 2 --profile " + profile).out);
    REQUIRE(plan["step_s"].is_number());
    CHECK(plan["samples_per_s"].get<double>() == doctest::Approx(16 / plan["step_s"].get<double>()));
    // Under bf16 autocast the matmuls take bf16's measured rates.
    const auto bf16 = nlohmann::json::parse(
        dtrain("plan " + path + " --json --nproc 2 --set precision.dtype=bf16 --profile " + profile).out);
    CHECK(bf16["step_s"].get<double>() != plan["step_s"].get<double>());
    // How near the plan's step comes to a run's is measured by scripts/bench_plan.sh, not
    // here: a test that timed it failed on a loaded machine (the run's step 4x the plan's
    // with another job on the cores). Here the plan only has to be a time.
    CHECK(std::isfinite(plan["step_s"].get<double>()));
    CHECK(plan["step_s"].get<double>() > 0);

    // Every layout of 4 processes, fastest first among those that fit; a limit nothing
    // fits marks them all.
    auto all = dtrain("plan " + path + " --all --json --nproc 4 --profile " + profile);
    INFO(all.err);
    REQUIRE(all.code == 0);
    const auto list = nlohmann::json::parse(all.out)["layouts"];
    CHECK(list.size() >= 20);
    double last = 0;
    std::set<std::string> labels;
    for (const auto& l : list) {
      REQUIRE(l["fits"] == true);
      CHECK(l["step_s"].get<double>() >= last);
      last = l["step_s"].get<double>();
      labels.insert(l["label"].get<std::string>());
    }
    CHECK(labels.size() == list.size());
    CHECK(labels.count("d4 x t1 x p1, zero 0, 1 micro-batch(es)") == 1);
    CHECK(labels.count("d1 x t2 x p2, zero 0, interleaved_1f1b x2, 2 micro-batch(es), recompute") == 1);
    auto tight = dtrain("plan " + path + " --all --nproc 4 --memory-gb 0.01 --profile " + profile);
    CHECK(tight.code == 0);
    CHECK(tight.out.find(" yes\n") == std::string::npos);
    CHECK(tight.out.find(" no\n") != std::string::npos);
    // A profile that does not parse is named.
    std::ofstream(dir + "/bad.json") << "{";
    auto bad = dtrain("plan " + path + " --profile " + dir + "/bad.json");
    CHECK(bad.code == 3);
    CHECK(bad.err.find("bad.json") != std::string::npos);
    // A profile of the first version (square products, read by volume), of the fourth
    // (cores timed cold) or of the fifth (fp32 products by ATen's mm only) is as none.
    for (int version : {1, 4, 5}) {
      auto stale_profile = p;
      stale_profile["version"] = version;
      const auto file = dir + "/v" + std::to_string(version) + ".json";
      std::ofstream(file) << stale_profile.dump();
      const auto stale = nlohmann::json::parse(dtrain("plan " + path + " --json --profile " + file).out);
      CHECK(stale["step_s"].is_null());
    }

    // parallel.auto takes --all's first layout, holding the layout keys the job sets (its
    // grad_accum 2, and here zero 1): the plan of an auto job is that layout's, and a run
    // trains on it, says so and records it.
    const std::string with_profile = "timeout 500 env DTRAIN_PROFILE=" + profile;
    const std::string held = " --set parallel.auto=true --set parallel.zero=1";
    auto first = dtrain("plan " + path + " --all --json --nproc 4" + held, with_profile);
    INFO(first.err);
    REQUIRE(first.code == 0);
    const auto choices = nlohmann::json::parse(first.out)["layouts"];
    REQUIRE(choices.size() >= 3);
    CHECK(choices.size() < list.size());
    for (const auto& l : choices) {
      CHECK(l["layout"]["zero"] == 1);
      CHECK(l["layout"]["grad_accum"] == 2);
    }
    auto chosen = dtrain("plan " + path + " --json --nproc 4" + held, with_profile);
    INFO(chosen.err);
    REQUIRE(chosen.code == 0);
    CHECK(nlohmann::json::parse(chosen.out)["layout"] == choices[0]["layout"]);
    CHECK(chosen.err.find("parallel.auto: " + choices[0]["label"].get<std::string>()) != std::string::npos);

    // A run at 2 processes: the choice said, in config.yaml and the summary, and the same
    // model trained as on one process.
    const std::string steps = " --set train.max_steps=6 --set train.log_every=1" + std::string(kQuiet);
    auto ran = dtrain("run " + path + " --nproc 2 --run-dir " + dir + "/auto" + held + steps, with_profile);
    INFO(ran.out << ran.err);
    REQUIRE(ran.code == 0);
    CHECK(ran.out.find("parallel.auto: d") != std::string::npos);
    const auto s2 = of_kind(metrics(dir + "/auto"), "summary").at(0);
    CAPTURE(s2.dump());
    CHECK(s2["layout"]["chosen_by"] == "parallel.auto");
    CHECK(s2["layout"]["zero"] == 1);
    CHECK(s2["layout"]["grad_accum"] == 2);
    const auto yaml = slurp(dir + "/auto/config.yaml");
    CHECK(yaml.find("auto: true") != std::string::npos);
    CHECK(yaml.find("data: " + std::to_string(s2["layout"]["data"].get<int64_t>())) != std::string::npos);
    run_ok("run " + path + " --run-dir " + dir + "/one" + steps);
    check_losses_close(train_losses(dir + "/one"), train_losses(dir + "/auto"), 1e-5, "auto");

    // A resume keeps the layout config.yaml records, though this job no longer holds
    // tensor at 2 and a fresh choice could differ.
    auto t2 = dtrain("run " + path + " --nproc 2 --run-dir " + dir + "/t2" + held +
                     " --set parallel.tensor=2 --set checkpoint.every_steps=3" + steps, with_profile);
    INFO(t2.err);
    REQUIRE(t2.code == 0);
    auto resumed = dtrain("run " + path + " --nproc 2 --resume auto --run-dir " + dir + "/t2" + held +
                          " --set train.max_steps=9 --set train.log_every=1" + kQuiet, with_profile);
    INFO(resumed.out << resumed.err);
    REQUIRE(resumed.code == 0);
    CHECK(resumed.out.find("config.yaml records") != std::string::npos);
    CHECK(of_kind(metrics(dir + "/t2"), "summary").back()["layout"]["tensor"] == 2);
    // A layout key the resume sets itself wins over the record (the rest is kept).
    auto zero2 = dtrain("run " + path + " --nproc 2 --resume auto --run-dir " + dir + "/auto" + held +
                        " --set parallel.zero=2 --set train.max_steps=8 --set train.log_every=1" + kQuiet,
                        with_profile);
    INFO(zero2.out << zero2.err);
    REQUIRE(zero2.code == 0);
    CHECK(zero2.out.find("records; parallel.zero, train.grad_accum as the job sets") != std::string::npos);
    const auto s3 = of_kind(metrics(dir + "/auto"), "summary").back();
    CHECK(s3["layout"]["zero"] == 2);
    CHECK(s3["layout"]["data"] == s2["layout"]["data"]);

    // No layout validates with what the job holds: exit 2 naming parallel.auto.
    auto none = dtrain("validate " + path + " --nproc 2 --set parallel.auto=true --set parallel.tensor=3",
                       with_profile);
    CHECK(none.code == 2);
    CHECK(none.err.find("parallel.auto") != std::string::npos);

    // With no profile the first start measures one, in a child dtrain (`plan --measure`):
    // nothing of the measurement (OpenMP's threads, a GPU's contexts) stays in the
    // supervisor while its workers train.
    auto fresh = dtrain("run " + path + " --nproc 2 --run-dir " + dir + "/fresh --set parallel.auto=true"
                        " --set train.threads=2 --set train.max_steps=3" + kQuiet,
                        "timeout 200 env DTRAIN_PROFILE=" + dir + "/fresh.json");
    INFO(fresh.out << fresh.err);
    CHECK(fresh.code == 0);
    CHECK(fresh.err.find("measuring this machine") != std::string::npos);
    CHECK(std::filesystem::is_regular_file(dir + "/fresh.json"));
    std::system(("rm -rf '" + dir + "'").c_str());
  }
}

}  // namespace e2e::plan_tests
