// Wall-clock intervals for the phases' times.
#pragma once
#include <chrono>

namespace dtrain {

using Clock = std::chrono::steady_clock;

inline double ms_since(Clock::time_point t) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t).count();
}

}  // namespace dtrain
