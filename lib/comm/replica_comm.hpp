// The group across a fault-tolerant job's replicas (comm/quorum.hpp), as the rest of the
// code sees it: one Comm whose members change when a quorum does. A failure of one of its
// collectives (a member gone, its connection closed) is not thrown where the collective is
// waited on, deep in a gradient sync's hooks: it is remembered, every later collective of
// the step is skipped, and the step goes on to its vote, which reports it (TorchFT's
// managed process group does the same). What the skipped collectives leave in their tensors
// is garbage, which is sound only because a failed step is discarded whole; reform() then
// puts the survivors' new group in the old one's place.
//
// The failed group is dropped at once, on a thread of its own (its process group closes
// its connections once its own operations have ended): a member waiting for data from
// this one, not from the one that died, then fails too instead of waiting out the group's
// timeout. Gloo has no abort of its own (LibTorch 2.15's ProcessGroupGloo aborts single
// transfers only); a member that dies closes its connections the same way.
#pragma once
#include <memory>
#include <mutex>
#include <string>

#include "comm/comm.hpp"

namespace dtrain {

class ReplicaComm : public Comm {
 public:
  explicit ReplicaComm(std::shared_ptr<Comm> group);

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
  template <class Post>
  std::unique_ptr<Pending> guarded(Post&& post);
  std::shared_ptr<Comm> live_group() const;

  // Null once failed. Under mu_: a failure may be seen on any thread that waits.
  std::shared_ptr<Comm> group_;
  int64_t rank_ = 0, size_ = 1;
  bool sums_half_ = true, sums_bf16_ = true;  // the group's can_sum, kept like its size
  mutable std::mutex mu_;
  std::string error_;
};

}  // namespace dtrain
