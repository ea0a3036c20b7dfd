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

}  // namespace dtrain
