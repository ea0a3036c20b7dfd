// The collectives dtrain uses, over one group of processes. This is the only interface the
// rest of the code sees: the c10d calls (whose signatures differ between LibTorch 1.13 and
// 2.x) stay inside comm.cpp. Every wait is bounded by dist.timeout_s; a failure or a
// timeout throws DistError naming the operation and the rank (exit code 4).
#pragma once
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <torch/types.h>

#include "launch/world.hpp"

namespace dtrain {

// An operation in flight.
class Pending {
 public:
  virtual ~Pending() = default;
  virtual void wait() = 0;
};

class Comm {
 public:
  virtual ~Comm() = default;
  virtual int64_t rank() const = 0;
  virtual int64_t size() const = 0;

  // In-place sum over the group; the tensor must be contiguous.
  virtual std::unique_ptr<Pending> all_reduce_async(torch::Tensor t) = 0;
  void all_reduce(torch::Tensor t) { all_reduce_async(std::move(t))->wait(); }
  virtual void broadcast(torch::Tensor t, int64_t root) = 0;
  // Each rank's `t`, in rank order.
  virtual std::vector<torch::Tensor> all_gather(const torch::Tensor& t) = 0;
  virtual void barrier() = 0;
  virtual void send(torch::Tensor t, int64_t dst, int tag) = 0;
  virtual void recv(torch::Tensor t, int64_t src, int tag) = 0;
};

// A world of one: every collective is the identity and nothing is set up.
std::shared_ptr<Comm> make_local_comm();

struct CommOptions {
  std::string backend = "gloo";          // gloo | nccl
  std::chrono::seconds timeout{120};
  int64_t gloo_threads = 2;              // Gloo's worker threads per process
};

// Rendezvous through a TCPStore at world.master_addr:master_port (rank 0 hosts it), then
// a Gloo or NCCL process group over all ranks.
std::shared_ptr<Comm> make_c10d_comm(const WorldInfo& world, const CommOptions& opts);

}  // namespace dtrain
