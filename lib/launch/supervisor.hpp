// `dtrain run JOB --nproc N`: starts N worker processes of this same executable on this
// machine with torchrun-style environment variables, prefixes their output with the rank,
// and supervises them. When one fails, the others are stopped within seconds and the job
// either ends (exit 4, naming the rank and its status or signal) or, with --max-restarts,
// starts again from the latest checkpoint (--resume auto). A worker that exits 2 or 3 (bad
// job spec, unreadable data or checkpoint) ends the job with that code: a restart would
// fail the same way.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace dtrain {

struct SupervisorOptions {
  int64_t nproc = 1;
  int64_t max_restarts = 0;
  std::string executable;              // path to dtrain (usually /proc/self/exe)
  std::vector<std::string> run_args;   // "run", JOB, options; without --nproc/--max-restarts
  // A rank's part in the job, named in the message about a failed rank ("" when all are
  // alike: the training mode's ModeSpec::role).
  std::function<std::string(int64_t rank)> role;
};

// Returns the job's exit code.
int supervise(const SupervisorOptions& opts);

// A TCP port on 127.0.0.1 that was free a moment ago.
int free_local_port();

}  // namespace dtrain
