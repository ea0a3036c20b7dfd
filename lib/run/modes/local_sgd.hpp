// parallel.mode: local_sgd's rules, one place for both of its forms: the mode over the
// job's data replicas (modes/local_sgd.cpp) and over a fault-tolerant job's replicas
// (modes/local_replicas.cpp).
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include <torch/types.h>

#include "checkpoint/stateful.hpp"
#include "comm/comm.hpp"
#include "config/config.hpp"
#include "grad/grad_sync.hpp"

namespace dtrain {

class Optimizer;

// Whether step n (from 1) steps each data replica on its own gradient: past the
// synchronous start.
bool steps_locally(const ParallelConfig& cfg, int64_t n);
// Whether the replicas meet after step n of `total`: after each synchronous step, every
// parallel.average_every local steps, and after the last.
bool local_sgd_meets(const ParallelConfig& cfg, int64_t n, int64_t total);
// Whether step n is the first local step after a meeting: its interval starts from the
// replicas' state there (DiLoCo's outer copy; what a failed interval goes back to).
bool starts_interval(const ParallelConfig& cfg, int64_t n, int64_t total);

// The gradient: `sync` (over the data replicas) for the synchronous steps, then `local`
// (this replica's own, whose factor takes the mean over the replica's share of the batch).
// While local, `sync`'s hooks are disarmed, so its buckets launch nothing.
std::unique_ptr<GradSync> make_local_sync(const ParallelConfig& cfg, std::unique_ptr<GradSync> sync,
                                          std::unique_ptr<GradSync> local);

// What the replicas average where they meet: the parameters, the floating-point buffers
// and, under parallel.average_optimizer, the optimizer's slots.
std::vector<torch::Tensor> averaged_state(const ParallelConfig& cfg, const FlatParams& params,
                                          const std::vector<torch::Tensor>& buffers,
                                          const Optimizer& optimizer);
// Their average over `group`, in place; each member's weighted by `weight` (its share of
// the global batch) where the shares differ, else the plain mean (the same bits on every
// member: Gloo's ring leaves them so). Returns the bytes this rank sent.
int64_t average_over(Comm& group, const std::vector<torch::Tensor>& tensors, double weight,
                     bool even);

// DiLoCo's outer step (parallel.outer_lr, parallel.outer_momentum; Douillard et al. 2023):
// where the replicas meet, the difference of the parameters they last met at (the outer
// copy) from their average is a gradient, the pseudo-gradient, and an SGD step with
// Nesterov momentum along it (torch.optim.SGD's, nesterov=True) from the outer copy gives
// the parameters every replica goes on from. At rate 1 without momentum that is the
// average itself: plain local SGD, which takes no step and keeps nothing.
class OuterStep {
 public:
  // `like`: the flat parameters, which the momentum is laid out as.
  OuterStep(const ParallelConfig& cfg, const torch::Tensor& like);
  bool active() const { return lr_ != 1.0 || momentum_ > 0; }
  // `params` holds the replicas' average and ends as the step's result; `outer`, the
  // parameters they last met at, is left as it is (a failed interval goes back to it).
  void step(const torch::Tensor& params, const torch::Tensor& outer);
  // Nesterov's buffer, over the flat parameters (undefined without momentum): the state
  // a checkpoint and a joiner take, with the optimizer's (kOptimizer, "<name>.outer_momentum").
  const torch::Tensor& buffer() const { return buffer_; }
  void save(StateWriter& out, const FlatParams& params, const Tied& tied, int64_t tensor_rank) const;
  void load(const StateReader& in, const FlatParams& params, int64_t tensor_rank);

 private:
  double lr_, momentum_;
  torch::Tensor buffer_;
};

}  // namespace dtrain
