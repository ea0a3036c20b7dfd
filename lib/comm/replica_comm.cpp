#include "comm/replica_comm.hpp"

#include <algorithm>
#include <csignal>
#include <stdexcept>
#include <thread>

#include "util/error.hpp"

namespace dtrain {
namespace {

class Skipped : public Pending {
 public:
  void wait() override {}
};

using Staged = std::vector<std::pair<torch::Tensor, torch::Tensor>>;
using Written = std::vector<std::pair<torch::Tensor, bool>>;

}  // namespace

// A collective in flight whose failure is remembered, not thrown.
class ReplicaComm::Guarded : public Pending {
 public:
  Guarded(std::unique_ptr<Pending> op, ReplicaComm& comm, Staged staged)
      : op_(std::move(op)), comm_(comm), staged_(std::move(staged)) {}
  ~Guarded() override {
    if (op_) comm_.unstage(staged_, false);  // never waited: left to the backend
  }
  void wait() override {
    if (!op_) return;
    // Given up on, it runs on in the backend, which holds what it writes into.
    comm_.unstage(staged_, comm_.wait_out(*op_));
    op_.reset();
  }

 private:
  std::unique_ptr<Pending> op_;
  ReplicaComm& comm_;
  Staged staged_;
};

ReplicaComm::ReplicaComm(std::shared_ptr<Comm> group, Gone gone, std::chrono::milliseconds every)
    : gone_(std::move(gone)), every_(std::max(every, std::chrono::milliseconds(1))) {
  reform(std::move(group));  // (0 would be c10d's "no timeout")
}

void ReplicaComm::watch_members(Gone gone) {
  std::lock_guard<std::mutex> lock(mu_);
  gone_ = std::move(gone);
}

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

bool ReplicaComm::wait_out(Pending& op) {
  try {
    while (!failed()) {
      if (op.wait_for(every_)) return true;
      Gone ask;
      {
        std::lock_guard<std::mutex> lock(mu_);
        ask = gone_;
      }
      const std::string gone = ask ? ask() : "";
      if (!gone.empty()) fail(gone);
    }
  } catch (const std::exception& e) {
    fail(first_line(e.what()));
  }
  return false;
}

torch::Tensor ReplicaComm::stage(const torch::Tensor& t, bool fill) {
  torch::Tensor s;
  const auto bytes = int64_t(t.nbytes());
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = std::find_if(pool_.begin(), pool_.end(), [&](const torch::Tensor& p) {
      return p.numel() == t.numel() && p.scalar_type() == t.scalar_type() && p.device() == t.device();
    });
    if (it != pool_.end()) s = std::move(*it), pool_.erase(it), pooled_bytes_ -= bytes;
  }
  s = s.defined() ? s.view(t.sizes()) : torch::empty(t.sizes(), t.options());
  if (fill) s.copy_(t);
  std::lock_guard<std::mutex> lock(mu_);
  staged_bytes_ += bytes;
  peak_bytes_ = std::max(peak_bytes_, staged_bytes_);
  return s;
}

void ReplicaComm::unstage(Staged& staged, bool completed) {
  try {
    if (completed)
      for (auto& [copy, caller] : staged) caller.copy_(copy);
  } catch (const std::exception& e) {
    fail(first_line(e.what()));
  }
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& [copy, caller] : staged) {
    const auto bytes = int64_t(copy.nbytes());
    staged_bytes_ -= bytes;
    if (!completed) continue;
    pool_.push_back(std::move(copy));
    pooled_bytes_ += bytes;
  }
  staged.clear();
  // At most what was ever in flight at once: the sizes a step takes stay, others age out.
  while (pooled_bytes_ > peak_bytes_) {
    pooled_bytes_ -= int64_t(pool_.front().nbytes());
    pool_.erase(pool_.begin());
  }
}

// Where the group's waits can be given up on, the tensors in `written` (each with whether
// the collective reads its values too) go to `post` as staged copies; else as they are.
template <class Post>
std::unique_ptr<Pending> ReplicaComm::guarded(Post&& post, const Written& written) {
  const auto group = live_group();
  if (!group) return std::make_unique<Skipped>();
  const bool stages = group->can_give_up();
  Staged staged;
  std::vector<torch::Tensor> given;
  for (const auto& [t, read] : written) {
    given.push_back(stages ? stage(t, read) : t);
    if (stages) staged.emplace_back(given.back(), t);
  }
  std::unique_ptr<Pending> op;
  try {
    op = post(*group, given);
  } catch (const std::exception& e) {
    unstage(staged, false);
    fail(first_line(e.what()));
    return std::make_unique<Skipped>();
  }
  count_sent(group->take_sent());
  if (die_after_ > 0 && --die_after_ == 0) std::raise(SIGKILL);
  return std::make_unique<Guarded>(std::move(op), *this, std::move(staged));
}

using Given = const std::vector<torch::Tensor>&;

std::unique_ptr<Pending> ReplicaComm::all_reduce_async(torch::Tensor t, ReduceOp op) {
  return guarded([&](Comm& g, Given s) { return g.all_reduce_async(s[0], op); }, {{t, true}});
}

std::unique_ptr<Pending> ReplicaComm::reduce_async(torch::Tensor t, int64_t root) {
  return guarded([&](Comm& g, Given s) { return g.reduce_async(s[0], root); }, {{t, true}});
}

// The root's tensor too: Gloo's CUDA broadcast writes it back from its own buffer.
std::unique_ptr<Pending> ReplicaComm::broadcast_async(torch::Tensor t, int64_t root) {
  return guarded([&](Comm& g, Given s) { return g.broadcast_async(s[0], root); },
                 {{t, rank() == root}});
}

std::unique_ptr<Pending> ReplicaComm::all_gather_async(torch::Tensor out, const torch::Tensor& in) {
  return guarded([&](Comm& g, Given s) { return g.all_gather_async(s[0], in); }, {{out, false}});
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
  guarded([](Comm& g, Given) {
    g.barrier();
    return std::unique_ptr<Pending>(std::make_unique<Skipped>());
  })->wait();
}

// Not staged, and waited out whole (Gloo's timed wait on a transfer fails it): the
// replicas' only transfers carry a joiner's state to it, and a joiner whose group fails
// ends (run/modes/replicas.cpp); a copy would double gigabytes of it.
std::unique_ptr<Pending> ReplicaComm::exchange_async(std::vector<P2POp> ops) {
  return guarded([&](Comm& g, Given) { return g.exchange_async(std::move(ops)); });
}

std::shared_ptr<Comm> ReplicaComm::new_group(const std::string& name, const std::vector<int64_t>&) {
  throw std::logic_error("group '" + name + "' asked of the replicas' group, whose members change");
}

}  // namespace dtrain
