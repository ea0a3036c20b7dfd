// parallel.mode: sync (the default): every step's gradient averaged over the data group by
// the job's gradient sync, every rank meeting after every step. The lock-step family's
// defaults (run/mode.hpp's Lockstep) are exactly this.
#include "run/mode.hpp"

namespace dtrain {

ModeSpec sync_spec() {
  ModeSpec s;
  s.validate = [](const JobConfig&, int64_t) {};
  s.make = [](const JobConfig& cfg, const ParallelDims& dims,
              std::shared_ptr<Comm> world) -> std::unique_ptr<Mode> {
    return std::make_unique<Lockstep>(cfg, dims, std::move(world));
  };
  return s;
}

}  // namespace dtrain
