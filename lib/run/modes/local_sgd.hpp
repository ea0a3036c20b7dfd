// parallel.mode: local_sgd's rules, one place for both of its forms: the mode over the
// job's data replicas (modes/local_sgd.cpp) and over a fault-tolerant job's replicas
// (modes/local_replicas.cpp).
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include <torch/types.h>

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

}  // namespace dtrain
