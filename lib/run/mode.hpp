// The training mode: how the data replicas' parameters move between steps and when every
// rank meets. One interface above the step (Marian's GraphGroup): the step's phases
// (step.cpp) and the loop's cadence (loop.cpp) are the same for every mode, which answers
// only what differs.
//   sync       every step's gradient is averaged over the data group (the GradSync), and
//              every rank meets after every step: today's loop
//   local_sgd  each data replica steps on its own gradient (its shard of the global batch);
//              every parallel.average_every steps the replicas average their parameters
//              (and, under parallel.average_optimizer, their optimizer state) and meet.
//              Post-local SGD: the first parallel.local_after steps are synchronous.
// Where the ranks meet, and only there, the step's figures are agreed over the world, a stop
// is acted on, and the model is evaluated and checkpointed: every replica then holds the
// same parameters, so a checkpoint resumes exactly. Between meetings a replica agrees on its
// figures with its own tensor and pipeline ranks only, so a slow replica holds up the others
// only where they meet.
#pragma once
#include <cstdint>
#include <memory>

#include "comm/comm.hpp"
#include "config/config.hpp"
#include "parallel/flat_params.hpp"

namespace dtrain {

class Mesh;
class Optimizer;

class TrainingMode {
 public:
  virtual ~TrainingMode() = default;
  // Whether every rank meets after step n (from 1).
  virtual bool meets(int64_t n) const = 0;
  // The ranks that add up step n's figures (step.hpp's Figures), and how many data
  // replicas' losses that sum holds: the world and every replica where they meet, else this
  // replica's own ranks.
  virtual Comm& figures_group(int64_t n) const = 0;
  virtual int64_t replicas(int64_t n) const = 0;
  // After step n's update (local SGD averages the replicas where they meet). Returns the
  // bytes this rank sent.
  virtual int64_t after_update(int64_t /*n*/) { return 0; }
  // What each data replica keeps apart from the others (local SGD's own optimizer state),
  // as buffers laid out like the flat gradient, by name: saved with a checkpoint per data
  // rank, like the gradient sync's state.
  virtual NamedTensors replica_state() const { return {}; }
};

// The job's mode. `buffers`: the model's buffers this rank holds (BatchNorm's statistics),
// averaged with the parameters.
std::unique_ptr<TrainingMode> make_mode(const JobConfig& cfg, const Mesh& mesh, FlatParams& params,
                                        Optimizer& optimizer, NamedTensors buffers,
                                        int64_t total_steps);

}  // namespace dtrain
