#include "util/blas.hpp"

#include <fstream>

#include <ATen/Context.h>

namespace dtrain {

std::string loaded_blas() {
  std::ifstream maps("/proc/self/maps");
  std::string line;
  while (std::getline(maps, line)) {
    auto pos = line.find('/');
    if (pos == std::string::npos) continue;
    auto path = line.substr(pos);
    if (path.find("libblas.so") != std::string::npos || path.find("libopenblas") != std::string::npos)
      return path;
  }
  // The torch wheel's LibTorch links MKL into itself: no library of its own to name.
  return at::hasMKL() ? "MKL (in LibTorch)" : "";
}

bool is_reference_blas(const std::string& path) {
  return path.find("/blas/libblas.so") != std::string::npos;
}

}  // namespace dtrain
