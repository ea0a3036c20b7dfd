// Whether a job can run on `world_size` processes with this build of dtrain: the spec's own
// ranges (config/schema.hpp), then what needs the models, the devices and the layout. The
// job spec stays a leaf that knows nothing of these; each model checks its own keys.
#pragma once
#include <cstdint>
#include <functional>

#include "config/config.hpp"
#include "data/dataset.hpp"
#include "launch/device.hpp"
#include "parallel/dims.hpp"

namespace dtrain {

// Every range, enum and divisibility check for a job run on `world_size` processes among
// `devices` (this machine's, or a GPU machine's planned for), and the layout it resolves
// to. Throws ConfigError with a message that names the key and what would be valid.
ParallelDims validate(const JobConfig& cfg, int64_t world_size = 1,
                      const Devices& devices = Devices::here());

// The processes of one replica of a fault-tolerant job (fault_tolerance: replicas) at
// layout `dims`: its data ranks (fault_tolerance.replica_data) x tensor x pipeline.
inline int64_t replica_ranks(const JobConfig& cfg, const ParallelDims& dims) {
  return cfg.fault_tolerance.replica_data * dims.tensor * dims.pipeline;
}

// `check` (validate() where none is given) at every world size an elastic job may take:
// `min_nodes` to `max_nodes` nodes of `per_node` processes. The error names the world size
// that fails.
using WorldCheck = std::function<void(const JobConfig&, int64_t world)>;
void validate_elastic(const JobConfig& cfg, int64_t min_nodes, int64_t max_nodes, int64_t per_node,
                      const WorldCheck& check = nullptr);

// Refuses (ConfigError naming train.threads) more intra-op threads than 4 per core of this
// machine, and, unless train.memory_check is off, a job on the CPU whose estimated memory
// (plan/plan.hpp's, for the first `local_processes` ranks of `world`) exceeds what this
// machine has available: what would otherwise hang in setup or fail to allocate long after
// starting.
void check_machine(const JobConfig& cfg, int64_t world, int64_t local_processes);

// What this machine has available (MemAvailable), bytes; 0 where that cannot be read.
double available_memory();

// The model's checks that need the data (its windows' length and vocabulary, the images'
// shape): what `validate` runs once it has read the data, as `run` would refuse it.
void check_model_fits_data(const JobConfig& cfg, const DataSplits& data);

}  // namespace dtrain
