#include "launch/requeue.hpp"

#include <fmt/format.h>

#include "util/process.hpp"

namespace dtrain {

std::string slurm_job_to_requeue(const Env& env) {
  if (auto array = env("SLURM_ARRAY_JOB_ID"), task = env("SLURM_ARRAY_TASK_ID"); array && task)
    return *array + "_" + *task;
  return env("SLURM_JOB_ID").value_or("");
}

std::string requeue_slurm_job(const std::string& job, std::chrono::seconds timeout) {
  const ChildResult r = run_child({"scontrol", "requeue", job}, timeout);
  if (!r.error.empty()) return r.error;  // could not start it, or it did not answer in time
  if (r.code == 0) return "";
  return fmt::format("scontrol requeue {} failed (exit {})", job, r.code);
}

}  // namespace dtrain
