// Runs one training job on this process's share of the world: the entry point the
// executable calls. The job's training mode (run/mode.hpp) is made first (its groups), the
// run is built from components (run/run.hpp, setup.cpp), and the mode runs it.
#pragma once
#include <memory>
#include <string>

#include <c10/core/Device.h>

#include "comm/comm.hpp"
#include "config/config.hpp"
#include "launch/world.hpp"
#include "parallel/dims.hpp"
#include "run/run_log.hpp"

namespace dtrain {

class ReplicaSet;

struct RunOptions {
  std::string resume;  // "" = fresh, "auto" = newest valid checkpoint if any, else a folder
  // The SLURM job to requeue after a SIGUSR1 checkpoint ("" = none: not under SLURM, or
  // dist.requeue / --no-requeue turned it off).
  std::string requeue_job;
  // Where this rank computes (plan_device's choice for it).
  c10::Device device = c10::Device(c10::kCPU);
  // fault_tolerance: replicas: the replicas this one trains with (null: off).
  std::shared_ptr<ReplicaSet> replicas;
};

// `cfg` must be resolved and validated for world.world processes (`dims` is what
// validate() returned); `comm` spans them all (make_local_comm() for one; under
// opts.replicas, this replica's ranks, and `dims` the replica's). Throws
// dtrain::Error subclasses on failure.
RunResult run_training(const JobConfig& cfg, const ParallelDims& dims, const RunOptions& opts,
                       const WorldInfo& world, std::shared_ptr<Comm> comm);

}  // namespace dtrain
