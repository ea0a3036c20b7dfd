// The collectives dtrain uses, over one group of processes. This is the only interface the
// rest of the code sees: the c10d calls (whose signatures change between LibTorch
// versions) stay inside comm.cpp. Every wait is bounded by dist.timeout_s; a failure or a
// timeout throws DistError naming the operation, the group and the world rank (exit 4).
#pragma once
#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <torch/types.h>

#include "launch/world.hpp"

namespace dtrain {

enum class ReduceOp { kSum, kAvg, kMax };

// An operation in flight.
class Pending {
 public:
  virtual ~Pending() = default;
  virtual void wait() = 0;
  // Waits up to about `slice` for each of its parts: true once the operation has completed
  // (as wait() leaves it), false while it still runs, to be asked again or given up on (a
  // fault-tolerant job's replicas stop waiting on a member that has gone,
  // comm/replica_comm.hpp). What cannot wait a while (Comm::can_give_up) waits it out
  // here, as wait() does.
  virtual bool wait_for(std::chrono::milliseconds /*slice*/) {
    wait();
    return true;
  }
};

// Several operations as one.
class PendingAll : public Pending {
 public:
  std::vector<std::unique_ptr<Pending>> parts;
  void wait() override {
    for (auto& p : parts) p->wait();
  }
  bool wait_for(std::chrono::milliseconds slice) override {
    for (auto& p : parts)
      if (!p->wait_for(slice)) return false;
    return true;
  }
};

// An operation, and what to do with its result once it has arrived (`then` runs once, in
// the first wait()).
class PendingThen : public Pending {
 public:
  PendingThen(std::unique_ptr<Pending> op, std::function<void()> then)
      : op_(std::move(op)), then_(std::move(then)) {}
  void wait() override {
    op_->wait();
    if (then_) std::exchange(then_, nullptr)();
  }
  bool wait_for(std::chrono::milliseconds slice) override {
    if (!op_->wait_for(slice)) return false;
    if (then_) std::exchange(then_, nullptr)();
    return true;
  }

 private:
  std::unique_ptr<Pending> op_;
  std::function<void()> then_;
};

// One point-to-point transfer of a batch (see Comm::exchange_async).
struct P2POp {
  enum Kind { kSend, kRecv } kind;
  torch::Tensor tensor;  // contiguous; filled in place for kRecv
  int64_t peer;          // group rank
  // Transfers between two ranks match in the order they are posted, per tag: separate
  // streams (a pipeline's activations and gradients) take separate tags.
  int tag = 0;
};

class Comm {
 public:
  virtual ~Comm() = default;
  virtual int64_t rank() const = 0;
  virtual int64_t size() const = 0;
  // The bytes this rank has sent through the group since the last call, by Gloo's
  // algorithms: an all-reduce of B bytes over D ranks sends 2B(D-1)/D, a reduce B(D-1)/D
  // and off the root B/D more, a broadcast B(D-1)/D, an all-gather B(D-1), a send B.
  int64_t take_sent() { return sent_.exchange(0); }

  // In place over the group; the tensor must be contiguous. kAvg divides the sum by size().
  virtual std::unique_ptr<Pending> all_reduce_async(torch::Tensor t,
                                                    ReduceOp op = ReduceOp::kSum) = 0;
  void all_reduce(torch::Tensor t, ReduceOp op = ReduceOp::kSum) {
    all_reduce_async(std::move(t), op)->wait();
  }
  // The sum over the group into `t` on `root`, in place; on the other ranks `t` is left
  // undefined (the backend may use it as scratch). `t` must be contiguous.
  virtual std::unique_ptr<Pending> reduce_async(torch::Tensor t, int64_t root) = 0;
  // `root`'s `t` into every rank's `t`, in place.
  virtual std::unique_ptr<Pending> broadcast_async(torch::Tensor t, int64_t root) = 0;
  void broadcast(torch::Tensor t, int64_t root) { broadcast_async(std::move(t), root)->wait(); }
  // Each rank's `t`, in rank order.
  virtual std::vector<torch::Tensor> all_gather(const torch::Tensor& t) = 0;
  // Every rank's `in` side by side in one flat tensor: `out` holds size() * in.numel()
  // elements and rank r's `in` lands at [r * n, (r + 1) * n).
  void all_gather_into(torch::Tensor out, const torch::Tensor& in) {
    all_gather_async(std::move(out), in)->wait();
  }
  virtual std::unique_ptr<Pending> all_gather_async(torch::Tensor out, const torch::Tensor& in) = 0;
  // Whether the backend sums this type natively, at full speed: NCCL every float type;
  // Gloo fp32 and fp64 only (it adds 16-bit floats element by element through fp32: an
  // fp16 all-reduce of the MLP's gradient ran 3x slower, when measured, than gathering the
  // fp16 values and summing them here).
  virtual bool can_sum(torch::ScalarType type) const = 0;
  // Whether a wait on its collectives can return while they run (Pending::wait_for), to
  // be given up on.
  virtual bool can_give_up() const { return false; }
  virtual void barrier() = 0;
  // Sends and receives posted together and completed together, so two peers that each send
  // to and receive from the other cannot deadlock on the order they post them in.
  virtual std::unique_ptr<Pending> exchange_async(std::vector<P2POp> ops) = 0;
  void send(torch::Tensor t, int64_t dst, int tag = 0) {
    exchange_async({{P2POp::kSend, std::move(t), dst, tag}})->wait();
  }
  void recv(torch::Tensor t, int64_t src, int tag = 0) {
    exchange_async({{P2POp::kRecv, std::move(t), src, tag}})->wait();
  }

  // The step this rank is in, for the heartbeat that names hangs (comm/watch.hpp).
  virtual void note_step(int64_t /*n*/) {}

  // The group of the world ranks `members` (in that order; this process among them), named
  // `name` (unique per group in the job: it prefixes the group's rendezvous keys). Only the
  // members call it. A group of one needs no process group and gets a local Comm; a group
  // of every rank is a process group of its own (the mesh reuses the world's instead: a
  // fault-tolerant job's replicas drop theirs when it fails, comm/replica_comm.hpp).
  virtual std::shared_ptr<Comm> new_group(const std::string& name,
                                          const std::vector<int64_t>& members) = 0;

 protected:
  void count_sent(int64_t bytes) { sent_ += bytes; }

 private:
  std::atomic<int64_t> sent_{0};
};

// Autograd functions (SyncBatchNorm, the tensor-parallel conjugates) keep non-tensor state
// in saved_data, which holds only IValues: a Comm rides there as its address. The Comm
// outlives every graph (the mesh owns each group for the whole run).
inline int64_t comm_handle(Comm* comm) { return reinterpret_cast<int64_t>(comm); }
inline Comm* comm_from_handle(int64_t handle) { return reinterpret_cast<Comm*>(handle); }

// A world of one: every collective is the identity and nothing is set up.
std::shared_ptr<Comm> make_local_comm();

// A group that only says its rank and size, for building a rank's share of a model where
// no group exists (`dtrain plan`); any communication throws std::logic_error.
std::shared_ptr<Comm> make_shape_comm(int64_t rank, int64_t size);

struct CommOptions {
  std::string backend = "gloo";          // gloo | nccl
  std::chrono::seconds timeout{120};
  int64_t gloo_threads = 2;              // Gloo's worker threads per process group
  bool store_everywhere = false;         // dist.store_bind: all (else MASTER_ADDR's interface)
  // This rank's device. NCCL moves CUDA tensors only: CPU tensors given to an NCCL group
  // (a few numbers: the step's agreement, evaluation sums) go through this device.
  c10::Device device = c10::Device(c10::kCPU);
  // Gloo's threads run at a higher priority than compute: right where every compute thread
  // of the machine's ranks has a core, wrong where they outnumber the cores (comm.cpp).
  bool comm_first = true;
  // dist.hang_report_s: a wait this long is named (comm/watch.hpp; 0: never), in lines
  // given to `say_hang` (stderr when unset).
  std::chrono::milliseconds hang_after{0};
  std::function<void(const std::string&)> say_hang;
};

// Rendezvous through a store at world.master_addr:master_port (rank 0 hosts dtrain's
// TcpStore on that address, or under torchrun its agent hosts a TCPStore), then a Gloo or
// NCCL process group over all ranks.
std::shared_ptr<Comm> make_c10d_comm(const WorldInfo& world, const CommOptions& opts);

// One rank of a group whose ranks are threads of this process (tests/unit/ranks.hpp):
// they find each other through an in-memory store shared by the calls that name the same
// `rendezvous`, and talk over real Gloo on loopback.
std::shared_ptr<Comm> make_in_process_comm(const std::string& rendezvous, int64_t rank,
                                           int64_t size, const CommOptions& opts = {});

}  // namespace dtrain
