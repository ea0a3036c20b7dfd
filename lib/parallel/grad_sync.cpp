#include "parallel/grad_sync.hpp"

#include <algorithm>

#include <torch/torch.h>

#include "comm/comm.hpp"
#include "config/config.hpp"
#include "parallel/compression.hpp"
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
  std::unique_ptr<Pending> start(const torch::Tensor& grad, int64_t offset,
                                 int64_t numel) override {
    count(ring_all_reduce_bytes(numel * grad.element_size(), comm_->size()));
    return comm_->all_reduce_async(grad.narrow(0, offset, numel));
  }

 private:
  std::shared_ptr<Comm> comm_;
};

// ZeRO's reduction: the flat gradient is cut in equal shards, one per data rank, and each
// part of a ready slice is reduced to the rank whose shard holds it (a slice that crosses a
// shard boundary is two reductions), so a rank ends with its shard's sum, and a slice is
// still reduced as soon as backward has made it final (DeepSpeed's stage-2 bucketing does
// the same). Entries listed as `whole` are all-reduced instead: every rank needs them.
// On the wire, Gloo's reduce is a ring reduce-scatter then a gather to the root: a rank
// sends (D-1)/D of a slice plus, unless it owns it, 1/D; 0.75 of the bytes of the
// all-reduce at 2 ranks, 0.63 at 4. (Gloo in LibTorch 1.13 has no reduce-scatter; an
// all-reduce whose result each rank keeps a part of would send all of them.)
class ReduceToOwners : public Reduction {
 public:
  ReduceToOwners(std::shared_ptr<Comm> comm, int64_t shard_numel,
                 std::vector<std::pair<int64_t, int64_t>> whole)
      : comm_(std::move(comm)), shard_(shard_numel), whole_(std::move(whole)) {}

  std::unique_ptr<Pending> start(const torch::Tensor& grad, int64_t offset,
                                 int64_t numel) override {
    auto all = std::make_unique<PendingAll>();
    // Cut at the whole ranges' ends and the shards' boundaries.
    std::vector<int64_t> cuts{offset, offset + numel};
    for (const auto& [lo, hi] : whole_)
      for (int64_t at : {lo, hi}) cuts.push_back(at);
    for (int64_t at = (offset / shard_ + 1) * shard_; at < offset + numel; at += shard_)
      cuts.push_back(at);
    std::sort(cuts.begin(), cuts.end());
    const int64_t d = comm_->size();
    for (size_t i = 0; i + 1 < cuts.size(); ++i) {
      const int64_t from = std::max(cuts[i], offset), to = std::min(cuts[i + 1], offset + numel);
      if (from >= to) continue;
      auto part = grad.narrow(0, from, to - from);
      const int64_t bytes = (to - from) * grad.element_size(), owner = from / shard_;
      if (in_whole(from)) {
        count(ring_all_reduce_bytes(bytes, d));
        all->parts.push_back(comm_->all_reduce_async(part));
      } else {
        count(bytes * (d - 1) / d + (owner != comm_->rank() ? bytes / d : 0));
        all->parts.push_back(comm_->reduce_async(part, owner));
      }
    }
    return all;
  }

 private:
  bool in_whole(int64_t at) const {
    return std::any_of(whole_.begin(), whole_.end(),
                       [&](const auto& r) { return r.first <= at && at < r.second; });
  }
  std::shared_ptr<Comm> comm_;
  int64_t shard_;
  std::vector<std::pair<int64_t, int64_t>> whole_;  // [begin, end) of the whole entries
};

// Each bucket reduced as soon as it is final, asynchronously, so the communication
// overlaps the rest of backward; finish() waits for all of them. During the first
// `warmup` steps the buckets go to `plain` (an all-reduce) instead of `reduction`
// (compression's warm-up: 1-bit Adam's lesson, the first steps' gradients move most).
class BucketedSync : public GradSync {
 public:
  BucketedSync(FlatParams& params, std::unique_ptr<Reduction> reduction, int64_t ranks,
               double bucket_mb, int64_t micro_batches,
               std::unique_ptr<Reduction> plain = nullptr, int64_t warmup = 0)
      : params_(params),
        reduction_(std::move(reduction)),
        plain_(std::move(plain)),
        warmup_(warmup),
        active_(reduction_.get()),
        factor_(1.0 / double(micro_batches * ranks)),
        buckets_(params, bucket_mb, [this](int64_t offset, int64_t numel) {
          inflight_.push_back(active_->start(params_.grad(), offset, numel));
        }) {}
  // The loss is scaled by 1 / (micro-batches x ranks), so the reduction is a plain sum.
  double loss_factor() const override { return factor_; }
  void begin_step(int64_t step) override {
    active_ = plain_ && step <= warmup_ ? plain_.get() : reduction_.get();
  }
  void begin_micro_batch(bool last) override { buckets_.arm(last); }
  void finish() override {
    buckets_.flush();  // buckets no hook completed (parameters unused this step)
    for (auto& p : inflight_) p->wait();
    inflight_.clear();
    sent_ = active_->take_sent();
  }
  void after_update(const torch::Tensor& skip) override { reduction_->after_step(skip); }
  NamedTensors state() const override { return reduction_->state(); }
  PerEntry factors() const override { return reduction_->factors(); }
  int64_t bytes_per_step() const override { return sent_; }

 protected:
  FlatParams& params_;
  int64_t sent_ = 0;  // by the last step

 private:
  std::unique_ptr<Reduction> reduction_, plain_;
  int64_t warmup_;
  Reduction* active_;
  double factor_;
  std::vector<std::unique_ptr<Pending>> inflight_;
  GradBuckets buckets_;  // last: its hooks use the members above
};

// ZeRO-1: the optimizer updates this rank's shard from its shard's reduced gradient (and
// keeps state for the shard only); the updated shards are then all-gathered, so every rank
// runs the next forward on the whole of the new parameters.
class ZeroSync : public BucketedSync {
 public:
  ZeroSync(FlatParams& params, std::shared_ptr<Comm> data, Shard shard,
           std::vector<std::pair<int64_t, int64_t>> whole, double bucket_mb,
           int64_t micro_batches)
      : BucketedSync(params, std::make_unique<ReduceToOwners>(data, shard.numel, std::move(whole)),
                     data->size(), bucket_mb, micro_batches),
        data_(std::move(data)),
        shard_(shard) {}
  Shard shard() const override { return shard_; }
  void after_update(const torch::Tensor& skip) override {
    BucketedSync::after_update(skip);
    // The backend copies this rank's part into the output too: from a copy, not an alias.
    const auto mine = params_.data().narrow(0, shard_.offset, shard_.numel).clone();
    data_->all_gather_into(params_.data(), mine);
    const int64_t d = data_->size();
    sent_ += mine.numel() * mine.element_size() * (d - 1);
  }

 private:
  std::shared_ptr<Comm> data_;
  Shard shard_;
};

// Shards start at a multiple of this many elements (64 bytes in fp32): aligned for the
// vectorised update.
constexpr int64_t kShardAlign = 16;

}  // namespace

int64_t shard_padding(const ParallelConfig& cfg, const Mesh& mesh) {
  return cfg.zero > 0 && mesh.dims().data > 1 ? mesh.dims().data * kShardAlign : 1;
}

Shard update_shard(const ParallelConfig& cfg, const Mesh& mesh, const FlatParams& params) {
  if (cfg.zero == 0 || mesh.dims().data == 1) return {};
  return params.shard(mesh.dims().data, mesh.coord().data);
}

std::unique_ptr<GradSync> make_grad_sync(const ParallelConfig& cfg, const Mesh& mesh,
                                         FlatParams& params, int64_t micro_batches,
                                         const std::vector<size_t>& whole) {
  if (mesh.dims().data == 1) return std::make_unique<NoSync>(micro_batches);
  if (cfg.zero > 0) {
    std::vector<std::pair<int64_t, int64_t>> ranges;
    for (size_t i : whole) {
      const auto& e = params.entries()[i];
      ranges.emplace_back(e.offset, e.offset + e.numel);
    }
    return std::make_unique<ZeroSync>(params, mesh.data(), update_shard(cfg, mesh, params),
                                      std::move(ranges), cfg.bucket_mb, micro_batches);
  }
  if (cfg.compression != "none")
    return std::make_unique<BucketedSync>(
        params, make_compression(cfg, mesh.data(), params), mesh.dims().data, cfg.bucket_mb,
        micro_batches, std::make_unique<AllReduce>(mesh.data()), cfg.compression_warmup);
  return std::make_unique<BucketedSync>(params, std::make_unique<AllReduce>(mesh.data()),
                                        mesh.dims().data, cfg.bucket_mb, micro_batches);
}

}  // namespace dtrain
