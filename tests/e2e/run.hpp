// Runs the dtrain command as a user would and reads what it wrote.
#pragma once
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <functional>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include <ATen/CPUGeneratorImpl.h>
#include <doctest/doctest.h>
#include <fcntl.h>
#include <nlohmann/json.hpp>
#include <poll.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>
#include <wordexp.h>

#include "cli.hpp"  // dtrain_main: the binary's whole command
#include "launch/device.hpp"
#include "launch/supervisor.hpp"
#include "../unit/temp_dir.hpp"

namespace e2e {

struct Result {
  int code = -1;
  std::string out, err;
};

inline std::string slurp(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// This process's folder under the system temp dir, removed as the process ends (see
// TempDir): a run of the suite writes gigabytes (ZeRO's peak test alone 1.3 GB).
inline const std::filesystem::path& process_dir() {
  static const dtrain::test::TempDir dir("dtrain-e2e");
  return dir.path();
}

inline std::string temp_dir(const std::string& name) {
  auto dir = process_dir() / name;
  dtrain::remove_tree(dir.string());  // a test's folder from before, in this process
  std::filesystem::create_directories(dir);
  return dir.string();
}

// `dtrain ARGS` as the binary would run it, in a forked copy of this process: the test
// binary links the same command (dtrain_main), and the fork spares each command the second
// of CPU that loading LibTorch and its libraries costs an exec (about 6 of the suite's 27
// CPU-minutes). The child is made as a fresh process would be: its own process group (as
// `timeout` gives one), default handlers where this process installed its own (doctest's)
// and only the descriptors an exec keeps (as_if_exec, as for the supervisor's workers), a
// fresh seed for LibTorch's default generator, the
// name `dtrain`. Where that copy could differ from an exec, the shell runs the binary
// instead (dtrain, below): a prefix (an environment or a signal of its own; kExec for a
// test that reads a process's own memory, which a fork shares with the test), shell syntax,
// more than one OpenMP thread or any other thread here (a fork copies only the caller, and
// a forked OpenMP team does not come back), and a build with CUDA (its workers are exec'd,
// too). `verify` forks its runs alike, under the same two conditions (one thread, no
// CUDA), so it never execs /proc/self/exe, which here is the test binary.
inline std::optional<std::vector<std::string>> forkable(const std::string& args, const std::string& prefix) {
  const char* threads = std::getenv("OMP_NUM_THREADS");
  if (!prefix.empty() || !threads || std::string(threads) != "1" || dtrain::cuda_linked() ||
      args.find('#') != std::string::npos)  // a comment to sh, a character to wordexp
    return std::nullopt;
  if (dtrain::threads_here() != 1) return std::nullopt;
  wordexp_t w{};
  const int failed = ::wordexp(args.c_str(), &w, WRDE_NOCMD);  // |, >, $(...): the shell's
  if (failed == WRDE_NOSPACE) ::wordfree(&w);
  if (failed) return std::nullopt;
  std::vector<std::string> words(w.we_wordv, w.we_wordv + w.we_wordc);
  ::wordfree(&w);
  if (words.empty()) return std::nullopt;
  return words;
}

inline int run_in_fork(std::vector<std::string> words, const std::string& out, const std::string& err,
                       std::chrono::seconds limit) {
  std::cout.flush(), std::cerr.flush(), std::fflush(nullptr);  // or the child repeats it
  const pid_t pid = ::fork();
  if (pid < 0) return -1;
  if (pid == 0) {
    ::setpgid(0, 0);
    ::prctl(PR_SET_NAME, "dtrain");
    const int fo = ::open(out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    const int fe = ::open(err.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fo < 0 || fe < 0) ::_exit(127);
    ::dup2(fo, STDOUT_FILENO), ::dup2(fe, STDERR_FILENO);
    ::close(fo), ::close(fe);
    dtrain::as_if_exec();
    at::Generator rng = at::detail::getDefaultCPUGenerator();  // a handle on the process's own
    rng.set_current_seed(c10::detail::getNonDeterministicRandom());  // as LibTorch seeds it
    words.insert(words.begin(), DTRAIN_BIN);
    std::vector<char*> argv;
    for (auto& w : words) argv.push_back(w.data());
    argv.push_back(nullptr);
    // What escapes dtrain_main ends the process as it would end the binary (terminate),
    // not in doctest's hands running the rest of the suite.
    std::exit([&]() noexcept { return dtrain_main(int(words.size()), argv.data()); }());
  }
  ::setpgid(pid, pid);  // the child's own, before any signal to its group (either may run first)
  // `timeout`'s bound: SIGTERM to the group, then SIGKILL; exit 124.
  const int pidfd = int(::syscall(SYS_pidfd_open, pid, 0));
  const auto deadline = std::chrono::steady_clock::now() + limit;
  int status = 0;
  bool timed_out = false;
  for (int signal : {0, SIGTERM, SIGKILL}) {
    if (signal) ::kill(-pid, signal), timed_out = true;
    const auto until = signal == 0 ? deadline : std::chrono::steady_clock::now() + std::chrono::seconds(10);
    for (;;) {
      const pid_t got = ::waitpid(pid, &status, WNOHANG);
      if (got < 0 && errno != EINTR) {
        if (pidfd >= 0) ::close(pidfd);
        return -1;
      }
      if (got == pid) {
        if (pidfd >= 0) ::close(pidfd);
        if (timed_out) return 124;
        return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      }
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - std::chrono::steady_clock::now());
      if (left.count() <= 0) break;
      if (pidfd >= 0) {
        pollfd p{pidfd, POLLIN, 0};
        ::poll(&p, 1, int(std::min<int64_t>(left.count(), 1000)));
      } else {
        ::usleep(10000);
      }
    }
  }
  ::waitpid(pid, &status, 0);
  if (pidfd >= 0) ::close(pidfd);
  return 124;
}

// A prefix that runs the binary itself, for a test that reads a process's own memory
// (peak_rss_mb, plan's runtime baseline): a forked command shares the test process's.
inline const char* kExec = "timeout 500";

// Runs `dtrain ARGS` bounded at 500 s so that no test can hang, in a fork of this process
// where it can (above), else by the shell under `timeout`; `prefix` may add e.g.
// "timeout --preserve-status -s TERM 2" (and so runs the binary itself).
inline Result dtrain(const std::string& args, const std::string& prefix = "") {
  static int n = 0;
  auto base = process_dir() / ("io-" + std::to_string(n++));
  Result r;
  if (auto words = forkable(args, prefix)) {
    r.code = run_in_fork(*words, base.string() + ".out", base.string() + ".err", std::chrono::seconds(500));
  } else {
    std::string cmd = (prefix.empty() ? std::string("timeout 500") : prefix) + " " + DTRAIN_BIN +
                      " " + args + " > " + base.string() + ".out 2> " + base.string() + ".err";
    int status = std::system(cmd.c_str());
    r.code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  }
  r.out = slurp(base.string() + ".out");
  r.err = slurp(base.string() + ".err");
  std::filesystem::remove(base.string() + ".out");
  std::filesystem::remove(base.string() + ".err");
  return r;
}

// No progress line: the tests read metrics.jsonl and stderr's messages.
inline const char* kQuiet = " --set logging.progress=off";

// `dtrain ARGS` without the progress line, which must succeed (else its stderr is the
// failure's message).
inline void run_ok(const std::string& args, const std::string& prefix = "") {
  auto r = dtrain(args + kQuiet, prefix);
  INFO(args << ": " << r.err);
  REQUIRE(r.code == 0);
}

// A run that several suites compare against (the same job file and settings, run by the
// same dtrain binary: the same losses, bit for bit), made once and kept in the build tree
// for the suites that come later, in other ctest processes too. A changed job file,
// settings or binary makes it again. A suite that finds another making it (side by side
// under ctest -j) makes its own copy rather than wait with a core idle.
inline std::string shared_run(const std::string& job, const std::string& sets) {
  namespace fs = std::filesystem;
  const fs::path root = DTRAIN_SHARED_RUNS;
  fs::create_directories(root);
  char key[32];
  std::snprintf(key, sizeof key, "%016zx", std::hash<std::string>{}(slurp(job) + "\n" + sets));
  const fs::path bin = DTRAIN_BIN;
  const auto made_by = std::to_string(fs::file_size(bin)) + " " +
                       std::to_string(fs::last_write_time(bin).time_since_epoch().count()) + " " +
                       job + sets;
  auto dir = (root / key).string();
  struct Lock {  // released at close, or when the process exits
    int fd;
    ~Lock() { if (fd >= 0) ::close(fd); }
  } lock{::open((dir + ".lock").c_str(), O_CREAT | O_RDWR, 0644)};
  REQUIRE(lock.fd >= 0);
  const bool mine = ::flock(lock.fd, LOCK_EX | LOCK_NB) == 0;
  if (!mine) dir = temp_dir("shared-" + std::string(key));
  if (!mine || slurp(dir + "/made-by") != made_by) {
    std::system(("rm -rf '" + dir + "'").c_str());
    run_ok("run " + job + " --run-dir " + dir + sets);
    if (mine) std::ofstream(dir + "/made-by") << made_by;
  }
  return dir;
}

inline std::vector<nlohmann::json> metrics(const std::string& run_dir) {
  std::vector<nlohmann::json> lines;
  std::ifstream in(run_dir + "/metrics.jsonl");
  std::string line;
  while (std::getline(in, line)) lines.push_back(nlohmann::json::parse(line));
  return lines;
}

inline std::vector<nlohmann::json> of_kind(const std::vector<nlohmann::json>& lines,
                                           const std::string& kind) {
  std::vector<nlohmann::json> out;
  for (const auto& l : lines)
    if (l["kind"] == kind) out.push_back(l);
  return out;
}

// Each logged step's training loss, by step.
inline std::map<int64_t, double> train_losses(const std::string& run_dir) {
  std::map<int64_t, double> out;
  for (const auto& l : of_kind(metrics(run_dir), "train")) out[l["step"]] = l["loss"];
  return out;
}

inline const char* kFashion = "/usr/share/datasets/fashion-mnist";

// A job spec for the tests: each section a YAML flow mapping, with defaults that keep a
// run small (synthetic images, an MLP, 12 steps of 2 micro-batches, one thread per rank).
// An empty section or an unset train key is not written, so the job keeps dtrain's default.
struct Job {
  std::string name = "e2e";
  int64_t seed = 11;
  std::string data = "{dataset: synthetic, samples: 512, test_samples: 64, input_shape: [1, 8, 8],"
                     " classes: 4, batch_size: 16, workers: 1}";
  std::string model = "{arch: mlp, hidden: [32, 16]}";
  std::string optimizer = "{name: sgd, lr: 0.05, momentum: 0.9}";
  std::string schedule = "{warmup_steps: 2, decay: cosine}";
  std::optional<int64_t> max_steps = 12, log_every = 1, threads = 1, eval_every = 0;
  std::string train = "grad_accum: 2";  // train's keys besides the four above
  std::string checkpoint;
  std::string parallel;
  std::string dist = "{timeout_s: 60}";
  std::string extra;                    // more top-level YAML
  // Writes it as DIR/FILE; returns the path.
  std::string write(const std::string& dir, const std::string& file = "job.yaml") const {
    std::string keys;
    auto key = [&](const std::string& text) {
      if (!text.empty()) keys += (keys.empty() ? "" : ", ") + text;
    };
    auto number = [&](const char* k, std::optional<int64_t> v) {
      if (v) key(k + (": " + std::to_string(*v)));
    };
    number("max_steps", max_steps);
    number("log_every", log_every);
    number("threads", threads);
    number("eval_every", eval_every);
    key(train);
    const auto path = dir + "/" + file;
    std::ofstream out(path);
    out << "name: " << name << "\nseed: " << seed << "\n";
    auto section = [&](const char* k, const std::string& value) {
      if (!value.empty()) out << k << ": " << value << "\n";
    };
    section("data", data);
    section("model", model);
    section("optimizer", optimizer);
    section("schedule", schedule);
    section("train", keys.empty() ? "" : "{" + keys + "}");
    section("checkpoint", checkpoint);
    section("parallel", parallel);
    section("dist", dist);
    out << extra;
    return path;
  }
};
// What most multi-rank checks train: synthetic 8x8 images (2048 to train, 256 to test,
// 4 classes) in batches of 32, the MLP [64, 32], no train keys beyond the four above,
// every wait bounded at 30 s. Each test sets what it checks on top.
inline Job ranks_job(const std::string& name, int64_t seed) {
  Job j;
  j.name = name, j.seed = seed;
  j.data = "{dataset: synthetic, samples: 2048, test_samples: 256, input_shape: [1, 8, 8],"
           " classes: 4, batch_size: 32, workers: 1}";
  j.model = "{arch: mlp, hidden: [64, 32]}";
  j.train = "";
  j.dist = "{timeout_s: 30}";
  return j;
}

// A 2-layer GPT on the fortunes corpus (setup installs it) in batches of 8 windows of 32
// tokens, with dropout: small enough for 4 ranks on 2 cores.
inline Job gpt_text_job(const std::string& name, int64_t seed) {
  Job j = ranks_job(name, seed);
  j.data = "{dataset: text, path: /usr/share/games/fortunes, batch_size: 8, seq_len: 32,"
           " workers: 1}";
  j.model = "{arch: gpt, layers: 2, heads: 4, dim: 32, seq_len: 32, dropout: 0.1}";
  return j;
}

inline std::string config(const std::string& name) { return std::string(DTRAIN_CONFIGS) + "/" + name; }

// A shipped job's synchronous run at 2 ranks for STEPS steps (logged every 100): what the
// accuracy tests of local SGD, async_ps and compression compare against, run once for all.
inline std::string sync_reference(const std::string& config_name, const std::string& steps) {
  return shared_run(config(config_name),
                    " --nproc 2 --set train.max_steps=" + steps + " --set train.log_every=100");
}

}  // namespace e2e

#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <thread>

namespace e2e {

// A dtrain started in the background, for tests that act on it while it runs.
struct Background {
  pid_t pid = -1;
  std::string out, err;  // file paths
};

inline Background start_dtrain(const std::string& args) {
  static int n = 0;
  Background b;
  auto base = process_dir() / ("bg-" + std::to_string(n++));
  b.out = base.string() + ".out";
  b.err = base.string() + ".err";
  b.pid = ::fork();
  if (b.pid == 0) {
    std::string cmd = std::string("exec ") + DTRAIN_BIN + " " + args + " > " + b.out + " 2> " + b.err;
    ::execl("/bin/sh", "sh", "-c", cmd.c_str(), static_cast<char*>(nullptr));
    ::_exit(127);
  }
  return b;
}

// Waits up to `limit` for the process; returns its exit code (128+signal) or -1 on timeout.
inline int wait_for(pid_t pid, std::chrono::seconds limit) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  while (std::chrono::steady_clock::now() < deadline) {
    int st = 0;
    if (::waitpid(pid, &st, WNOHANG) == pid)
      return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return -1;
}

// Waits until process `pid`, once it runs dtrain, has a handler for `sig` (its /proc status
// lists the signal as caught), up to `limit`; false if it did not in time or has exited. A
// test that signals dtrain "during setup" must not signal it while it is still loading its
// libraries, where the default action ends it without a word: on a loaded machine that takes
// seconds. (Before its exec the child is a copy of this test, doctest's handlers and all.)
inline bool wait_until_catching(pid_t pid, int sig, std::chrono::seconds limit) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  const auto proc = "/proc/" + std::to_string(pid);
  while (std::chrono::steady_clock::now() < deadline) {
    const auto status = slurp(proc + "/status");
    const auto at = status.find("SigCgt:");
    if (at == std::string::npos) return false;
    const auto mask = std::stoull(status.substr(at + 7), nullptr, 16);
    if (slurp(proc + "/comm") == "dtrain\n" && (mask & (1ULL << (sig - 1)))) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return false;
}

// The child process of `parent` that is worker `rank`, or -1: one the supervisor forked is
// named "dtrain rank N"; one it exec'd (where LibTorch has CUDA) has RANK=N in its environment.
inline pid_t worker_pid(pid_t parent, int rank) {
  for (const auto& e : std::filesystem::directory_iterator("/proc")) {
    const auto name = e.path().filename().string();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    auto stat = slurp(e.path().string() + "/stat");
    auto close = stat.rfind(')');
    if (close == std::string::npos) continue;
    std::istringstream rest(stat.substr(close + 2));
    char state;
    pid_t ppid;
    rest >> state >> ppid;
    if (ppid != parent) continue;
    if (slurp(e.path().string() + "/comm") == "dtrain rank " + std::to_string(rank) + "\n")
      return std::stoi(name);
    // environ is NUL-separated: look for the whole entry RANK=<rank>.
    const std::string env = std::string(1, '\0') + slurp(e.path().string() + "/environ");
    const std::string entry = std::string(1, '\0') + "RANK=" + std::to_string(rank) + '\0';
    if (env.find(entry) != std::string::npos)
      return std::stoi(name);
  }
  return -1;
}

// Waits until `run_dir`'s metrics show at least `step` (the job is in its loop).
inline bool wait_for_step(const std::string& run_dir, int64_t step, std::chrono::seconds limit) {
  const auto deadline = std::chrono::steady_clock::now() + limit;
  while (std::chrono::steady_clock::now() < deadline) {
    std::ifstream in(run_dir + "/metrics.jsonl");
    std::string line, last;
    while (std::getline(in, line)) last = line;
    if (!last.empty()) {
      try {
        if (nlohmann::json::parse(last).value("step", int64_t(0)) >= step) return true;
      } catch (...) {
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return false;
}

// Starts `dtrain ARGS` (a job logging to `run_dir` under --nproc), kills worker `rank` with
// SIGKILL once the job has logged step `step`, and waits up to `limit` for it to end: its
// exit code (-1 if it did not end) and what it printed on stderr.
inline Result kill_worker_at(const std::string& args, const std::string& run_dir, int64_t step,
                             int rank, std::chrono::seconds limit) {
  auto bg = start_dtrain(args);
  Result r;
  r.code = -1;
  if (wait_for_step(run_dir, step, std::chrono::seconds(60))) {
    const pid_t victim = worker_pid(bg.pid, rank);
    if (victim > 0) ::kill(victim, SIGKILL);
    r.code = wait_for(bg.pid, limit);
  }
  if (r.code == -1) ::kill(bg.pid, SIGKILL), wait_for(bg.pid, std::chrono::seconds(10));
  r.err = slurp(bg.err);
  return r;
}

// A job trained whole (DIR/whole) and in two legs (DIR/legs): the first stops after step
// `first`, the second resumes with --resume auto and runs to the job's end (`args` go to
// every run: --nproc, --set); `between` looks at the first leg's checkpoint before the
// second. Each run's train losses by step, and what the resumed leg said.
struct WholeAndLegs {
  std::map<int64_t, double> whole, legs;
  std::string resumed_err;
};
inline WholeAndLegs train_whole_and_in_legs(const std::string& dir, const std::string& job,
                                            int64_t first, const std::string& args = "",
                                            const std::function<void()>& between = {}) {
  run_ok("run " + job + " --run-dir " + dir + "/whole" + args);
  run_ok("run " + job + " --run-dir " + dir + "/legs --set train.max_steps=" + std::to_string(first) + args);
  if (between) between();
  const auto second = dtrain("run " + job + " --run-dir " + dir + "/legs --resume auto" + args + kQuiet);
  INFO("the resumed leg: " << second.err);
  REQUIRE(second.code == 0);
  return {train_losses(dir + "/whole"), train_losses(dir + "/legs"), second.err};
}
// The legs trained `steps` steps, each with the whole run's loss bit for bit.
inline void check_same_trajectory(const WholeAndLegs& runs, size_t steps) {
  REQUIRE(runs.whole.size() == steps);
  REQUIRE(runs.legs.size() == steps);
  for (const auto& [step, loss] : runs.whole) {
    INFO("step " << step);
    CHECK(runs.legs.at(step) == loss);
  }
}

// Every step of `ref` has a loss within `rtol` relative in `got`.
inline void check_losses_close(const std::map<int64_t, double>& ref,
                               const std::map<int64_t, double>& got, double rtol,
                               const std::string& what) {
  REQUIRE(!ref.empty());
  for (const auto& [step, loss] : ref) {
    INFO(what << " step " << step << ": " << (got.count(step) ? got.at(step) : NAN) << " vs " << loss);
    REQUIRE(got.count(step));
    CHECK(std::abs(got.at(step) - loss) <= rtol * std::abs(loss));
  }
}

}  // namespace e2e
