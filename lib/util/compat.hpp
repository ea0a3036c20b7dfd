// What differs between the LibTorch versions dtrain builds against (Debian's 1.13, the
// CUDA 2.x inside a Python torch). Code asks these, never the version numbers.
#pragma once
#include <ATen/autocast_mode.h>
#include <torch/version.h>

// at::scaled_dot_product_attention (fused attention) exists from 2.0 on.
#define DTRAIN_HAS_FUSED_ATTENTION (TORCH_VERSION_MAJOR >= 2)

// LibTorch >= 2.4 hosts and joins c10d's TCPStore through libuv by default, which
// distribution builds (Debian 13's 2.6) lack: "use_libuv was requested but PyTorch was
// build without libuv support". dtrain only joins a c10d store as a client (torchrun's
// agent's); the classic socket client works with either server. Where the option exists,
// turn it off; where it does not (1.13), there is nothing to turn off.
namespace dtrain::compat {
template <class StoreOptions>
auto without_libuv(StoreOptions& o, int) -> decltype(o.useLibUV = false, void()) {
  o.useLibUV = false;
}
template <class StoreOptions>
void without_libuv(StoreOptions&, long) {}
template <class StoreOptions>
void store_without_libuv(StoreOptions& o) {
  without_libuv(o, 0);
}
}  // namespace dtrain::compat

// CPU autocast on or off. LibTorch 2.4 brought at::autocast::set_autocast_enabled(device,
// on) and deprecated set_cpu_enabled(on) in the same change, through the macro tested here
// (its spelling is LibTorch's); before it, set_cpu_enabled is the only way.
namespace dtrain::compat {
inline void set_cpu_autocast(bool on) {
#ifdef AT_FORALL_DEPRECATED_AUTOCAST_BAKCNEDS
  at::autocast::set_autocast_enabled(at::kCPU, on);
#else
  at::autocast::set_cpu_enabled(on);
#endif
}
}  // namespace dtrain::compat
