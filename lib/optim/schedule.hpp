// Learning rate as a pure function of the optimizer step, so a resumed run needs no
// scheduler state beyond the step count.
#pragma once
#include <cstdint>

#include "config/config.hpp"

namespace dtrain {

// The rate for optimizer step `step` (1-based) of `total_steps`: a linear warmup from
// peak/warmup to `peak` over schedule.warmup_steps, then the decay over the remaining steps.
double lr_at(const ScheduleConfig& cfg, double peak, int64_t step, int64_t total_steps);

}  // namespace dtrain
