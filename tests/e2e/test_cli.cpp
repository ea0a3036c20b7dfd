// The command line's contract: exit codes and one-line errors for bad input.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <fstream>
#include <regex>
#include <thread>

#include <fmt/format.h>

#include "run.hpp"

namespace e2e::cli_tests {

namespace {
// Every error is one line on stderr that starts with "dtrain: error:".
void check_one_line_error(const Result& r, int code, const std::string& needle) {
  INFO("stderr: " << r.err);
  CHECK(r.code == code);
  CHECK(r.err.rfind("dtrain: error: ", 0) == 0);
  CHECK(std::count(r.err.begin(), r.err.end(), '\n') == 1);
  CHECK(r.err.find(needle) != std::string::npos);
}

// The least a job names: its model and its data.
const char* kMinimal = "model: {arch: mlp}\ndata: {dataset: synthetic}\n";

std::string write_job(const std::string& dir, const std::string& text) {
  auto path = dir + "/job.yaml";
  std::ofstream(path) << text;
  return path;
}
}  // namespace

TEST_SUITE("cli") {
  TEST_CASE("shipped configs validate and print") {
    // gpt2_tokens.yaml reads shards of GPT-2 token ids: a small one stands in.
    auto dir = temp_dir("shipped");
    {
      std::vector<uint16_t> ids(4096);
      for (size_t i = 0; i < ids.size(); ++i) ids[i] = uint16_t((i * 7919) % 50304);
      std::ofstream(dir + "/tokens.bin", std::ios::binary)
          .write(reinterpret_cast<const char*>(ids.data()), std::streamsize(2 * ids.size()));
    }
    for (const auto& e : std::filesystem::directory_iterator(DTRAIN_CONFIGS)) {
      // GPT-2 small's shape is the GPU benchmark: on a CPU it fits at batch 1 (as its
      // comment says), not at its batch of 16 x 1024 tokens.
      const auto name = e.path().filename();
      const bool gpu_job = name == "gpt2_small.yaml" || name == "gpt2_tokens.yaml";
      std::string sets = gpu_job ? " --set data.batch_size=1" : "";
      if (name == "gpt2_tokens.yaml")
        sets += " --set data.path=" + dir + "/tokens.bin --set data.eval_path=" + dir + "/tokens.bin";
      auto r = dtrain("validate " + e.path().string() + sets);
      INFO(e.path() << ": " << r.err);
      CHECK(r.code == 0);
    }
  }

  TEST_CASE("config prints a resolved job that reads back to the same job") {
    auto dir = temp_dir("config");
    auto r = dtrain("config " + config("fashion_mnist_mlp.yaml") + " --set optimizer.lr=0.125" +
                    " --set model.hidden=[64,32]");
    REQUIRE(r.code == 0);
    CHECK(r.out.find("lr: 0.125") != std::string::npos);
    CHECK(r.out.find("hidden: [64, 32]") != std::string::npos);
    CHECK(r.out.find("run_dir: runs/fashion-mnist-mlp") != std::string::npos);
    auto resolved = write_job(dir, r.out);
    auto again = dtrain("config " + resolved);
    CHECK(again.code == 0);
    CHECK(again.out == r.out);
  }

  TEST_CASE("bad specs exit 2 with a one-line error naming the key") {
    auto dir = temp_dir("badspec");
    struct Case { std::string yaml, sets, needle; };
    std::vector<Case> cases{
        {"data:\n  batchsize: 64\n", "", "did you mean 'data.batch_size'"},
        {"lr: 0.1\n", "", "did you mean 'optimizer.lr'"},
        {"data:\n  batch_size: abc\n", "", "job.yaml:2:15: data.batch_size: expected an integer"},
        {"model:\n  arch: transformer\n", "", "'transformer' is not one of mlp | cnn"},
        {std::string(kMinimal) + "optimizer:\n  lr: -1\n", "", "optimizer.lr: must be > 0"},
        {"model: {arch: mlp}\ndata:\n  dataset: synthetic\n  batch_size: 64\ntrain:\n  grad_accum: 5\n",
         "", "data.batch_size: 64 does not divide"},
        {"data: [1, 2\n", "", "job.yaml:"},
        {kMinimal, "--set optimizer.momentun=0.5", "did you mean 'optimizer.momentum'"},
        {kMinimal, "--set train.epochs=two", "train.epochs: expected an integer"},
        {kMinimal, "--set optimizer.lr", "expected KEY=VALUE"},
        {kMinimal, "--set parallel.tensor=2", "parallel.tensor"},
        {kMinimal, "--set checkpoint.keep_last=0", "checkpoint.keep_last: must be >= 1"},
        // Sizes whose tensors LibTorch cannot address (their byte counts overflow int64).
        {kMinimal, "--set model.hidden=[10000000000,10000000000]", "model.hidden: layer 2's weight"},
        {kMinimal, "--set data.input_shape=[1,3000000000,3000000000]", "data.input_shape: must be small enough"},
        {"model: {arch: cnn, fc: [10000000000, 10000000000]}\ndata: {dataset: synthetic, input_shape: [1, 8, 8]}\n",
         "", "model.fc: dense layer 2's weight"},
        // Devices: what cannot run on this machine is refused before anything starts.
        {kMinimal, "--set train.device=gpu", "train.device: expected auto, cpu, cuda or cuda:N"},
        {kMinimal, "--set train.device=cuda:99", "train.device: cuda:99"},
        {kMinimal, "--set train.device=cpu --set precision.dtype=fp16",
         "precision.dtype: fp16 needs a CUDA device"},
        {kMinimal, "--set train.device=cpu --set dist.backend=nccl", "dist.backend: nccl"},
        // The job file itself.
        {"", "", "job file '" + dir + "/job.yaml' is empty"},
        {"# only a comment\n", "", "is empty"},
        {std::string(kMinimal) + "---\nmodel: {arch: cnn}\n", "", "holds more than one YAML document"},
        {"optimizer: {lr: 0.1}\n", "", "model.arch is not set"},
        {"model: {arch: mlp}\n", "", "data.dataset is not set"},
        // Names become folders: nothing that walks out of runs/, hides, or hides a byte.
        {kMinimal, "--set name=..", "name: must be 1 to 128 letters, digits"},
        {kMinimal, "--set name=.hidden", "(got '.hidden')"},
        {kMinimal, "--set name=a/b", "(got 'a/b')"},
        {kMinimal, "--set name=a\\ b", "name: must be"},
        {std::string(kMinimal) + "name: \"a\\0b\"\n", "", "(got 'a\\x00b')"},
        {kMinimal, "--set name=" + std::string(129, 'n'), "name: must be 1 to 128"},
        // Hostile sizes: an error, never a stack overflow or an endless parse.
        {std::string(kMinimal) + "x: " + std::string(100000, '[') + std::string(100000, ']'), "",
         "nested too deeply"},
        {std::string(kMinimal) + "# " + std::string(2 << 20, 'x') + "\n", "", "a job spec is at most"},
    };
    // Each case through run, validate or config in turn: the three read a job through
    // the same code. (A process start costs LibTorch's 0.8 s of CPU, its 289 libraries'
    // symbols and operator registry: every command for every case took 90 s of the
    // suite's time on a 2-core machine.)
    for (size_t i = 0; i < cases.size(); ++i) {
      const auto& c = cases[i];
      auto job = write_job(dir, c.yaml);
      const std::string cmd = std::vector<std::string>{"run", "validate", "config"}[i % 3];
      const std::string run_dir = cmd == "run" ? " --run-dir " + dir + "/run" : "";
      auto r = dtrain(cmd + " " + job + " " + c.sets + run_dir);
      INFO(cmd << " with spec <" << c.yaml << "> " << c.sets);
      check_one_line_error(r, 2, c.needle);
    }
    CHECK(!std::filesystem::exists(dir + "/run"));  // nothing was started
  }

  TEST_CASE("bad command lines exit 2") {
    check_one_line_error(dtrain(""), 2, "");
    check_one_line_error(dtrain("train x.yaml"), 2, "");
    check_one_line_error(dtrain("validate /nonexistent/job.yaml"), 2, "/nonexistent/job.yaml");
    for (const char* cmd : {"validate", "config", "run"}) {
      check_one_line_error(dtrain(std::string(cmd) + " /dev/null"), 2, "'/dev/null' is empty");
      check_one_line_error(dtrain(std::string(cmd) + " " + DTRAIN_CONFIGS), 2, "is a folder");
    }
    check_one_line_error(dtrain("run " + config("fashion_mnist_mlp.yaml") + " --bogus"), 2, "--bogus");
    // A memory limit that is no amount, and more measuring ranks than a profile holds.
    for (const char* gb : {"nan", "inf", "0", "-2", "1e400", "lots"})
      check_one_line_error(dtrain("plan " + config("fashion_mnist_mlp.yaml") + " --all --memory-gb " + gb),
                           2, "a number of GiB above 0, e.g. 64 (got '" + std::string(gb) + "')");
    check_one_line_error(dtrain("plan --measure --nproc 17 --profile /nonexistent/p.json"), 2,
                         "at most 16 local ranks");
    CHECK(dtrain("--help").code == 0);
  }

  TEST_CASE("--version names the build: dtrain's version, its LibTorch, CUDA and NCCL") {
    const auto r = dtrain("--version");
    CHECK(r.code == 0);
    INFO(r.out);
    CHECK(r.out.rfind("dtrain " DTRAIN_VERSION " (LibTorch ", 0) == 0);
    const bool cuda = r.out.find(", CUDA ") != std::string::npos;
    CHECK((cuda || r.out.find(", no CUDA, ") != std::string::npos));
    CHECK((r.out.find(", NCCL") != std::string::npos || r.out.find(", no NCCL") != std::string::npos));
    CHECK(std::count(r.out.begin(), r.out.end(), '\n') == 1);
  }

  TEST_CASE("an elastic range: every world size in it must take the global batch") {
    const std::string job = "validate " + config("fashion_mnist_mlp.yaml") + " --nproc 1";
    CHECK(dtrain(job + " --set data.batch_size=48 --nnodes 1:4").code == 0);
    auto r = dtrain(job + " --set data.batch_size=32 --nnodes 1:4");
    check_one_line_error(r, 2, "data.batch_size");
    CHECK(r.err.find("world size 3") != std::string::npos);
    check_one_line_error(dtrain(job + " --nnodes 3:1"), 2, "--nnodes");
    // A worker torchrun starts with such a range stops before training, exit 2.
    auto dir = temp_dir("elastic-range");
    r = dtrain("run " + config("fashion_mnist_mlp.yaml") + " --set data.batch_size=32 --run-dir " +
                   dir + "/run",
               "env RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 LOCAL_WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 "
               "MASTER_PORT=29999 TORCHELASTIC_RUN_ID=e2e PET_NNODES=1:3 timeout 60");
    check_one_line_error(r, 2, "data.batch_size");
    CHECK(r.err.find("world size 3") != std::string::npos);
    CHECK(!std::filesystem::exists(dir + "/run/metrics.jsonl"));
  }

  TEST_CASE("the suite's forked commands are the binary's: the same output, losses and codes; bounded") {
    // run.hpp runs a command in a fork of the test process where it can, and by exec of
    // build/dtrain where a prefix is given: the two must not be told apart.
    const char* threads = std::getenv("OMP_NUM_THREADS");
    if (!threads || std::string(threads) != "1" || dtrain::cuda_linked()) {
      MESSAGE("commands run by exec here (OMP_NUM_THREADS is not 1, or CUDA): only exec is compared with itself");
      CHECK(!forkable("run job.yaml", ""));
    } else {
      CHECK(forkable("run job.yaml --set 'a=b c' x\\ y", "") ==
            std::vector<std::string>{"run", "job.yaml", "--set", "a=b c", "x y"});
    }
    CHECK(!forkable("run job.yaml > out", ""));
    CHECK(!forkable("run job.yaml # a comment", ""));
    CHECK(!forkable("run job.yaml", "timeout 500"));
    auto dir = temp_dir("forked");
    const auto job = write_job(dir, std::string(kMinimal) + "train: {max_steps: 6, log_every: 1}\n");
    // {} is the run folder's name: fork or exec.
    for (const std::string args : {"run " + job + " --nproc 2 --run-dir " + dir + "/{}",
                                   "run " + job + " --set train.max_steps=x --run-dir " + dir + "/{}",
                                   std::string("--version"), "validate " + job + " --nproc 3"}) {
      CAPTURE(args);
      auto with = [&](const std::string& name) { return fmt::format(fmt::runtime(args), name); };
      const auto forked = e2e::dtrain(with("fork"));
      const auto execd = e2e::dtrain(with("exec"), "timeout 500");
      CHECK(forked.code == execd.code);
      auto same = [&](std::string a, std::string b) {  // but the run folders' names and speeds
        const std::regex folder("/(fork|exec)"), speed("[0-9.]+ samples/s");
        for (auto* s : {&a, &b}) *s = std::regex_replace(std::regex_replace(*s, folder, "/X"), speed, "N samples/s");
        CHECK(a == b);
      };
      same(forked.err, execd.err);
      same(forked.out, execd.out);
      if (args.rfind("run", 0) == 0 && forked.code == 0) {
        CHECK(train_losses(dir + "/fork").size() == 6);
        CHECK(train_losses(dir + "/fork") == train_losses(dir + "/exec"));
      }
    }
    // A command past its bound is stopped with its workers: exit 124, as `timeout` says,
    // and nothing of the run writes after it.
    const auto start = std::chrono::steady_clock::now();
    auto words = forkable("run " + job + " --nproc 2 --run-dir " + dir + "/slow --set train.max_steps=100000"
                          " --set train.debug_slow_rank=1 --set train.debug_slow_ms=50" + kQuiet, "");
    if (words) {
      CHECK(run_in_fork(*words, dir + "/slow.out", dir + "/slow.err", std::chrono::seconds(3)) == 124);
      CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(30));
      auto size = [&] {  // 0 before the run's first line
        std::error_code ec;
        const auto n = std::filesystem::file_size(dir + "/slow/metrics.jsonl", ec);
        return ec ? 0 : n;
      };
      const auto before = size();
      std::this_thread::sleep_for(std::chrono::seconds(1));
      CHECK(size() == before);
    }
  }

  TEST_CASE("validate reads the data as run would: unreadable data exits 3") {
    auto dir = temp_dir("validate-data");
    auto r = dtrain("validate " + config("fashion_mnist_mlp.yaml") + " --set data.path=" + dir);
    check_one_line_error(r, 3, "train-images-idx3-ubyte.gz");
    r = dtrain("validate " + config("gpt_text.yaml") + " --set data.path=" + dir + "/none.txt");
    check_one_line_error(r, 3, dir + "/none.txt");
  }
}

}  // namespace e2e::cli_tests
