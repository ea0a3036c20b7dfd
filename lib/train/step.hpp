// One optimizer step, whatever the layout.
#pragma once
#include "data/loader.hpp"
#include "train/report.hpp"

namespace dtrain {

// `want_norm`: compute the global gradient norm even without clipping (a logged step).
StepStats train_step(Context& c, Loader& loader, bool want_norm);

}  // namespace dtrain
