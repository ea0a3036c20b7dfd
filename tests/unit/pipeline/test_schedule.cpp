// Pipeline schedules and stage splits. The 1F1B and GPipe lists are checked against the
// published tables (Narayanan et al., "Efficient Large-Scale Language Model Training on
// GPU Clusters Using Megatron-LM", SC'21, figure 4; Huang et al., "GPipe", figure 2), the
// interleaved ones against hand-worked lists of Megatron-LM's rule; every schedule is then
// played out over the whole pipeline (play_schedule: each action waits for the one it
// needs on the neighbouring stage), which must finish without deadlock, hold no more
// micro-batches than the schedule promises and leave the bubble the papers derive.
#include <doctest/doctest.h>

#include <algorithm>
#include <numeric>
#include <ostream>

#include <fmt/format.h>

#include "parallel/stages.hpp"
#include "pipeline/schedule.hpp"

namespace dtrain {
std::ostream& operator<<(std::ostream& os, const PartRange& r) {
  return os << "[" << r.first << ", " << r.last << ")";
}
}  // namespace dtrain

namespace unit_pipeline_schedule {

using namespace dtrain;

namespace {

// "F0 F1 B0 ..." (with chunks, "F0.0 F1.0 F0.1 ..."): a rank's schedule as the papers'
// tables write it.
std::string table(const std::string& name, int64_t rank, int64_t ranks, int64_t micro,
                  int64_t chunks = 1) {
  const auto actions = pipeline_schedule(name, rank, ranks, micro, chunks);
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

struct Simulated {
  double bubble = 0;            // idle share of the ranks' time
  int64_t most_in_flight = 0;   // the most micro-batches any rank held activations for
  double first_rank_bubble = 0; // rank 0's, as its executor measures it
};

// Plays every rank's list with forward taking 1 unit and backward 2 (their usual ratio), no
// time for communication (play_schedule throws where the lists deadlock).
Simulated simulate(const std::string& name, int64_t ranks, int64_t micro, int64_t chunks) {
  const int64_t stages = ranks * chunks;
  const auto run = play_schedule(name, ranks, micro, chunks, std::vector<double>(size_t(stages), 1.0 / double(chunks)),
                                 std::vector<double>(size_t(stages), 2.0 / double(chunks)));
  Simulated out;
  const double busy = std::accumulate(run.busy.begin(), run.busy.end(), 0.0);
  out.bubble = 1 - busy / (run.makespan() * double(ranks));
  out.most_in_flight = *std::max_element(run.most_held.begin(), run.most_held.end());
  out.first_rank_bubble = run.bubble(0);
  return out;
}

}  // namespace

TEST_CASE("pipeline: 1F1B and GPipe are the published tables") {
  // SC'21 figure 4 (top): 4 stages, 8 micro-batches.
  CHECK(table("1f1b", 0, 4, 8) == "F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 F7 B4 B5 B6 B7");
  CHECK(table("1f1b", 1, 4, 8) == "F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 F6 B4 F7 B5 B6 B7");
  CHECK(table("1f1b", 2, 4, 8) == "F0 F1 B0 F2 B1 F3 B2 F4 B3 F5 B4 F6 B5 F7 B6 B7");
  CHECK(table("1f1b", 3, 4, 8) == "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7");
  CHECK(table("1f1b", 0, 2, 4) == "F0 F1 B0 F2 B1 F3 B2 B3");
  CHECK(table("1f1b", 1, 2, 4) == "F0 B0 F1 B1 F2 B2 F3 B3");
  // Fewer micro-batches than stages: the warm-up is cut short.
  CHECK(table("1f1b", 0, 4, 2) == "F0 F1 B0 B1");
  // GPipe, figure 2(c): every forward, then the backwards from the last.
  for (int64_t r = 0; r < 4; ++r)
    CHECK(table("gpipe", r, 4, 4) == "F0 F1 F2 F3 B3 B2 B1 B0");
}

TEST_CASE("pipeline: interleaved 1F1B follows Megatron-LM's rule") {
  // 2 ranks, 2 chunks each (global stages 0 and 2 on rank 0, 1 and 3 on rank 1), 4
  // micro-batches: forwards in groups of 2 micro-batches per chunk, backwards chunks last
  // to first; rank 0 warms up with 4 forwards, rank 1 with 2.
  CHECK(table("interleaved_1f1b", 0, 2, 4, 2) ==
        "F0.0 F1.0 F0.1 F1.1 F2.0 B0.1 F3.0 B1.1 F2.1 B0.0 F3.1 B1.0 B2.1 B3.1 B2.0 B3.0");
  CHECK(table("interleaved_1f1b", 1, 2, 4, 2) ==
        "F0.0 F1.0 F0.1 B0.1 F1.1 B1.1 F2.0 B0.0 F3.0 B1.0 F2.1 B2.1 F3.1 B3.1 B2.0 B3.0");
  // As many micro-batches as ranks: all forwards first.
  CHECK(table("interleaved_1f1b", 0, 2, 2, 2) == "F0.0 F1.0 F0.1 F1.1 B0.1 B1.1 B0.0 B1.0");
}

TEST_CASE("pipeline: every schedule runs to the end, within its memory, with the bubble of "
          "theory") {
  for (int64_t p : {2, 4})
    for (int64_t m : {4, 8, 16}) {
      CAPTURE(p);
      CAPTURE(m);
      // GPipe and 1F1B idle (p - 1) / (m + p - 1) of the time; GPipe holds all m
      // micro-batches, 1F1B at most p.
      const double theory = double(p - 1) / double(m + p - 1);
      auto gpipe = simulate("gpipe", p, m, 1);
      CHECK(gpipe.bubble == doctest::Approx(theory));
      CHECK(gpipe.first_rank_bubble == doctest::Approx(theory));  // the last to finish
      CHECK(gpipe.most_in_flight == m);
      auto f1b1 = simulate("1f1b", p, m, 1);
      CHECK(f1b1.bubble == doctest::Approx(theory));
      CHECK(f1b1.first_rank_bubble == doctest::Approx(theory));
      CHECK(f1b1.most_in_flight == std::min(p, m));
      // Interleaved over v chunks: the bubble, in units of one (whole-rank) micro-batch,
      // shrinks v-fold: (p - 1) / (v m + p - 1) of the time.
      for (int64_t v : {2, 3}) {
        CAPTURE(v);
        auto inter = simulate("interleaved_1f1b", p, m, v);
        CHECK(inter.bubble == doctest::Approx(double(p - 1) / double(v * m + p - 1)));
        CHECK(inter.first_rank_bubble == doctest::Approx(double(p - 1) / double(v * m + p - 1)));
      }
    }
}

TEST_CASE("pipeline: unequal stages idle the lighter one") {
  // 1F1B, 2 ranks, 4 micro-batches; stage 1 twice stage 0 (forward 1 and 2, backward 2 and
  // 4). Worked by hand: rank 0 runs F0 [0,1] F1 [1,2], then B0 waits for rank 1's B0
  // (F0 [1,3], B0 [3,7]): [7,9]; F2 [9,10]; B1 waits for rank 1's B1 (F1 [7,9], B1
  // [9,13]): [13,15]; F3 [15,16]; rank 1's F2 [13,15] B2 [15,19] F3 [19,21] B3 [21,25];
  // rank 0's B2 [19,21] B3 [25,27]. Rank 0 works 12 of 27, rank 1 24 of 25.
  const auto run = play_schedule("1f1b", 2, 4, 1, {1, 2}, {2, 4});
  CHECK(run.end == std::vector<double>{27, 25});
  CHECK(run.busy == std::vector<double>{12, 24});
  CHECK(run.makespan() == 27);
  CHECK(run.bubble(0) == doctest::Approx(15.0 / 27));
  CHECK(run.bubble(1) == doctest::Approx(1.0 / 25));
  // Equal stages: theory's (p - 1) / (m + p - 1) on the first rank.
  CHECK(play_schedule("1f1b", 2, 4, 1, {1, 1}, {2, 2}).bubble(0) == doctest::Approx(1.0 / 5));
}

TEST_CASE("pipeline: each action appears once, every backward after its forward") {
  for (const char* name : {"gpipe", "1f1b", "interleaved_1f1b"})
    for (int64_t p : {2, 4})
      for (int64_t m : {4, 8}) {
        const int64_t v = std::string(name) == "interleaved_1f1b" ? 2 : 1;
        for (int64_t r = 0; r < p; ++r) {
          CAPTURE(name);
          CAPTURE(r);
          auto list = pipeline_schedule(name, r, p, m, v);
          CHECK(int64_t(list.size()) == 2 * m * v);
          for (int64_t c = 0; c < v; ++c)
            for (int64_t mb = 0; mb < m; ++mb) {
              auto f = std::find(list.begin(), list.end(), Action{Action::kForward, mb, c});
              auto b = std::find(list.begin(), list.end(), Action{Action::kBackward, mb, c});
              REQUIRE(f != list.end());
              REQUIRE(b != list.end());
              CHECK(f < b);
            }
        }
      }
}

TEST_CASE("pipeline: stages balanced by parameters, or as parallel.stages says") {
  // A GPT-like model: a large embedding, equal blocks, a small head.
  const std::vector<int64_t> gpt = {40, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 1};
  auto two = split_stages(gpt, 2);
  REQUIRE(two.size() == 2);
  CHECK(two[0] == PartRange{0, 4});   // 40 + 3 x 7 = 61
  CHECK(two[1] == PartRange{4, 14});  // 9 x 7 + 1 = 64: no cut does better than 64
  // Equal parts split evenly; every stage gets at least one part.
  CHECK(split_stages({5, 5, 5, 5}, 4) == std::vector<PartRange>{{0, 1}, {1, 2}, {2, 3}, {3, 4}});
  CHECK(split_stages({5, 5, 5, 5, 5, 5}, 3) == std::vector<PartRange>{{0, 2}, {2, 4}, {4, 6}});
  CHECK(split_stages({100, 1, 1}, 3) == std::vector<PartRange>{{0, 1}, {1, 2}, {2, 3}});
  CHECK(split_stages({1, 1, 1, 100}, 2) == std::vector<PartRange>{{0, 3}, {3, 4}});
  // Explicit: parts per stage, in order.
  CHECK(split_stages(gpt, 3, {2, 10, 2}) == std::vector<PartRange>{{0, 2}, {2, 12}, {12, 14}});
}

}  // namespace unit_pipeline_schedule
