#include "parallel/grad_sync.hpp"

#include <torch/torch.h>

#include "comm/comm.hpp"
#include "config/config.hpp"
#include "parallel/flat_params.hpp"
#include "parallel/grad_buckets.hpp"
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

// The sum over the group, in place, every value on the wire as it is.
class AllReduce : public Reduction {
 public:
  explicit AllReduce(std::shared_ptr<Comm> comm) : comm_(std::move(comm)) {}
  std::unique_ptr<Pending> start(torch::Tensor slice) override {
    return comm_->all_reduce_async(slice);
  }
  int64_t wire_bytes(int64_t numel, int64_t element_size) const override {
    return numel * element_size;
  }

 private:
  std::shared_ptr<Comm> comm_;
};

// Each bucket reduced as soon as it is final, asynchronously, so the communication
// overlaps the rest of backward; finish() waits for all of them.
class BucketedSync : public GradSync {
 public:
  BucketedSync(FlatParams& params, std::unique_ptr<Reduction> reduction, int64_t ranks,
               double bucket_mb, int64_t micro_batches)
      : params_(params),
        reduction_(std::move(reduction)),
        factor_(1.0 / double(micro_batches * ranks)),
        buckets_(params, bucket_mb, [this](int64_t offset, int64_t numel) {
          inflight_.push_back(reduction_->start(params_.grad().narrow(0, offset, numel)));
        }) {}
  // The loss is scaled by 1 / (micro-batches x ranks), so the reduction is a plain sum.
  double loss_factor() const override { return factor_; }
  void begin_micro_batch(bool last) override { buckets_.arm(last); }
  void finish() override {
    buckets_.flush();  // buckets no hook completed (parameters unused this step)
    for (auto& p : inflight_) p->wait();
    inflight_.clear();
  }
  int64_t bytes_per_step() const override {
    return reduction_->wire_bytes(params_.grad().numel(), params_.grad().element_size());
  }

 private:
  FlatParams& params_;
  std::unique_ptr<Reduction> reduction_;
  double factor_;
  std::vector<std::unique_ptr<Pending>> inflight_;
  GradBuckets buckets_;  // last: its hooks use the members above
};

}  // namespace

std::unique_ptr<GradSync> make_grad_sync(const ParallelConfig& cfg, const Mesh& mesh,
                                         FlatParams& params, int64_t micro_batches) {
  if (mesh.dims().data == 1) return std::make_unique<NoSync>(micro_batches);
  return std::make_unique<BucketedSync>(params, std::make_unique<AllReduce>(mesh.data()),
                                        mesh.dims().data, cfg.bucket_mb, micro_batches);
}

}  // namespace dtrain
