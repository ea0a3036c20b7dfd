// Learning-rate schedules at chosen steps, against values worked out by hand.
#include <doctest/doctest.h>

#include <cmath>

#include "config/config.hpp"
#include "optim/schedule.hpp"

namespace unit_optim_lr_schedule {

using namespace dtrain;

namespace {
ScheduleConfig sched(const char* decay, int64_t warmup, double min_lr = 0.0) {
  ScheduleConfig s;
  s.decay = decay;
  s.warmup_steps = warmup;
  s.min_lr = min_lr;
  return s;
}
}  // namespace

TEST_CASE("schedule: constant") {
  auto s = sched("constant", 0);
  CHECK(lr_at(s, 0.3, 1, 100) == doctest::Approx(0.3));
  CHECK(lr_at(s, 0.3, 50, 100) == doctest::Approx(0.3));
  CHECK(lr_at(s, 0.3, 100, 100) == doctest::Approx(0.3));
  s.warmup_steps = 4;
  CHECK(lr_at(s, 0.4, 1, 100) == doctest::Approx(0.1));
  CHECK(lr_at(s, 0.4, 2, 100) == doctest::Approx(0.2));
  CHECK(lr_at(s, 0.4, 4, 100) == doctest::Approx(0.4));
  CHECK(lr_at(s, 0.4, 5, 100) == doctest::Approx(0.4));
  CHECK(lr_at(s, 0.4, 100, 100) == doctest::Approx(0.4));
}

TEST_CASE("schedule: cosine") {
  // peak 1, min 0, no warmup, 101 steps: the half-cosine spans steps 1..101.
  auto s = sched("cosine", 0);
  CHECK(lr_at(s, 1.0, 1, 101) == doctest::Approx(1.0));
  CHECK(lr_at(s, 1.0, 26, 101) == doctest::Approx(0.8535533905932737));  // (1 + cos(pi/4)) / 2
  CHECK(lr_at(s, 1.0, 51, 101) == doctest::Approx(0.5));
  CHECK(lr_at(s, 1.0, 76, 101) == doctest::Approx(0.14644660940672624));  // (1 - cos(pi/4)) / 2
  CHECK(lr_at(s, 1.0, 101, 101) == doctest::Approx(0.0));
  CHECK(lr_at(s, 1.0, 150, 101) == doctest::Approx(0.0));  // past the end: stays at the floor

  // A floor: min + (peak - min) * (1 + cos) / 2.
  s.min_lr = 0.1;
  CHECK(lr_at(s, 2.0, 1, 101) == doctest::Approx(2.0));
  CHECK(lr_at(s, 2.0, 51, 101) == doctest::Approx(1.05));
  CHECK(lr_at(s, 2.0, 101, 101) == doctest::Approx(0.1));

  // Warmup 10 then cosine over the 100 steps after it (total 111).
  s = sched("cosine", 10);
  CHECK(lr_at(s, 1.0, 1, 111) == doctest::Approx(0.1));
  CHECK(lr_at(s, 1.0, 5, 111) == doctest::Approx(0.5));
  CHECK(lr_at(s, 1.0, 10, 111) == doctest::Approx(1.0));
  CHECK(lr_at(s, 1.0, 11, 111) == doctest::Approx(1.0));
  CHECK(lr_at(s, 1.0, 61, 111) == doctest::Approx(0.5));
  CHECK(lr_at(s, 1.0, 111, 111) == doctest::Approx(0.0));
  CHECK(lr_at(s, 0.2, 5, 111) == doctest::Approx(0.1));
}

TEST_CASE("schedule: linear") {
  auto s = sched("linear", 0, /*min_lr=*/0.2);
  CHECK(lr_at(s, 2.0, 1, 11) == doctest::Approx(2.0));
  CHECK(lr_at(s, 2.0, 2, 11) == doctest::Approx(1.82));
  CHECK(lr_at(s, 2.0, 6, 11) == doctest::Approx(1.1));
  CHECK(lr_at(s, 2.0, 11, 11) == doctest::Approx(0.2));
  CHECK(lr_at(s, 2.0, 20, 11) == doctest::Approx(0.2));
  s.warmup_steps = 5;
  s.min_lr = 0;
  // Warmup steps 1..5, then the decay from step 6 (peak) to step 14 (floor): 8 decrements.
  CHECK(lr_at(s, 1.0, 1, 14) == doctest::Approx(0.2));
  CHECK(lr_at(s, 1.0, 5, 14) == doctest::Approx(1.0));
  CHECK(lr_at(s, 1.0, 6, 14) == doctest::Approx(1.0));
  CHECK(lr_at(s, 1.0, 10, 14) == doctest::Approx(0.5));
  CHECK(lr_at(s, 1.0, 14, 14) == doctest::Approx(0.0));
}

TEST_CASE("schedule: step") {
  auto s = sched("step", 0);
  s.step_size = 10;
  s.gamma = 0.1;
  CHECK(lr_at(s, 1.0, 1, 100) == doctest::Approx(1.0));
  CHECK(lr_at(s, 1.0, 10, 100) == doctest::Approx(1.0));
  CHECK(lr_at(s, 1.0, 11, 100) == doctest::Approx(0.1));
  CHECK(lr_at(s, 1.0, 20, 100) == doctest::Approx(0.1));
  CHECK(lr_at(s, 1.0, 21, 100) == doctest::Approx(0.01));
  CHECK(lr_at(s, 1.0, 95, 100) == doctest::Approx(1e-9));
  s.warmup_steps = 5;
  CHECK(lr_at(s, 1.0, 3, 100) == doctest::Approx(0.6));
  CHECK(lr_at(s, 1.0, 6, 100) == doctest::Approx(1.0));
  CHECK(lr_at(s, 1.0, 15, 100) == doctest::Approx(1.0));
  CHECK(lr_at(s, 1.0, 16, 100) == doctest::Approx(0.1));
  s.gamma = 0.5;
  CHECK(lr_at(s, 0.8, 26, 100) == doctest::Approx(0.2));
}

TEST_CASE("schedule: every decay is finite, positive and at most the peak") {
  for (const char* decay : {"constant", "cosine", "linear", "step"}) {
    for (int64_t warmup : {0, 1, 7}) {
      for (int64_t total : {1, 2, 8, 50}) {
        auto s = sched(decay, warmup, 0.01);
        for (int64_t step = 1; step <= total + 2; ++step) {
          CAPTURE(decay);
          CAPTURE(warmup);
          CAPTURE(total);
          CAPTURE(step);
          const double lr = lr_at(s, 0.5, step, total);
          CHECK(std::isfinite(lr));
          CHECK(lr > 0);
          CHECK(lr <= 0.5 + 1e-12);
        }
      }
    }
  }
}

}  // namespace unit_optim_lr_schedule
