// Mixed precision for the forward pass: bf16 autocast on the CPU while a guard is alive.
// Weights (the flat buffer) stay fp32, the master copy every update writes to; the loss is
// taken in fp32 by the task.
#pragma once
#include <ATen/autocast_mode.h>

#include "util/compat.hpp"

namespace dtrain {

class AutocastGuard {
 public:
  explicit AutocastGuard(bool bf16) : on_(bf16) { compat::set_cpu_autocast(on_); }
  ~AutocastGuard() {
    compat::set_cpu_autocast(false);
    if (on_) at::autocast::clear_cache();  // casts of the weights are per step
  }
  AutocastGuard(const AutocastGuard&) = delete;
  AutocastGuard& operator=(const AutocastGuard&) = delete;

 private:
  bool on_;
};

}  // namespace dtrain
