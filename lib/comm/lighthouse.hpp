// fault_tolerance: replicas under a launcher of another's (torchrun, SLURM's srun): each
// replica is a job of its own launcher (torchrun's agent restarts its ranks alone, as
// dtrain's --nproc supervisor restarts a replica), and the lighthouse, one process beside
// them, hosts the store the replicas meet through (docs/fault-tolerance.md). It outlives
// every rank, as the supervisor's does, and it learns at once that a rank has ended: each
// rank's store connection leaves word to mark it ended when it closes (leave_word), which
// the kernel does as the process ends, however it ends. A rank that stops answering (its
// heartbeat stale: SIGSTOP, a machine that hangs) is killed when it runs on the
// lighthouse's machine, so its launcher restarts it; elsewhere its peers leave it out.
#pragma once
#include <chrono>
#include <cstdint>
#include <functional>
#include <string>

#include <torch/csrc/distributed/c10d/Store.hpp>

#include "launch/world.hpp"

namespace dtrain {

struct LighthouseOptions {
  std::string host = "127.0.0.1";  // the address it listens on, which the ranks are given
  int port = 0;
  int64_t replicas = 0;      // the replicas that start the job
  int64_t most = 0;          // the most it may have (0: `replicas`); the others join later
  int64_t replica_size = 1;  // ranks in each (parallel.tensor x parallel.pipeline)
  std::chrono::milliseconds timeout{std::chrono::seconds(300)};   // dist.timeout_s
  std::chrono::milliseconds silent{std::chrono::seconds(5)};      // fault_tolerance.heartbeat_s
  std::chrono::milliseconds hang_after{0};  // dist.hang_report_s: when to print the picture
  std::function<bool()> stop;               // asked every tick: a signal came
  std::function<void(const std::string&)> say;
};

// Hosts the job's store until every rank that came has ended (and none has come back for
// the heartbeat timeout) or `stop` says so; returns 0, or throws when it cannot listen or
// no rank came within the timeout.
int serve_lighthouse(const LighthouseOptions& o);

// The job's world for a rank its launcher started as one of a replica's ranks, or of
// several whole replicas' (`launched`: its rank among the launcher's and their number),
// the first of them replica `replica` of those the lighthouse at `address` (HOST:PORT)
// serves: rank replica x size + its own, of the most replicas x size, the store the
// lighthouse's. `size_here`: the ranks per replica this rank's job spec makes, which must
// be the lighthouse's.
WorldInfo lighthouse_world(const WorldInfo& launched, const std::string& address,
                           const std::string& replica, int64_t size_here,
                           std::chrono::milliseconds timeout);

// The replicas that start the job together, where a lighthouse serves `store` (a replica
// above them joins as one more); else all `replicas`.
int64_t starting_replicas(c10d::Store& store, int64_t replicas);

}  // namespace dtrain
