// `dtrain verify`: does a parallel layout still compute the same model? Trains the job on one
// process and on each layout for a few steps from the same start, each in its own processes
// (as `dtrain run --nproc` does), and compares every step's loss with one process's: the
// layout-equivalence check dtrain's own tests make, as a command a user runs on a job of
// theirs. The reference losses can be saved and compared with later (a golden-loss check
// across commits and machines).
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace dtrain {

struct VerifyOptions {
  std::string job_path;
  std::vector<std::string> sets;  // the user's --set, applied to every run
  std::string layouts;            // comma-separated; may be empty with --save or --against
  int64_t steps = 0;              // 0: the --against file's, else 20
  double tolerance = 1e-4;        // largest relative loss difference
  std::string save, against;      // reference losses: write them / compare with them
  bool keep = false;              // keep the runs' folder (its path is printed)
  std::string executable = "/proc/self/exe";
  // Where set, a run is a fork of verify calling this with the run's command line (argv[0]
  // first), as `run --nproc` starts its workers, instead of an exec of `executable`: it
  // skips LibTorch's start, about a second a run. Verify execs where a fork could differ
  // (a CUDA build; a second thread in verify, which a fork would not copy).
  std::function<int(std::vector<std::string> args)> start_here;
};

// Prints the table; returns the exit code: 0 every layout within the tolerance, 1 one is
// not. A bad layout, job or reference file, or a layout the job cannot take, throws
// ConfigError (exit 2) before anything runs; a run that fails otherwise throws an error
// with its exit code, naming the layout and the run's own words.
int verify(const VerifyOptions& opts);

}  // namespace dtrain
