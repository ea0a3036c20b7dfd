#include "models/dropout.hpp"

#include <cstring>
#include <map>
#include <mutex>
#include <stdexcept>
#include <tuple>

#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <fmt/format.h>
#include <torch/torch.h>
#ifdef DTRAIN_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include "models/dropout_mask.hpp"
#include "util/hash.hpp"

namespace dtrain {
namespace {

uint64_t mix64(uint64_t x) { return splitmix64_mix(x + kGoldenGamma); }

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
  auto hashed = index.expand(local.vec()).contiguous();
  int64_t* h = hashed.data_ptr<int64_t>();
  for (int64_t i = 0; i < hashed.numel(); ++i)
    h[i] = dropout_mask::hash32(uint32_t(h[i] ^ int64_t(0x9e3779b9)));
  hashed = hashed.to(device);
  if (cache.size() > 64) cache.clear();
  return cache[key] = hashed;
}

// The mask on a GPU: dropout_mask.cu's kernel on the device's current stream.
template <class Bits>
void fill_on_device([[maybe_unused]] const int64_t* positions, [[maybe_unused]] const int64_t* units,
                    [[maybe_unused]] Bits* out, [[maybe_unused]] int64_t rows,
                    [[maybe_unused]] int64_t n, [[maybe_unused]] const dropout_mask::Draw<Bits>& d,
                    const c10::Device& device) {
#ifdef DTRAIN_CUDA
  if (device.is_cuda()) {
    const c10::cuda::CUDAGuard guard(device);
    const char* error = dropout_mask::fill_cuda(positions, units, out, rows, n, sizeof(Bits), d.key,
                                                d.threshold, d.kept,
                                                c10::cuda::getCurrentCUDAStream().stream());
    if (error) throw std::runtime_error(fmt::format("dropout: the mask kernel failed: {}", error));
    return;
  }
#endif
  throw std::logic_error(fmt::format("dropout: no mask kernel for {}", device.str()));
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
  const auto units = unit_hashes(x.sizes().slice(1), slice, x.device());
  const auto positions = draw->positions.to(x.device(), torch::kInt64).contiguous();
  // The mask in x's dtype: a kept unit's scale rounded as a cast of the fp32 mask would.
  auto mask = torch::empty(x.sizes(), x.options().memory_format(torch::MemoryFormat::Contiguous));
  const auto scale = float(1.0 / (1.0 - p));
  const auto fill = [&](auto kept) {
    using Bits = decltype(kept);
    // Named in LibTorch's profiles (and counted as the kernel it is on a GPU).
    RECORD_FUNCTION("dtrain::dropout_mask", std::vector<c10::IValue>());
    const dropout_mask::Draw<Bits> d{key, threshold, kept};
    const int64_t* pos = positions.data_ptr<int64_t>();
    const int64_t* u = units.data_ptr<int64_t>();
    const int64_t n = units.numel();
    auto* out = static_cast<Bits*>(mask.data_ptr());
    if (!x.device().is_cpu()) return fill_on_device(pos, u, out, rows, n, d, x.device());
    // One pass, no temporaries; a row's hash once per row.
    at::parallel_for(0, rows * n, 1 << 14, [&](int64_t begin, int64_t end) {
      int64_t r = begin / n, j = begin % n;
      uint32_t row = dropout_mask::row_hash(pos[r], key);
      for (int64_t i = begin; i < end; ++i) {
        out[i] = dropout_mask::value(u[j], row, d);
        if (++j == n && i + 1 < end) j = 0, row = dropout_mask::row_hash(pos[++r], key);
      }
    });
  };
  switch (x.scalar_type()) {
    case torch::kFloat: {
      uint32_t bits = 0;
      std::memcpy(&bits, &scale, sizeof bits);
      fill(bits);
      break;
    }
    case torch::kBFloat16: fill(c10::BFloat16(scale).x); break;
    case torch::kHalf: fill(c10::Half(scale).x); break;
    default:
      throw std::logic_error(fmt::format("dropout: no mask in {}", c10::toString(x.scalar_type())));
  }
  return x * mask;
}

}  // namespace dtrain
