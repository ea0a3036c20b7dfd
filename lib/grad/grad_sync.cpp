#include "grad/grad_sync.hpp"

#include <algorithm>
#include <cmath>

#include <fmt/format.h>
#include <torch/torch.h>

#include "comm/comm.hpp"
#include "grad/bucketed.hpp"
#include "grad/compression.hpp"
#include "grad/sync_cost.hpp"
#include "grad/zero.hpp"
#include "parallel/mesh.hpp"
#include "util/error.hpp"
#include "util/units.hpp"

namespace dtrain {

// Each copy gets its stage's share of the gradient: summed, both make the same update.
void Tied::sum(const FlatParams& params) const {
  for (size_t i : entries) group->all_reduce(params.view(params.grad(), i));
}

std::string Tied::saved_name(const FlatParams& params, const std::string& key) const {
  if (!copy) return key;
  for (size_t i : entries)
    if (key.rfind(params.entries()[i].name + ".", 0) == 0) return key + "_copy";
  return key;
}

NamedTensors Tied::owned(const FlatParams& params, const torch::Tensor& flat,
                         const std::string& suffix, int64_t tensor_rank, PartsOf& parts) const {
  NamedTensors out;
  for (auto& [key, t] : params.owned(flat, suffix, tensor_rank, parts)) {
    const auto saved_as = saved_name(params, key);
    if (saved_as != key)  // a split part keeps its placement under its new name
      if (auto part = parts.extract(key)) parts[saved_as] = part.mapped();
    out.emplace_back(saved_as, t);
  }
  return out;
}

void Tied::load(const FlatParams& params, const torch::Tensor& flat, const std::string& suffix,
                const SavedTensors& saved, int64_t tensor_rank) const {
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < params.entries().size(); ++i) {
    const auto& e = params.entries()[i];
    params.view(flat, i).copy_(
        saved.part(saved_name(params, e.name + suffix), e.full_shape, e.placement, tensor_rank));
  }
}

namespace {

class NoSync : public GradSync {
 public:
  NoSync(const FlatParams& params, int64_t micro_batches, Tied tied, Shard shard)
      : params_(params), factor_(1.0 / double(micro_batches)), tied_(std::move(tied)),
        shard_(shard) {}
  double loss_factor() const override { return factor_; }
  void finish() override { tied_.sum(params_); }
  Shard shard() const override { return shard_; }

 private:
  const FlatParams& params_;
  double factor_;
  Tied tied_;
  Shard shard_;
};

// PowerSGD's Q of entry `e` as saved: a split parameter's is its tensor rank's own (the
// power iteration ran on that rank's part), a replicated one's the same on all.
std::string factor_key(const FlatParams& params, const Tied& tied, size_t i, int64_t tensor_rank) {
  const auto& e = params.entries()[i];
  return tied.saved_name(params, e.name + ".powersgd_q" +
                                     (e.placement.is_split() ? fmt::format(".tp{}", tensor_rank) : ""));
}

}  // namespace

// The residuals, laid out like the flat gradient, go per data rank as each entry's part
// (".residual"); a tied weight's copy has its own ("_copy"). The Q matrices go with them,
// a replicated parameter's from tensor rank 0.
void BucketedSync::save(StateWriter& out) const {
  NamedTensors tensors;
  PartsOf parts;
  for (const auto& [name, flat] : reduction_->state())
    for (auto& named : tied_.owned(params_, flat, "." + name, tensor_rank_, parts))
      tensors.push_back(std::move(named));
  for (const auto& [i, q] : reduction_->factors())
    if (params_.entries()[i].placement.is_split() || tensor_rank_ == 0)
      tensors.emplace_back(factor_key(params_, tied_, i, tensor_rank_), q);
  if (!tensors.empty()) out.add(StateFile::kReplica, tensors, parts);
}

// The residuals when the checkpoint was written at this data and pipeline size (a pipeline
// gives a tied weight's copy a residual of its own), the Q matrices when at this tensor
// size too; else they start afresh, with a warning.
std::vector<torch::Tensor> BucketedSync::carried() const {
  std::vector<torch::Tensor> out;
  for (const auto& [name, t] : reduction_->state()) out.push_back(t);
  for (const auto& [entry, q] : reduction_->factors()) out.push_back(q);
  return out;
}

void BucketedSync::load(const StateReader& in) {
  const auto state = reduction_->state();
  const auto factors = reduction_->factors();
  if (state.empty() && factors.empty()) return;
  if (!in.replica_fits(fmt::format("warning: parallel.compression: the residuals start from zero{}",
                                   factors.empty() ? "" : " and PowerSGD's Q matrices afresh")))
    return;
  const SavedTensors tensors = in.tensors(StateFile::kReplica);
  for (const auto& [name, flat] : state) tied_.load(params_, flat, "." + name, tensors, tensor_rank_);
  torch::NoGradGuard no_grad;
  if (factors.empty()) return;
  // Each Q is the power iteration's own state on its rank's matrix: another split, another
  // matrix. Another rank (powersgd_rank) has them shaped otherwise.
  const auto saved = in.saved_layout(), now = in.layout();
  std::string why = saved.tensor != now.tensor
                        ? fmt::format("the checkpoint was written at tensor size {}, this run "
                                      "has {}", saved.tensor, now.tensor)
                        : "";
  std::vector<torch::Tensor> got;
  for (const auto& [i, q] : factors) {
    if (!why.empty()) break;
    try {
      got.push_back(tensors.at(factor_key(params_, tied_, i, tensor_rank_), q.sizes().vec()));
    } catch (const CheckpointError& e) {
      why = first_line(e.what());
    }
  }
  if (!why.empty()) {
    in.warn(fmt::format("warning: parallel.compression: PowerSGD's Q matrices start afresh ({})", why));
    return;
  }
  for (size_t j = 0; j < factors.size(); ++j) factors[j].second.copy_(got[j]);
}

std::unique_ptr<GradSync> make_no_sync(const FlatParams& params, int64_t micro_batches, Tied tied,
                                       Shard shard) {
  return std::make_unique<NoSync>(params, micro_batches, std::move(tied), shard);
}

std::unique_ptr<GradSync> make_all_reduce_sync(const ParallelConfig& cfg, const Mesh& mesh,
                                               FlatParams& params, int64_t micro_batches, Tied tied) {
  return std::make_unique<BucketedSync>(params, std::make_unique<AllReduce>(mesh.data()),
                                        mesh.dims().data, cfg.bucket_mb, micro_batches,
                                        std::move(tied), mesh.coord().tensor);
}

namespace {

// The reduction's sum is each replica's share-weighted gradient's, so ranks = 1: the
// scaling is all in the loss factor. A compression's state, kept as each step begins, is
// put back when the step is discarded (it is trained again from where it began).
class ReplicaSync : public BucketedSync {
 public:
  ReplicaSync(const ParallelConfig& cfg, const std::shared_ptr<Comm>& replicas, FlatParams& params,
              int64_t micro_batches, int64_t total_steps, int64_t tensor_rank,
              std::function<double()> share, Tied tied)
      : BucketedSync(params, reduction(cfg, replicas, params), /*ranks=*/1, cfg.bucket_mb,
                     micro_batches, std::move(tied), tensor_rank, std::make_unique<AllReduce>(replicas),
                     compression_warmup_steps(cfg, total_steps)),
        share_(std::move(share)) {}
  double loss_factor() const override { return BucketedSync::loss_factor() * share_(); }
  void begin_step(int64_t step) override {
    BucketedSync::begin_step(step);
    const auto now = carried();
    kept_.resize(now.size());
    for (size_t i = 0; i < now.size(); ++i)
      if (kept_[i].defined() && kept_[i].sizes() == now[i].sizes())
        kept_[i].copy_(now[i]);
      else
        kept_[i] = now[i].clone();
  }
  void discard() override {
    const auto now = carried();
    for (size_t i = 0; i < kept_.size(); ++i) now[i].copy_(kept_[i]);
  }

 private:
  static std::unique_ptr<Reduction> reduction(const ParallelConfig& cfg,
                                              const std::shared_ptr<Comm>& replicas,
                                              FlatParams& params) {
    const auto& how = compression_spec(cfg.compression);
    if (how.make) return how.make(cfg, replicas, params);
    return std::make_unique<AllReduce>(replicas);
  }

  std::function<double()> share_;
  std::vector<torch::Tensor> kept_;  // the carried state as the step began
};

}  // namespace

std::unique_ptr<GradSync> make_replica_sync(const ParallelConfig& cfg, std::shared_ptr<Comm> replicas,
                                            FlatParams& params, int64_t micro_batches,
                                            int64_t total_steps, int64_t tensor_rank,
                                            std::function<double()> share, Tied tied) {
  return std::make_unique<ReplicaSync>(cfg, replicas, params, micro_batches, total_steps,
                                       tensor_rank, std::move(share), std::move(tied));
}

std::unique_ptr<GradSync> make_grad_sync(const ParallelConfig& cfg, const Mesh& mesh,
                                         FlatParams& params, int64_t micro_batches,
                                         int64_t total_steps, Tied tied) {
  if (mesh.dims().data == 1) return make_no_sync(params, micro_batches, std::move(tied));
  if (cfg.zero > 0) return make_zero_sync(cfg, mesh, params, micro_batches, std::move(tied));
  if (const auto& how = compression_spec(cfg.compression); how.make)
    return std::make_unique<BucketedSync>(
        params, how.make(cfg, mesh.data(), params), mesh.dims().data, cfg.bucket_mb,
        micro_batches, std::move(tied), mesh.coord().tensor,
        std::make_unique<AllReduce>(mesh.data()), compression_warmup_steps(cfg, total_steps));
  return make_all_reduce_sync(cfg, mesh, params, micro_batches, std::move(tied));
}

double buckets_of(const ParallelConfig& cfg, int64_t numel) {
  return std::ceil(4 * double(numel) / (cfg.bucket_mb * kMiB));
}

GradientPath gradient_path(const FlatShape& shape, bool gathered) {
  GradientPath path;
  for (const auto& e : shape.entries) {
    path.largest = std::max(path.largest, double(e.numel * (gathered ? e.gathered : 4)));
    if (e.gathered < 4) path.copies += double(e.numel * e.gathered);
  }
  return path;
}

SyncCost unsharded_cost(const FlatShape& shape, int64_t pad_to) {
  FlatOptions opts;
  opts.pad_to = pad_to;
  const FlatSizes sizes = flat_sizes(opts, shape.total);
  SyncCost c;
  c.numel = sizes.numel;
  c.shard = sizes.numel;
  c.params = 4 * double(sizes.params);
  c.grads = 4 * double(sizes.grads);
  const GradientPath path = gradient_path(shape, /*gathered=*/false);
  c.buffers = path.largest + path.copies;
  c.bytes = 0;
  return c;
}

SyncCost grad_sync_cost(const ParallelConfig& cfg, const FlatShape& shape, const DataGroup& group) {
  if (group.ranks == 1) return unsharded_cost(shape);
  if (cfg.zero > 0) return zero_sync_cost(cfg, shape, group);
  SyncCost c = unsharded_cost(shape);
  const auto& how = compression_spec(cfg.compression);
  GradShape g;
  for (const auto& e : shape.entries) g.params.push_back({e.shape, e.numel});
  g.numel = c.numel;
  g.ranks = group.ranks;
  g.sums_16bit = group.sums_16bit;
  c.bytes = how.step_bytes(cfg, g);
  c.ops = double(how.ops_per_bucket) * buckets_of(cfg, c.numel);
  if (how.residual) c.buffers += 4 * double(c.numel);  // error feedback's
  return c;
}

}  // namespace dtrain
