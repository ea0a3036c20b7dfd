// Whether a job can run on `world_size` processes with this build of dtrain: the spec's own
// ranges (config/schema.hpp), then what needs the models, the devices and the layout. The
// job spec stays a leaf that knows nothing of these; each model checks its own keys.
#pragma once
#include <cstdint>

#include "config/config.hpp"
#include "parallel/dims.hpp"

namespace dtrain {

// Every range, enum and divisibility check for a job run on `world_size` processes, and
// the layout it resolves to. Throws ConfigError with a message that names the key and what
// would be valid.
ParallelDims validate(const JobConfig& cfg, int64_t world_size = 1);

}  // namespace dtrain
