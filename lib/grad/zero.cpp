// ZeRO (Rajbhandari et al. 2020; DeepSpeed's stages 1 to 3): the optimizer state, under
// stage 2 the gradient, under stage 3 the parameters too, sharded over the data ranks as
// offsets into the flat buffers (llm.c's ShardInfo): each shard's gradient is reduced to
// its owner, the owner updates its shard, and the updated shards go back to every rank
// (stages 1 and 2: after the update; stage 3: a unit at a time, where forward needs it).
#include "grad/zero.hpp"

#include <algorithm>
#include <map>
#include <set>

#include <torch/torch.h>

#include "grad/bucketed.hpp"
#include "grad/sync_cost.hpp"
#include "parallel/mesh.hpp"
#include "util/units.hpp"

namespace dtrain {
namespace {

// ZeRO's reduction: the flat gradient is cut in equal shards, one per data rank, and each
// part of a ready slice is reduced to the rank whose shard holds it (a slice that crosses a
// shard boundary is two reductions), so a rank ends with its shard's sum, and a slice is
// still reduced as soon as backward has made it final (DeepSpeed's stage-2 bucketing does
// the same). Entries listed as `whole` are all-reduced instead: every rank needs them.
// On the wire, Gloo's reduce is a ring reduce-scatter then a gather to the root: a rank
// sends (D-1)/D of a slice plus, unless it owns it, 1/D; 0.75 of the bytes of the
// all-reduce at 2 ranks, 0.63 at 4. (Gloo's reduce-scatter is an all-reduce whose
// result each rank keeps a part of: it would send all of them.)
class ReduceToOwners : public Reduction {
 public:
  ReduceToOwners(std::shared_ptr<Comm> comm, int64_t shard_numel,
                 std::vector<std::pair<int64_t, int64_t>> whole)
      : comm_(std::move(comm)), shard_(shard_numel), whole_(std::move(whole)) {}

  std::unique_ptr<Pending> start(const torch::Tensor& slice, int64_t offset) override {
    const int64_t numel = slice.numel();
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
      auto part = slice.narrow(0, from - offset, to - from);
      const int64_t bytes = (to - from) * slice.element_size(), owner = from / shard_;
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

// ZeRO-1: the optimizer updates this rank's shard from its shard's reduced gradient (and
// keeps state for the shard only); the updated shards then go to every rank, so that each
// runs the next forward on the whole of the new parameters. They go in pieces of about a
// bucket, each broadcast from the rank whose shard holds it, in the order of the flat
// buffer (the order the forward uses the layers), asynchronously: the forward waits for a
// layer's pieces only when it reaches that layer (before_use), so the later pieces travel
// while the earlier layers compute (DeepSpeed's and FSDP's prefetch, by layer). The bytes
// are the all-gather's.
class ZeroSync : public BucketedSync {
 public:
  ZeroSync(FlatParams& params, std::shared_ptr<Comm> data, Shard shard, Tied tied,
           double bucket_mb, int64_t micro_batches, AcrossReplicas across)
      : BucketedSync(params, std::make_unique<ReduceToOwners>(data, shard.numel, ranges_of(params, tied)),
                     // Across replicas the loss factor is the share's, not the data ranks'.
                     across.replicas ? 1 : data->size(), bucket_mb, micro_batches, tied,
                     /*tensor_rank=*/0),
        data_(std::move(data)),
        shard_(shard),
        across_(std::move(across)) {
    const int64_t cap = bucket_numel(params, bucket_mb);
    for (int64_t r = 0; r < data_->size(); ++r)
      for (int64_t at = r * shard.numel; at < (r + 1) * shard.numel; at += cap)
        pieces_.push_back({at, std::min(cap, (r + 1) * shard.numel - at), r});
  }
  Shard shard() const override { return shard_; }
  double loss_factor() const override {
    return BucketedSync::loss_factor() * (across_.replicas ? across_.share() : 1.0);
  }
  void finish() override {
    settle();  // the next update writes the shard being sent (a parameter no forward used)
    BucketedSync::finish();
    if (!across_.replicas || across_.replicas->size() == 1) return;
    // The replica's sum of this shard, summed over the replicas: after the replica's own
    // reductions, not overlapping backward (a failure here is the step's vote to report).
    const auto mine = params_.grad().narrow(0, shard_.offset - params_.grad_held().offset, shard_.numel);
    across_.replicas->all_reduce(mine);
    sent_ += ring_all_reduce_bytes(mine.numel() * mine.element_size(), across_.replicas->size());
  }
  void after_update(const torch::Tensor& skip) override {
    BucketedSync::after_update(skip);
    settle();
    for (const auto& p : pieces_)
      gathers_.push_back(data_->broadcast_async(params_.data().narrow(0, p.offset, p.numel), p.owner));
    sent_ += shard_.numel * params_.data().element_size() * (data_->size() - 1);
  }
  void before_use(const Modules& modules) override {
    if (gathered_ == gathers_.size()) return;
    int64_t end = 0;
    for (const auto* m : modules) end = std::max(end, end_of(*m));
    while (gathered_ < gathers_.size() && pieces_[gathered_].offset < end) gathers_[gathered_++]->wait();
  }
  void settle() override {
    while (gathered_ < gathers_.size()) gathers_[gathered_++]->wait();
    gathers_.clear();
    gathered_ = 0;
  }

 protected:
  // The tied entries as [begin, end) ranges: every data rank needs them reduced whole.
  static std::vector<std::pair<int64_t, int64_t>> ranges_of(const FlatParams& params,
                                                            const Tied& tied) {
    std::vector<std::pair<int64_t, int64_t>> out;
    for (size_t i : tied.entries) {
      const auto& e = params.entries()[i];
      out.emplace_back(e.offset, e.offset + e.numel);
    }
    return out;
  }
  std::shared_ptr<Comm> data_;
  Shard shard_;
  AcrossReplicas across_;

 private:
  struct Piece {
    int64_t offset, numel, owner;
  };
  // Where the last of a module's parameters ends in the flat buffer (found from their
  // addresses, once per module).
  int64_t end_of(const torch::nn::Module& module) {
    auto [it, fresh] = ends_.try_emplace(&module, 0);
    if (fresh) {
      const auto& base = params_.data();  // whole: ZeRO-1 and 2 do not shard it
      const auto* first = static_cast<const char*>(base.data_ptr());
      for (const auto& p : module.parameters()) {
        const auto at = (static_cast<const char*>(p.data_ptr()) - first) / p.element_size();
        if (at >= 0 && at < base.numel()) it->second = std::max(it->second, at + p.numel());
      }
    }
    return it->second;
  }
  std::vector<Piece> pieces_;                     // in offset order
  std::vector<std::unique_ptr<Pending>> gathers_;  // the pieces' broadcasts
  size_t gathered_ = 0;                            // gathers_'s first ones, waited for
  std::map<const torch::nn::Module*, int64_t> ends_;
};

// ZeRO-2: ZeRO-1, and the reduced gradient is kept for this rank's shard only (FlatParams
// holds no more). Backward writes each parameter's gradient into a tensor of autograd's
// own; its hook takes it from the parameter. Each bucket is reduced to its owners from a
// staging buffer of its own, then this rank's part is copied into its shard and the buffer
// freed. A bucket that lies within one parameter is copied out of its gradient when it goes
// (they go one after another as soon as that gradient is final, in the same hook); one
// shared with other parameters, as each of them arrives. The gradient is freed when its
// last bucket has gone, and at most kInFlight buckets are reduced at once (a hook waits
// for the oldest), so the gradient takes the shard, the parameter whose backward is running
// and a few buckets, not the whole (DeepSpeed's stage 2 the same), and a large weight's
// gradient lives once, not twice (autograd's and its staged copy).
// Under gradient accumulation the earlier micro-batches' gradients still add up in the
// parameters' own tensors, whole, until the last one's backward. A tied entry is kept
// whole until it has been summed across stages.
class Zero2Sync : public ZeroSync {
 public:
  static constexpr size_t kInFlight = size_t(kZeroInFlight);
  Zero2Sync(FlatParams& params, std::shared_ptr<Comm> data, Shard shard, Tied tied,
            double bucket_mb, int64_t micro_batches, AcrossReplicas across)
      : ZeroSync(params, std::move(data), shard, std::move(tied), bucket_mb, micro_batches,
                 std::move(across)),
        slices_(buckets().slices()) {
    max_inflight_ = kInFlight;
    const size_t n = params.entries().size();
    ready_.resize(n);
    inside_.assign(n, 0);
    launched_.assign(n, 0);
    staged_.resize(slices_.size());
    buckets_of_.resize(n);
    within_.assign(slices_.size(), kShared);
    for (size_t b = 0; b < slices_.size(); ++b) {
      const auto [offset, numel] = slices_[b];
      slice_at_[offset] = b;
      for (size_t k = 0; k < n; ++k) {
        const auto& e = params.entries()[k];
        if (e.offset < offset + numel && offset < e.offset + e.numel) buckets_of_[k].push_back(b);
        if (e.offset <= offset && offset + numel <= e.offset + e.numel) within_[b] = k, ++inside_[k];
      }
    }
    for (size_t i : tied_.entries)
      whole_.emplace_back(i, torch::zeros({params.entries()[i].numel}, params.data().options()));
  }

 protected:
  void arrived(size_t k) override {
    const auto& p = params_.params()[k];
    torch::NoGradGuard no_grad;
    torch::Tensor grad = p.grad();
    if (auto it = earlier_.find(k); it != earlier_.end()) {
      grad = grad.defined() ? it->second.add_(grad) : it->second;
      earlier_.erase(it);
    }
    if (!grad.defined()) return;
    const auto g = params_.flatten(grad, k);
    for (size_t b : buckets_of_[k])
      if (within_[b] == kShared) copy_overlap(staging(b), slices_[b].first, g, params_.entries()[k].offset);
    if (inside_[k] > 0) ready_[k] = g;  // until its own buckets have gone
    p.mutable_grad() = torch::Tensor();
  }
  std::unique_ptr<Pending> launch(int64_t offset, int64_t numel) override {
    torch::NoGradGuard no_grad;
    const size_t b = slice_at_.at(offset);
    torch::Tensor slice;
    if (const size_t k = within_[b]; k != kShared) {
      const int64_t at = offset - params_.entries()[k].offset;
      // In the master dtype, as a shared bucket's staging (ZeRO-3's low weights' are bf16).
      slice = ready_[k].defined()
                  ? ready_[k].narrow(0, at, numel).to(params_.data().scalar_type(), false, /*copy=*/true)
                  : torch::zeros({numel}, params_.data().options());  // unused this step
      if (++launched_[k] == inside_[k]) ready_[k] = torch::Tensor(), launched_[k] = 0;
    } else {
      slice = staging(b);
      staged_[b] = torch::Tensor();  // the exchange holds it from here
    }
    return std::make_unique<PendingThen>(reduce(slice, offset), [this, slice, offset] {
      torch::NoGradGuard no_grad;
      // This rank's part of it into its shard; a tied entry's part into its whole.
      copy_overlap(params_.grad(), params_.grad_held().offset, slice, offset);
      for (auto& [i, whole] : whole_) copy_overlap(whole, params_.entries()[i].offset, slice, offset);
    });
  }
  void sum_tied() override {
    for (auto& [i, whole] : whole_) {
      tied_.group->all_reduce(whole);
      copy_overlap(params_.grad(), params_.grad_held().offset, whole, params_.entries()[i].offset);
    }
  }

 public:
  // A parameter held in the compute dtype (ZeRO-3 under mixed precision) gets its gradient
  // in that dtype; the earlier micro-batches' are summed here in the master dtype, as they
  // would be into a master-dtype parameter's (the sums equal to the last bit).
  void begin_micro_batch(bool last) override {
    torch::NoGradGuard no_grad;
    const auto master = params_.data().scalar_type();
    for (size_t k = 0; k < params_.params().size(); ++k) {
      auto p = params_.params()[k];
      if (p.scalar_type() == master || !p.grad().defined()) continue;
      auto& sum = earlier_[k];
      sum = sum.defined() ? sum.add_(p.grad()) : p.grad().to(master);
      p.mutable_grad() = torch::Tensor();
    }
    ZeroSync::begin_micro_batch(last);
  }
  void finish() override {
    // A parameter whose gradient came from earlier micro-batches only (unused in the last):
    // its hook did not run while armed.
    for (size_t k = 0; k < params_.params().size(); ++k) arrived(k);
    ZeroSync::finish();
  }

 private:
  // `dst` and `src` lie at `dst_at` and `src_at` of the flat layout: what they share is
  // copied from `src` into `dst`.
  static void copy_overlap(const torch::Tensor& dst, int64_t dst_at, const torch::Tensor& src,
                           int64_t src_at) {
    const int64_t lo = std::max(dst_at, src_at);
    const int64_t hi = std::min(dst_at + dst.numel(), src_at + src.numel());
    if (lo < hi) dst.narrow(0, lo - dst_at, hi - lo).copy_(src.narrow(0, lo - src_at, hi - lo));
  }
  torch::Tensor& staging(size_t b) {
    if (!staged_[b].defined()) staged_[b] = torch::zeros({slices_[b].second}, params_.data().options());
    return staged_[b];
  }
  static constexpr size_t kShared = size_t(-1);
  const std::vector<std::pair<int64_t, int64_t>> slices_;  // the buckets, (offset, numel)
  std::vector<torch::Tensor> staged_;          // per shared bucket, while it fills
  std::vector<size_t> within_;                 // per bucket: the entry it lies in, or kShared
  std::vector<torch::Tensor> ready_;           // per entry: its final gradient, flat
  std::vector<size_t> inside_, launched_;      // per entry: its buckets, those gone this step
  std::vector<std::vector<size_t>> buckets_of_;  // per entry: the buckets it overlaps
  std::map<int64_t, size_t> slice_at_;                     // bucket by offset
  std::vector<std::pair<size_t, torch::Tensor>> whole_;    // tied entries' gradients
  std::map<size_t, torch::Tensor> earlier_;  // compute-dtype entries' earlier micro-batches'
};


// ZeRO-3 (DeepSpeed's stage 3, FSDP): ZeRO-2, and the parameters too are kept for this
// rank's shard only (FlatParams under param_ranks). A unit's parameters (Network::units:
// a layer, a block) live in a buffer of their own that has storage only while the unit is
// gathered: before the forward runs it, then again before its output's backward (a hook
// on that output), each time from the ranks whose shards hold it, one broadcast per owner
// (the shards are cut from the one flat layout, so a unit has one or two owners, and every
// rank still sends its own shard once per pass: the bytes of an all-gather). Gathering a
// unit frees those not in use (autograd runs a unit's whole backward before it reaches the
// output of the unit before, so the unit whose backward is done is never needed again);
// the next unit's gather starts ahead (in forward the one after, in backward the one
// before: prefetch). A rank therefore holds its shards plus about two units of parameters,
// and the gradient as ZeRO-2. Every data rank runs the same units in the same order, so
// their broadcasts match.
class Zero3Sync : public Zero2Sync {
 public:
  Zero3Sync(FlatParams& params, std::shared_ptr<Comm> data, Shard shard, Tied tied,
            double bucket_mb, int64_t micro_batches, AcrossReplicas across)
      : Zero2Sync(params, data, shard, std::move(tied), bucket_mb, micro_batches, std::move(across)),
        pending_(params.units().size()) {}

  void begin_step(int64_t step) override {
    Zero2Sync::begin_step(step);
    gather_sent_ = 0;  // an evaluation's gathers are not the step's
  }
  void before_use(const Modules& modules) override {
    const auto units = units_of(modules);
    if (units.empty()) return;
    gather(units);
    prefetch(*std::max_element(units.begin(), units.end()), +1);
  }
  void after_use(const Modules& modules, const torch::Tensor& out) override {
    if (!out.defined() || !out.requires_grad()) return;
    auto units = units_of(modules);
    if (units.empty()) return;
    out.register_hook([this, units](const torch::Tensor&) {
      gather(units);
      prefetch(*std::max_element(units.begin(), units.end()), -1);
    });
  }
  void finish() override {
    Zero2Sync::finish();
    for (size_t u = 0; u < pending_.size(); ++u) drop(u);
    ahead_ = kNone;
    sent_ += std::exchange(gather_sent_, 0);
  }
  void after_update(const torch::Tensor& skip) override {
    BucketedSync::after_update(skip);  // the updated shards stay where they are
  }
  void settle() override {
    for (size_t u = 0; u < pending_.size(); ++u) wait(u);
  }

 private:
  std::vector<size_t> units_of(const Modules& modules) const {
    std::vector<size_t> units;
    for (const auto* m : modules)
      if (auto u = params_.unit_of(*m)) units.push_back(*u);
    return units;
  }
  // `units` gathered, every other one released but the one prefetched.
  void gather(const std::vector<size_t>& units) {
    for (size_t u = 0; u < pending_.size(); ++u)
      if (u != ahead_ && std::find(units.begin(), units.end(), u) == units.end()) drop(u);
    for (size_t u : units) start(u);
    for (size_t u : units) wait(u);
  }
  // The unit `step` away from `u` in the same module, gathered ahead.
  void prefetch(size_t u, int step) {
    const auto& units = params_.units();
    const int64_t next = int64_t(u) + step;
    ahead_ = kNone;
    if (next < 0 || next >= int64_t(units.size()) || units[size_t(next)].module != units[u].module)
      return;
    ahead_ = size_t(next);
    start(ahead_);
  }
  // Unit u's gather, started unless it is resident: each owner's piece broadcast from it.
  void start(size_t u) {
    if (params_.resident(u)) return;
    params_.allocate(u);
    torch::NoGradGuard no_grad;
    const auto& unit = params_.units()[u];
    const Shard mine = params_.data_held();
    auto all = std::make_unique<PendingAll>();
    for (int64_t at = unit.offset; at < unit.offset + unit.numel;) {
      const int64_t owner = at / mine.numel;
      const int64_t end = std::min(unit.offset + unit.numel, (owner + 1) * mine.numel);
      const Shard part{at, end - at};
      if (owner == data_->rank()) params_.fill(u, part);
      for (const auto& piece : params_.pieces(u, part)) {  // in the master / compute dtype
        if (owner == data_->rank())
          gather_sent_ += piece.numel() * piece.element_size() * (data_->size() - 1);
        all->parts.push_back(data_->broadcast_async(piece, owner));
      }
      at = end;
    }
    pending_[u] = std::move(all);
  }
  void wait(size_t u) {
    if (pending_[u]) std::exchange(pending_[u], nullptr)->wait();
  }
  // Unit u freed, once its gather (if any) has landed.
  void drop(size_t u) {
    wait(u);
    if (params_.resident(u)) params_.release(u);
  }
  static constexpr size_t kNone = size_t(-1);
  std::vector<std::unique_ptr<Pending>> pending_;  // per unit: its gather, in flight
  size_t ahead_ = kNone;                           // the unit gathered ahead
  int64_t gather_sent_ = 0;                        // bytes, since the last step's
};

// ZeRO-3's gathers over a step, as Zero3Sync makes them: each use gathers its units unless
// resident, frees every other but the one gathered ahead, and starts the next unit's
// gather (forward: the one after; backward: the one before, within a chunk). Returns the
// bytes this data rank sends and the most it holds gathered at once.
std::pair<double, double> zero3_gathers(const FlatShape& h, const DataGroup& group, int64_t shard) {
  const int64_t d = group.ranks;
  std::set<size_t> resident;
  size_t ahead = size_t(-1);
  double sent = 0, held = 0, peak = 0;
  auto start = [&](size_t u) {
    if (!resident.insert(u).second) return;
    const auto& unit = h.units[u];
    held += unit.bytes;
    for (size_t i : unit.entries) {  // this rank's part of it, to every other
      const auto& e = h.entries[i];
      const int64_t lo = std::max(e.offset, group.rank * shard);
      const int64_t hi = std::min(e.offset + e.numel, (group.rank + 1) * shard);
      if (hi > lo) sent += double((hi - lo) * e.gathered) * double(d - 1);
    }
  };
  auto gather = [&](const std::vector<size_t>& units, int step) {
    for (auto it = resident.begin(); it != resident.end();)
      if (*it != ahead && std::find(units.begin(), units.end(), *it) == units.end())
        held -= h.units[*it].bytes, it = resident.erase(it);
      else
        ++it;
    for (size_t u : units) start(u);
    peak = std::max(peak, held);
    const size_t top = *std::max_element(units.begin(), units.end());
    const int64_t next = int64_t(top) + step;
    ahead = size_t(-1);
    if (next >= 0 && next < int64_t(h.units.size()) && h.units[size_t(next)].chunk == h.units[top].chunk) {
      ahead = size_t(next);
      start(ahead);
      peak = std::max(peak, held);
    }
  };
  for (const auto& [chunk, forward] : group.passes) {
    const auto& uses = h.uses[chunk];
    if (forward)
      for (const auto& use : uses) gather(use, +1);
    else
      for (auto it = uses.rbegin(); it != uses.rend(); ++it) gather(*it, -1);
  }
  return {sent, peak};
}

}  // namespace

void shard_flat(const ParallelConfig& cfg, const ParallelDims& dims, const Coord& at,
                FlatOptions& opts) {
  const int64_t d = dims.data;
  if (cfg.zero == 0 || d == 1) return;
  opts.pad_to = d * kShardAlign;
  if (cfg.zero >= 2) opts.grad_ranks = d, opts.grad_rank = at.data;
  if (cfg.zero == 3) opts.param_ranks = d, opts.param_rank = at.data;
}

Shard update_shard(const ParallelConfig& cfg, const ParallelDims& dims, const Coord& at,
                   const FlatParams& params) {
  if (cfg.zero == 0 || dims.data == 1) return {};
  return params.shard(dims.data, at.data);
}

std::unique_ptr<GradSync> make_zero_sync(const ParallelConfig& cfg, const Mesh& mesh,
                                         FlatParams& params, int64_t micro_batches, Tied tied,
                                         AcrossReplicas across) {
  const Shard shard = update_shard(cfg, mesh.dims(), mesh.coord(), params);
  const double mb = cfg.bucket_mb;
  if (cfg.zero == 3 && params.sharded())
    return std::make_unique<Zero3Sync>(params, mesh.data(), shard, tied, mb, micro_batches, across);
  if (cfg.zero >= 2)
    return std::make_unique<Zero2Sync>(params, mesh.data(), shard, tied, mb, micro_batches, across);
  return std::make_unique<ZeroSync>(params, mesh.data(), shard, tied, mb, micro_batches, across);
}

SyncCost zero_sync_cost(const ParallelConfig& cfg, const FlatShape& h, const DataGroup& group) {
  const int64_t d = group.ranks;
  ParallelDims dims;
  dims.data = d;
  Coord at;
  at.data = group.rank;
  FlatOptions opts;
  shard_flat(cfg, dims, at, opts);
  const FlatSizes sizes = flat_sizes(opts, h.total);
  const int64_t numel = sizes.numel, shard = numel / d;
  const bool gathers = cfg.zero >= 3;
  SyncCost c;
  c.numel = numel;
  c.shard = shard;
  c.params = 4 * double(sizes.params);
  c.grads = 4 * double(sizes.grads);
  // Autocast's 16-bit copies, unless ZeRO-3 gathers the weights in that dtype.
  const GradientPath path = gradient_path(h, gathers);
  c.buffers = path.largest + (gathers ? 0 : path.copies);
  double gathered_sent = 0;
  if (cfg.zero >= 2) {
    c.buffers += double(kZeroInFlight) * cfg.bucket_mb * kMiB + 4 * double(h.tied);
    if (group.micro > 1) c.buffers += 4 * double(h.total);  // micro-batches add up whole
    // and a compute-dtype weight's next one beside its fp32 sum
    if (group.micro > 1 && gathers) c.buffers += path.copies;
    if (gathers) {
      const auto [sent, peak] = zero3_gathers(h, group, shard);
      gathered_sent = sent;
      c.buffers += peak;
    }
  }
  // Each slice reduced to its owner: (D-1)/D of it, and 1/D more off the owner; the tied
  // weight all-reduced instead (every data rank needs it whole to sum it across stages);
  // ZeRO-1 and 2's shard broadcast back, ZeRO-3's gathers.
  double tied_here = 0;
  for (const auto& [lo, hi] : h.tied_at)
    tied_here += double(std::max<int64_t>(0, std::min(hi, (at.data + 1) * shard) - std::max(lo, at.data * shard)));
  const double others = 4 * double(numel - h.tied), owned = 4 * (double(shard) - tied_here);
  double bytes = others * double(d - 1) / double(d) + (others - owned) / double(d);
  bytes += ring_all_reduce_share(4 * double(h.tied), d);
  if (!gathers) bytes += 4 * double(shard) * double(d - 1);
  c.bytes = bytes + gathered_sent;
  double broadcasts = 0;
  for (const auto& u : h.units) broadcasts += double(u.dtypes.size());
  c.ops = 2 * buckets_of(cfg, numel) + (gathers ? 2 * double(group.micro) * broadcasts : 0);
  return c;
}

}  // namespace dtrain
