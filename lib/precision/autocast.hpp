// Mixed precision for the forward pass: autocast on the job's device while a guard is
// alive (bf16 on the CPU or CUDA, fp16 on CUDA). Weights (the flat buffer) stay fp32, the
// master copy every update writes to; the loss is taken in fp32 by the task. (ZeRO-3
// holds the weights autocast would cast in the compute dtype while they are gathered:
// FlatOptions::compute_dtype.)
#pragma once
#include <string>

#include <ATen/autocast_mode.h>
#include <c10/core/Device.h>

#include "util/compat.hpp"

namespace dtrain {

// The dtype autocast computes in under precision.dtype `dtype` (fp32: none, autocast off).
inline at::ScalarType compute_dtype(const std::string& dtype) {
  return dtype == "fp16" ? at::kHalf : dtype == "bf16" ? at::kBFloat16 : at::kFloat;
}

class AutocastGuard {
 public:
  // `dtype`: precision.dtype; fp32 leaves autocast off.
  AutocastGuard(const std::string& dtype, c10::DeviceType device)
      : on_(compute_dtype(dtype) != at::kFloat), device_(device) {
    if (on_) compat::set_autocast(device_, true, compute_dtype(dtype));
  }
  ~AutocastGuard() {
    if (!on_) return;
    compat::set_autocast(device_, false, at::kFloat);
    at::autocast::clear_cache();  // casts of the weights are per step
  }
  AutocastGuard(const AutocastGuard&) = delete;
  AutocastGuard& operator=(const AutocastGuard&) = delete;

 private:
  bool on_;
  c10::DeviceType device_;
};

}  // namespace dtrain
