// `dtrain run JOB --nproc N`: starts N worker processes of this same executable on this
// machine (forked, or forked and exec'd: SupervisorOptions::start_here) with
// torchrun-style environment variables, prefixes their output with the rank, and
// supervises them. When one fails, the others are stopped within seconds and the job
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
  // Where set, a worker runs this on the command line it would have been exec'd with,
  // in the supervisor's forked process, and exits with its result: LibTorch is loaded and
  // its operators registered already, which costs a CPU-second per process otherwise.
  // Sound only while the supervisor runs single-threaded and has computed nothing (no
  // OpenMP region: GNU OpenMP's pool does not survive a fork) and has not started CUDA:
  // dtrain sets it where its LibTorch has no CUDA.
  std::function<int(std::vector<std::string> args)> start_here;
  // Where set, the supervisor hosts the job's store: called with each attempt's port once
  // its workers are started (a fork copies only the calling thread, and the store runs
  // one), it returns what to call every 100 ms while they run (reading their heartbeats),
  // and what to call with a worker's rank once it has ended (under `replicas` the store
  // says so at once: its peers need not wait for its heartbeat to go stale); they are
  // dropped, the store with them, before another attempt starts.
  struct HostedStore {
    std::function<void()> tick;
    std::function<void(int64_t rank)> ended;
    // Under `replicas`: those of `ranks` that have stopped answering (their heartbeat
    // stale: a stopped process, a machine gone), which the supervisor then kills and
    // replaces; read together (comm/watch.hpp's Liveness::dead_among), not a request a rank.
    std::function<std::vector<int64_t>(const std::vector<int64_t>& ranks)> silent;
  };
  std::function<HostedStore(int port)> host_store;
  // fault_tolerance: replicas, the ranks in each (the job's in runs of that many; 0: off).
  // A worker that fails takes its replica's other ranks with it and leaves the other
  // replicas training (its replica is dropped from the job's set); the job has succeeded
  // when one of them completes.
  int64_t replica_size = 0;
};

// Returns the job's exit code.
int supervise(const SupervisorOptions& opts);

// What exec would have done, for a process forked to run a command without exec (the
// supervisor's workers, the end-to-end tests' commands): every signal handler back to the
// default (ignored signals stay ignored), and the descriptors marked close-on-exec (other
// processes' pipes, read ends) closed.
void as_if_exec();

// The threads of this process now (0 where /proc does not say). A fork copies only the
// caller's: a process forked to run dtrain without exec must come from one of a single
// thread.
size_t threads_here();

// Whether a run's workers on this machine share the supervisor's start-up (forked, not
// exec'd): this process is such a worker, or it is where `dtrain run --nproc` would start
// `world` of them (no launcher around it), this build forks them (its LibTorch has no
// CUDA) and this process is still single-threaded (parallel.auto's first start measures
// the machine here, which leaves OpenMP's pool behind). Their memory is smaller by the
// library pages LibTorch's start-up touched.
bool workers_forked(int64_t world);

}  // namespace dtrain
