#include "comm/replica_comm.hpp"

#include <stdexcept>
#include <thread>

#include "util/error.hpp"

namespace dtrain {
namespace {

class Skipped : public Pending {
 public:
  void wait() override {}
};

// A collective in flight whose failure is remembered, not thrown.
class Guarded : public Pending {
 public:
  Guarded(std::unique_ptr<Pending> op, ReplicaComm& comm) : op_(std::move(op)), comm_(comm) {}
  void wait() override {
    if (!op_) return;
    try {
      op_->wait();
    } catch (const std::exception& e) {
      comm_.fail(first_line(e.what()));
    }
    op_.reset();
  }

 private:
  std::unique_ptr<Pending> op_;
  ReplicaComm& comm_;
};

}  // namespace

ReplicaComm::ReplicaComm(std::shared_ptr<Comm> group) { reform(std::move(group)); }

bool ReplicaComm::failed() const {
  std::lock_guard<std::mutex> lock(mu_);
  return !error_.empty();
}

std::string ReplicaComm::error() const {
  std::lock_guard<std::mutex> lock(mu_);
  return error_;
}

void ReplicaComm::fail(const std::string& why) {
  std::shared_ptr<Comm> failed;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!error_.empty()) return;
    error_ = why.empty() ? "a collective failed" : why;
    failed = std::move(group_);
  }
  // Its destructor waits for its operations still running: not here.
  std::thread([g = std::move(failed)]() mutable { g.reset(); }).detach();
}

void ReplicaComm::reform(std::shared_ptr<Comm> group) {
  std::lock_guard<std::mutex> lock(mu_);
  if (group_) count_sent(group_->take_sent());
  group_ = std::move(group);
  rank_ = group_->rank(), size_ = group_->size();
  sums_half_ = group_->can_sum(torch::kHalf), sums_bf16_ = group_->can_sum(torch::kBFloat16);
  error_.clear();
}

bool ReplicaComm::can_sum(torch::ScalarType type) const {
  return type == torch::kHalf ? sums_half_ : type == torch::kBFloat16 ? sums_bf16_ : true;
}

void ReplicaComm::note_step(int64_t n) {
  std::lock_guard<std::mutex> lock(mu_);
  if (group_) group_->note_step(n);
}

// The group while it has not failed, else null.
std::shared_ptr<Comm> ReplicaComm::live_group() const {
  std::lock_guard<std::mutex> lock(mu_);
  return group_;
}

template <class Post>
std::unique_ptr<Pending> ReplicaComm::guarded(Post&& post) {
  const auto group = live_group();
  if (!group) return std::make_unique<Skipped>();
  std::unique_ptr<Pending> op;
  try {
    op = post(*group);
  } catch (const std::exception& e) {
    fail(first_line(e.what()));
    return std::make_unique<Skipped>();
  }
  count_sent(group->take_sent());
  return std::make_unique<Guarded>(std::move(op), *this);
}

std::unique_ptr<Pending> ReplicaComm::all_reduce_async(torch::Tensor t, ReduceOp op) {
  return guarded([&](Comm& g) { return g.all_reduce_async(std::move(t), op); });
}

std::unique_ptr<Pending> ReplicaComm::reduce_async(torch::Tensor t, int64_t root) {
  return guarded([&](Comm& g) { return g.reduce_async(std::move(t), root); });
}

std::unique_ptr<Pending> ReplicaComm::broadcast_async(torch::Tensor t, int64_t root) {
  return guarded([&](Comm& g) { return g.broadcast_async(std::move(t), root); });
}

std::unique_ptr<Pending> ReplicaComm::all_gather_async(torch::Tensor out, const torch::Tensor& in) {
  return guarded([&](Comm& g) { return g.all_gather_async(std::move(out), in); });
}

// Through all_gather_async: one path for the failure. A failed step's copies are zeros.
std::vector<torch::Tensor> ReplicaComm::all_gather(const torch::Tensor& t) {
  const int64_t n = size();
  auto flat = torch::zeros({n * t.numel()}, t.options());
  all_gather_async(flat, t.contiguous())->wait();
  std::vector<torch::Tensor> out;
  for (int64_t r = 0; r < n; ++r) out.push_back(flat.narrow(0, r * t.numel(), t.numel()).view(t.sizes()));
  return out;
}

void ReplicaComm::barrier() {
  guarded([](Comm& g) {
    g.barrier();
    return std::unique_ptr<Pending>(std::make_unique<Skipped>());
  })->wait();
}

std::unique_ptr<Pending> ReplicaComm::exchange_async(std::vector<P2POp> ops) {
  return guarded([&](Comm& g) { return g.exchange_async(std::move(ops)); });
}

std::shared_ptr<Comm> ReplicaComm::new_group(const std::string& name, const std::vector<int64_t>&) {
  throw std::logic_error("group '" + name + "' asked of the replicas' group, whose members change");
}

}  // namespace dtrain
