// What the bucketed strategies share (grad_sync.cpp, zero.cpp): BucketedSync reduces each
// bucket of the flat gradient as soon as backward has made it final, through a Reduction.
// Internal to the gradient room.
#pragma once
#include <memory>
#include <vector>

#include "comm/comm.hpp"
#include "grad/buckets.hpp"
#include "grad/grad_sync.hpp"

namespace dtrain {

// The sum over the group, in place, every value on the wire as it is.
class AllReduce : public Reduction {
 public:
  explicit AllReduce(std::shared_ptr<Comm> comm) : comm_(std::move(comm)) {}
  std::unique_ptr<Pending> start(const torch::Tensor& slice, int64_t /*offset*/) override {
    count(ring_all_reduce_bytes(slice.numel() * slice.element_size(), comm_->size()));
    return comm_->all_reduce_async(slice);
  }

 private:
  std::shared_ptr<Comm> comm_;
};

// Each bucket reduced as soon as it is final, asynchronously, so the communication
// overlaps the rest of backward; finish() waits for all of them. During the first
// `warmup` steps the buckets go to `plain` (an all-reduce) instead of `reduction`
// (compression's warm-up: 1-bit Adam's lesson, the first steps' gradients move most).
class BucketedSync : public GradSync {
 public:
  BucketedSync(FlatParams& params, std::unique_ptr<Reduction> reduction, int64_t ranks,
               double bucket_mb, int64_t micro_batches, Tied tied, int64_t tensor_rank,
               std::unique_ptr<Reduction> plain = nullptr, int64_t warmup = 0)
      : params_(params),
        tensor_rank_(tensor_rank),
        tied_(std::move(tied)),
        reduction_(std::move(reduction)),
        plain_(std::move(plain)),
        warmup_(warmup),
        active_(reduction_.get()),
        factor_(1.0 / double(micro_batches * ranks)),
        buckets_(
            params, bucket_mb,
            [this](int64_t offset, int64_t numel) {
              inflight_.push_back(launch(offset, numel));
              // Dropped once waited for: a reduction may hold a staging buffer (ZeRO-2's).
              while (max_inflight_ > 0 && inflight_.size() - waited_ > max_inflight_)
                std::exchange(inflight_[waited_++], nullptr)->wait();
            },
            [this](size_t entry) { arrived(entry); }) {}
  // The loss is scaled by 1 / (micro-batches x ranks), so the reduction is a plain sum.
  double loss_factor() const override { return factor_; }
  void begin_step(int64_t step) override {
    active_ = plain_ && step <= warmup_ ? plain_.get() : reduction_.get();
  }
  void begin_micro_batch(bool last) override { buckets_.arm(last); }
  void finish() override {
    buckets_.flush();  // buckets no hook completed (parameters unused this step)
    for (size_t i = waited_; i < inflight_.size(); ++i) inflight_[i]->wait();
    inflight_.clear();
    waited_ = 0;
    sent_ = active_->take_sent();
    sum_tied();
  }
  void after_update(const torch::Tensor& skip) override { reduction_->after_step(skip); }
  int64_t bytes_per_step() const override { return sent_; }
  // The reduction's residuals (per data rank) and PowerSGD's Q matrices (per tensor rank).
  void save(StateWriter& out) const override;
  void load(const StateReader& in) override;

 protected:
  // A final bucket's reduction, launched (in backward's hook).
  virtual std::unique_ptr<Pending> launch(int64_t offset, int64_t numel) {
    return reduce(params_.grad().narrow(0, offset, numel), offset);
  }
  std::unique_ptr<Pending> reduce(const torch::Tensor& slice, int64_t offset) {
    return active_->start(slice, offset);
  }
  // An entry's gradient is final (in backward's hook, before its buckets are counted).
  virtual void arrived(size_t /*entry*/) {}
  virtual void sum_tied() { tied_.sum(params_); }
  const GradBuckets& buckets() const { return buckets_; }
  // What the reduction carries from step to step: its residuals and factors (views).
  std::vector<torch::Tensor> carried() const;

  FlatParams& params_;
  int64_t tensor_rank_;
  Tied tied_;
  int64_t sent_ = 0;         // by the last step
  size_t max_inflight_ = 0;  // buckets reduced at once, beyond which a hook waits; 0: all

 private:
  std::unique_ptr<Reduction> reduction_, plain_;
  int64_t warmup_;
  Reduction* active_;
  double factor_;
  std::vector<std::unique_ptr<Pending>> inflight_;
  size_t waited_ = 0;  // inflight_'s first ones, already waited for
  GradBuckets buckets_;  // last: its hooks use the members above
};

}  // namespace dtrain
