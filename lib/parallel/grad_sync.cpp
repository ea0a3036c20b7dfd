#include "parallel/grad_sync.hpp"

#include <algorithm>

#include <torch/torch.h>

#include "comm/comm.hpp"
#include "config/config.hpp"
#include "parallel/flat_params.hpp"
#include "parallel/grad_buckets.hpp"
#include "parallel/mesh.hpp"

namespace dtrain {
namespace {

// What one rank sends in a ring all-reduce of `bytes` over `ranks`: a reduce-scatter and an
// all-gather, each (D-1)/D of the data.
int64_t ring_all_reduce_bytes(int64_t bytes, int64_t ranks) {
  return 2 * bytes * (ranks - 1) / ranks;
}

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
    return comm_->all_reduce_async(grad.narrow(0, offset, numel));
  }
  int64_t wire_bytes(const torch::Tensor& grad) const override {
    return ring_all_reduce_bytes(grad.numel() * grad.element_size(), comm_->size());
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
    for (size_t i = 0; i + 1 < cuts.size(); ++i) {
      const int64_t from = std::max(cuts[i], offset), to = std::min(cuts[i + 1], offset + numel);
      if (from >= to) continue;
      auto part = grad.narrow(0, from, to - from);
      all->parts.push_back(in_whole(from) ? comm_->all_reduce_async(part)
                                          : comm_->reduce_async(part, from / shard_));
    }
    return all;
  }
  int64_t wire_bytes(const torch::Tensor& grad) const override {
    const int64_t d = comm_->size(), elem = grad.element_size();
    int64_t whole = 0;
    for (const auto& [lo, hi] : whole_) whole += hi - lo;
    // Each of the D owners' reductions, summed: (D-1)/D of every shard, 1/D of the others'.
    const int64_t reduced = grad.numel() - whole;
    return reduced * elem * (d - 1) / d + reduced * elem * (d - 1) / d / d +
           ring_all_reduce_bytes(whole * elem, d);
  }

 private:
  struct PendingAll : Pending {
    std::vector<std::unique_ptr<Pending>> parts;
    void wait() override {
      for (auto& p : parts) p->wait();
    }
    bool done() override {
      return std::all_of(parts.begin(), parts.end(), [](auto& p) { return p->done(); });
    }
  };
  bool in_whole(int64_t at) const {
    return std::any_of(whole_.begin(), whole_.end(),
                       [&](const auto& r) { return r.first <= at && at < r.second; });
  }
  std::shared_ptr<Comm> comm_;
  int64_t shard_;
  std::vector<std::pair<int64_t, int64_t>> whole_;  // [begin, end) of the whole entries
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
          inflight_.push_back(reduction_->start(params_.grad(), offset, numel));
        }) {}
  // The loss is scaled by 1 / (micro-batches x ranks), so the reduction is a plain sum.
  double loss_factor() const override { return factor_; }
  void begin_micro_batch(bool last) override { buckets_.arm(last); }
  void finish() override {
    buckets_.flush();  // buckets no hook completed (parameters unused this step)
    for (auto& p : inflight_) p->wait();
    inflight_.clear();
  }
  int64_t bytes_per_step() const override { return reduction_->wire_bytes(params_.grad()); }

 protected:
  FlatParams& params_;

 private:
  std::unique_ptr<Reduction> reduction_;
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
  void after_update() override {
    // The backend copies this rank's part into the output too: from a copy, not an alias.
    const auto mine = params_.data().narrow(0, shard_.offset, shard_.numel).clone();
    data_->all_gather_into(params_.data(), mine);
  }
  int64_t bytes_per_step() const override {
    const int64_t d = data_->size();
    return BucketedSync::bytes_per_step() +
           params_.data().numel() * params_.data().element_size() * (d - 1) / d;
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
  return std::make_unique<BucketedSync>(params, std::make_unique<AllReduce>(mesh.data()),
                                        mesh.dims().data, cfg.bucket_mb, micro_batches);
}

}  // namespace dtrain
