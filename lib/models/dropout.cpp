#include "models/dropout.hpp"

#include <map>
#include <mutex>
#include <stdexcept>
#include <tuple>

#include <ATen/Parallel.h>
#include <torch/torch.h>

#include "util/hash.hpp"

namespace dtrain {
namespace {

// A 32-bit integer hash with good avalanche (two multiply-xorshift rounds). Its constant
// is below 2^27, so the tensor form below stays exact in int64 without overflow.
constexpr uint32_t kMul = 0x45d9f3b;
inline uint32_t hash32(uint32_t x) {
  x = ((x >> 16) ^ x) * kMul;
  x = ((x >> 16) ^ x) * kMul;
  return (x >> 16) ^ x;
}
torch::Tensor hash32(torch::Tensor x) {  // int64 holding values below 2^32
  constexpr int64_t low = 0xffffffff;
  x = ((x.__rshift__(16) ^ x) * int64_t(kMul)) & low;
  x = ((x.__rshift__(16) ^ x) * int64_t(kMul)) & low;
  return x.__rshift__(16) ^ x;
}

inline uint64_t mix64(uint64_t x) {  // splitmix64's finaliser
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

thread_local DropoutDraw t_draw;
thread_local bool t_has_draw = false;

// Each local unit's place in the whole layer, hashed: [d1, ..., dk] int64 on `device`,
// kept per shape (a model has a handful of them).
torch::Tensor unit_hashes(c10::IntArrayRef local, const LayerSlice& slice, c10::Device device) {
  using Key = std::tuple<std::vector<int64_t>, int64_t, int64_t, int64_t, std::string>;
  static std::mutex mutex;
  static std::map<Key, torch::Tensor> cache;
  Key key{local.vec(), slice.dim, slice.index, slice.parts, device.str()};
  std::lock_guard<std::mutex> lock(mutex);
  if (auto it = cache.find(key); it != cache.end()) return it->second;
  // The linear index in the whole layer's [D1, ..., Dk] of each local unit: a sum of
  // broadcast aranges, one per dimension, the split one offset to this rank's part.
  const int64_t k = int64_t(local.size());
  std::vector<int64_t> full = local.vec();
  if (slice.parts > 1) full[size_t(slice.dim - 1)] *= slice.parts;
  int64_t total = 1;
  for (auto d : full) total *= d;
  if (total >= (int64_t(1) << 32))
    throw std::invalid_argument("dropout: a layer of 2^32 units or more per sample");
  auto index = torch::zeros({}, torch::kInt64);
  int64_t stride = 1;
  for (int64_t d = k - 1; d >= 0; --d) {
    const int64_t offset = slice.parts > 1 && d == slice.dim - 1 ? slice.index * local[size_t(d)] : 0;
    std::vector<int64_t> shape(size_t(k), 1);
    shape[size_t(d)] = local[size_t(d)];
    index = index + (torch::arange(local[size_t(d)], torch::kInt64) + offset).view(shape) * stride;
    stride *= full[size_t(d)];
  }
  auto hashed = hash32(index ^ int64_t(0x9e3779b9)).contiguous().to(device);
  if (cache.size() > 64) cache.clear();
  return cache[key] = hashed;
}

}  // namespace

DropoutScope::DropoutScope(DropoutDraw draw) : previous_(std::move(t_draw)), had_(t_has_draw) {
  t_draw = std::move(draw);
  t_has_draw = true;
}

DropoutScope::~DropoutScope() {
  t_draw = std::move(previous_);
  t_has_draw = had_;
}

const DropoutDraw* current_dropout_draw() { return t_has_draw ? &t_draw : nullptr; }

uint64_t dropout_site(const std::string& name) { return fnv1a(name); }

torch::Tensor seeded_dropout(const torch::Tensor& x, double p, uint64_t site,
                             const LayerSlice& slice) {
  if (p <= 0) return x;
  const DropoutDraw* draw = current_dropout_draw();
  if (!draw) throw std::logic_error("dropout in training outside a training step's DropoutScope");
  const int64_t rows = x.size(0);
  if (draw->positions.numel() != rows)
    throw std::logic_error("dropout: the draw's positions do not match the batch's rows");
  const auto key = uint32_t(mix64(draw->seed ^ mix64(site ^ mix64(uint64_t(draw->step)))));
  const auto threshold = int64_t(p * 4294967296.0);  // drop when the hash is below
  const double scale = 1.0 / (1.0 - p);
  const auto units = unit_hashes(x.sizes().slice(1), slice, x.device());
  torch::Tensor mask;
  if (x.device().is_cpu()) {
    // One pass, no temporaries: the CPU's common case.
    mask = torch::empty(x.sizes(), torch::kFloat32);
    auto pos = draw->positions.to(torch::kCPU, torch::kInt64).contiguous();
    const int64_t* at = pos.data_ptr<int64_t>();
    const int64_t* u = units.data_ptr<int64_t>();
    float* out = mask.data_ptr<float>();
    const int64_t n = units.numel();
    const auto kept = float(scale);
    at::parallel_for(0, rows * n, 1 << 14, [&](int64_t begin, int64_t end) {
      int64_t r = begin / n, j = begin % n;
      uint32_t row = hash32(uint32_t(at[r]) + key);
      for (int64_t i = begin; i < end; ++i) {
        out[i] = int64_t(hash32(uint32_t(u[j]) ^ row)) < threshold ? 0.f : kept;
        if (++j == n && i + 1 < end) j = 0, row = hash32(uint32_t(at[++r]) + key);
      }
    });
  } else {
    // The same arithmetic as tensor operations (on a GPU).
    auto pos = draw->positions.to(x.device(), torch::kInt64);
    auto row = hash32((pos + int64_t(key)) & int64_t(0xffffffff));
    std::vector<int64_t> shape(size_t(x.dim()), 1);
    shape[0] = rows;
    auto h = hash32(units.unsqueeze(0) ^ row.view(shape));
    mask = (h >= threshold).to(torch::kFloat32) * scale;
  }
  return x * mask.to(x.scalar_type());
}

}  // namespace dtrain
