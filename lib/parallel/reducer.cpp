#include "parallel/reducer.hpp"

#include <chrono>

#include <torch/csrc/autograd/utils/lambda_post_hook.h>

namespace dtrain {

GradReducer::GradReducer(torch::nn::Module& model, FlatParams& params,
                         std::shared_ptr<Comm> comm, double bucket_mb)
    : params_(params), comm_(std::move(comm)) {
  const auto& entries = params_.entries();
  const int64_t cap = std::max<int64_t>(1, int64_t(bucket_mb * 1024 * 1024 / 4));
  std::vector<size_t> bucket_of(entries.size());
  // Walk parameters last to first, closing a bucket once it holds `cap` values.
  for (size_t k = entries.size(); k-- > 0;) {
    const auto& e = entries[k];
    if (buckets_.empty() || buckets_.back().numel >= cap)
      buckets_.push_back({e.offset + e.numel, 0, 0, 0});
    auto& b = buckets_.back();
    b.offset = e.offset;
    b.numel += e.numel;
    b.params += 1;
    bucket_of[k] = buckets_.size() - 1;
  }
  for (auto& b : buckets_) b.remaining = b.params;
  auto named = model.named_parameters(/*recurse=*/true);
  for (size_t k = 0; k < entries.size(); ++k) {
    auto acc = torch::autograd::impl::grad_accumulator(named[k].value());
    const size_t bucket = bucket_of[k];
    acc->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
        [this, bucket](const torch::autograd::variable_list& outputs,
                       const torch::autograd::variable_list&) {
          on_grad_ready(bucket);
          return outputs;
        }));
    accumulators_.push_back(std::move(acc));
  }
}

void GradReducer::on_grad_ready(size_t bucket) {
  if (!sync_) return;
  if (--buckets_[bucket].remaining == 0) launch_ready();
}

void GradReducer::launch_ready() {
  const double scale = 1.0 / double(comm_->size());
  while (next_launch_ < buckets_.size() && buckets_[next_launch_].remaining == 0) {
    const auto& b = buckets_[next_launch_++];
    auto view = params_.grad().narrow(0, b.offset, b.numel);
    view.mul_(scale);  // sum of grad/N = the average
    inflight_.push_back(comm_->all_reduce_async(view));
  }
}

double GradReducer::finalize() {
  const auto t0 = std::chrono::steady_clock::now();
  for (auto& b : buckets_) b.remaining = 0;  // parameters unused this step count as ready
  launch_ready();
  for (auto& p : inflight_) p->wait();
  inflight_.clear();
  next_launch_ = 0;
  for (auto& b : buckets_) b.remaining = b.params;
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace dtrain
