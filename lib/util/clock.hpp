// Wall-clock intervals for the phases' times, and the wall clock's time.
#pragma once
#include <chrono>

namespace dtrain {

using Clock = std::chrono::steady_clock;

inline double ms_since(Clock::time_point t) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t).count();
}

// Seconds since the Unix epoch: the "time" of a metrics line, a checkpoint's creation.
inline double unix_time() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

}  // namespace dtrain
