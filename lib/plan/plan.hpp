// `dtrain plan`: what a job will cost each rank, worked out from the job alone, without
// training: memory by part, the bytes it sends per step (as the train line's comm_bytes
// counts them), its pipeline bubble and its FLOPs. The model's parameters come from its
// outline (each rank's share, built on the meta device: the shapes a run builds, no
// memory); activations, FLOPs and tensor-parallel traffic from the model's cost sheet
// (models/model.hpp's PartCost); the schedule's from its action list; the flat buffers,
// optimizer state and the data group's bytes as each rank's mode declares them (ModeSpec::
// cost: the gradient syncs' own, grad/sync_cost.hpp). It names no mode or strategy.
// The memory check of `validate` and `run` uses the same estimate.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "config/config.hpp"
#include "launch/device.hpp"
#include "parallel/dims.hpp"
#include "parallel/stages.hpp"
#include "plan/profile.hpp"
#include "util/units.hpp"

namespace dtrain {

// One rank's memory, bytes. `data` (the dataset each process holds) and `runtime` (what a
// LibTorch process takes before any model: measured on the CPU) are host memory: on a GPU
// they are left out (nullopt), so the total compares with the allocator's peak there and
// with the train line's peak_rss_mb on a CPU.
struct MemoryPlan {
  double params = 0, grads = 0, optimizer = 0, activations = 0, buffers = 0;
  std::optional<double> data, runtime;
  double total() const { return params + grads + optimizer + activations + buffers +
                                data.value_or(0) + runtime.value_or(0); }
};

struct RankPlan {
  int64_t rank = 0;            // the world rank planned (the lowest of those alike)
  Coord coord;
  std::string role;            // "stage 1 of 2", "server" (a parameter server)
  bool trains = true;          // runs forward and backward (a rank apart from the layout may not)
  int64_t alike = 1;           // ranks with this plan (they differ in data or tensor rank)
  MemoryPlan memory;
  std::optional<double> comm_bytes;  // per step, after any compression warm-up
  // The share of its step's schedule the rank waits for its neighbours (the train line's
  // `bubble`), the schedule played with each stage's time (its FLOPs without a profile)
  double bubble = 0;
  double flops = 0;            // per step, forward and backward (and recompute)
  std::optional<double> step_s;  // with a profile of the device (sync and local SGD modes)
};

struct Plan {
  ParallelDims dims;
  int64_t world = 1;
  std::string device;            // "cpu", "cuda"
  std::vector<RankPlan> ranks;   // one per distinct rank: each pipeline stage (and server)
  std::optional<double> step_s, samples_per_s;  // the slowest rank's, with a machine profile
  // Every rank's memory added up (what one machine holds when all run on it), bytes.
  double world_memory = 0;
  // On a GPU, the ranks that share one (more ranks than the profile's GPUs), else 1.
  int64_t ranks_per_gpu = 1;
};

// Whether a plan of `cfg` among `devices` is a GPU's: the device the job takes on this
// machine, or on a GPU machine planned from elsewhere (`plan --device cuda`: a login node
// planning for GPU nodes, with a profile measured on one).
bool plans_gpu(const JobConfig& cfg, const Devices& devices);

// The plan of a job validated for `world` processes among `devices`; times where `profile`
// is given and measured the device planned for.
Plan plan_job(const JobConfig& cfg, int64_t world, const MachineProfile* profile = nullptr,
              const Devices& devices = Devices::here());

// Rank `rank`'s plan alone (the memory check sums a machine's local ranks).
RankPlan plan_rank(const JobConfig& cfg, int64_t world, int64_t rank,
                   const MachineProfile* profile = nullptr);

// The parts each of `stages` global stages would hold over `tensor` tensor ranks
// (models/model.hpp's stage_split), for a job that validates with those.
std::vector<PartRange> planned_split(const JobConfig& cfg, int64_t stages, int64_t tensor);

// The human table and the --json object.
std::string plan_table(const JobConfig& cfg, const Plan& plan);
nlohmann::json plan_json(const JobConfig& cfg, const Plan& plan);

}  // namespace dtrain
