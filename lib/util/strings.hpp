// Small string tests the rooms share (std::string::ends_with is C++20; with a
// distribution's LibTorch 2.6 dtrain builds as C++17).
#pragma once
#include <string>

namespace dtrain {

inline bool ends_with(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

}  // namespace dtrain
