#include "train/flat_params.hpp"

#include <torch/torch.h>

namespace dtrain {

FlatParams::FlatParams(torch::nn::Module& model, torch::MemoryFormat format) : format_(format) {
  auto named = model.named_parameters(/*recurse=*/true);
  int64_t total = 0;
  for (const auto& p : named) {
    entries_.push_back({p.key(), total, p.value().numel(), p.value().sizes().vec()});
    total += p.value().numel();
  }
  torch::NoGradGuard no_grad;
  data_ = torch::empty({total}, torch::kFloat32);
  grad_ = torch::zeros({total}, torch::kFloat32);
  for (size_t i = 0; i < entries_.size(); ++i) {
    auto& p = named[i].value();
    auto slot = view(data_, i);
    slot.copy_(p);
    p.set_data(slot);
    p.mutable_grad() = view(grad_, i);
  }
}

torch::Tensor FlatParams::view(const torch::Tensor& flat, size_t i) const {
  const auto& e = entries_[i];
  auto slot = flat.narrow(0, e.offset, e.numel);
  if (format_ == torch::MemoryFormat::ChannelsLast && e.shape.size() == 4)  // stored N,H,W,C
    return slot.view({e.shape[0], e.shape[2], e.shape[3], e.shape[1]}).permute({0, 3, 1, 2});
  return slot.view(e.shape);
}

}  // namespace dtrain
