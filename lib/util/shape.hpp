// Tensor shapes: in messages, as "[512, 784]", and their sizes.
#pragma once
#include <string>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/types.h>

namespace dtrain {

inline std::string shape_str(const std::vector<int64_t>& shape) {
  return fmt::format("[{}]", fmt::join(shape, ", "));
}
inline std::string shape_str(const torch::Tensor& t) { return shape_str(t.sizes().vec()); }

// The elements a tensor of `shape` holds.
inline int64_t shape_numel(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (auto d : shape) n *= d;
  return n;
}

// The most values a tensor may hold: its bytes (8 a value at most) must stay an int64,
// which LibTorch counts them in ("Storage size calculation overflowed" past it).
inline constexpr int64_t kMostValues = int64_t(1) << 60;

// Whether sizes that are each >= 0 multiply to at most kMostValues (checked as they
// multiply, so no product overflows on the way).
inline bool addressable(const std::vector<int64_t>& sizes) {
  int64_t n = 1;
  for (auto d : sizes)
    if (d != 0 && n > kMostValues / d) return false;
    else n *= d;
  return n <= kMostValues;
}

}  // namespace dtrain
