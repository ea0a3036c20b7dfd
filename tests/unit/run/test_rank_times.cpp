// Each rank's busy time over steps, and the straggler it names (run/run_log.hpp's RankTimes).
#include <doctest/doctest.h>

#include "run/run_log.hpp"

namespace unit_run_rank_times {

using namespace dtrain;

TEST_CASE("the slowest rank by its mean busy time, against the median of the ranks' means") {
  RankTimes t;
  t.add({10, 12, 40, 11});
  t.add({14, 12, 50, 13});
  nlohmann::json out;
  t.describe(out);
  CHECK(out["slowest_rank"] == 2);
  CHECK(out["slowest_busy_ms"].get<double>() == doctest::Approx(45));
  CHECK(out["median_busy_ms"].get<double>() == doctest::Approx(12));  // (12 + 12) / 2
}

TEST_CASE("a rank that did not agree on a step (0) is left out of that step's mean") {
  RankTimes t;
  t.add({10, 30, 0});  // rank 2 apart this step (local SGD's replica)
  t.add({10, 30, 50});
  nlohmann::json out;
  t.describe(out);
  CHECK(out["slowest_rank"] == 2);
  CHECK(out["slowest_busy_ms"].get<double>() == doctest::Approx(50));
  CHECK(out["median_busy_ms"].get<double>() == doctest::Approx(30));
}

TEST_CASE("one rank, or none timed: nothing to name") {
  nlohmann::json out;
  RankTimes none;
  none.describe(out);
  RankTimes one;
  one.add({12});
  one.describe(out);
  CHECK(out.empty());
}

}  // namespace unit_run_rank_times
