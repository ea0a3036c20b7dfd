#include "util/process.hpp"

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>
#include <thread>

#include <fmt/format.h>

#include "util/error.hpp"
#include "util/files.hpp"

extern char** environ;

namespace dtrain {

double process_age_s() {
  // /proc/self/stat's 22nd field, after the command's parenthesised name: the start, in
  // clock ticks since boot; /proc/uptime's first, seconds since boot.
  std::string text;
  try {
    text = read_file("/proc/self/stat");
  } catch (const std::exception&) {
    return -1;
  }
  std::ifstream uptime("/proc/uptime");
  const auto name_end = text.rfind(')');
  double up = 0;
  if (name_end == std::string::npos || !(uptime >> up)) return -1;
  std::istringstream fields(text.substr(name_end + 2));
  std::string field;
  for (int k = 3; k < 22 && fields >> field; ++k) {}
  unsigned long long start = 0;
  const long ticks = ::sysconf(_SC_CLK_TCK);
  if (!(fields >> start) || ticks <= 0) return -1;
  return up - double(start) / double(ticks);
}

std::string host_name() {
  char host[256] = {};  // a name longer than the buffer is cut, and still ends in a null
  ::gethostname(host, sizeof host - 1);
  return host;
}

std::vector<char*> argv_of(std::vector<std::string>& args) {
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  return argv;
}

void exec_or_die(const std::string& path, std::vector<std::string>& args) {
  ::execv(path.c_str(), argv_of(args).data());
  std::fprintf(stderr, "dtrain: error: cannot start %s: %s\n", path.c_str(), std::strerror(errno));
  ::_exit(kExitFailure);
}

ChildResult run_child(const std::vector<std::string>& args, std::chrono::seconds timeout,
                      const std::string& log) {
  std::vector<std::string> copy = args;
  const auto argv = argv_of(copy);
  posix_spawn_file_actions_t files;
  ::posix_spawn_file_actions_init(&files);
  if (!log.empty()) {
    ::posix_spawn_file_actions_addopen(&files, STDOUT_FILENO, log.c_str(),
                                       O_WRONLY | O_CREAT | O_APPEND, 0644);
    ::posix_spawn_file_actions_adddup2(&files, STDOUT_FILENO, STDERR_FILENO);
  }
  pid_t pid = -1;
  const int err = ::posix_spawnp(&pid, argv[0], &files, nullptr, argv.data(), environ);
  ::posix_spawn_file_actions_destroy(&files);
  if (err) return {0, fmt::format("cannot run {}: {}", args[0], std::strerror(err))};
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  int status = 0;
  while (true) {
    const pid_t done = ::waitpid(pid, &status, WNOHANG);
    if (done == pid) break;
    if (done < 0 && errno != EINTR)
      return {0, fmt::format("cannot wait for {}: {}", args[0], std::strerror(errno))};
    if (std::chrono::steady_clock::now() > deadline) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, &status, 0);
      return {128 + SIGKILL, fmt::format("{} did not finish within {} s", args[0], timeout.count())};
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return {WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status), ""};
}

}  // namespace dtrain
