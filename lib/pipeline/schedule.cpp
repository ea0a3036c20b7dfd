#include "pipeline/schedule.hpp"

#include <algorithm>
#include <limits>
#include <stdexcept>

#include <fmt/format.h>

namespace dtrain {

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

// 1F1B's shape over `total` actions of each kind: `warmup` forwards, then a forward and a
// backward in turn, then the backwards left; `action(kind, k)` is the k-th of its kind.
template <class MakeAction>
std::vector<Action> one_f_one_b(int64_t total, int64_t warmup, MakeAction action) {
  std::vector<Action> out;
  int64_t f = 0, b = 0;
  while (f < warmup) out.push_back(action(Action::kForward, f++));
  while (f < total) {
    out.push_back(action(Action::kForward, f++));
    out.push_back(action(Action::kBackward, b++));
  }
  while (b < total) out.push_back(action(Action::kBackward, b++));
  return out;
}

}  // namespace

std::vector<Action> pipeline_schedule(const std::string& name, int64_t rank, int64_t ranks,
                                      int64_t micro, int64_t chunks) {
  if (name == "gpipe")  // all forwards first: the backwards run from the last micro-batch
    return one_f_one_b(micro, micro, [&](Action::Kind kind, int64_t m) {
      return Action{kind, kind == Action::kForward ? m : micro - 1 - m};
    });
  if (name == "1f1b")
    return one_f_one_b(micro, std::min(ranks - rank - 1, micro),
                       [](Action::Kind kind, int64_t m) { return Action{kind, m}; });
  if (name == "interleaved_1f1b") {
    if (micro % ranks != 0)
      throw std::logic_error(fmt::format("interleaved_1f1b: {} micro-batches over {} ranks",
                                         micro, ranks));
    const int64_t total = micro * chunks;
    // Enough forwards that the first backward's gradient has come round the whole pipeline;
    // with as many micro-batches as ranks, every forward comes first.
    const int64_t warmup =
        micro == ranks ? total : std::min(total, (ranks - rank - 1) * 2 + (chunks - 1) * ranks);
    return one_f_one_b(total, warmup, [&](Action::Kind kind, int64_t k) {
      return interleaved_action(kind, k, ranks, chunks);
    });
  }
  throw std::logic_error("unknown pipeline schedule '" + name + "'");
}

ScheduleRun play_schedule(const std::string& name, int64_t ranks, int64_t micro, int64_t chunks,
                          const std::vector<double>& forward, const std::vector<double>& backward) {
  const int64_t stages = ranks * chunks;
  std::vector<std::vector<Action>> lists;
  for (int64_t r = 0; r < ranks; ++r) lists.push_back(pipeline_schedule(name, r, ranks, micro, chunks));
  // When each (kind, micro-batch, global stage) ended; below 0 where it has not run yet.
  std::vector<double> ended(size_t(2 * micro * stages), -1);
  auto at = [&](Action::Kind kind, int64_t m, int64_t g) -> double& {
    return ended[size_t((int64_t(kind) * micro + m) * stages + g)];
  };
  ScheduleRun run;
  run.busy.assign(size_t(ranks), 0);
  run.end.assign(size_t(ranks), 0);
  run.most_held.assign(size_t(ranks), 0);
  std::vector<int64_t> held(size_t(ranks), 0);
  std::vector<size_t> next(size_t(ranks), 0);
  // Each pass runs every rank's next action whose input is there; an action's times follow
  // from its rank's previous action and its input alone, so the order of passes is free.
  for (bool progress = true; progress;) {
    progress = false;
    for (int64_t r = 0; r < ranks; ++r) {
      const auto& list = lists[size_t(r)];
      for (; next[size_t(r)] < list.size(); ++next[size_t(r)]) {
        const Action a = list[next[size_t(r)]];
        const int64_t g = a.chunk * ranks + r;
        const bool forward_pass = a.kind == Action::kForward;
        double input = 0;  // when its input arrived
        if (forward_pass && g > 0) input = at(Action::kForward, a.micro, g - 1);
        if (!forward_pass)
          input = g == stages - 1 ? at(Action::kForward, a.micro, g) : at(Action::kBackward, a.micro, g + 1);
        if (input < 0) break;
        const double cost = forward_pass ? forward[size_t(g)] : backward[size_t(g)];
        const double start = std::max(run.end[size_t(r)], input);
        run.end[size_t(r)] = at(a.kind, a.micro, g) = start + cost;
        run.busy[size_t(r)] += cost;
        held[size_t(r)] += forward_pass ? 1 : -1;
        run.most_held[size_t(r)] = std::max(run.most_held[size_t(r)], held[size_t(r)]);
        progress = true;
      }
    }
  }
  for (int64_t r = 0; r < ranks; ++r)
    if (next[size_t(r)] != lists[size_t(r)].size())
      throw std::logic_error(fmt::format("{}: rank {} of {} cannot go on past action {} of {}", name,
                                         r, ranks, next[size_t(r)], lists[size_t(r)].size()));
  return run;
}

double ScheduleRun::makespan() const {
  return end.empty() ? 0 : *std::max_element(end.begin(), end.end());
}

double ScheduleRun::bubble(int64_t rank) const {
  const double e = end[size_t(rank)];
  return e > 0 ? 1 - busy[size_t(rank)] / e : 0;
}

}  // namespace dtrain
