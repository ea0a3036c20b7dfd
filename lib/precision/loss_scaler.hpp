// fp16's loss scaling. fp16 has five exponent bits: small gradients underflow to zero. The
// loss is multiplied by a scale before backward, so the gradients are too, and divided back
// out before the update. Dynamic scaling (PyTorch's GradScaler, DeepSpeed's loss scaler):
// start at 2^16; a step whose gradients overflowed (inf or nan) makes no update and halves
// the scale; after `growth_interval` clean steps in a row the scale doubles. A floor keeps
// a real divergence from halving forever: an overflow at the floor is reported, and the
// run's train.on_nonfinite decides. A fixed scale (precision.loss_scale: N) never changes;
// its overflows go to train.on_nonfinite at once.
//
// The verdict needs the gradients' finiteness to be the same on every rank: the caller
// passes the global gradient norm (after the data-parallel sum, over the tensor group), so
// all ranks skip together.
#pragma once
#include <cstdint>

#include <nlohmann/json.hpp>

#include "config/config.hpp"

namespace dtrain {

class LossScaler {
 public:
  struct Options {
    bool dynamic = true;
    double scale = 65536.0;        // initial (dynamic) or fixed
    double growth = 2.0;
    double backoff = 0.5;
    int64_t growth_interval = 2000;
    double floor = 1.0;            // DeepSpeed's min_loss_scale
  };
  // From precision.loss_scale: "dynamic" or a number.
  static Options from_config(const PrecisionConfig& cfg);
  explicit LossScaler(Options o);

  double scale() const { return scale_; }

  enum class Verdict {
    kUpdate,    // gradients finite: unscale and update
    kSkip,      // overflow: no update, the scale was lowered
    kNonFinite, // overflow at the floor or with a fixed scale: train.on_nonfinite decides
  };
  // After one step's backward, from whether its (scaled) gradients are all finite.
  Verdict after_backward(bool grads_finite);

  int64_t overflows() const { return overflows_; }  // steps skipped for an overflow

  // Saved with a checkpoint (trainer.json), so a resumed run goes on with the same scale.
  nlohmann::json state() const;
  // Throws CheckpointError naming `file` on a malformed state.
  void load(const nlohmann::json& state, const std::string& file);

 private:
  Options o_;
  double scale_;
  int64_t clean_ = 0;      // finite steps since the last overflow or growth
  int64_t overflows_ = 0;
};

}  // namespace dtrain
