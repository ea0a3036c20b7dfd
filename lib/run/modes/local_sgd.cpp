#include "train/mode.hpp"

#include <torch/torch.h>

#include "optim/optimizer.hpp"
#include "parallel/grad_sync.hpp"
#include "parallel/mesh.hpp"

namespace dtrain {
namespace {

class SyncMode : public TrainingMode {
 public:
  explicit SyncMode(const Mesh& mesh) : mesh_(mesh) {}
  bool meets(int64_t /*n*/) const override { return true; }
  Comm& figures_group(int64_t /*n*/) const override { return *mesh_.world(); }
  int64_t replicas(int64_t /*n*/) const override { return mesh_.dims().data; }

 private:
  const Mesh& mesh_;
};

// Local SGD (Stich 2019; post-local SGD, Lin et al. 2020, as PyTorch's PostLocalSGD): the
// gradient sync steps locally after local_after steps (make_grad_sync), and here the
// replicas' parameters, floating-point buffers and, when asked, optimizer slots are
// averaged over the data group where they meet. Gloo's ring all-reduce leaves the same bits
// on every rank, so after an average the replicas are equal, not just close.
class LocalSgdMode : public TrainingMode {
 public:
  LocalSgdMode(const JobConfig& cfg, const Mesh& mesh, FlatParams& params, Optimizer& optimizer,
               NamedTensors buffers, int64_t total_steps)
      : cfg_(cfg.parallel), mesh_(mesh), params_(params), optimizer_(optimizer),
        total_steps_(total_steps) {
    for (auto& [name, b] : buffers)
      if (b.is_floating_point()) buffers_.push_back(b);
  }

  bool meets(int64_t n) const override {
    return !steps_locally(cfg_, n) || (n - cfg_.local_after) % cfg_.average_every == 0 ||
           n == total_steps_;
  }
  Comm& figures_group(int64_t n) const override {
    return meets(n) ? *mesh_.world() : *mesh_.replica();
  }
  int64_t replicas(int64_t n) const override { return meets(n) ? mesh_.dims().data : 1; }

  int64_t after_update(int64_t n) override {
    if (!steps_locally(cfg_, n) || !meets(n)) return 0;
    auto& data = *mesh_.data();  // two or more ranks: make_mode's condition
    torch::NoGradGuard no_grad;
    std::vector<torch::Tensor> all{params_.data()};
    for (const auto& b : buffers_) all.push_back(b);
    if (cfg_.average_optimizer)
      for (const auto& [name, slot] : optimizer_.slots()) all.push_back(slot);
    int64_t bytes = 0;
    auto pending = std::make_unique<PendingAll>();
    for (const auto& t : all) {
      bytes += ring_all_reduce_bytes(t.numel() * t.element_size(), data.size());
      pending->parts.push_back(data.all_reduce_async(t, ReduceOp::kAvg));
    }
    pending->wait();
    return bytes;
  }

  NamedTensors replica_state() const override {
    if (cfg_.average_optimizer) return {};
    return optimizer_.slots();
  }

 private:
  const ParallelConfig& cfg_;
  const Mesh& mesh_;
  FlatParams& params_;
  Optimizer& optimizer_;
  int64_t total_steps_;
  std::vector<torch::Tensor> buffers_;
};

}  // namespace

std::unique_ptr<TrainingMode> make_mode(const JobConfig& cfg, const Mesh& mesh, FlatParams& params,
                                        Optimizer& optimizer, NamedTensors buffers,
                                        int64_t total_steps) {
  if (cfg.parallel.mode == "local_sgd" && mesh.dims().data > 1)
    return std::make_unique<LocalSgdMode>(cfg, mesh, params, optimizer, std::move(buffers),
                                          total_steps);
  return std::make_unique<SyncMode>(mesh);
}

}  // namespace dtrain
