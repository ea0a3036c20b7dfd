// Tensor shapes in messages, as "[512, 784]".
#pragma once
#include <string>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/types.h>

namespace dtrain {

inline std::string shape_str(const torch::Tensor& t) {
  return fmt::format("[{}]", fmt::join(t.sizes().vec(), ", "));
}

}  // namespace dtrain
