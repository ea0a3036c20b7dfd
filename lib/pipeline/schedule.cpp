#include "pipeline/schedule.hpp"

#include <algorithm>
#include <limits>
#include <stdexcept>

#include <fmt/format.h>

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

namespace {

// Megatron-LM's order of an interleaved rank's forwards (and, chunks reversed, backwards):
// the k-th runs micro-batch (k / (ranks * chunks)) * ranks + k % ranks on chunk
// (k / ranks) % chunks.
Action interleaved_action(Action::Kind kind, int64_t k, int64_t ranks, int64_t chunks) {
  const int64_t micro = k / (ranks * chunks) * ranks + k % ranks;
  int64_t chunk = k / ranks % chunks;
  if (kind == Action::kBackward) chunk = chunks - 1 - chunk;
  return {kind, micro, chunk};
}

}  // namespace

std::vector<Action> pipeline_schedule(const std::string& name, int64_t rank, int64_t ranks,
                                      int64_t micro, int64_t chunks) {
  std::vector<Action> out;
  if (name == "gpipe") {
    for (int64_t m = 0; m < micro; ++m) out.push_back({Action::kForward, m});
    for (int64_t m = micro - 1; m >= 0; --m) out.push_back({Action::kBackward, m});
    return out;
  }
  if (name == "1f1b") {
    const int64_t warmup = std::min(ranks - rank - 1, micro);
    int64_t f = 0, b = 0;
    while (f < warmup) out.push_back({Action::kForward, f++});
    while (f < micro) {
      out.push_back({Action::kForward, f++});
      out.push_back({Action::kBackward, b++});
    }
    while (b < micro) out.push_back({Action::kBackward, b++});
    return out;
  }
  if (name == "interleaved_1f1b") {
    if (micro % ranks != 0)
      throw std::logic_error(fmt::format("interleaved_1f1b: {} micro-batches over {} ranks",
                                         micro, ranks));
    const int64_t total = micro * chunks;
    // Enough forwards that the first backward's gradient has come round the whole pipeline;
    // with as many micro-batches as ranks, every forward comes first.
    const int64_t warmup =
        micro == ranks ? total : std::min(total, (ranks - rank - 1) * 2 + (chunks - 1) * ranks);
    int64_t f = 0, b = 0;
    while (f < warmup) out.push_back(interleaved_action(Action::kForward, f++, ranks, chunks));
    while (f < total) {
      out.push_back(interleaved_action(Action::kForward, f++, ranks, chunks));
      out.push_back(interleaved_action(Action::kBackward, b++, ranks, chunks));
    }
    while (b < total) out.push_back(interleaved_action(Action::kBackward, b++, ranks, chunks));
    return out;
  }
  throw std::logic_error("unknown pipeline schedule '" + name + "'");
}

std::string schedule_str(const std::vector<Action>& actions) {
  const bool chunked = std::any_of(actions.begin(), actions.end(),
                                   [](const Action& a) { return a.chunk > 0; });
  std::string s;
  for (const auto& a : actions) {
    if (!s.empty()) s += ' ';
    s += fmt::format("{}{}", a.kind == Action::kForward ? 'F' : 'B', a.micro);
    if (chunked) s += fmt::format(".{}", a.chunk);
  }
  return s;
}

}  // namespace dtrain
