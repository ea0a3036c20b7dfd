// The group across a fault-tolerant job's replicas (comm/quorum.hpp), as the rest of the
// code sees it: one Comm whose members change when a quorum does. A failure of one of its
// collectives (a member gone, its connection closed) is not thrown where the collective is
// waited on, deep in a gradient sync's hooks: it is remembered, every later collective of
// the step is skipped, and the step goes on to its vote, which reports it (TorchFT's
// managed process group does the same). What the skipped collectives leave in their tensors
// is garbage, which is sound only because a failed step is discarded whole; reform() then
// puts the survivors' new group in the old one's place.
//
// A member that dies closes its connections, and its peers' collectives with it fail. But
// Gloo has no abort (LibTorch 2.15's ProcessGroupGloo aborts single transfers only), and a
// group closes its own connections only once its operations have ended: with several
// collectives in flight (a gradient's buckets), survivors could wait on one another until
// the group's timeout. So a wait here gives up once the step has failed, or when the
// liveness (`gone`: the launcher's word, a stale heartbeat) says a member has gone; the
// failed group is dropped on a thread of its own. A collective given up on runs on in the
// backend until it ends, and may still write its result: every tensor a collective writes
// into is a staged copy, whose result reaches the caller's tensor only from a collective
// that completed (a transfer's is not: see exchange_async). NCCL's waits are not given up
// on: see Pending::wait_for.
#pragma once
#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "comm/comm.hpp"

namespace dtrain {

class ReplicaComm : public Comm {
 public:
  // Says which member has gone ("" while none has); asked every `every` of a wait.
  using Gone = std::function<std::string()>;
  explicit ReplicaComm(std::shared_ptr<Comm> group, Gone gone = nullptr,
                       std::chrono::milliseconds every = std::chrono::milliseconds(100));

  // In the quorum's group (kept past a failure: a failed step still weighs its shares).
  int64_t rank() const override { return rank_; }
  int64_t size() const override { return size_; }

  // Whether a collective failed since the last reform(), and the first failure's message.
  bool failed() const;
  std::string error() const;
  // The new quorum's group from here on; forgets the failure. The old group is dropped
  // without a collective on it (its members may be gone).
  void reform(std::shared_ptr<Comm> group);
  // Marks the step failed from outside (a member seen dead before anything was posted).
  void fail(const std::string& why);
  // Waits for `op`: false (the step marked failed) where it failed, or was given up on
  // because the step had failed or a member had gone.
  bool wait_out(Pending& op);
  // Who is asked from now on (nullptr: nobody; an owner that goes before this group).
  void watch_members(Gone gone);
  // Testing (fault_tolerance.debug_kill_in: reduce): this process kills itself (SIGKILL)
  // once it has posted `n` more collectives, the others' own still in flight.
  void die_after_posts(int64_t n) { die_after_ = n; }

  std::unique_ptr<Pending> all_reduce_async(torch::Tensor t, ReduceOp op) override;
  std::unique_ptr<Pending> reduce_async(torch::Tensor t, int64_t root) override;
  std::unique_ptr<Pending> broadcast_async(torch::Tensor t, int64_t root) override;
  std::vector<torch::Tensor> all_gather(const torch::Tensor& t) override;
  std::unique_ptr<Pending> all_gather_async(torch::Tensor out, const torch::Tensor& in) override;
  bool can_sum(torch::ScalarType type) const override;
  void barrier() override;
  std::unique_ptr<Pending> exchange_async(std::vector<P2POp> ops) override;
  void note_step(int64_t n) override;
  // Groups of a changing membership would change under their users: not offered.
  std::shared_ptr<Comm> new_group(const std::string& name,
                                  const std::vector<int64_t>& members) override;

 private:
  // Posts `op` on the group unless the step has failed; a failure, at post or at wait,
  // is remembered instead of thrown.
  // `written`: the tensors the operation writes into, each with whether it reads them too.
  template <class Post>
  std::unique_ptr<Pending> guarded(Post&& post,
                                   const std::vector<std::pair<torch::Tensor, bool>>& written = {});
  std::shared_ptr<Comm> live_group() const;
  // A copy of `t` for the backend to write into (holding t's values where `fill`): from
  // the pool of those a completed collective gave back, or new.
  torch::Tensor stage(const torch::Tensor& t, bool fill);
  // A collective's copies once it is over: where it `completed`, their results to the
  // callers' tensors and the copies to the pool; else left to the backend.
  void unstage(std::vector<std::pair<torch::Tensor, torch::Tensor>>& staged, bool completed);
  class Guarded;  // a collective in flight, waited as wait_out() says

  // Null once failed. Under mu_: a failure may be seen on any thread that waits.
  std::shared_ptr<Comm> group_;
  int64_t rank_ = 0, size_ = 1;
  bool sums_half_ = true, sums_bf16_ = true;  // the group's can_sum, kept like its size
  mutable std::mutex mu_;
  std::string error_;
  Gone gone_;  // under mu_
  std::atomic<int64_t> die_after_{0};
  std::chrono::milliseconds every_;
  // Under mu_: the copies free for reuse, oldest first, and the bytes of copies pooled, in
  // flight now, and at most in flight at once (the pool's bound: a step's buckets).
  std::vector<torch::Tensor> pool_;
  int64_t pooled_bytes_ = 0, staged_bytes_ = 0, peak_bytes_ = 0;
};

}  // namespace dtrain
