// `dtrain plan --all` and parallel.auto: every layout of a number of processes the job
// validates for, planned and ranked, and the choice among them. Here, above plan/, because
// it validates each candidate (validate.hpp, which uses the plan's memory estimate).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "comm/comm.hpp"
#include "config/config.hpp"
#include "plan/plan.hpp"
#include "plan/profile.hpp"

namespace dtrain {

// One layout: data x tensor x pipeline, ZeRO stage, schedule, micro-batches, recompute (the
// job's other keys as they are).
struct Candidate {
  std::string layout;  // "d2 x t1 x p2, zero 1, 1f1b x2, 4 micro-batches, recompute"
  JobConfig cfg;       // the job with that layout
  Plan plan;
  bool fits = true;    // its memory within the limit
};

// Every candidate that validates for `world` processes among `devices`, those that fit
// first, each part fastest first (without a time estimate: least bubble, bytes sent, work,
// micro-batches, memory). `memory_bytes`: what the machine has for all of them on a CPU
// (every rank on it), what one device has on a GPU (the largest rank); 0 = no limit. Under
// parallel.auto the layout keys the job sets itself (JobConfig::given) are held as set: the
// list parallel.auto takes the first of.
std::vector<Candidate> all_layouts(const JobConfig& cfg, int64_t world, const MachineProfile* profile,
                                   double memory_bytes, const Devices& devices = Devices::here());

// Throws parallel.auto's ConfigError where no layout of `world` processes validates (an
// elastic auto job's check at each size, with nothing planned).
void check_some_layout(const JobConfig& cfg, int64_t world);

// What parallel.auto's choice ranks by: the stored machine profile (plan/profile.hpp), else
// this machine measured for up to `local` local ranks and stored for the next start (also
// where the job is on a GPU and the stored profile has none).
MachineProfile profile_for_auto(int64_t local, bool gpu);

// What one GPU holds for a rank, bytes: the device's memory less a tenth (the CUDA
// context, the caching allocator's slack), where the profile measured it; else 0 (no limit).
double gpu_limit(const MachineProfile* profile);

// parallel.auto at a start: the job with the layout chosen for `world` processes (`local`
// of them on this machine, whose free memory is the limit on a CPU), and the line that says
// which. A resume keeps the layout its run's config.yaml records while that validates.
// Without parallel.auto, the job as it is and no line.
struct AutoChoice {
  JobConfig cfg;
  std::string line;
};
AutoChoice auto_layout(const JobConfig& cfg, int64_t world, int64_t local, bool resuming);

// auto_layout over the job's processes, a collective: rank 0 chooses (and says so) and
// every rank takes its layout (two ranks' own choices could differ with a node's free
// memory or profile). Rank 0's failure is every rank's.
JobConfig agree_on_layout(const JobConfig& cfg, int64_t local, bool resuming, Comm& job);
std::string candidates_table(const std::vector<Candidate>& all, double memory_bytes);
nlohmann::json candidates_json(const std::vector<Candidate>& all, double memory_bytes);

}  // namespace dtrain
