// Evaluation on the held-out split.
#pragma once
#include "train/context.hpp"

namespace dtrain {

// Each data-parallel rank scores a contiguous slice of the test split; the sums are
// combined over the data group, so every item counts exactly once whatever the layout.
EvalResult evaluate(Context& c);
// An evaluation after step state.step: its line (rank 0), the best metric so far.
void evaluate_and_report(Context& c);

}  // namespace dtrain
