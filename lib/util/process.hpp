// A child program run to completion within a time limit: `scontrol requeue` for a SLURM
// preemption, a child dtrain that measures the machine for parallel.auto. And the end of
// a forked child: the exec of its command.
#pragma once
#include <chrono>
#include <string>
#include <vector>

namespace dtrain {

// How a child ended: its exit code (128 + the signal for one killed), or why it did not
// run or finish (`error` non-empty: it could not start, or outlived its time and was
// killed).
struct ChildResult {
  int code = 0;
  std::string error;
  bool ok() const { return error.empty() && code == 0; }
};

// Runs args[0] (looked up in PATH) with `args`, standard output and error into `log`
// (appended; "" keeps this process's), and waits for it at most `timeout`, killing it
// then.
ChildResult run_child(const std::vector<std::string>& args, std::chrono::seconds timeout,
                      const std::string& log = "");

// Seconds since this process began (its fork: a launcher's restart), from /proc; -1 where
// that cannot be read.
double process_age_s();

// This machine's host name ("" where it cannot be read).
std::string host_name();

// `args` as main's argv: pointers into them, then a null.
std::vector<char*> argv_of(std::vector<std::string>& args);

// A forked child's exec of `path` with `args` (args[0] first); where that fails, a line
// "dtrain: error: cannot start PATH: why" on stderr and exit kExitFailure.
[[noreturn]] void exec_or_die(const std::string& path, std::vector<std::string>& args);

}  // namespace dtrain
