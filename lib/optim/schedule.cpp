#include "optim/schedule.hpp"

#include <algorithm>
#include <cmath>

namespace dtrain {

double lr_at(const ScheduleConfig& cfg, double peak, int64_t step, int64_t total_steps) {
  if (step <= cfg.warmup_steps) return peak * double(step) / double(cfg.warmup_steps);
  const int64_t since = step - cfg.warmup_steps - 1;  // 0 on the first step after warmup
  const int64_t span = std::max<int64_t>(1, total_steps - cfg.warmup_steps - 1);
  const double progress = std::min(1.0, double(since) / double(span));
  if (cfg.decay == "cosine")
    return cfg.min_lr + (peak - cfg.min_lr) * 0.5 * (1.0 + std::cos(M_PI * progress));
  if (cfg.decay == "linear") return peak - (peak - cfg.min_lr) * progress;
  if (cfg.decay == "step") return peak * std::pow(cfg.gamma, double(since / cfg.step_size));
  return peak;  // constant
}

}  // namespace dtrain
