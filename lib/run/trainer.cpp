#include "run/trainer.hpp"

#include "run/mode.hpp"
#include "run/run.hpp"
#include "run/signals.hpp"

namespace dtrain {

RunResult run_training(const JobConfig& cfg, const ParallelDims& dims, const RunOptions& opts,
                       const WorldInfo& world, std::shared_ptr<Comm> comm) {
  install_stop_signals();
  set_setting_up(true);  // a stop before the first step: nothing to save, exit at once
  auto mode = opts.replicas ? make_replicas_mode(cfg, dims, comm, opts.replicas)
                            : mode_spec(cfg.parallel.mode).make(cfg, dims, comm);
  Run run;
  run.cfg = cfg;
  run.opts = opts;
  run.world = world;
  run.job = std::move(comm);
  run.mode = mode.get();
  build_run(run);
  set_setting_up(false);
  auto parts = train_parts(run);
  return mode->run(parts);
}

}  // namespace dtrain
