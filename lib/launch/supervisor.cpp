#include "launch/supervisor.hpp"

#include <arpa/inet.h>
#include <dirent.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <optional>
#include <thread>

#include <fmt/format.h>

#include "launch/device.hpp"
#include "launch/world.hpp"
#include "util/error.hpp"
#include "util/process.hpp"

namespace dtrain {
namespace {

using Clock = std::chrono::steady_clock;
volatile sig_atomic_t g_forward = 0;  // a signal to pass on to the workers
bool g_forked_worker = false;          // this process is a worker the supervisor forked
extern "C" void on_signal(int sig) { g_forward = sig; }

struct Worker {
  pid_t pid = -1;
  int out = -1, err = -1;         // read ends of its stdout/stderr pipes
  std::string out_buf, err_buf;   // partial lines
  std::optional<int> status;      // waitpid status once it has ended
  bool stopped_by_us = false;
};

void emit(int rank, std::string& buf, const char* data, size_t n, std::ostream& os, bool flush_all) {
  buf.append(data, n);
  if (flush_all && !buf.empty()) buf += '\n';  // the last line, cut short
  size_t pos;
  while ((pos = buf.find('\n')) != std::string::npos) {
    os << "[rank " << rank << "] " << buf.substr(0, pos) << "\n";
    buf.erase(0, pos + 1);
  }
  os.flush();
}

// Reads whatever the workers have written, for up to `ms`.
void pump(std::vector<Worker>& ws, int ms) {
  std::vector<pollfd> fds;
  std::vector<std::pair<size_t, bool>> who;  // worker, is_err
  for (size_t i = 0; i < ws.size(); ++i) {
    if (ws[i].out >= 0) fds.push_back({ws[i].out, POLLIN, 0}), who.push_back({i, false});
    if (ws[i].err >= 0) fds.push_back({ws[i].err, POLLIN, 0}), who.push_back({i, true});
  }
  if (fds.empty()) {
    std::this_thread::sleep_for(std::chrono::milliseconds(ms));
    return;
  }
  if (::poll(fds.data(), fds.size(), ms) <= 0) return;
  char buf[65536];
  for (size_t k = 0; k < fds.size(); ++k) {
    if (!(fds[k].revents & (POLLIN | POLLHUP | POLLERR))) continue;
    auto& w = ws[who[k].first];
    const bool is_err = who[k].second;
    ssize_t n = ::read(fds[k].fd, buf, sizeof buf);
    auto& line_buf = is_err ? w.err_buf : w.out_buf;
    auto& os = is_err ? std::cerr : std::cout;
    if (n > 0) {
      emit(int(who[k].first), line_buf, buf, size_t(n), os, false);
    } else {
      emit(int(who[k].first), line_buf, buf, 0, os, true);
      ::close(fds[k].fd);
      (is_err ? w.err : w.out) = -1;
    }
  }
}

void reap(std::vector<Worker>& ws) {
  for (auto& w : ws) {
    if (w.status) continue;
    int st = 0;
    if (::waitpid(w.pid, &st, WNOHANG) == w.pid) w.status = st;
  }
}

bool all_done(const std::vector<Worker>& ws) {
  return std::all_of(ws.begin(), ws.end(), [](const Worker& w) { return w.status.has_value(); });
}

bool failed(const Worker& w) {
  return w.status && !(WIFEXITED(*w.status) && WEXITSTATUS(*w.status) == 0);
}

// The signal a worker stopped on by itself (it exited 130 or 143: a user's kill or a
// cluster's SIGTERM reached it, not ours), or 0. The ranks agree on a stop at a step
// boundary, checkpoint, and all exit alike.
int stopped_on(const Worker& w) {
  if (!w.status || !WIFEXITED(*w.status)) return 0;
  const int code = WEXITSTATUS(*w.status);
  return code == 128 + SIGTERM ? SIGTERM : code == 128 + SIGINT ? SIGINT : 0;
}

std::string describe(int rank, int status) {
  if (WIFSIGNALED(status))
    return fmt::format("rank {} was killed by signal {} ({})", rank, WTERMSIG(status),
                       strsignal(WTERMSIG(status)));
  return fmt::format("rank {} exited with status {}", rank, WEXITSTATUS(status));
}

// The state letter of /proc/PID/stat: R, S, D, T (stopped), t (traced), Z, ...
char proc_state(pid_t pid) {
  std::ifstream in(fmt::format("/proc/{}/stat", pid));
  std::string stat((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const auto close = stat.rfind(')');
  return close != std::string::npos && close + 2 < stat.size() ? stat[close + 2] : '?';
}

// Why the job failed, blaming the rank that caused it rather than the first to notice:
// a rank that died of a signal we did not send; else one that failed on its own (an exit
// code other than 4, which means "a peer failed"); else, when every failure is a peer
// giving up, the one rank that is stopped or, failing that, the one still running then
// (it stalled); else the first rank to fail. `running` holds the state letters of the
// ranks still alive when the first failure was seen (0 for the others).
std::pair<size_t, std::string> blame(const std::vector<Worker>& ws, size_t first,
                                     const std::vector<char>& running) {
  for (size_t i = 0; i < ws.size(); ++i)
    if (ws[i].status && WIFSIGNALED(*ws[i].status) && !ws[i].stopped_by_us)
      return {i, describe(int(i), *ws[i].status)};
  auto exited = [&](size_t i, int code) {
    return ws[i].status && WIFEXITED(*ws[i].status) && WEXITSTATUS(*ws[i].status) == code;
  };
  for (size_t i = 0; i < ws.size(); ++i)
    if (ws[i].status && !ws[i].stopped_by_us && !exited(i, 0) && !exited(i, kExitPeerFailed))
      return {i, describe(int(i), *ws[i].status)};
  const int first_status = *ws[first].status;
  if (exited(first, kExitPeerFailed)) {
    auto only = [&](auto pred) -> std::optional<size_t> {
      std::optional<size_t> found;
      for (size_t i = 0; i < ws.size(); ++i)
        if (pred(running[i])) {
          if (found) return std::nullopt;  // two candidates: no telling which
          found = i;
        }
      return found;
    };
    if (auto i = only([](char st) { return st == 'T' || st == 't'; }))
      return {*i, fmt::format("rank {} was stopped (SIGSTOP or a debugger) and rank {} gave up "
                              "waiting for it ({})", *i, first, describe(int(first), first_status))};
    if (auto i = only([](char st) { return st != 0 && st != 'Z' && st != 'X'; }))
      return {*i, fmt::format("rank {} stopped responding and rank {} gave up waiting for it "
                              "({})", *i, first, describe(int(first), first_status))};
  }
  return {first, describe(int(first), first_status)};
}

// The workers' command line: the job's, continuing from the latest checkpoint when
// `resume_auto` (a restart).
std::vector<std::string> worker_args(const SupervisorOptions& o, bool resume_auto) {
  std::vector<std::string> args{o.executable};
  for (size_t i = 0; i < o.run_args.size(); ++i) {
    if (resume_auto && o.run_args[i] == "--resume") {
      ++i;  // a restart always continues from the newest checkpoint
      continue;
    }
    if (resume_auto && o.run_args[i].rfind("--resume=", 0) == 0) continue;
    args.push_back(o.run_args[i]);
  }
  if (resume_auto) args.insert(args.end(), {"--resume", "auto"});
  return args;
}

// Worker `r`, started on `args`: forked to run o.start_here where `forked` allows it, else
// exec'd. `joins`: above 0, the incarnation of a replica restarted alone (fault_tolerance:
// replicas), which joins the others training.
Worker start_worker(const SupervisorOptions& o, int64_t r, int port,
                    const std::vector<std::string>& args, bool forked, int64_t joins) {
  int out[2], err[2];
  if (::pipe2(out, O_CLOEXEC) != 0 || ::pipe2(err, O_CLOEXEC) != 0)
    throw std::runtime_error("cannot create pipes for the workers");
  std::cout.flush(), std::cerr.flush(), std::fflush(nullptr);  // or the child repeats it
  pid_t pid = ::fork();
  if (pid < 0) throw std::runtime_error("cannot start a worker process");
  if (pid == 0) {
    ::dup2(out[1], STDOUT_FILENO);
    ::dup2(err[1], STDERR_FILENO);
    // Die with the supervisor rather than linger if it is killed outright.
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    auto set = [](const char* k, const std::string& v) { ::setenv(k, v.c_str(), 1); };
    set("RANK", std::to_string(r));
    set("LOCAL_RANK", std::to_string(r));
    set("WORLD_SIZE", std::to_string(o.nproc));
    set("LOCAL_WORLD_SIZE", std::to_string(o.nproc));
    set("MASTER_ADDR", "127.0.0.1");
    set("MASTER_PORT", std::to_string(port));
    if (o.host_store) set("DTRAIN_STORE_HOSTED", "1");
    if (joins > 0) set("DTRAIN_FT_JOIN", std::to_string(joins));
    if (o.start_here && forked) {
      as_if_exec();
      g_forked_worker = true;
      // ps and top tell the ranks apart (an exec'd worker shows RANK in /proc's environ).
      ::prctl(PR_SET_NAME, fmt::format("dtrain rank {}", r).c_str());
      std::exit(o.start_here(args));
    }
    // The binary /proc/self/exe names (so the process is called dtrain, not exe).
    std::error_code ec;
    const auto binary = std::filesystem::canonical(o.executable, ec);
    auto argv = args;
    exec_or_die(ec ? o.executable : binary.string(), argv);
  }
  ::close(out[1]);
  ::close(err[1]);
  return Worker{pid, out[0], err[0], {}, {}, std::nullopt, false};
}

std::vector<Worker> spawn(const SupervisorOptions& o, int port, bool resume_auto) {
  const auto args = worker_args(o, resume_auto);
  std::vector<Worker> ws;
  for (int64_t r = 0; r < o.nproc; ++r) ws.push_back(start_worker(o, r, port, args, true, 0));
  return ws;
}

// How long the other workers have, once one stopped on a signal of its own, to write the
// checkpoint and exit alike.
constexpr std::chrono::seconds kStopGrace{300};
constexpr std::chrono::seconds kPeerFailGrace{2};

// fault_tolerance: replicas: what the supervisor keeps of the replicas' failures.
struct LostReplicas {
  explicit LostReplicas(const SupervisorOptions& o)
      : said(size_t(o.nproc), false),
        generations(o.replica_size > 0 ? size_t(o.nproc / o.replica_size) : 0, 0) {}
  std::vector<bool> said;            // each worker's end said (its replica stopped)
  std::optional<size_t> first;       // the first worker that failed
  int64_t restarts = 0;              // replicas restarted, against --max-restarts
  std::vector<int64_t> generations;  // each replica's incarnations so far
};

// Workers [from, from + size) of a replica one of which failed: the others are killed
// (they cannot train without it), and the store says each has ended at once (their peers
// need not wait for their heartbeats to go stale).
void stop_replica(std::vector<Worker>& ws, size_t from, size_t size, LostReplicas& lost,
                  const std::function<void(int64_t)>& ended) {
  for (size_t k = from; k < from + size; ++k) {
    if (!ws[k].status) {
      ::kill(ws[k].pid, SIGKILL);
      ws[k].stopped_by_us = true;
      int st = 0;
      if (::waitpid(ws[k].pid, &st, 0) == ws[k].pid) ws[k].status = st;
    }
    lost.said[k] = true;
    if (ended) ended(int64_t(k));
  }
}

// Each replica with a worker that failed since the last call, once: stopped, and its ranks
// restarted together to join the others while --max-restarts allows (a bad spec or data is
// not: it would fail the same way).
void replace_lost_replicas(const SupervisorOptions& o, std::vector<Worker>& ws, LostReplicas& lost,
                           const std::function<void(int64_t)>& ended, int port) {
  const size_t size = size_t(o.replica_size);
  for (size_t i = 0; i < ws.size(); ++i) {
    if (lost.said[i] || !failed(ws[i]) || stopped_on(ws[i])) continue;
    if (!lost.first) lost.first = i;
    const size_t from = i - i % size, replica = i / size;
    stop_replica(ws, from, size, lost, ended);
    const int status = *ws[i].status;
    const int code = WIFEXITED(status) ? WEXITSTATUS(status) : 0;
    const bool others = std::any_of(ws.begin(), ws.end(), [](const Worker& w) { return !w.status; });
    const bool restart = others && lost.restarts < o.max_restarts && code != kExitBadSpec &&
                         code != kExitBadData;
    std::cerr << fmt::format("dtrain: {}; {}the other replicas go on without it{}\n",
                             describe(int(i), status),
                             size > 1 ? fmt::format("replica {} (ranks {} to {}) is stopped and ",
                                                    replica, from, from + size - 1)
                                      : "",
                             restart ? fmt::format(", and it restarts to join them (restart {} of {})",
                                                   lost.restarts + 1, o.max_restarts)
                                     : "");
    if (!restart) continue;
    ++lost.restarts;
    const int64_t generation = ++lost.generations[replica];
    for (size_t k = from; k < from + size; ++k) {
      while (ws[k].out >= 0 || ws[k].err >= 0) pump(ws, 20);  // its last lines
      // Exec'd: the supervisor runs the store's thread now, and a fork copies only this one.
      ws[k] = start_worker(o, int64_t(k), port, worker_args(o, false), /*forked=*/false, generation);
      lost.said[k] = false;
    }
  }
}

// A replica that has stopped answering holds its peers in their collectives until their
// timeout: killed, it closes its connections, and its peers go on at once.
void kill_silent_replicas(std::vector<Worker>& ws,
                          const std::function<std::vector<int64_t>(const std::vector<int64_t>&)>& silent) {
  if (!silent) return;
  std::vector<int64_t> running;
  for (size_t i = 0; i < ws.size(); ++i)
    if (!ws[i].status) running.push_back(int64_t(i));
  for (const int64_t r : silent(running)) {
    auto& w = ws[size_t(r)];
    std::cerr << fmt::format("dtrain: rank {} stopped answering (its heartbeat is stale, the "
                             "process {}): killing it\n", r,
                             proc_state(w.pid) == 'T' ? "stopped" : "still there");
    ::kill(w.pid, SIGKILL);
    int st = 0;
    if (::waitpid(w.pid, &st, 0) == w.pid) w.status = st;
  }
}

bool all_failed(const std::vector<Worker>& ws) {
  return std::all_of(ws.begin(), ws.end(), [](const Worker& w) { return failed(w); });
}

void signal_all(std::vector<Worker>& ws, int sig) {
  for (auto& w : ws)
    if (!w.status) {
      if (sig == SIGKILL || sig == SIGTERM) w.stopped_by_us = true;
      ::kill(w.pid, SIGCONT);  // a stopped (SIGSTOP) worker must run to act on SIGTERM
      ::kill(w.pid, sig);
    }
}

// Stops the remaining workers: SIGTERM (they checkpoint and exit), then SIGKILL.
void stop_all(std::vector<Worker>& ws, std::chrono::seconds grace) {
  signal_all(ws, SIGTERM);
  const auto deadline = Clock::now() + grace;
  while (!all_done(ws) && Clock::now() < deadline) pump(ws, 50), reap(ws);
  signal_all(ws, SIGKILL);
  while (!all_done(ws)) pump(ws, 50), reap(ws);
  pump(ws, 0);
}

// A TCP port on 127.0.0.1 that was free a moment ago.
int free_local_port() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  socklen_t len = sizeof a;
  if (fd < 0 || ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
    if (fd >= 0) ::close(fd);
    throw std::runtime_error("cannot find a free local port");
  }
  ::close(fd);
  return ntohs(a.sin_port);
}

// How an attempt ended: the job's exit code (a forwarded stop, success, a failure the job
// cannot outlive: a bad spec or data, the restarts used up), or none where the workers
// restart; `why` names the failure.
struct AttemptEnd {
  std::optional<int> exit;
  std::string why;
};
AttemptEnd attempt_end(const SupervisorOptions& o, const std::vector<Worker>& ws, int forwarded,
                       const std::optional<size_t>& first_failure, const std::vector<char>& running,
                       int64_t attempt) {
  if (forwarded) {
    // A worker stops by checkpointing and exiting 128+signal, or, still starting up,
    // by dying of the signal itself.
    for (auto& w : ws)
      if (failed(w) && !(WIFEXITED(*w.status) && WEXITSTATUS(*w.status) >= 128) &&
          !(WIFSIGNALED(*w.status) && WTERMSIG(*w.status) == forwarded))
        return {kExitPeerFailed, ""};
    return {forwarded == SIGINT ? 130 : 143, ""};
  }
  if (!first_failure) return {kExitOk, ""};
  auto [culprit, what] = blame(ws, *first_failure, running);
  if (const auto role = o.role ? o.role(int64_t(culprit)) : ""; !role.empty())
    what += fmt::format(" (it was {})", role);
  const int status = *ws[culprit].status;
  const int code = WIFEXITED(status) ? WEXITSTATUS(status) : 0;
  // A bad job spec or unreadable data fails the same way on every attempt: no restart,
  // and the worker's own exit code (its message says why).
  const bool repeats = code == kExitBadSpec || code == kExitBadData;
  if (!repeats && attempt < o.max_restarts) return {std::nullopt, what};
  std::cerr << "dtrain: error: " << what << "; the other ranks were stopped"
            << (!repeats && o.max_restarts > 0
                    ? fmt::format("; no restarts left (--max-restarts {} used)", o.max_restarts)
                    : std::string())
            << "\n";
  return {repeats ? code : kExitPeerFailed, what};
}

}  // namespace

void as_if_exec() {
  for (int sig = 1; sig < NSIG; ++sig) {  // exec resets handlers, keeps what is ignored
    struct sigaction now {};
    if (sig != SIGKILL && sig != SIGSTOP && ::sigaction(sig, nullptr, &now) == 0 &&
        now.sa_handler != SIG_IGN && now.sa_handler != SIG_DFL)
      ::signal(sig, SIG_DFL);
  }
  std::vector<int> fds;
  if (DIR* d = ::opendir("/proc/self/fd")) {
    while (const dirent* e = ::readdir(d)) {
      const int fd = std::atoi(e->d_name);
      if (fd > STDERR_FILENO && fd != ::dirfd(d) && (::fcntl(fd, F_GETFD) & FD_CLOEXEC)) fds.push_back(fd);
    }
    ::closedir(d);
  }
  for (int fd : fds) ::close(fd);
}

size_t threads_here() {
  size_t n = 0;
  std::error_code ec;
  for (std::filesystem::directory_iterator it("/proc/self/task", ec), end; !ec && it != end; it.increment(ec)) ++n;
  return n;
}

bool workers_forked(int64_t world) {
  if (g_forked_worker) return true;
  return world > 1 && detect_launcher(process_env()) == "single" && !cuda_linked() && threads_here() == 1;
}

int supervise(const SupervisorOptions& o) {
  struct sigaction sa {};
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  for (int sig : {SIGTERM, SIGINT, SIGUSR1}) sigaction(sig, &sa, nullptr);

  for (int64_t attempt = 0;; ++attempt) {
    const int port = free_local_port();
    auto ws = spawn(o, port, /*resume_auto=*/attempt > 0);
    SupervisorOptions::HostedStore hosted = o.host_store ? o.host_store(port) : SupervisorOptions::HostedStore{};
    auto& watch = hosted.tick;
    std::optional<size_t> first_failure;
    std::vector<char> running(ws.size(), 0);  // state letters of the ranks alive at the failure
    int forwarded = 0;
    std::optional<Clock::time_point> stop_seen;  // a worker stopped on a signal of its own
    LostReplicas lost(o);  // fault tolerance
    while (!all_done(ws)) {
      pump(ws, 100);
      reap(ws);
      if (watch) watch();
      if (g_forward && !forwarded) {
        forwarded = g_forward;  // preemption: every worker checkpoints and exits
        signal_all(ws, forwarded);
      }
      if (o.replica_size > 0) {  // a replica failed: the others go on without it
        kill_silent_replicas(ws, hosted.silent);
        replace_lost_replicas(o, ws, lost, hosted.ended, port);
        if (!all_failed(ws)) continue;
        first_failure = lost.first;
      }
      if (!first_failure && !forwarded)
        for (size_t i = 0; i < ws.size(); ++i) {
          if (const int sig = stopped_on(ws[i])) {
            // The others stop after the same step: wait for them, as for a forwarded stop
            // (stop_all below only if they do not within the grace).
            forwarded = sig;
            stop_seen = Clock::now();
            break;
          }
          if (failed(ws[i])) {
            first_failure = i;
            break;
          }
        }
      if (stop_seen && Clock::now() - *stop_seen > kStopGrace) stop_all(ws, std::chrono::seconds(5));
      if (first_failure) {
        // Give the peers a moment to fail on their own (a dead peer breaks their next
        // collective), so a signal death can be told from its consequences and each says
        // what it saw. Two seconds, not less: on a loaded machine a survivor may wait that
        // long for a core before it reaches the broken collective (CI saw 500 ms fall short).
        const auto until = Clock::now() + kPeerFailGrace;
        while (!all_done(ws) && Clock::now() < until) pump(ws, 50), reap(ws);
        for (size_t i = 0; i < ws.size(); ++i) running[i] = ws[i].status ? 0 : proc_state(ws[i].pid);
        stop_all(ws, std::chrono::seconds(5));
        break;
      }
    }
    hosted = {};  // the store too: the next attempt forks from one thread
    // Drain what is left in the pipes.
    while (std::any_of(ws.begin(), ws.end(), [](const Worker& w) { return w.out >= 0 || w.err >= 0; }))
      pump(ws, 50);
    const auto end = attempt_end(o, ws, forwarded, first_failure, running, attempt);
    if (end.exit) return *end.exit;
    std::cerr << fmt::format("dtrain: {}; restarting all {} workers from the latest checkpoint "
                             "(restart {} of {})\n", end.why, o.nproc, attempt + 1, o.max_restarts);
  }
}

}  // namespace dtrain
