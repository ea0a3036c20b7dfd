#include "precision/loss_scaler.hpp"

#include <cmath>

#include <fmt/format.h>

#include "util/error.hpp"

namespace dtrain {

LossScaler::Options LossScaler::from_config(const PrecisionConfig& cfg) {
  Options o;
  if (cfg.loss_scale != "dynamic") {  // validated as a positive number
    o.dynamic = false;
    o.scale = std::stod(cfg.loss_scale);
  }
  return o;
}

LossScaler::LossScaler(Options o) : o_(o), scale_(o.scale) {}

LossScaler::Verdict LossScaler::after_backward(bool grads_finite) {
  if (grads_finite) {
    if (o_.dynamic && ++clean_ >= o_.growth_interval) {
      scale_ *= o_.growth;
      clean_ = 0;
    }
    return Verdict::kUpdate;
  }
  clean_ = 0;
  if (!o_.dynamic || scale_ <= o_.floor) return Verdict::kNonFinite;
  scale_ = std::max(o_.floor, scale_ * o_.backoff);
  ++overflows_;
  return Verdict::kSkip;
}

nlohmann::json LossScaler::state() const {
  return {{"scale", scale_}, {"clean_steps", clean_}, {"overflows", overflows_}};
}

void LossScaler::load(const nlohmann::json& s, const std::string& file) {
  try {
    const double scale = s.at("scale").get<double>();
    const int64_t clean = s.at("clean_steps").get<int64_t>();
    const int64_t overflows = s.at("overflows").get<int64_t>();
    fail_if<CheckpointError>(!std::isfinite(scale) || scale <= 0 || clean < 0 || overflows < 0,
                             "{}: loss_scaler holds scale {}, clean_steps {}, overflows {}", file,
                             scale, clean, overflows);
    // A fixed scale is the job's, not the checkpoint's: only the counts carry over.
    if (o_.dynamic) scale_ = scale, clean_ = clean;
    overflows_ = overflows;
  } catch (const nlohmann::json::exception& e) {
    throw CheckpointError(fmt::format("{}: loss_scaler: {}", file, e.what()));
  }
}

}  // namespace dtrain
