// Byte units, for sizes the user reads (MiB in logs and keys, GiB in memory errors).
#pragma once

namespace dtrain {

constexpr double kMiB = 1024.0 * 1024.0;
constexpr double kGiB = 1024.0 * kMiB;

}  // namespace dtrain
