#include "run/modes/async_ps/wire.hpp"

namespace dtrain::ps {

torch::Tensor pack(const std::vector<torch::Tensor>& buffers) {
  std::vector<torch::Tensor> flat;
  for (const auto& b : buffers) flat.push_back(b.reshape(-1).to(torch::kFloat32));
  return flat.empty() ? torch::empty({0}) : torch::cat(flat);
}

void unpack(const torch::Tensor& flat, const std::vector<torch::Tensor>& buffers) {
  torch::NoGradGuard no_grad;
  int64_t at = 0;
  for (const auto& b : buffers) {
    b.copy_(flat.narrow(0, at, b.numel()).view(b.sizes()));
    at += b.numel();
  }
}

void wait_for(Pending& p, const std::string& who, int64_t rank) {
  try {
    p.wait();
  } catch (const DistError& e) {
    throw DistError(fmt::format("rank {}: lost {}: {}", rank, who, e.what()));
  }
}

}  // namespace dtrain::ps
