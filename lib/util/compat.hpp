// What differs between the LibTorch versions dtrain builds against (Debian's 1.13, the
// CUDA 2.x inside a Python torch). Code asks these, never the version numbers.
#pragma once
#include <ATen/autocast_mode.h>
#include <torch/version.h>

// Whether the LibTorch being built against is at least major.minor.
#define DTRAIN_TORCH_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) ||         \
   (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))

// at::scaled_dot_product_attention (fused attention) exists from 2.0 on.
#define DTRAIN_HAS_FUSED_ATTENTION DTRAIN_TORCH_AT_LEAST(2, 0)

// c10::Allocator::allocate lost its const and copy_data became pure virtual in 2.3 (the
// allocator's clone()); before, allocate is const and there is no copy_data.
#define DTRAIN_ALLOCATOR_MUTABLE DTRAIN_TORCH_AT_LEAST(2, 3)

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

// Autocast on or off for a device type, in a dtype. LibTorch 2.4 brought the
// device-generic at::autocast::set_autocast_enabled / set_autocast_dtype and deprecated the
// per-device functions (set_cpu_enabled, set_enabled for CUDA, ...), which later releases
// may drop; before 2.4 those are the only way.
#define DTRAIN_HAS_GENERIC_AUTOCAST DTRAIN_TORCH_AT_LEAST(2, 4)

namespace dtrain::compat {
inline void set_autocast(c10::DeviceType device, bool on, c10::ScalarType dtype) {
#if DTRAIN_HAS_GENERIC_AUTOCAST
  if (on) at::autocast::set_autocast_dtype(device, dtype);
  at::autocast::set_autocast_enabled(device, on);
#else
  if (device == c10::kCUDA) {
    if (on) at::autocast::set_autocast_gpu_dtype(dtype);
    at::autocast::set_enabled(on);
  } else {
    if (on) at::autocast::set_autocast_cpu_dtype(dtype);
    at::autocast::set_cpu_enabled(on);
  }
#endif
}
}  // namespace dtrain::compat

// Whether autocast is on for a device type, and in which dtype (what a recomputation in
// backward must run under again).
namespace dtrain::compat {
inline bool autocast_enabled(c10::DeviceType device) {
#if DTRAIN_HAS_GENERIC_AUTOCAST
  return at::autocast::is_autocast_enabled(device);
#else
  return device == c10::kCUDA ? at::autocast::is_enabled() : at::autocast::is_cpu_enabled();
#endif
}
inline c10::ScalarType autocast_dtype(c10::DeviceType device) {
#if DTRAIN_HAS_GENERIC_AUTOCAST
  return at::autocast::get_autocast_dtype(device);
#else
  return device == c10::kCUDA ? at::autocast::get_autocast_gpu_dtype()
                              : at::autocast::get_autocast_cpu_dtype();
#endif
}
}  // namespace dtrain::compat

// The fused optimizer kernels (at::_fused_adamw_, at::_fused_sgd_: one pass over lists of
// tensors, and a found_inf tensor that makes the step no update without the host reading
// it): AdamW on CUDA from 2.1, SGD on CUDA from 2.3, both on the CPU from 2.4.
#define DTRAIN_HAS_FUSED_ADAMW DTRAIN_TORCH_AT_LEAST(2, 1)
#define DTRAIN_HAS_FUSED_SGD DTRAIN_TORCH_AT_LEAST(2, 3)
#define DTRAIN_HAS_FUSED_CPU DTRAIN_TORCH_AT_LEAST(2, 4)

// The environment variable that makes NCCL's work.wait() block the caller with a timeout.
namespace dtrain::compat {
#if DTRAIN_TORCH_AT_LEAST(2, 2)
inline constexpr const char* kNcclBlockingWait = "TORCH_NCCL_BLOCKING_WAIT";
#else
inline constexpr const char* kNcclBlockingWait = "NCCL_BLOCKING_WAIT";
#endif
}  // namespace dtrain::compat
