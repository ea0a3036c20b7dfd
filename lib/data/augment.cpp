#include "data/augment.hpp"

#include <algorithm>
#include <cmath>

#include <torch/torch.h>

#include "util/hash.hpp"

namespace dtrain {
namespace {

// A sample's own stream of draws from (seed, epoch, index).
struct Draws : SplitMix64 {
  Draws(uint64_t seed, int64_t epoch, int64_t index)
      : SplitMix64{seed ^ (uint64_t(epoch) * kGoldenGamma) ^ (uint64_t(index) * 0xD1B54A32D192ED03ull)} {}
  double uniform() { return double(next() >> 11) * 0x1.0p-53; }  // [0, 1)
  int64_t between(int64_t lo, int64_t hi) { return lo + int64_t(next() % uint64_t(hi - lo + 1)); }
};

// Shifted by (dy, dx), the uncovered edge filled with `fill`: a crop of the image padded
// by `padding` on every side, as torchvision's RandomCrop(size, padding).
void shift(float* img, float* tmp, int64_t c, int64_t h, int64_t w, int64_t dy, int64_t dx,
           float fill) {
  for (int64_t ch = 0; ch < c; ++ch)
    for (int64_t y = 0; y < h; ++y)
      for (int64_t x = 0; x < w; ++x) {
        const int64_t sy = y + dy, sx = x + dx;
        tmp[(ch * h + y) * w + x] =
            sy >= 0 && sy < h && sx >= 0 && sx < w ? img[(ch * h + sy) * w + sx] : fill;
      }
  std::copy(tmp, tmp + c * h * w, img);
}

}  // namespace

torch::Tensor Augment::apply(const torch::Tensor& batch, const torch::Tensor& indices,
                             int64_t epoch) const {
  auto x = batch.to(torch::kFloat32).contiguous().clone();
  const int64_t n = x.size(0), c = x.size(1), h = x.size(2), w = x.size(3);
  const auto idx = indices.to(torch::kInt64).contiguous();
  const int64_t* pi = idx.data_ptr<int64_t>();
  std::vector<float> tmp(size_t(c * h * w));
  const auto has = [&](const char* op) { return std::find(ops.begin(), ops.end(), op) != ops.end(); };
  const bool crop = has("random_crop"), flip = has("hflip"), erase = has("erase");
  for (int64_t i = 0; i < n; ++i) {
    float* img = x.data_ptr<float>() + i * c * h * w;
    Draws d(seed, epoch, pi[i]);
    if (crop) {
      const float black = *std::min_element(img, img + c * h * w);  // the image's own
      const int64_t dy = d.between(-padding, padding), dx = d.between(-padding, padding);
      if (dy != 0 || dx != 0) shift(img, tmp.data(), c, h, w, dy, dx, black);
    }
    if (flip && d.uniform() < 0.5)
      for (int64_t row = 0; row < c * h; ++row) std::reverse(img + row * w, img + (row + 1) * w);
    // Random erasing (Zhong et al. 2017, torchvision's defaults): half the time, a
    // rectangle of 2-33% of the image with aspect ratio in [0.3, 3.3] set to 0 (the mean,
    // after normalisation); up to 10 tries to fit one.
    if (erase && d.uniform() < 0.5)
      for (int tries = 0; tries < 10; ++tries) {
        const double area = double(h * w) * (0.02 + d.uniform() * (0.33 - 0.02));
        const double ratio = std::exp(std::log(0.3) + d.uniform() * (std::log(3.3) - std::log(0.3)));
        const int64_t eh = std::llround(std::sqrt(area * ratio)), ew = std::llround(std::sqrt(area / ratio));
        if (eh < 1 || ew < 1 || eh >= h || ew >= w) continue;
        const int64_t top = d.between(0, h - eh), left = d.between(0, w - ew);
        for (int64_t ch = 0; ch < c; ++ch)
          for (int64_t y = top; y < top + eh; ++y)
            std::fill(img + (ch * h + y) * w + left, img + (ch * h + y) * w + left + ew, 0.0f);
        break;
      }
  }
  return x.to(batch.scalar_type());
}

}  // namespace dtrain
