#include "grad/buckets.hpp"

#include <algorithm>

#include <torch/csrc/autograd/utils/lambda_post_hook.h>
#include <torch/torch.h>

#include "parallel/flat_params.hpp"
#include "util/units.hpp"

namespace dtrain {

int64_t bucket_numel(const FlatParams& params, double bucket_mb) {
  return std::max<int64_t>(1, int64_t(bucket_mb * kMiB / double(params.data().element_size())));
}

GradBuckets::GradBuckets(FlatParams& params, double bucket_mb, Ready ready, Arrived arrived)
    : ready_(std::move(ready)), arrived_(std::move(arrived)) {
  const auto& entries = params.entries();
  const int64_t cap = bucket_numel(params, bucket_mb);
  // Fixed-size slices from the end: a large parameter spans several buckets, so its
  // gradient goes out as several reductions that the backend's threads run side by side.
  const int64_t total = params.numel();
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
    auto acc = torch::autograd::impl::grad_accumulator(params.params()[k]);
    acc->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
        [this, k, buckets = buckets_of[k]](const torch::autograd::variable_list& outputs,
                                           const torch::autograd::variable_list&) {
          if (!armed_) return outputs;
          if (arrived_) arrived_(k);
          for (size_t b : buckets)
            if (--buckets_[b].remaining == 0) hand_out();
          return outputs;
        }));
    accumulators_.push_back(std::move(acc));
  }
}

void GradBuckets::hand_out() {
  while (next_ < buckets_.size() && buckets_[next_].remaining == 0) {
    const auto& b = buckets_[next_++];
    ready_(b.offset, b.numel);
  }
}

std::vector<std::pair<int64_t, int64_t>> GradBuckets::slices() const {
  std::vector<std::pair<int64_t, int64_t>> out;
  for (const auto& b : buckets_) out.emplace_back(b.offset, b.numel);
  return out;
}

void GradBuckets::flush() {
  for (auto& b : buckets_) b.remaining = 0;  // parameters unused this step count as ready
  hand_out();
  next_ = 0;
  for (auto& b : buckets_) b.remaining = b.params;
}

}  // namespace dtrain
