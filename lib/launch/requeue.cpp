#include "launch/requeue.hpp"

#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>

#include <cerrno>
#include <cstring>
#include <thread>
#include <vector>

#include <fmt/format.h>

extern char** environ;

namespace dtrain {

std::string slurm_job_to_requeue(const Env& env) {
  if (auto array = env("SLURM_ARRAY_JOB_ID"), task = env("SLURM_ARRAY_TASK_ID"); array && task)
    return *array + "_" + *task;
  return env("SLURM_JOB_ID").value_or("");
}

std::string requeue_slurm_job(const std::string& job, std::chrono::seconds timeout) {
  std::vector<std::string> args{"scontrol", "requeue", job};
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  pid_t pid = -1;
  if (int err = ::posix_spawnp(&pid, "scontrol", nullptr, nullptr, argv.data(), environ))
    return fmt::format("cannot run scontrol: {}", std::strerror(err));
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  int status = 0;
  while (true) {
    const pid_t done = ::waitpid(pid, &status, WNOHANG);
    if (done == pid) break;
    if (done < 0 && errno != EINTR)
      return fmt::format("cannot wait for scontrol: {}", std::strerror(errno));
    if (std::chrono::steady_clock::now() > deadline) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, &status, 0);
      return fmt::format("scontrol requeue {} did not answer within {} s", job, timeout.count());
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  if (WIFEXITED(status) && WEXITSTATUS(status) == 0) return "";
  return fmt::format("scontrol requeue {} failed (exit {})", job,
                     WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status));
}

}  // namespace dtrain
