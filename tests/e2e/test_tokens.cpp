// Tokenized corpora (data.dataset: tokens): shards in llm.c's and nanoGPT's formats, made
// here from the shipped corpus's bytes, train exactly as the same bytes read as text (the
// text loader is the independent reference: the same windows, the same tokens), resume bit
// for bit from a checkpoint at 2 ranks, and a damaged shard is exit 3 naming the file.
#include <doctest/doctest.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <functional>

#include <fcntl.h>
#include <sys/stat.h>

#include "run.hpp"

namespace e2e::tokens_tests {

namespace {
const std::string kCorpus = "/usr/share/games/fortunes/computers";  // 238 KB of text

std::vector<uint16_t> corpus_tokens(size_t from, size_t n) {
  const auto text = slurp(kCorpus);
  REQUIRE(text.size() >= from + n);
  std::vector<uint16_t> out;
  for (size_t i = from; i < from + n; ++i) out.push_back(static_cast<unsigned char>(text[i]));
  return out;
}

void write_nanogpt(const std::string& path, const std::vector<uint16_t>& tokens) {
  std::ofstream(path, std::ios::binary)
      .write(reinterpret_cast<const char*>(tokens.data()), std::streamsize(2 * tokens.size()));
}

// llm.c's shard: 256 int32 (magic, version, token count, zeros), then the uint16 tokens.
void write_llmc(const std::string& path, const std::vector<uint16_t>& tokens,
                int32_t magic = 20240520, int32_t version = 1, int64_t claimed = -1) {
  std::vector<int32_t> header(256, 0);
  header[0] = magic, header[1] = version;
  header[2] = int32_t(claimed >= 0 ? claimed : int64_t(tokens.size()));
  std::ofstream out(path, std::ios::binary);
  out.write(reinterpret_cast<const char*>(header.data()), 1024);
  out.write(reinterpret_cast<const char*>(tokens.data()), std::streamsize(2 * tokens.size()));
}

std::string gpt_job(const std::string& dir, const std::string& data) {
  Job j = ranks_job("tokens-check", 5);
  j.data = "{" + data + ", batch_size: 8, seq_len: 32, workers: 1}";
  j.model = "{arch: gpt, layers: 2, heads: 4, dim: 32, seq_len: 32, vocab: 256}";
  j.optimizer = "{name: adamw, lr: 0.003, weight_decay: 0.1}";
  j.schedule = "{decay: step, step_size: 10}";
  j.max_steps = 20, j.eval_every = 10, j.train = "";
  j.checkpoint = "{every_steps: 10}";
  return j.write(dir, "gpt.yaml");
}

}  // namespace

TEST_SUITE("tokens") {
  TEST_CASE("llm.c and nanoGPT shards train exactly as the same bytes read as text") {
    REQUIRE_MESSAGE(std::filesystem::exists(kCorpus), "apt-get install fortunes");
    auto dir = temp_dir("tokens-formats");
    const auto tokens = corpus_tokens(0, 60000);
    const std::string text = dir + "/corpus.txt";
    {
      std::string bytes(tokens.begin(), tokens.end());
      std::ofstream(text, std::ios::binary) << bytes;
    }
    write_nanogpt(dir + "/corpus.bin", tokens);
    write_llmc(dir + "/corpus.llmc", tokens);
    run_ok("run " + gpt_job(dir, "dataset: text, path: " + text) + " --run-dir " + dir + "/text");
    run_ok("run " + gpt_job(dir, "dataset: tokens, path: " + dir + "/corpus.bin") + " --run-dir " +
        dir + "/nanogpt");
    run_ok("run " + gpt_job(dir, "dataset: tokens, path: " + dir + "/corpus.llmc") + " --run-dir " +
        dir + "/llmc");
    const auto want = train_losses(dir + "/text");
    REQUIRE(want.size() == 20);
    for (const std::string how : {"nanogpt", "llmc"}) {
      CAPTURE(how);
      const auto got = train_losses(dir + "/" + how);
      for (const auto& [step, loss] : want) {
        INFO("step " << step);
        CHECK(got.at(step) == loss);
      }
      const auto evals = of_kind(metrics(dir + "/" + how), "eval");
      REQUIRE(evals.size() == 2);
      CHECK(evals.back()["loss"] == of_kind(metrics(dir + "/text"), "eval").back()["loss"]);
    }
  }

  TEST_CASE("shards by glob with held-out shards: 2 ranks resume bit-exactly") {
    REQUIRE_MESSAGE(std::filesystem::exists(kCorpus), "apt-get install fortunes");
    auto dir = temp_dir("tokens-resume");
    std::filesystem::create_directories(dir + "/data");
    write_llmc(dir + "/data/train_000001.bin", corpus_tokens(0, 30000));
    write_llmc(dir + "/data/train_000002.bin", corpus_tokens(30000, 30000));
    write_llmc(dir + "/data/val_000000.bin", corpus_tokens(60000, 5000));
    const auto job = gpt_job(dir, "dataset: tokens, path: '" + dir + "/data/train_*.bin', "
                                  "eval_path: '" + dir + "/data/val_*.bin'");
    check_same_trajectory(train_whole_and_in_legs(dir, job, 10, " --nproc 2"), 20);
    // The held-out split is the val shard's whole: 5000 tokens make 156 windows of 32 + 1.
    const auto evals = of_kind(metrics(dir + "/whole"), "eval");
    REQUIRE(evals.size() == 2);
    CHECK(evals.back()["loss"].get<double>() < evals.front()["loss"].get<double>());
  }

  TEST_CASE("a damaged shard or an id outside the vocabulary is exit 3 naming the file") {
    auto dir = temp_dir("tokens-bad");
    const std::vector<uint16_t> ok(4000, 65);
    struct Case {
      std::string name, sets, needle;
      std::function<void(const std::string&)> make;
    };
    auto with_bad_id = ok;
    with_bad_id[1234] = 300;
    const std::vector<Case> cases{
        {"magic.bin", " --set data.token_format=llmc", "is not an llm.c shard: its header starts with",
         [&](const std::string& p) { write_llmc(p, ok, 12345); }},
        {"version.bin", "", "is an llm.c shard of version 2; dtrain reads version 1",
         [&](const std::string& p) { write_llmc(p, ok, 20240520, 2); }},
        {"truncated.bin", "", "is truncated or damaged: its header says 5000 tokens, the file holds "
         "8000 bytes after the header (4000 tokens)",
         [&](const std::string& p) { write_llmc(p, ok, 20240520, 1, 5000); }},
        {"odd.bin", "", "is truncated: 8001 bytes is not a whole number of uint16 tokens",
         [&](const std::string& p) {
           write_nanogpt(p, ok);
           std::ofstream(p, std::ios::app | std::ios::binary) << 'x';
         }},
        {"id.bin", "", "holds token id 300 at position 3492 (token 1234 of the shard), outside the "
         "vocabulary of 256",
         [&](const std::string& p) { write_llmc(p, with_bad_id); }},
        {"nothing-*.bin", "", "data.path: no file matches", [](const std::string&) {}},
    };
    for (const auto& k : cases) {
      CAPTURE(k.name);
      const auto path = dir + "/" + k.name;
      k.make(path);
      const auto job = gpt_job(dir, "dataset: tokens, path: '" + path + "'");
      for (const std::string cmd : {"run", "validate"}) {
        const std::string where = cmd == "run" ? " --run-dir " + dir + "/run" : "";
        auto r = e2e::dtrain(cmd + " " + job + where + k.sets + kQuiet);
        INFO(cmd << ": " << r.err);
        CHECK(r.code == 3);
        CHECK(r.err.find(k.needle) != std::string::npos);
        if (k.name != "nothing-*.bin") CHECK(r.err.find(path) != std::string::npos);
      }
    }
  }

  TEST_CASE("the shards' scan is shared by the ranks and recorded; a rewritten shard is scanned again") {
    REQUIRE_MESSAGE(std::filesystem::exists(kCorpus), "apt-get install fortunes");
    auto dir = temp_dir("tokens-record");
    std::filesystem::create_directories(dir + "/data");
    for (int k = 0; k < 3; ++k)  // shards of unequal lengths: the ranks' shares cross them
      write_nanogpt(dir + "/data/train_" + std::to_string(k) + ".bin",
                    corpus_tokens(size_t(k) * 20000, 7000 + size_t(k) * 3001));
    const auto job = gpt_job(dir, "dataset: tokens, path: '" + dir + "/data/train_*.bin'");
    const auto one = dir + "/one", two = dir + "/two";
    run_ok("run " + job + " --run-dir " + one + " --set train.max_steps=2");
    run_ok("run " + job + " --run-dir " + two + " --nproc 2 --set train.max_steps=2");
    // Each rank scanned its half of the tokens: the record rank 0 wrote is one process's.
    const auto record = nlohmann::json::parse(slurp(one + "/token-scan.json"));
    CHECK(record == nlohmann::json::parse(slurp(two + "/token-scan.json")));
    REQUIRE(record["shards"].size() == 3);
    CHECK(record["shards"][0]["max_id"].get<int64_t>() < 256);
    // A resume finds every shard in the record and trains on as before (its evaluation
    // capped at 4 held-out windows).
    run_ok("run " + job + " --run-dir " + two + " --nproc 2 --resume auto --set train.max_steps=4"
           " --set train.eval_samples=4");
    CHECK(train_losses(two).size() == 4);
    CHECK(of_kind(metrics(two), "eval").back()["step"] == 4);
    // A shard rewritten with an id outside the vocabulary no longer matches its record: it
    // is scanned again and named (exit 3), on one process and on two.
    auto bad = corpus_tokens(20000, 10001);
    bad[777] = 999;
    write_nanogpt(dir + "/data/train_1.bin", bad);
    for (const std::string how : {std::string(""), std::string(" --nproc 2")}) {
      auto r = dtrain("run " + job + " --run-dir " + two + how + " --resume auto --set train.max_steps=6" + kQuiet);
      INFO(how << ": " << r.err);
      CHECK(r.code == 3);
      CHECK(r.err.find("train_1.bin' holds token id 999 at position 1554 (token 777 of the shard)") !=
            std::string::npos);
    }
    // A shard rewritten in place with its size, first KiB and modification time kept: the
    // record still vouches for it, so the ids are checked where they are read, on one
    // process and on two tensor ranks.
    write_nanogpt(dir + "/data/train_1.bin", corpus_tokens(20000, 10001));
    run_ok("run " + job + " --run-dir " + two + " --resume auto --set train.max_steps=6");
    const std::string shard = dir + "/data/train_2.bin";
    struct stat st {};
    REQUIRE(::stat(shard.c_str(), &st) == 0);
    auto far = corpus_tokens(40000, 13002);  // as written above
    for (size_t i = 512; i < far.size(); ++i) far[i] = 300;
    write_nanogpt(shard, far);
    const timespec times[2] = {st.st_atim, st.st_mtim};
    REQUIRE(::utimensat(AT_FDCWD, shard.c_str(), times, 0) == 0);
    for (const std::string how : {std::string(""), std::string(" --nproc 2 --set parallel.tensor=2")}) {
      auto r = dtrain("run " + job + " --run-dir " + two + how + " --resume auto --set train.max_steps=12" + kQuiet);
      INFO(how << ": " << r.err);
      CHECK(r.code == 3);
      CHECK(r.err.find("train_2.bin' holds token id 300 at token ") != std::string::npos);
      CHECK(r.err.find("it changed since it was scanned") != std::string::npos);
    }
  }
}

}  // namespace e2e::tokens_tests
