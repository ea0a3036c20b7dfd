#include "parallel/reducer.hpp"

#include <torch/csrc/autograd/utils/lambda_post_hook.h>

namespace dtrain {

GradReducer::GradReducer(torch::nn::Module& model, FlatParams& params,
                         std::shared_ptr<Comm> comm, double bucket_mb)
    : params_(params), comm_(std::move(comm)) {
  const auto& entries = params_.entries();
  const int64_t cap = std::max<int64_t>(1, int64_t(bucket_mb * 1024 * 1024 / 4));
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
  auto named = model.named_parameters(/*recurse=*/true);
  for (size_t k = 0; k < entries.size(); ++k) {
    auto acc = torch::autograd::impl::grad_accumulator(named[k].value());
    acc->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
        [this, buckets = buckets_of[k]](const torch::autograd::variable_list& outputs,
                                        const torch::autograd::variable_list&) {
          for (size_t b : buckets) on_grad_ready(b);
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
  while (next_launch_ < buckets_.size() && buckets_[next_launch_].remaining == 0) {
    const auto& b = buckets_[next_launch_++];
    inflight_.push_back(comm_->all_reduce_async(params_.grad().narrow(0, b.offset, b.numel)));
  }
}

void GradReducer::finalize() {
  for (auto& b : buckets_) b.remaining = 0;  // parameters unused this step count as ready
  launch_ready();
  for (auto& p : inflight_) p->wait();
  inflight_.clear();
  next_launch_ = 0;
  for (auto& b : buckets_) b.remaining = b.params;
}

}  // namespace dtrain
