// Pipeline stages, the pure part: which contiguous run of the model's parts
// (models/model.hpp's Network) each global stage holds. Below models/ and pipeline/ because
// both ask it: the models for their split (stage_split), the schedules for what runs where.
#pragma once
#include <cstdint>
#include <vector>

namespace dtrain {

struct PartRange {
  int64_t first = 0, last = 0;  // parts [first, last)
  bool operator==(const PartRange& o) const { return first == o.first && last == o.last; }
};

// The parts of each global stage. `explicit_split` (parallel.stages) gives each stage's
// number of parts; empty, the split is the contiguous one whose largest stage has the
// fewest parameters (`part_params`: each part's count), ties going to earlier cuts.
// The caller has checked that every stage gets at least one part (validation).
std::vector<PartRange> split_stages(const std::vector<int64_t>& part_params, int64_t stages,
                                    const std::vector<int64_t>& explicit_split = {});

}  // namespace dtrain
