#include "verify/verify.hpp"

#include <fcntl.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <set>
#include <sstream>

#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <yaml-cpp/yaml.h>

#include "config/schema.hpp"
#include "job/validate.hpp"
#include "launch/device.hpp"
#include "launch/supervisor.hpp"
#include "launch/world.hpp"
#include "run/mode.hpp"
#include "util/error.hpp"
#include "util/files.hpp"
#include "util/process.hpp"

namespace dtrain {
namespace {

// One layout of `--layouts`: "d2", "t2", "p2", "d2xt2xp2", with "z1".."z3" for ZeRO, e.g.
// "d2xz1"; "1" is one process.
struct Layout {
  int64_t data = 1, tensor = 1, pipeline = 1, zero = 0;
  std::string text;

  int64_t processes() const { return data * tensor * pipeline; }
  // In messages: "layout d2xt2", or "one process".
  std::string name() const { return text == "1" ? "one process" : "layout " + text; }
};

// Throws ConfigError naming the layout that does not parse.
Layout parse_layout(const std::string& text) {
  Layout l;
  l.text = text;
  auto bad = [&](const std::string& why) {
    return ConfigError(fmt::format("verify --layouts: '{}' {} (write d2, t2, p2 or z1..z3 "
                                   "joined by x, e.g. d2xt2 or d2xz1; 1 is one process)",
                                   text, why));
  };
  if (text == "1") return l;
  if (text.empty()) throw bad("is empty");
  if (text.back() == 'x') throw bad("ends in x");
  std::map<char, int64_t*> dims{{'d', &l.data}, {'t', &l.tensor}, {'p', &l.pipeline}, {'z', &l.zero}};
  std::map<char, bool> seen;
  std::stringstream in(text);
  for (std::string part; std::getline(in, part, 'x');) {
    if (part.empty()) throw bad("has an empty part");
    if (part.size() < 2 || !dims.count(part[0]) ||
        part.find_first_not_of("0123456789", 1) != std::string::npos || part.size() > 5 ||
        (part[1] == '0' && part.size() > 2))
      throw bad(fmt::format("has '{}'", part));
    if (seen[part[0]]) throw bad(fmt::format("names '{}' twice", part.substr(0, 1)));
    seen[part[0]] = true;
    *dims[part[0]] = std::stoll(part.substr(1));
  }
  if (l.data < 1 || l.tensor < 1 || l.pipeline < 1) throw bad("has a size below 1");
  if (l.processes() > 1024) throw bad("needs more than 1024 processes");
  if (l.zero > 3) throw bad("asks for a ZeRO stage above 3");
  if (l.zero > 0 && l.data < 2) throw bad("shards with ZeRO over one data rank (add d2 or more)");
  return l;
}

std::vector<Layout> parse_layouts(const std::string& list) {
  std::vector<Layout> out;
  std::stringstream in(list);
  for (std::string item; std::getline(in, item, ',');) {
    item.erase(0, item.find_first_not_of(" \t"));
    item.erase(item.find_last_not_of(" \t") + 1);
    out.push_back(parse_layout(item));
  }
  if (!list.empty() && list.back() == ',') out.push_back(parse_layout(""));
  return out;
}

// The --set assignments that make `job` this layout: its sizes and ZeRO stage replace the
// job's; a stage list written for another pipeline goes back to the balanced split.
std::vector<std::string> layout_sets(const Layout& l, const JobConfig& job) {
  std::vector<std::string> s{fmt::format("parallel.data={}", l.data),
                             fmt::format("parallel.tensor={}", l.tensor),
                             fmt::format("parallel.pipeline={}", l.pipeline),
                             fmt::format("parallel.zero={}", l.zero)};
  if (l.pipeline != job.parallel.pipeline) s.push_back("parallel.stages=[]");
  if (l.pipeline == 1) s.push_back("parallel.virtual_stages=1");
  return s;
}

// What verify sets on every run, the reference's too: N steps, each logged, one evaluation
// (a capped one) and one checkpoint at the end, nothing else written.
std::vector<std::string> run_sets(const VerifyOptions& o, int64_t steps, int64_t eval_samples) {
  std::vector<std::string> s = o.sets;
  s.insert(s.end(), {fmt::format("train.max_steps={}", steps), "train.log_every=1",
                     fmt::format("train.eval_every={}", steps),
                     fmt::format("train.eval_samples={}", eval_samples),
                     fmt::format("checkpoint.every_steps={}", steps), "logging.progress=off",
                     "logging.tensorboard=false",
                     "parallel.auto=false"});  // the layouts are verify's to set
  return s;
}

// The job as the reference runs it, without what differs between runs that train the same
// model (the run folder, the layout's own keys): what --save records and --against compares.
std::map<std::string, std::string> job_keys(const std::string& yaml_text) {
  // What tells runs apart without changing what they compute: names and places, threads,
  // the layout (verify's own), checkpoints, logs and the rendezvous.
  static const std::set<std::string> kApart{
      "name", "run_dir", "data.path", "data.workers", "data.prefetch", "train.threads",
      "train.pin_threads", "train.memory_check", "parallel.data", "parallel.tensor",
      "parallel.pipeline", "parallel.zero", "parallel.stages", "parallel.auto"};
  auto apart = [](const std::string& k) {
    return kApart.count(k) || k.rfind("checkpoint.", 0) == 0 || k.rfind("logging.", 0) == 0 ||
           k.rfind("dist.", 0) == 0;
  };
  std::map<std::string, std::string> keys;
  std::function<void(const YAML::Node&, const std::string&)> walk = [&](const YAML::Node& n,
                                                                        const std::string& at) {
    if (n.IsMap()) {
      for (const auto& kv : n)
        walk(kv.second, at.empty() ? kv.first.as<std::string>() : at + "." + kv.first.as<std::string>());
    } else if (!apart(at)) {
      YAML::Emitter e;
      e << YAML::Flow << n;
      keys[at] = e.c_str();
    }
  };
  walk(YAML::Load(yaml_text), "");
  return keys;
}

std::string job_text(const VerifyOptions& o, int64_t steps, int64_t eval_samples) {
  JobConfig cfg = load_job(o.job_path, run_sets(o, steps, eval_samples));
  resolve(cfg);
  std::string text;
  for (const auto& [k, v] : job_keys(to_yaml(cfg))) text += k + ": " + v + "\n";
  return text;
}

// The first key where two jobs differ, in words, `seed` aside unless `with_seed`; "" when
// they are the same.
std::string first_difference(const std::string& here, const std::string& there, bool with_seed = true) {
  auto parse = [](const std::string& text) {
    std::map<std::string, std::string> m;
    std::stringstream in(text);
    for (std::string line; std::getline(in, line);)
      if (auto c = line.find(": "); c != std::string::npos) m[line.substr(0, c)] = line.substr(c + 2);
    return m;
  };
  auto a = parse(here), b = parse(there);
  if (!with_seed) a.erase("seed"), b.erase("seed");
  // A key one side lacks (added or removed between the versions that wrote them) counts
  // only where it is not at its default.
  const auto defaults = job_keys(to_yaml(JobConfig{}));
  auto is_default = [&](const std::string& k, const std::string& v) {
    return defaults.count(k) && defaults.at(k) == v;
  };
  for (const auto& [k, v] : a)
    if (!b.count(k)) {
      if (!is_default(k, v)) return fmt::format("{} (here {}, not in the file)", k, v);
    } else if (b.at(k) != v) {
      return fmt::format("{} (here {}, there {})", k, v, b.at(k));
    }
  for (const auto& [k, v] : b)
    if (!a.count(k) && !is_default(k, v)) return fmt::format("{} (there {}, not here)", k, v);
  return "";
}

struct RunResult {
  int code = 0;
  std::string error;                  // the run's "dtrain: error:" line, if any
  std::map<int64_t, double> losses;   // step -> train loss
  std::optional<double> eval_loss;    // the evaluation at the last step
  double seconds = 0;
};

// A stop signal to verify goes on to the run in progress (which checkpoints and exits),
// and verify stops after it.
volatile std::sig_atomic_t g_stop_signal = 0;
extern "C" void on_stop_signal(int sig) { g_stop_signal = sig; }

// The child that runs `args`, its output into the files `out` and `err`: in this process's
// image where `here` (no exec: verify's own code, as the binary would run it), else the
// executable's.
pid_t start_run(const VerifyOptions& o, const Layout& l, std::vector<std::string>& args,
                const std::string& out, const std::string& err, bool here) {
  std::cout.flush(), std::cerr.flush(), std::fflush(nullptr);  // or the child repeats it
  pid_t pid = ::fork();
  fail_if<RunDirError>(pid < 0, "verify: cannot start a run for layout {}", l.text);
  if (pid != 0) return pid;
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);  // dies with verify, should verify be killed outright
  if (::getppid() == 1) ::_exit(kExitFailure);
  int fo = ::open(out.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  int fe = ::open(err.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fo >= 0) ::dup2(fo, STDOUT_FILENO);
  if (fe >= 0) ::dup2(fe, STDERR_FILENO);
  ::signal(SIGINT, SIG_DFL);
  ::signal(SIGTERM, SIG_DFL);
  clear_launcher_env();
  if (here) {
    as_if_exec();
    ::prctl(PR_SET_NAME, "dtrain");
    // Whatever escapes ends the child as it would the binary, never unwinding into verify.
    std::exit([&]() noexcept { return o.start_here(args); }());
  }
  exec_or_die(o.executable, args);
}

// The child's exit code (128 + the signal that ended it), a stop signal to verify passed
// on to it meanwhile.
int wait_run(pid_t pid) {
  int status = 0;
  bool forwarded = false;
  for (;;) {
    if (::waitpid(pid, &status, 0) == pid) break;
    if (errno != EINTR) return kExitFailure;
    if (g_stop_signal && !forwarded) ::kill(pid, g_stop_signal), forwarded = true;
  }
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

// What a run left: its error line (from `err`), its train losses by step and its last
// evaluation's loss (from its metrics file in `run_dir`).
void read_run(const std::string& err, const std::string& run_dir, RunResult& r) {
  std::ifstream errs(err);
  for (std::string line; std::getline(errs, line);)
    if (auto at = line.find("dtrain: error: "); at != std::string::npos && r.error.empty())
      r.error = line.substr(at + 15);
  std::ifstream metrics(run_dir + "/metrics.jsonl");
  for (std::string line; std::getline(metrics, line);) {
    const auto j = nlohmann::json::parse(line, nullptr, false);
    if (!j.is_object() || !j.contains("kind") || !j.contains("loss") || !j["loss"].is_number()) continue;
    if (j["kind"] == "train") r.losses[j["step"].get<int64_t>()] = j["loss"].get<double>();
    if (j["kind"] == "eval") r.eval_loss = j["loss"].get<double>();
  }
}

// `dtrain run JOB --set ... [--nproc N]` in `dir`, its output in files there.
RunResult run_layout(const VerifyOptions& o, const Layout& l, const std::vector<std::string>& sets,
                     const std::vector<std::string>& layout, const std::string& dir) {
  if (g_stop_signal) return RunResult{128 + g_stop_signal, "", {}, {}, 0};  // between runs
  std::filesystem::create_directories(dir);
  std::vector<std::string> args{o.executable, "run", o.job_path, "--run-dir", dir + "/run"};
  for (const auto& s : sets) args.insert(args.end(), {"--set", s});
  for (const auto& s : layout) args.insert(args.end(), {"--set", s});
  if (l.processes() > 1) args.insert(args.end(), {"--nproc", std::to_string(l.processes())});
  const auto start = std::chrono::steady_clock::now();
  const std::string out = dir + "/stdout", err = dir + "/stderr";
  const bool here = o.start_here && !cuda_linked() && threads_here() == 1;
  RunResult r;
  r.code = wait_run(start_run(o, l, args, out, err, here));
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  read_run(err, dir + "/run", r);
  return r;
}

// A failed run ends verify with the run's exit code and words (a stop signal to verify
// with the signal's code); its folder is kept (WorkDir) and named.
void require_ok(const RunResult& r, const Layout& l, const std::string& dir) {
  if (g_stop_signal)
    throw Error(ExitCode(128 + g_stop_signal),
                fmt::format("verify: stopped by signal {} during the run of {}", int(g_stop_signal), l.name()));
  if (r.code == 0) return;
  throw Error(ExitCode(r.code),
              fmt::format("verify: {} ({} process(es)) failed: {} (its output: {})",
                          l.name(), l.processes(),
                          r.error.empty() ? fmt::format("exit {}", r.code) : r.error, dir));
}

struct Reference {
  std::vector<double> losses;     // steps 1..N
  std::optional<double> eval_loss;
  std::string job, dtrain, libtorch;
};

Reference read_reference(const std::string& path) {
  std::ifstream in(path);
  fail_if<ConfigError>(!in, "verify --against: cannot read '{}'", path);
  const auto j = nlohmann::json::parse(in, nullptr, false);
  auto text = [&](const char* k) {
    return j.is_object() && j.contains(k) && j[k].is_string() ? j[k].get<std::string>() : "";
  };
  fail_if<ConfigError>(text("format") != "dtrain-verify" || !j.contains("losses") ||
                           !j["losses"].is_array() || text("job").empty(),
                       "verify --against: '{}' is not a file `dtrain verify --save` wrote", path);
  Reference ref;
  for (const auto& x : j["losses"]) {
    fail_if<ConfigError>(!x.is_number(), "verify --against: '{}': a loss is not a number", path);
    ref.losses.push_back(x.get<double>());
  }
  fail_if<ConfigError>(ref.losses.empty(), "verify --against: '{}' holds no losses", path);
  if (j.contains("eval_loss") && j["eval_loss"].is_number()) ref.eval_loss = j["eval_loss"].get<double>();
  ref.job = text("job");
  ref.dtrain = text("dtrain");
  ref.libtorch = text("build");
  return ref;
}

void write_reference(const std::string& path, const Reference& ref) {
  nlohmann::json j{{"format", "dtrain-verify"}, {"version", 1}, {"steps", ref.losses.size()},
                   {"losses", ref.losses}, {"job", ref.job}, {"dtrain", DTRAIN_VERSION},
                   {"build", build_info()}};
  if (ref.eval_loss) j["eval_loss"] = *ref.eval_loss;
  try {
    write_file_atomic(path, j.dump(1) + "\n");
  } catch (const std::exception& e) {
    throw RunDirError(fmt::format("verify --save: cannot write '{}': {}", path, first_line(e.what())));
  }
}

// Relative to the reference, or to 1e-3 for a loss below it (a loss near 0 would make
// rounding alone look large).
double relative(double a, double ref) {
  if (!std::isfinite(a) || !std::isfinite(ref)) return a == ref ? 0.0 : INFINITY;
  return std::abs(a - ref) / std::max(std::abs(ref), 1e-3);
}

// A temporary folder for the runs, removed at the end unless kept.
struct WorkDir {
  std::string path;
  bool keep;
  explicit WorkDir(bool keep) : keep(keep) {
    std::string t = (std::filesystem::temp_directory_path() / "dtrain-verify-XXXXXX").string();
    fail_if<RunDirError>(::mkdtemp(t.data()) == nullptr, "verify: cannot create a folder in {}",
                         std::filesystem::temp_directory_path().string());
    path = t;
  }
  // Kept, and named, also when verify stops on an error: the failed run's output is there.
  ~WorkDir() {
    if (keep || std::uncaught_exceptions() > 0) {
      std::cerr << fmt::format("verify: the runs are in {}\n", path);
      return;
    }
    try {
      remove_tree(path);
    } catch (const std::exception& e) {
      std::cerr << fmt::format("verify: warning: cannot remove {}: {}\n", path, first_line(e.what()));
    }
  }
};

// The options against one another and the launcher: ConfigError where they cannot run.
void check_options(const VerifyOptions& o) {
  fail_if<ConfigError>(!o.save.empty() && !o.against.empty(),
                       "verify: --save and --against: one or the other (--against compares "
                       "with a saved reference, --save writes one)");
  fail_if<ConfigError>(o.layouts.empty() && o.save.empty() && o.against.empty(),
                       "verify: --layouts LIST is required (e.g. --layouts d2,t2,p2,d2xz1), "
                       "unless --save or --against");
  fail_if<ConfigError>(o.steps < 0 || o.steps > 100000, "verify --steps: 1..100000 (got {})", o.steps);
  fail_if<ConfigError>(!(o.tolerance >= 0) || !std::isfinite(o.tolerance),
                       "verify --tolerance: a number >= 0 (got {})", o.tolerance);
  const auto env = process_env();
  fail_if<ConfigError>(detect_launcher(env) != "single" && discover_world(env, 0).world > 1,
                       "verify: run it as one process; it starts each layout's processes itself");
}

// The reference: one process trained `steps` steps (written to --save), or the saved one.
Reference reference_of(const VerifyOptions& o, const std::optional<Reference>& saved, int64_t steps,
                       const std::vector<std::string>& sets, const JobConfig& job,
                       const std::string& text, const WorkDir& work) {
  if (saved) {
    std::cout << fmt::format("verify {}: {} steps against {} (dtrain {}, {})\n", o.job_path, steps,
                             o.against, saved->dtrain, saved->libtorch);
    return *saved;
  }
  Reference ref;
  const auto one = parse_layout("1");
  const auto dir = work.path + "/reference";
  const auto r = run_layout(o, one, sets, layout_sets(one, job), dir);
  require_ok(r, one, dir);
  for (int64_t s = 1; s <= steps; ++s) {
    if (!r.losses.count(s))
      throw Error(kExitFailure, fmt::format("verify: one process logged no loss at step {}", s));
    ref.losses.push_back(r.losses.at(s));
  }
  ref.eval_loss = r.eval_loss;
  ref.job = text;
  std::cout << fmt::format("verify {}: {} steps, one process in {:.1f} s; tolerance {:g} "
                           "(relative)\n", o.job_path, steps, r.seconds, o.tolerance);
  if (!o.save.empty()) {
    write_reference(o.save, ref);
    std::cout << fmt::format("saved the reference losses to {}\n", o.save);
  }
  return ref;
}

// Layout `l`'s run against the reference: its table row, and whether it went past the
// tolerance.
bool compare_layout(const VerifyOptions& o, const Layout& l, const Reference& ref, int64_t steps,
                    const std::vector<std::string>& sets, const JobConfig& job, const std::string& dir) {
  const auto r = run_layout(o, l, sets, layout_sets(l, job), dir);
  require_ok(r, l, dir);
  double worst = 0;
  int64_t first = 0;
  for (int64_t s = 1; s <= steps; ++s) {
    const double d = r.losses.count(s) ? relative(r.losses.at(s), ref.losses[size_t(s - 1)]) : INFINITY;
    worst = std::max(worst, d);
    if (d > o.tolerance && first == 0) first = s;
  }
  std::string eval = "-";
  if (r.eval_loss && ref.eval_loss) {
    const double d = relative(*r.eval_loss, *ref.eval_loss);
    eval = fmt::format("{:.1e}", d);
    if (d > o.tolerance && first == 0) first = steps;  // the last step's evaluation
  }
  std::cout << fmt::format("{:<14} {:>9} {:>6} {:>17.1e} {:>10} {:>15} {:>8.1f}\n",
                           l.text == "1" ? "one process" : l.text, l.processes(), steps, worst,
                           first > 0 ? std::to_string(first) : "-", eval, r.seconds)
            << std::flush;
  return first > 0;
}

}  // namespace

int verify(const VerifyOptions& o) {
  check_options(o);
  std::vector<Layout> layouts = parse_layouts(o.layouts);
  std::optional<Reference> saved;
  if (!o.against.empty()) saved = read_reference(o.against);
  // The schedule follows train.max_steps: a reference holds the losses of its own count.
  fail_if<ConfigError>(saved && o.steps > 0 && o.steps != int64_t(saved->losses.size()),
                       "verify --steps {}: '{}' holds the losses of {} steps (leave --steps out)",
                       o.steps, o.against, saved ? saved->losses.size() : 0);
  const int64_t steps = saved ? int64_t(saved->losses.size()) : o.steps > 0 ? o.steps : 20;
  if (saved && layouts.empty()) layouts.push_back(parse_layout("1"));

  // The job is checked before anything runs: a bad key or value is exit 2 here, once.
  JobConfig job = load_job(o.job_path, o.sets);
  resolve(job);
  const auto& unrepeatable = mode_spec(job.parallel.mode).unrepeatable;
  fail_if<ConfigError>(!unrepeatable.empty(),
                       "verify: parallel.mode {}: {}, so no layout repeats another's losses "
                       "(verify a mode whose layouts train alike)", job.parallel.mode, unrepeatable);
  const int64_t eval_samples = job.train.eval_samples > 0 ? job.train.eval_samples : 512;
  const std::string text = job_text(o, steps, eval_samples);
  if (saved) {
    // Another seed is the same job drawn again (weights, data order, dropout): compared,
    // and said, so that a reference shows what a seed alone moves. Any other key is
    // another job.
    const auto diff = first_difference(text, saved->job, /*with_seed=*/false);
    fail_if<ConfigError>(!diff.empty(), "verify: {} is not the job '{}' was saved from: {}",
                         o.job_path, o.against, diff);
    if (const auto seed = first_difference(text, saved->job); !seed.empty())
      std::cerr << fmt::format("verify: another seed than the reference's: {}; its losses are "
                               "compared as they are\n", seed);
  }

  const auto sets = run_sets(o, steps, eval_samples);
  // Every layout checked as `run --nproc` would check it, before anything runs.
  for (const auto& l : layouts) {
    auto with = sets;
    for (const auto& s : layout_sets(l, job)) with.push_back(s);
    try {
      JobConfig c = load_job(o.job_path, with);
      resolve(c);
      validate(c, l.processes());
    } catch (const ConfigError& e) {
      throw ConfigError(fmt::format("verify: layout {}: {}", l.text, first_line(e.what())));
    }
  }

  struct sigaction sa {};
  sa.sa_handler = on_stop_signal;  // no SA_RESTART: the wait for a run wakes up
  ::sigaction(SIGINT, &sa, nullptr);
  ::sigaction(SIGTERM, &sa, nullptr);
  WorkDir work(o.keep);
  const Reference ref = reference_of(o, saved, steps, sets, job, text, work);
  if (layouts.empty()) return 0;

  std::cout << fmt::format("{:<14} {:>9} {:>6} {:>17} {:>10} {:>15} {:>8}\n", "layout",
                           "processes", "steps", "largest rel diff", "first over", "eval rel diff",
                           "time s");
  int over = 0;
  for (size_t i = 0; i < layouts.size(); ++i)
    over += compare_layout(o, layouts[i], ref, steps, sets, job, work.path + "/layout" + std::to_string(i));
  const std::string against = saved ? "the saved reference" : "one process";
  if (over == 0)
    std::cout << fmt::format("ok: every layout within {:g} of {}\n", o.tolerance, against);
  else
    std::cout << fmt::format("differ: {} of {} layout(s) past {:g} of {}\n", over,
                             layouts.size(), o.tolerance, against);
  return over == 0 ? 0 : 1;
}

}  // namespace dtrain
