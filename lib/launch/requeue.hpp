// SLURM preemption, end to end: the warning signal (sbatch --signal=USR1@120) makes every
// rank checkpoint at the next step boundary; then rank 0 puts the job back in the queue,
// as PyTorch Lightning does, and the requeued job resumes with --resume auto.
#pragma once
#include <chrono>
#include <string>

#include "launch/world.hpp"

namespace dtrain {

// The id `scontrol requeue` takes for this SLURM job: JOBID, or ARRAYJOBID_TASKID for an
// array task; "" outside SLURM.
std::string slurm_job_to_requeue(const Env& env);

// Runs `scontrol requeue JOB`, bounded by `timeout`. Returns "" on success, else why not.
std::string requeue_slurm_job(const std::string& job, std::chrono::seconds timeout);

}  // namespace dtrain
