// Mixed precision for the forward pass: autocast on the job's device while a guard is
// alive (bf16 on the CPU or CUDA, fp16 on CUDA). Weights (the flat buffer) stay fp32, the
// master copy every update writes to; the loss is taken in fp32 by the task.
#pragma once
#include <string>

#include <ATen/autocast_mode.h>
#include <c10/core/Device.h>

#include "util/compat.hpp"

namespace dtrain {

class AutocastGuard {
 public:
  // `dtype`: precision.dtype; fp32 leaves autocast off.
  AutocastGuard(const std::string& dtype, c10::DeviceType device)
      : on_(dtype != "fp32"), device_(device) {
    if (on_) compat::set_autocast(device_, true, dtype == "fp16" ? at::kHalf : at::kBFloat16);
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
