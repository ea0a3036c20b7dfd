#include "grad/compression.hpp"

#include <algorithm>
#include <cmath>
#include <map>

#include <fmt/format.h>
#include <torch/torch.h>

#include "comm/comm.hpp"
#include "config/config.hpp"
#include "parallel/flat_params.hpp"
#include "util/hash.hpp"

namespace dtrain {
namespace {

// sign: the values of one parameter that share one scale (the mean magnitude) on the wire.
constexpr int64_t kSignBlock = 256;
// powersgd: whether an n x m matrix goes as a rank-r product (when that shrinks it at least
// 2x, PyTorch's rule); others go as they are.
bool powersgd_compresses(int64_t n, int64_t m, int64_t rank) { return (n + m) * rank * 2 < n * m; }

using Comms = std::shared_ptr<Comm>;

// Every rank's `wire` (the same length on each), side by side: [ranks, wire.numel()] bytes.
// Sent as bytes: the backend need not know the type it carries.
struct Gathered {
  torch::Tensor rows;  // [ranks, bytes], filled once the Pending has been waited for
  std::unique_ptr<Pending> pending;
};
Gathered gather_bytes(Comm& comm, const torch::Tensor& wire) {
  auto bytes = wire.contiguous().view(torch::kUInt8);
  Gathered g;
  g.rows = torch::empty({comm.size(), bytes.numel()}, bytes.options());
  g.pending = comm.all_gather_async(g.rows, bytes);
  return g;
}

// fp16 / bf16 on the wire.
class Cast16 : public Reduction {
 public:
  Cast16(std::shared_ptr<Comm> comm, torch::ScalarType type) : comm_(std::move(comm)), type_(type) {}
  template <torch::ScalarType kType>
  static std::unique_ptr<Reduction> make(const ParallelConfig&, Comms comm, const FlatParams&) {
    return std::make_unique<Cast16>(std::move(comm), kType);
  }
  // Two bytes a value, all-reduced where the backend sums them, else all-gathered.
  static double step_bytes(const ParallelConfig&, const GradShape& g) {
    const double bytes = 2 * double(g.numel);
    return g.sums_16bit ? ring_all_reduce_share(bytes, g.ranks) : bytes * double(g.ranks - 1);
  }
  std::unique_ptr<Pending> start(const torch::Tensor& slice, int64_t /*offset*/) override {
    torch::NoGradGuard no_grad;
    const int64_t numel = slice.numel();
    auto wire = slice.to(type_);
    const int64_t d = comm_->size(), bytes = numel * wire.element_size();
    if (comm_->can_sum(type_)) {
      count(ring_all_reduce_bytes(bytes, d));
      auto op = comm_->all_reduce_async(wire);
      return std::make_unique<PendingThen>(std::move(op), [slice, wire]() mutable { slice.copy_(wire); });
    }
    count(bytes * (d - 1));
    auto g = gather_bytes(*comm_, wire);
    return std::make_unique<PendingThen>(std::move(g.pending), [slice, rows = g.rows, this]() mutable {
      slice.copy_(rows.view(type_).to(torch::kFloat32).sum(0));
    });
  }

 private:
  std::shared_ptr<Comm> comm_;
  torch::ScalarType type_;
};

// What sign, topk and powersgd share: the residual, laid out like the flat gradient.
class ErrorFeedback : public Reduction {
 public:
  ErrorFeedback(std::shared_ptr<Comm> comm, const FlatParams& params)
      : comm_(std::move(comm)), residual_(torch::zeros_like(params.grad())) {}
  NamedTensors state() const override { return {{"residual", residual_}}; }
  void after_step(const torch::Tensor& skip) override {
    // A skipped step's gradient (non-finite) must not live on in the residual. On the
    // device, unread: masked_fill_ takes the flag as a tensor.
    if (skip.defined()) residual_.masked_fill_(skip.to(torch::kBool), 0.0);
  }

 protected:
  std::shared_ptr<Comm> comm_;
  torch::Tensor residual_;
};

// A compression that takes each slice by itself (sign, topk).
class EachSlice : public ErrorFeedback {
 public:
  using ErrorFeedback::ErrorFeedback;
  std::unique_ptr<Pending> start(const torch::Tensor& slice, int64_t offset) override {
    torch::NoGradGuard no_grad;
    auto residual = residual_.narrow(0, offset, slice.numel());
    return compress(slice, slice + residual, residual, offset);
  }

 protected:
  // Sends `c` (the slice's gradient plus its residual) compressed, sets `e` (the slice's
  // residual) to what was left out, and returns the exchange, which on completion writes
  // the sum over ranks into `slice` (at `offset` in the flat gradient).
  virtual std::unique_ptr<Pending> compress(torch::Tensor slice, torch::Tensor c, torch::Tensor e,
                                            int64_t offset) = 0;
};

// Bits of a bool tensor, eight to a byte (the first value in the highest bit), and back.
torch::Tensor bit_weights(const torch::Device& device) {
  return torch::tensor({128, 64, 32, 16, 8, 4, 2, 1}, torch::dtype(torch::kUInt8).device(device));
}
torch::Tensor pack_bits(const torch::Tensor& bits) {
  const int64_t n = bits.numel(), bytes = (n + 7) / 8;
  auto padded = torch::zeros({bytes * 8}, bits.options().dtype(torch::kUInt8));
  padded.narrow(0, 0, n).copy_(bits);
  return padded.view({bytes, 8}).mul(bit_weights(bits.device())).sum(1).to(torch::kUInt8);
}
// [rows, bytes] -> [rows, n] of 0 / 1.
torch::Tensor unpack_bits(const torch::Tensor& packed, int64_t n) {
  auto bits = packed.unsqueeze(-1).bitwise_and(bit_weights(packed.device())).ne(0);
  return bits.reshape({packed.size(0), -1}).narrow(1, 0, n);
}

// A slice cut into runs at fixed points of the flat buffer (parameters' starts, blocks'):
// each run's last value (its index in the slice) and length, on the host and the device.
struct Runs {
  int64_t count = 0, numel = 0;
  std::vector<int64_t> begin, length;  // host: where each run starts in the slice, its size
  torch::Tensor last, lengths, sizes;  // device: int64, int64, float64
  // Per-run values [..., count] repeated over each run's values: [..., numel].
  torch::Tensor spread(const torch::Tensor& per_run) const {
    return per_run.repeat_interleave(lengths, /*dim=*/-1, /*output_size=*/numel);
  }
};

// The runs of each slice, for cuts at `starts` (ascending), made once: the buckets are the
// same slices every step. References stay valid (a map's nodes do not move).
class RunCache {
 public:
  explicit RunCache(std::vector<int64_t> starts) : starts_(std::move(starts)) {}
  const Runs& of(int64_t offset, int64_t numel, const torch::Device& device) {
    auto it = runs_.find(offset);
    if (it != runs_.end()) return it->second;
    Runs r;
    r.numel = numel;
    std::vector<int64_t> last;
    int64_t begin = offset;
    for (auto at = std::upper_bound(starts_.begin(), starts_.end(), offset);
         at != starts_.end() && *at < offset + numel; ++at) {
      r.begin.push_back(begin - offset), r.length.push_back(*at - begin), last.push_back(*at - 1 - offset);
      begin = *at;
    }
    r.begin.push_back(begin - offset), r.length.push_back(offset + numel - begin), last.push_back(numel - 1);
    r.count = int64_t(last.size());
    const auto i64 = torch::dtype(torch::kInt64).device(device);
    r.last = torch::tensor(last, i64);
    r.lengths = torch::tensor(r.length, i64);
    r.sizes = r.lengths.to(torch::kFloat64);
    return runs_.emplace(offset, std::move(r)).first->second;
  }

 private:
  std::vector<int64_t> starts_;
  std::map<int64_t, Runs> runs_;
};

// Where each parameter starts, and with `block` > 0 every `block` values within it.
std::vector<int64_t> cuts_of(const FlatParams& params, int64_t block = 0) {
  std::vector<int64_t> starts;
  for (const auto& e : params.entries())
    for (int64_t at = e.offset; at < e.offset + e.numel; at += block > 0 ? block : e.numel)
      starts.push_back(at);
  return starts;
}

// The scale is per block of kSignBlock values of one parameter: a slice sends one scale for
// each block it holds. (One scale for the whole slice, cut without regard for parameters,
// gave a conv layer's small gradients the fc layer's magnitudes, and the CNN did not train;
// one per parameter trained it 1.5 points short of uncompressed in 3 epochs. A scale per
// 256 values costs 1/8 of a bit per value: 28x fewer bytes than fp32 instead of 32x.)
// Within one parameter, so a replicated parameter's scales are the same on every tensor
// rank whatever the split parameters beside it in the slice hold.

class Sign : public EachSlice {
 public:
  Sign(std::shared_ptr<Comm> comm, const FlatParams& params)
      : EachSlice(std::move(comm), params), blocks_(cuts_of(params, kSignBlock)) {}
  static std::unique_ptr<Reduction> make(const ParallelConfig&, Comms comm, const FlatParams& params) {
    return std::make_unique<Sign>(std::move(comm), params);
  }
  // A bit a value and an fp32 scale a block, all-gathered. (A bucket's cut through a
  // parameter adds a block: the plan counts whole parameters.)
  static double step_bytes(const ParallelConfig&, const GradShape& g) {
    double blocks = 0;
    for (const auto& p : g.params) blocks += std::ceil(double(p.numel) / double(kSignBlock));
    return (std::ceil(double(g.numel) / 8) + 4 * blocks) * double(g.ranks - 1);
  }
  std::unique_ptr<Pending> compress(torch::Tensor slice, torch::Tensor c, torch::Tensor e,
                                    int64_t offset) override {
    const int64_t numel = slice.numel();
    const Runs& blocks = blocks_.of(offset, numel, c.device());
    // Each block's mean magnitude from a running sum (in fp64, and deterministic on a GPU,
    // where a scattered add is not: every rank must compute the same scales), and each
    // value's block's.
    auto running = c.abs().to(torch::kFloat64).cumsum(0).index_select(0, blocks.last);
    auto sums = running - torch::cat({torch::zeros({1}, running.options()),
                                      running.narrow(0, 0, blocks.count - 1)});
    auto scales = (sums / blocks.sizes).to(torch::kFloat32);
    auto positive = c.ge(0);
    // What this rank sends stands for scale * (+1 | -1); the rest stays behind.
    auto sent = (positive.to(c.scalar_type()) * 2 - 1) * blocks.spread(scales).to(c.scalar_type());
    e.copy_(c - sent);
    auto packed = pack_bits(positive);
    const int64_t packed_bytes = packed.numel(), count = blocks.count;
    auto wire = torch::cat({packed, scales.view(torch::kUInt8)});
    this->count(wire.numel() * (comm_->size() - 1));
    auto g = gather_bytes(*comm_, wire);
    return std::make_unique<PendingThen>(
        std::move(g.pending), [slice, rows = g.rows, packed_bytes, count, numel, &blocks]() mutable {
          auto scales = rows.narrow(1, packed_bytes, 4 * count).contiguous().view(torch::kFloat32);
          auto signs = unpack_bits(rows.narrow(1, 0, packed_bytes), numel).to(slice.scalar_type()) * 2 - 1;
          slice.copy_((signs * blocks.spread(scales).to(slice.scalar_type())).sum(0));
        });
  }

 private:
  RunCache blocks_;
};

// The top k of each parameter's part of the slice, not of the slice as a whole: a
// replicated parameter then sends the same values from every tensor rank whatever the split
// parameters beside it hold (chosen over the whole slice, its tensor ranks' copies drifted
// apart).
class TopK : public EachSlice {
 public:
  TopK(std::shared_ptr<Comm> comm, const FlatParams& params, double ratio)
      : EachSlice(std::move(comm), params), ratio_(ratio), parts_(cuts_of(params)) {}
  static std::unique_ptr<Reduction> make(const ParallelConfig& cfg, Comms comm, const FlatParams& params) {
    return std::make_unique<TopK>(std::move(comm), params, cfg.topk_ratio);
  }
  // k (index, value) pairs of 4 + 4 bytes for each parameter, all-gathered.
  static double step_bytes(const ParallelConfig& cfg, const GradShape& g) {
    double k = 0;
    for (const auto& p : g.params) k += double(values_sent(cfg.topk_ratio, p.numel));
    return 8 * k * double(g.ranks - 1);
  }
  // The values of `n` a parameter's part sends.
  static int64_t values_sent(double ratio, int64_t n) {
    return std::max<int64_t>(1, int64_t(std::ceil(ratio * double(n))));
  }
  std::unique_ptr<Pending> compress(torch::Tensor slice, torch::Tensor c, torch::Tensor e,
                                    int64_t offset) override {
    const Runs& parts = parts_.of(offset, slice.numel(), c.device());
    std::vector<torch::Tensor> picked;
    for (int64_t j = 0; j < parts.count; ++j) {
      const int64_t n = parts.length[size_t(j)];
      const int64_t k = values_sent(ratio_, n);
      auto top = std::get<1>(c.narrow(0, parts.begin[size_t(j)], n).abs().topk(
          k, /*dim=*/0, /*largest=*/true, /*sorted=*/false));
      picked.push_back(top + parts.begin[size_t(j)]);
    }
    auto index = torch::cat(picked);
    const int64_t k = index.numel();
    auto values = c.index_select(0, index).to(torch::kFloat32);
    e.copy_(c.index_fill_(0, index, 0.0));  // what was not sent
    auto wire = torch::cat({values.view(torch::kUInt8), index.to(torch::kInt32).view(torch::kUInt8)});
    count(wire.numel() * (comm_->size() - 1));
    auto g = gather_bytes(*comm_, wire);
    return std::make_unique<PendingThen>(std::move(g.pending), [slice, rows = g.rows, k]() mutable {
      auto values = rows.narrow(1, 0, 4 * k).contiguous().view(torch::kFloat32);
      auto index = rows.narrow(1, 4 * k, 4 * k).contiguous().view(torch::kInt32).to(torch::kInt64);
      slice.zero_();
      // Rank by rank: one rank's indices are distinct, so each add is free of races (on a
      // GPU) and every rank sums in the same order.
      for (int64_t r = 0; r < rows.size(0); ++r)
        slice.index_add_(0, index[r], values[r].to(slice.scalar_type()));
    });
  }

 private:
  double ratio_;
  RunCache parts_;
};

// The columns of `p` ([n, r]) made orthonormal, in place (Gram-Schmidt, as PyTorch's
// PowerSGD hook: r is small). A column that is all zero (a matrix whose gradient is) stays
// zero rather than becoming NaN.
void orthonormalise(torch::Tensor p) {
  for (int64_t j = 0; j < p.size(1); ++j) {
    auto col = p.select(1, j);
    if (j > 0) {
      auto before = p.narrow(1, 0, j);
      col.sub_(before.mv(before.t().mv(col)));
    }
    col.div_(col.norm().clamp_min(1e-30));
  }
}

// PowerSGD (Vogels et al., 2019; PyTorch DDP's powerSGD_hook): each matrix M (a parameter
// of two or more dimensions, as [size(0), the rest]) goes as a rank-r product, by one step
// of power iteration from the last step's Q (warm start):
//   P = M Q summed over ranks, its columns made orthonormal;
//   Q = M^T P summed over ranks; the sum of the ranks' M is then P Q^T.
// Two all-reduces of (n + m) r values instead of one of n m. A matrix goes whole, from the
// slice that completes it (the one holding its first value: slices arrive from the
// buffer's end), the matrices a slice completes in one all-reduce of their P and one of
// their Q. Vectors, and matrices a rank-r product would not shrink 2x (PyTorch's rule),
// go as they are. Error feedback keeps each rank's M - P P^T M (what the projection left
// out of its own matrix) for the next step.
class PowerSgd : public ErrorFeedback {
 public:
  PowerSgd(std::shared_ptr<Comm> comm, const FlatParams& params, int64_t rank)
      : ErrorFeedback(std::move(comm), params), grad_(params.grad()), entries_(params.entries()) {
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < entries_.size(); ++i) {
      const auto& shape = entries_[i].shape;
      if (shape.size() < 2) continue;
      const int64_t n = shape[0], m = entries_[i].numel / n;
      if (!powersgd_compresses(n, m, rank)) continue;
      // Seeded by the parameter's name: every data rank (and every tensor rank holding a
      // replicated parameter) starts its matrix from the same Q.
      auto gen = at::make_generator<at::CPUGeneratorImpl>(fnv1a(entries_[i].name));
      auto q = torch::randn({m, rank}, gen, torch::kFloat32);
      orthonormalise(q);
      q = q.to(params.grad().options());
      matrices_.push_back({i, n, m, q, q.clone(), q.clone()});
    }
  }
  static std::unique_ptr<Reduction> make(const ParallelConfig& cfg, Comms comm, const FlatParams& params) {
    return std::make_unique<PowerSgd>(std::move(comm), params, cfg.powersgd_rank);
  }
  // Each matrix it compresses as two all-reduces of (n + m) r values, the rest as it is.
  static double step_bytes(const ParallelConfig& cfg, const GradShape& g) {
    double bytes = 0, plain = double(g.numel);
    for (const auto& p : g.params) {
      if (p.shape.size() < 2) continue;
      const int64_t n = p.shape[0], m = p.numel / n;
      if (!powersgd_compresses(n, m, cfg.powersgd_rank)) continue;
      bytes += ring_all_reduce_share(4 * double((n + m) * cfg.powersgd_rank), g.ranks);
      plain -= double(p.numel);
    }
    return bytes + ring_all_reduce_share(4 * plain, g.ranks);
  }
  PerEntry factors() const override {
    PerEntry out;
    for (const auto& mx : matrices_) out.emplace_back(mx.entry, mx.q);
    return out;
  }
  void after_step(const torch::Tensor& skip) override {
    ErrorFeedback::after_step(skip);
    for (auto& mx : matrices_) {
      // A skipped step's Q goes back to the one before it; a Q that fell to zero (its
      // matrix's gradient was zero) would stay there, so it starts again. On the device.
      if (skip.defined()) mx.q.copy_(torch::where(skip.to(torch::kBool), mx.before, mx.q));
      mx.q.copy_(torch::where(mx.q.abs().sum().eq(0), mx.first, mx.q));
    }
  }

  // `slice` is a view of the flat gradient (not under ZeRO-2): a matrix's values before it
  // are read from there.
  std::unique_ptr<Pending> start(const torch::Tensor& slice, int64_t offset) override {
    torch::NoGradGuard no_grad;
    const int64_t end = offset + slice.numel();
    const auto& grad = grad_;
    auto all = std::make_unique<PendingAll>();
    std::vector<Matrix*> now;  // the matrices this slice completes
    int64_t from = -1, to = -1;  // a run of values that go as they are
    auto send_plain = [&] {
      if (from >= to) return;
      count(ring_all_reduce_bytes((to - from) * grad.element_size(), comm_->size()));
      all->parts.push_back(comm_->all_reduce_async(grad.narrow(0, from, to - from)));
    };
    size_t k = 0;  // matrices_ is in entry order
    for (size_t i = 0; i < entries_.size(); ++i) {
      const auto& e = entries_[i];
      while (k < matrices_.size() && matrices_[k].entry < i) ++k;
      const int64_t lo = std::max(e.offset, offset), hi = std::min(e.offset + e.numel, end);
      if (lo >= hi) continue;
      if (k < matrices_.size() && matrices_[k].entry == i) {
        if (e.offset >= offset) now.push_back(&matrices_[k]);
        continue;
      }
      if (lo != to) send_plain(), from = lo;
      to = hi;
    }
    send_plain();
    if (!now.empty()) all->parts.push_back(project(grad, std::move(now)));
    return all;
  }

 private:
  struct Matrix {
    size_t entry;
    int64_t n, m;
    torch::Tensor q;       // [m, r]: this step's, then the next's (warm start)
    torch::Tensor before;  // the step's Q before it was updated (a skipped step restores it)
    torch::Tensor first;   // the initial Q
  };

  std::unique_ptr<Pending> project(const torch::Tensor& grad, std::vector<Matrix*> mats) {
    std::vector<torch::Tensor> ms, ps;
    for (Matrix* mx : mats) {
      const auto& e = entries_[mx->entry];
      auto c = grad.narrow(0, e.offset, e.numel) + residual_.narrow(0, e.offset, e.numel);
      ms.push_back(c.view({mx->n, mx->m}));
      ps.push_back(ms.back().mm(mx->q).view(-1));
    }
    auto p = torch::cat(ps);
    count(ring_all_reduce_bytes(p.numel() * p.element_size(), comm_->size()));
    auto op = comm_->all_reduce_async(p);
    return std::make_unique<PendingThen>(std::move(op), [this, grad, mats = std::move(mats),
                                                         ms = std::move(ms), p]() mutable {
      torch::NoGradGuard no_grad;
      std::vector<torch::Tensor> pn, qs;
      int64_t at = 0;
      for (size_t j = 0; j < mats.size(); ++j) {
        const int64_t r = mats[j]->q.size(1);
        auto pj = p.narrow(0, at, mats[j]->n * r).view({mats[j]->n, r});
        at += mats[j]->n * r;
        orthonormalise(pj);
        auto q = ms[j].t().mm(pj);  // this rank's M^T P
        const auto& e = entries_[mats[j]->entry];
        residual_.narrow(0, e.offset, e.numel).copy_((ms[j] - pj.mm(q.t())).view(-1));
        pn.push_back(pj);
        qs.push_back(q.view(-1));
      }
      auto q = torch::cat(qs);
      count(ring_all_reduce_bytes(q.numel() * q.element_size(), comm_->size()));
      comm_->all_reduce_async(q)->wait();
      at = 0;
      for (size_t j = 0; j < mats.size(); ++j) {
        Matrix& mx = *mats[j];
        auto qj = q.narrow(0, at, mx.q.numel()).view({mx.m, mx.q.size(1)});
        at += mx.q.numel();
        mx.before.copy_(mx.q);
        mx.q.copy_(qj);
        const auto& e = entries_[mx.entry];
        grad.narrow(0, e.offset, e.numel).view({mx.n, mx.m}).copy_(pn[j].mm(qj.t()));
      }
    });
  }

  torch::Tensor grad_;  // the flat gradient
  const std::vector<FlatParams::Entry>& entries_;
  std::vector<Matrix> matrices_;  // in entry order
};

std::vector<std::string> reduction_names() {
  std::vector<std::string> names;
  for (const auto& s : compression_specs()) names.push_back(s.name);
  return names;
}
const ListedBy kListed{"parallel.compression", reduction_names};

}  // namespace

const std::vector<CompressionSpec>& compression_specs() {
  auto fp32 = [](const ParallelConfig&, const GradShape& g) {
    return ring_all_reduce_share(4 * double(g.numel), g.ranks);
  };
  // name, keeps a residual, warm-up share, collectives a bucket, bytes a step, make
  static const std::vector<CompressionSpec> specs{
      {"none", false, 0, 1, fp32, nullptr},
      {"fp16", false, 0, 1, Cast16::step_bytes, Cast16::make<torch::kFloat16>},
      {"bf16", false, 0, 1, Cast16::step_bytes, Cast16::make<torch::kBFloat16>},
      {"sign", true, 4, 1, Sign::step_bytes, Sign::make},
      {"topk", true, 5, 1, TopK::step_bytes, TopK::make},
      {"powersgd", true, 10, 2, PowerSgd::step_bytes, PowerSgd::make}};
  return specs;
}

const CompressionSpec& compression_spec(const std::string& name) {
  for (const auto& s : compression_specs())
    if (s.name == name) return s;
  throw std::logic_error(fmt::format("parallel.compression: no reduction '{}'", name));
}

int64_t compression_warmup_steps(const ParallelConfig& cfg, int64_t total_steps) {
  if (cfg.compression_warmup != "auto") return std::stoll(cfg.compression_warmup);
  const int64_t share = compression_spec(cfg.compression).warmup_share;
  return share > 0 ? (total_steps + share - 1) / share : 0;
}

}  // namespace dtrain
