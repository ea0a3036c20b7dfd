// The LibTorch lines dtrain builds against: the pinned one (scripts/libtorch.sh, 2.15) and,
// as the oldest, a distribution's own (Debian 13's 2.6), refused below that. Both have
// every call dtrain makes; should one differ again, it is asked here, never of version
// numbers elsewhere.
#pragma once
#include <ATen/autocast_mode.h>
#include <torch/version.h>

#if TORCH_VERSION_MAJOR < 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR < 6)
#error "dtrain needs LibTorch 2.6 or later (Debian 12's 1.13 is retired): scripts/setup.sh builds on the pinned 2.15"
#endif

namespace dtrain::compat {

// Autocast on or off for a device type, in a dtype (the dtype is set only when it goes on).
inline void set_autocast(c10::DeviceType device, bool on, c10::ScalarType dtype) {
  if (on) at::autocast::set_autocast_dtype(device, dtype);
  at::autocast::set_autocast_enabled(device, on);
}
}  // namespace dtrain::compat
