// Data-parallel gradient averaging by bucketed all-reduce. The flat gradient buffer is cut
// into buckets of up to parallel.bucket_mb, from its end (the order backward produces
// gradients) to its start. An autograd post-hook on each parameter's AccumulateGrad node
// counts down the buckets it touches; a bucket whose gradients are all final is all-reduced
// at once, asynchronously, so the communication overlaps the rest of backward. Buckets are
// launched strictly in order, so every rank issues the same sequence of collectives.
#include <torch/csrc/autograd/utils/lambda_post_hook.h>
#include <torch/torch.h>

#include "config/config.hpp"
#include "parallel/flat_params.hpp"
#include "parallel/grad_sync.hpp"
#include "parallel/mesh.hpp"

namespace dtrain {
namespace {

class NoSync : public GradSync {
 public:
  explicit NoSync(int64_t micro_batches) : factor_(1.0 / double(micro_batches)) {}
  double loss_factor() const override { return factor_; }

 private:
  double factor_;
};

class BucketedAllReduce : public GradSync {
 public:
  BucketedAllReduce(FlatParams& params, std::shared_ptr<Comm> comm, double bucket_mb,
                    int64_t micro_batches);
  // The loss is scaled by 1 / (micro-batches x ranks), so the all-reduce is a plain sum.
  double loss_factor() const override { return factor_; }
  void begin_micro_batch(bool last) override { sync_ = last; }
  // Launches buckets no hook completed (parameters unused this step), waits for all.
  void finish() override;
  int64_t bytes_per_step() const override {
    return params_.grad().numel() * params_.grad().element_size();
  }

 private:
  struct Bucket {
    int64_t offset, numel;
    int64_t params;      // how many parameters overlap it
    int64_t remaining;   // hooks still to fire this step
  };
  void on_grad_ready(size_t bucket);
  void launch_ready();

  FlatParams& params_;
  std::shared_ptr<Comm> comm_;
  double factor_;
  std::vector<Bucket> buckets_;  // in launch order (highest offsets first)
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators_;  // hooks live on these
  std::vector<std::unique_ptr<Pending>> inflight_;
  size_t next_launch_ = 0;
  bool sync_ = true;
};

BucketedAllReduce::BucketedAllReduce(FlatParams& params, std::shared_ptr<Comm> comm,
                                     double bucket_mb, int64_t micro_batches)
    : params_(params), comm_(std::move(comm)),
      factor_(1.0 / double(micro_batches * comm_->size())) {
  const auto& entries = params_.entries();
  const int64_t cap = std::max<int64_t>(
      1, int64_t(bucket_mb * 1024 * 1024 / double(params_.grad().element_size())));
  // Buckets are fixed-size slices of the flat gradient, from its end (the gradients backward
  // produces first) to its start. A large parameter spans several buckets, so its gradient
  // goes out as several all-reduces that Gloo's threads run side by side.
  const int64_t total = params_.grad().numel();
  for (int64_t end = total; end > 0; end -= cap) {
    const int64_t begin = std::max<int64_t>(0, end - cap);
    buckets_.push_back({begin, end - begin, 0, 0});
  }
  std::vector<std::vector<size_t>> buckets_of(entries.size());
  for (size_t k = 0; k < entries.size(); ++k)
    for (size_t b = 0; b < buckets_.size(); ++b)
      if (entries[k].offset < buckets_[b].offset + buckets_[b].numel &&
          buckets_[b].offset < entries[k].offset + entries[k].numel) {
        buckets_of[k].push_back(b);
        buckets_[b].params += 1;
      }
  for (auto& b : buckets_) b.remaining = b.params;
  for (size_t k = 0; k < entries.size(); ++k) {
    auto acc = torch::autograd::impl::grad_accumulator(params_.params()[k]);
    acc->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
        [this, buckets = buckets_of[k]](const torch::autograd::variable_list& outputs,
                                        const torch::autograd::variable_list&) {
          for (size_t b : buckets) on_grad_ready(b);
          return outputs;
        }));
    accumulators_.push_back(std::move(acc));
  }
}

void BucketedAllReduce::on_grad_ready(size_t bucket) {
  if (!sync_) return;
  if (--buckets_[bucket].remaining == 0) launch_ready();
}

void BucketedAllReduce::launch_ready() {
  while (next_launch_ < buckets_.size() && buckets_[next_launch_].remaining == 0) {
    const auto& b = buckets_[next_launch_++];
    inflight_.push_back(comm_->all_reduce_async(params_.grad().narrow(0, b.offset, b.numel)));
  }
}

void BucketedAllReduce::finish() {
  for (auto& b : buckets_) b.remaining = 0;  // parameters unused this step count as ready
  launch_ready();
  for (auto& p : inflight_) p->wait();
  inflight_.clear();
  next_launch_ = 0;
  for (auto& b : buckets_) b.remaining = b.params;
}

}  // namespace

std::unique_ptr<GradSync> make_grad_sync(const ParallelConfig& cfg, const Mesh& mesh,
                                         FlatParams& params, int64_t micro_batches) {
  if (mesh.dims().data == 1) return std::make_unique<NoSync>(micro_batches);
  return std::make_unique<BucketedAllReduce>(params, mesh.data(), cfg.bucket_mb, micro_batches);
}

}  // namespace dtrain
