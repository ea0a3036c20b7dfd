// Nothing lost, nothing silent: the run-directory lock, damaged and finished checkpoints, a
// full disk, and every user-facing failure mapped to an exit code of the contract. Each
// case is how a user meets it: through the binary.
#include <doctest/doctest.h>

#include <sstream>

#include <sys/mount.h>
#include <unistd.h>

#include <zlib.h>

#include "run.hpp"

namespace e2e::robust_tests {

namespace fs = std::filesystem;

namespace {

// A small synthetic MLP job that checkpoints every 10 steps; dtrain's optimizer and schedule.
Job small_job() {
  Job j;
  j.name = "robust", j.seed = 3;
  j.data = "{dataset: synthetic, samples: 512, test_samples: 64, input_shape: [1, 8, 8],"
           " classes: 4, batch_size: 32, workers: 1}";
  j.model = "{arch: mlp, hidden: [32]}";
  j.optimizer = j.schedule = "";
  j.max_steps = 30, j.log_every = 5, j.eval_every = 10, j.train = "";
  j.checkpoint = "{every_steps: 10, keep_last: 5}";
  j.dist = "";
  return j;
}

void check_one_line_error(const Result& r, int code, const std::string& needle) {
  INFO("exit " << r.code << ", stderr: " << r.err);
  CHECK(r.code == code);
  CHECK(r.err.rfind("dtrain: error: ", 0) == 0);
  CHECK(std::count(r.err.begin(), r.err.end(), '\n') == 1);
  CHECK(r.err.find(needle) != std::string::npos);
}

// Every file under `dir` with its bytes: to show a failed command changed nothing.
std::map<std::string, std::string> snapshot(const std::string& dir) {
  std::map<std::string, std::string> out;
  for (const auto& e : fs::recursive_directory_iterator(dir))
    if (e.is_regular_file() && e.path().filename() != ".lock")
      out[fs::relative(e.path(), dir).string()] = slurp(e.path().string());
  return out;
}

// Rewrites one file of a checkpoint and its manifest entry, so that the checkpoint still
// verifies: damage only a deeper check can find.
void forge(const std::string& folder, const std::string& name, const std::string& bytes) {
  { std::ofstream(folder + "/" + name, std::ios::binary) << bytes; }
  auto manifest = nlohmann::json::parse(slurp(folder + "/manifest.json"));
  for (auto& f : manifest["files"])
    if (f["name"] == name) {
      f["bytes"] = bytes.size();
      f["crc32"] = uint32_t(crc32(0, reinterpret_cast<const Bytef*>(bytes.data()), uInt(bytes.size())));
    }
  std::ofstream(folder + "/manifest.json") << manifest.dump(1);
}

// A tmpfs of `size` ("3m", "64k") at `dir` (read-only when asked), or false where mounting
// is not allowed (not root).
bool mount_tmpfs(const std::string& dir, const std::string& size, bool read_only = false) {
  fs::create_directories(dir);
  const std::string opts = "size=" + size;
  return ::mount("tmpfs", dir.c_str(), "tmpfs", read_only ? MS_RDONLY : 0, opts.c_str()) == 0;
}
}  // namespace

TEST_SUITE("robust") {
  TEST_CASE("one job per run directory: a second exits 2 naming the holder; the lock dies with it") {
    auto dir = temp_dir("lock");
    auto job = small_job().write(dir);
    auto run = dir + "/run";
    auto bg = start_dtrain("run " + job + " --run-dir " + run +
                           " --set train.max_steps=1000000 --set train.log_every=5" + kQuiet);
    REQUIRE(wait_for_step(run, 5, std::chrono::seconds(60)));
    const auto before = slurp(run + "/metrics.jsonl").size();
    char host[256] = {};
    ::gethostname(host, sizeof host - 1);
    const std::string holder = "pid " + std::to_string(bg.pid) + " on host " + host;
    for (const char* how : {"", " --resume auto", " --nproc 2 --resume auto"}) {
      INFO(how);
      auto r = dtrain("run " + job + " --run-dir " + run + how + kQuiet);
      INFO(r.err);
      CHECK(r.code == 2);
      CHECK(r.err.find("run directory '" + run + "' is in use by " + holder) != std::string::npos);
    }
    CHECK(slurp(run + "/metrics.jsonl").size() >= before);  // the first job's log is its own
    // A holder that dies, however it dies, leaves the directory free.
    ::kill(bg.pid, SIGKILL);
    CHECK(wait_for(bg.pid, std::chrono::seconds(30)) == 128 + SIGKILL);
    // The newest folder, not `latest`: the kill may fall between a rename and the pointer.
    int64_t step = -1;
    for (const auto& e : fs::directory_iterator(run + "/checkpoints"))
      if (e.path().filename().string().rfind("step-", 0) == 0)
        step = std::max<int64_t>(step, std::stoll(e.path().filename().string().substr(5)));
    REQUIRE(step > 0);
    auto r = dtrain("run " + job + " --run-dir " + run + " --resume auto --set train.max_steps=" +
                    std::to_string(step + 10) + kQuiet);
    INFO(r.err);
    CHECK(r.code == 0);
    const auto lines = metrics(run);  // every line whole JSON: one writer at a time
    CHECK(lines.back()["status"] == "completed");
    CHECK(lines.back()["steps"] == step + 10);
  }

  TEST_CASE("--resume auto names each damaged checkpoint it skips; none verifying changes nothing") {
    auto dir = temp_dir("damaged");
    auto job = small_job().write(dir);
    auto run = dir + "/run";
    REQUIRE(dtrain("run " + job + " --run-dir " + run + kQuiet).code == 0);
    const std::string ck = run + "/checkpoints/step-000000";
    { std::ofstream(ck + "30/model.safetensors", std::ios::app) << "x"; }
    fs::remove(ck + "20/manifest.json");
    auto r = dtrain("run " + job + " --run-dir " + run + " --resume auto --set train.max_steps=40" +
                    kQuiet);
    INFO(r.err);
    CHECK(r.code == 0);
    CHECK(r.err.find("warning: resume: skipping checkpoint '" + ck + "30': model.safetensors is "
                     "corrupt") != std::string::npos);
    CHECK(r.err.find("warning: resume: skipping checkpoint '" + ck + "20' has no manifest.json") !=
          std::string::npos);
    CHECK(r.err.find("resumed at step 10") != std::string::npos);

    // Now damage every checkpoint: exit 3, and the earlier run's record stays as it was.
    for (const auto& e : fs::directory_iterator(run + "/checkpoints"))
      if (e.is_directory()) std::ofstream(e.path() / "trainer.json", std::ios::app) << " ";
    const auto before = snapshot(run);
    r = dtrain("run " + job + " --run-dir " + run + " --resume auto --set train.max_steps=60" + kQuiet);
    check_one_line_error(r, 3, "checkpoint(s) in '" + run + "/checkpoints' verifies");
    CHECK(r.err.find("nothing was changed") != std::string::npos);
    CHECK(snapshot(run) == before);
    // Nor may a fresh start prune what it could not read.
    r = dtrain("run " + job + " --run-dir " + run + kQuiet);
    check_one_line_error(r, 2, "already holds checkpoints");
    CHECK(snapshot(run) == before);
  }

  TEST_CASE("a full disk: exit 3, earlier checkpoints intact, no partial folder, a failed summary") {
    auto dir = temp_dir("full");
    auto disk = dir + "/disk";
    if (!mount_tmpfs(disk, "3m")) {
      MESSAGE("skipped: mounting a tmpfs needs root");
      return;
    }
    // 141k parameters: a checkpoint holds ~1.7 MB (weights and two AdamW moments), so the
    // first fits in 3 MB and the second does not.
    auto adamw = small_job();
    adamw.optimizer = "{name: adamw, lr: 0.001}";
    auto job = adamw.write(dir);
    auto run = disk + "/run";
    auto r = dtrain("run " + job + " --run-dir " + run + " --set model.hidden=[2048] " + kQuiet);
    INFO(r.err);
    CHECK(r.code == 3);
    CHECK(r.err.find("dtrain: error: cannot write the checkpoint of step 20") != std::string::npos);
    CHECK(r.err.find("No space left on device") != std::string::npos);
    std::vector<std::string> names;
    for (const auto& e : fs::directory_iterator(run + "/checkpoints")) names.push_back(e.path().filename());
    std::sort(names.begin(), names.end());
    CHECK(names == std::vector<std::string>{"best", "latest", "step-00000010"});
    CHECK(dtrain("inspect " + run).code == 0);
    auto summary = metrics(run).back();
    CHECK(summary["kind"] == "summary");
    CHECK(summary["status"] == "failed");
    CHECK(summary["reason"].get<std::string>().find("No space left on device") != std::string::npos);
    ::umount2(disk.c_str(), MNT_DETACH);

    // Two ranks: rank 0 cannot write, and both stop together with its exit code (not 4).
    REQUIRE(mount_tmpfs(disk, "3m"));
    r = dtrain("run " + job + " --run-dir " + run + " --nproc 2 --set model.hidden=[2048] " + kQuiet);
    INFO(r.err);
    CHECK(r.code == 3);
    CHECK(r.err.find("[rank 0] dtrain: error: cannot write the checkpoint of step 20") !=
          std::string::npos);
    CHECK(r.err.find("[rank 1] dtrain: error: rank 0 could not write the checkpoint of step 20 "
                     "(see rank 0)") != std::string::npos);
    CHECK(metrics(run).back()["status"] == "failed");
    ::umount2(disk.c_str(), MNT_DETACH);
  }

  TEST_CASE("a metrics write that fails ends the job at once with exit 3, leaving whole lines") {
    auto dir = temp_dir("metrics-full");
    auto disk = dir + "/disk";
    if (!mount_tmpfs(disk, "64k")) {
      MESSAGE("skipped: mounting a tmpfs needs root");
      return;
    }
    // A train line every step and no checkpoint before the end: metrics.jsonl fills the
    // 64 KiB after ~150 steps, long before the 100000th.
    auto job = small_job().write(dir);
    auto run = disk + "/run";
    auto r = dtrain("run " + job + " --run-dir " + run + " --set train.max_steps=100000"
                    " --set train.log_every=1 --set train.eval_every=100000"
                    " --set checkpoint.every_steps=100000" + kQuiet);
    INFO(r.err);
    CHECK(r.code == 3);
    CHECK(r.err.find("cannot write '" + run + "/metrics.jsonl': No space left on device") !=
          std::string::npos);
    const auto text = slurp(run + "/metrics.jsonl");
    REQUIRE(!text.empty());
    CHECK(text.back() == '\n');
    std::istringstream lines(text);
    std::string line;
    int64_t n = 0, last = 0;
    while (std::getline(lines, line)) {
      auto j = nlohmann::json::parse(line);  // throws on a cut line
      last = j["step"], ++n;
    }
    CHECK(n == last);  // every step up to the failure, none missing
    CHECK(last < 1000);
    ::umount2(disk.c_str(), MNT_DETACH);
  }

  TEST_CASE("a rollback starts a new branch: nothing of either branch lost, auto follows latest") {
    auto dir = temp_dir("rollback");
    Job j = small_job();
    j.schedule = "{decay: constant}";  // the legs below end at other steps
    j.checkpoint = "{every_steps: 2, keep_last: 3}";
    j.log_every = 1, j.eval_every = 2;
    auto job = j.write(dir);
    const std::string run = dir + "/run", ck = run + "/checkpoints/";
    const std::string lr = " --set optimizer.lr=0.3";  // the second branch's
    auto to = [](int n) { return " --set train.max_steps=" + std::to_string(n); };
    // References that never roll back: the first learning rate to 12; to 6, then the second.
    run_ok("run " + job + " --run-dir " + dir + "/a" + to(12));
    run_ok("run " + job + " --run-dir " + dir + "/ab" + to(6));
    run_ok("run " + job + " --run-dir " + dir + "/ab --resume auto" + to(12) + lr);
    const auto a = train_losses(dir + "/a"), ab = train_losses(dir + "/ab");
    auto same_losses = [](const std::map<int64_t, double>& got, const std::map<int64_t, double>& want,
                          int64_t from, int64_t through) {
      for (int64_t s = from; s <= through; ++s) {
        INFO("step " << s);
        REQUIRE(got.count(s));
        CHECK(got.at(s) == want.at(s));  // bit-identical: the branch trains from its own weights
      }
    };
    auto line = [&] {
      std::vector<std::string> names;
      for (const auto& e : fs::directory_iterator(ck))
        if (e.is_directory() && e.path().filename().string().rfind("step-", 0) == 0)
          names.push_back(e.path().filename().string());
      std::sort(names.begin(), names.end());
      return names;
    };

    run_ok("run " + job + " --run-dir " + run + to(10));
    const auto old8 = slurp(ck + "step-00000008/model.safetensors");
    // Back to step 6 with another learning rate: it writes steps 8 and 9, which keep_last
    // counts among themselves, and the first branch's 8 and 10 are kept aside.
    auto r = dtrain("run " + job + " --run-dir " + run + " --resume " + ck + "step-00000006" + to(9) +
                    lr + kQuiet);
    INFO(r.err);
    REQUIRE(r.code == 0);
    CHECK(r.err.find("new branch after step 6 of " + ck + "step-00000006; the checkpoints of "
                     "steps 8, 10 (and their metrics lines) are kept aside in "
                     "checkpoints/abandoned/branch-1") != std::string::npos);
    CHECK(slurp(ck + "latest") == "step-00000009\n");
    const auto kept = line();
    CHECK(kept.back() == "step-00000009");
    CHECK(std::count(kept.begin(), kept.end(), "step-00000008") == 1);
    CHECK(slurp(ck + "step-00000008/model.safetensors") != old8);
    const std::string aside = ck + "abandoned/branch-1/";
    CHECK(slurp(aside + "step-00000008/model.safetensors") == old8);
    CHECK(fs::exists(aside + "step-00000010/manifest.json"));
    CHECK(dtrain("inspect " + run).out.find("step 9") != std::string::npos);
    // metrics.jsonl reads as one timeline with its branch point; the first branch's later
    // lines are with its checkpoints.
    auto lines = metrics(run);
    auto branches = of_kind(lines, "branch");
    REQUIRE(branches.size() == 1);
    CHECK(branches[0]["step"] == 6);
    CHECK(branches[0]["set_aside"] == nlohmann::json{8, 10});
    CHECK(branches[0]["kept_in"] == "checkpoints/abandoned/branch-1");
    CHECK(train_losses(run).size() == 9);
    CHECK(of_kind(lines, "train").size() == 9);
    auto old_lines = metrics(aside);
    CHECK(of_kind(old_lines, "train").size() == 4);  // 7 to 10
    CHECK(of_kind(old_lines, "summary").size() == 1);

    // --resume auto follows latest (9), not the abandoned step 10.
    r = dtrain("run " + job + " --run-dir " + run + " --resume auto" + to(12) + lr + kQuiet);
    INFO(r.err);
    REQUIRE(r.code == 0);
    CHECK(r.err.find("resumed at step 9") != std::string::npos);
    CHECK(r.err.find("new branch") == std::string::npos);
    auto losses = train_losses(run);
    CHECK(losses.size() == 12);
    same_losses(losses, a, 1, 6);
    same_losses(losses, ab, 7, 12);

    // The first branch again, from its step 10: the second branch goes aside whole.
    r = dtrain("run " + job + " --run-dir " + run + " --resume " + aside + "step-00000010" + to(12) +
               kQuiet);
    INFO(r.err);
    REQUIRE(r.code == 0);
    CHECK(r.err.find("kept aside in checkpoints/abandoned/branch-2") != std::string::npos);
    same_losses(train_losses(run), a, 11, 12);
    CHECK(line() == std::vector<std::string>{"step-00000012"});
    CHECK(slurp(ck + "latest") == "step-00000012\n");
    lines = metrics(run);
    REQUIRE(!lines.empty());
    CHECK(lines.front()["kind"] == "branch");
    CHECK(lines.front()["same_line"] == false);
    CHECK(of_kind(lines, "train").size() == 2);
    CHECK(fs::exists(ck + "abandoned/branch-2/step-00000012/manifest.json"));
  }

  TEST_CASE("resuming a finished run says there is nothing to train and changes nothing") {
    auto dir = temp_dir("finished");
    auto job = small_job().write(dir);
    auto run = dir + "/run";
    REQUIRE(dtrain("run " + job + " --run-dir " + run + kQuiet).code == 0);
    const auto before = snapshot(run);
    for (const char* steps : {"30", "20"}) {
      auto r = dtrain("run " + job + " --run-dir " + run + " --resume auto --set train.max_steps=" +
                      steps + kQuiet);
      INFO(r.err);
      CHECK(r.code == 0);
      CHECK(r.err.find("nothing to train: the checkpoint is at step 30 and the job ends at step " +
                       std::string(steps)) != std::string::npos);
      CHECK(snapshot(run) == before);
    }
    CHECK(metrics(run).back()["final_accuracy"].is_number());
  }

  TEST_CASE("files that cannot be written or read exit 3 with one line naming the path") {
    auto dir = temp_dir("exit3");
    auto job = small_job().write(dir);
    { std::ofstream(dir + "/a-file") << "x"; }
    check_one_line_error(dtrain("run " + job + " --run-dir " + dir + "/a-file/run" + kQuiet), 3,
                         "cannot use run directory '" + dir + "/a-file/run'");

    auto ro = dir + "/read-only";
    bool ro_ok = false;
    if (::geteuid() == 0) {
      ro_ok = mount_tmpfs(ro, "1m", /*read_only=*/true);
    } else {
      fs::create_directories(ro);
      fs::permissions(ro, fs::perms::owner_read | fs::perms::owner_exec);
      ro_ok = true;
    }
    if (ro_ok) {
      check_one_line_error(dtrain("run " + job + " --run-dir " + ro + kQuiet), 3,
                           "cannot use run directory '" + ro + "'");
      check_one_line_error(dtrain("run " + job + " --run-dir " + ro + "/sub" + kQuiet), 3,
                           "cannot use run directory '" + ro + "/sub'");
    }

    auto run = dir + "/run";
    REQUIRE(dtrain("run " + job + " --run-dir " + run + kQuiet).code == 0);
    check_one_line_error(dtrain("export " + run + " " + dir + "/missing/w.safetensors"), 3,
                         dir + "/missing/w.safetensors");
    check_one_line_error(dtrain("export " + run + " " + dir), 3, "'" + dir + "' is a folder");
    if (ro_ok) check_one_line_error(dtrain("export " + run + " " + ro + "/w.safetensors"), 3,
                                    ro + "/w.safetensors");
    if (::geteuid() == 0) ::umount2(ro.c_str(), MNT_DETACH);

    // trainer.json that parses but cannot be a trainer state.
    const auto ck = run + "/checkpoints/step-00000030";
    auto trainer = nlohmann::json::parse(slurp(ck + "/trainer.json"));
    trainer["step"] = -5;
    forge(ck, "trainer.json", trainer.dump());
    check_one_line_error(
        dtrain("run " + job + " --run-dir " + run + " --resume auto --set train.max_steps=40" + kQuiet),
        3, ck + "/trainer.json: step -5");
  }

  TEST_CASE("export never writes into a checkpoint; a Hugging Face folder it cannot write is exit 3, nothing left") {
    auto dir = temp_dir("export-target");
    Job j = small_job();
    j.data = "{dataset: synthetic_tokens, samples: 64, test_samples: 8, seq_len: 16, batch_size: 8, workers: 1}";
    j.model = "{arch: gpt, layers: 1, heads: 2, dim: 32, vocab: 256, seq_len: 16}";
    j.max_steps = 2, j.eval_every = 0;
    auto job = j.write(dir);
    const auto run = dir + "/run", ck = run + "/checkpoints/step-00000002";
    REQUIRE(dtrain("run " + job + " --run-dir " + run + kQuiet).code == 0);
    // Into the checkpoint it reads, or any other: its manifest's checksums would break.
    check_one_line_error(dtrain("export " + ck + " " + ck + "/model.dp0.safetensors"), 2,
                         "is inside checkpoint '" + ck + "'");
    check_one_line_error(dtrain("export " + run + " " + ck + "/hf --format hf"), 2,
                         "is inside checkpoint '" + ck + "'");
    CHECK(!fs::exists(ck + "/model.dp0.safetensors"));
    CHECK(!fs::exists(ck + "/hf"));
    CHECK(dtrain("inspect " + ck).code == 0);
    // A Hugging Face folder that lost its config.json is named as what it lacks.
    REQUIRE(dtrain("export " + ck + " " + dir + "/hf --format hf").code == 0);
    fs::remove(dir + "/hf/config.json");
    check_one_line_error(dtrain("inspect " + dir + "/hf"), 3, "nor config.json (a Hugging Face");
    check_one_line_error(dtrain("run " + job + " --run-dir " + dir + "/from-hf --set model.init_from=" +
                                dir + "/hf" + kQuiet), 3, "nor config.json (a Hugging Face");
    if (::geteuid() != 0) return;  // the targets below are file systems of their own
    const auto ro = dir + "/read-only", full = dir + "/full";
    REQUIRE(mount_tmpfs(ro, "1m", /*read_only=*/true));
    REQUIRE(mount_tmpfs(full, "16k"));  // less than the token embedding alone (32 KiB)
    check_one_line_error(dtrain("export " + ck + " " + ro + "/hf --format hf"), 3, ro + "/hf");
    check_one_line_error(dtrain("export " + ck + " " + full + "/hf --format hf"), 3, full + "/hf");
    CHECK(!fs::exists(full + "/hf"));  // made by export, removed with its temporary files
    ::umount2(ro.c_str(), MNT_DETACH);
    ::umount2(full.c_str(), MNT_DETACH);
  }

  TEST_CASE("export verifies the weights it writes; a forged header is refused") {
    auto dir = temp_dir("export");
    auto job = small_job().write(dir);
    auto run = dir + "/run";
    REQUIRE(dtrain("run " + job + " --run-dir " + run + kQuiet).code == 0);
    const auto ck = run + "/checkpoints/step-00000030";
    auto good = dtrain("export " + run + "/checkpoints/latest " + dir + "/good.safetensors");
    INFO(good.err);
    CHECK(good.code == 0);
    CHECK(slurp(dir + "/good.safetensors") == slurp(ck + "/model.safetensors"));

    // A header whose first tensor claims one more row than its bytes hold, the manifest
    // rewritten to match: the checkpoint verifies, the weights do not.
    auto bytes = slurp(ck + "/model.safetensors");
    const auto at = bytes.find("[32,64]");
    REQUIRE(at != std::string::npos);
    bytes.replace(at, 7, "[33,64]");
    forge(ck, "model.safetensors", bytes);
    check_one_line_error(dtrain("export " + ck + " " + dir + "/bad.safetensors"), 3,
                         "has inconsistent offsets");
    CHECK(!fs::exists(dir + "/bad.safetensors"));
    CHECK(!fs::exists(dir + "/bad.safetensors.tmp"));
    check_one_line_error(dtrain("inspect " + ck), 3, "has inconsistent offsets");
  }

  TEST_CASE("inspect, export and --resume follow a run directory's latest checkpoint") {
    auto dir = temp_dir("latest");
    auto job = small_job().write(dir);
    auto run = dir + "/run";
    REQUIRE(dtrain("run " + job + " --run-dir " + run + " --set train.max_steps=20" + kQuiet).code == 0);
    for (const auto& where : {run, run + "/checkpoints", run + "/checkpoints/latest"}) {
      auto r = dtrain("inspect " + where);
      INFO(where << ": " << r.err);
      CHECK(r.code == 0);
      CHECK(r.out.rfind("checkpoint " + run + "/checkpoints/step-00000020\n", 0) == 0);
    }
    auto r = dtrain("inspect " + run + "/metrics.jsonl");
    check_one_line_error(r, 3, "'" + run + "/metrics.jsonl' is a file; a checkpoint is a folder");
    check_one_line_error(dtrain("inspect " + dir + "/nothing-here"), 3, "does not exist");

    r = dtrain("run " + job + " --run-dir " + run + " --resume " + run + "/checkpoints/latest" + kQuiet);
    INFO(r.err);
    CHECK(r.code == 0);
    CHECK(r.err.find("resumed at step 20 from " + run + "/checkpoints/step-00000020") !=
          std::string::npos);
  }
}

}  // namespace e2e::robust_tests
