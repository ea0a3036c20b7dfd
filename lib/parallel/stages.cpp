#include "parallel/stages.hpp"

#include <algorithm>
#include <limits>

namespace dtrain {

std::vector<PartRange> split_stages(const std::vector<int64_t>& part_params, int64_t stages,
                                    const std::vector<int64_t>& explicit_split) {
  const int64_t n = int64_t(part_params.size());
  std::vector<PartRange> out;
  if (!explicit_split.empty()) {
    int64_t first = 0;
    for (auto count : explicit_split) out.push_back({first, first + count}), first += count;
    return out;
  }
  // The smallest achievable largest stage (linear partition, by dynamic programming over
  // prefixes), then the cuts from the front: each stage takes as many parts as fit under it
  // while leaving one for every later stage.
  std::vector<int64_t> prefix(size_t(n) + 1, 0);
  for (int64_t i = 0; i < n; ++i) prefix[size_t(i) + 1] = prefix[size_t(i)] + part_params[size_t(i)];
  const int64_t inf = std::numeric_limits<int64_t>::max();
  // best[j][i]: the smallest largest stage splitting the first i parts into j stages.
  std::vector<std::vector<int64_t>> best(size_t(stages) + 1, std::vector<int64_t>(size_t(n) + 1, inf));
  best[0][0] = 0;
  for (int64_t j = 1; j <= stages; ++j)
    for (int64_t i = j; i <= n; ++i)
      for (int64_t k = j - 1; k < i; ++k)
        if (best[size_t(j - 1)][size_t(k)] != inf)
          best[size_t(j)][size_t(i)] =
              std::min(best[size_t(j)][size_t(i)],
                       std::max(best[size_t(j - 1)][size_t(k)], prefix[size_t(i)] - prefix[size_t(k)]));
  const int64_t limit = best[size_t(stages)][size_t(n)];
  int64_t first = 0;
  for (int64_t s = 0; s < stages; ++s) {
    const int64_t later = stages - s - 1;
    int64_t last = first + 1;
    while (last < n - later && prefix[size_t(last) + 1] - prefix[size_t(first)] <= limit) ++last;
    if (s == stages - 1) last = n;
    out.push_back({first, last});
    first = last;
  }
  return out;
}

}  // namespace dtrain
