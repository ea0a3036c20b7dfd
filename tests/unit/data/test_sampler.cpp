// The distributed sampler: per-epoch permutations from (seed, epoch), and D ranks together
// taking exactly the global batch one rank would take.
#include <doctest/doctest.h>

#include <algorithm>
#include <map>
#include <numeric>
#include <set>
#include <vector>

#include <torch/torch.h>

#include "data/sampler.hpp"
#include "util/error.hpp"

namespace unit_data_sampler {

using namespace dtrain;

namespace {
std::vector<int64_t> to_vec(const torch::Tensor& t) {
  auto c = t.contiguous();
  return std::vector<int64_t>(c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel());
}
std::vector<int64_t> list(const EpochOrder& order) {
  std::vector<int64_t> v(size_t(order.size()));
  for (int64_t i = 0; i < order.size(); ++i) v[size_t(i)] = order.at(i);
  return v;
}
std::vector<int64_t> iota(int64_t n) {
  std::vector<int64_t> v(n);
  std::iota(v.begin(), v.end(), 0);
  return v;
}
}  // namespace

TEST_CASE("sampler: epoch_order is a permutation, fixed by (seed, epoch)") {
  const int64_t n = 1000;
  ShardedSampler s(n, /*global_batch=*/10, /*shuffle=*/true, /*seed=*/42);
  auto o0 = list(s.epoch_order(0));
  REQUIRE(o0.size() == static_cast<size_t>(n));
  auto sorted = o0;
  std::sort(sorted.begin(), sorted.end());
  CHECK(sorted == iota(n));
  CHECK(o0 != iota(n));  // actually shuffled

  CHECK(list(s.epoch_order(0)) == o0);  // same (seed, epoch), same order
  CHECK(list(ShardedSampler(n, 10, true, 42).epoch_order(0)) == o0);
  auto o1 = list(s.epoch_order(1));
  CHECK(o1 != o0);
  auto sorted1 = o1;
  std::sort(sorted1.begin(), sorted1.end());
  CHECK(sorted1 == iota(n));
  CHECK(list(ShardedSampler(n, 10, true, 43).epoch_order(0)) != o0);
  // The order does not depend on the rank or the number of ranks.
  CHECK(list(ShardedSampler(n, 10, true, 42, /*rank=*/1, /*ranks=*/2).epoch_order(0)) == o0);
  CHECK(list(ShardedSampler(n, 10, true, 42, /*rank=*/4, /*ranks=*/5).epoch_order(1)) == o1);

  // Many epochs: all distinct (a collision would mean correlated epochs).
  std::set<std::vector<int64_t>> seen;
  for (int64_t e = 0; e < 20; ++e) seen.insert(list(s.epoch_order(e)));
  CHECK(seen.size() == 20);

  // Tiny data sets too.
  CHECK(list(ShardedSampler(1, 1, true, 5).epoch_order(3)) == std::vector<int64_t>{0});
  auto two = list(ShardedSampler(2, 1, true, 5).epoch_order(0));
  std::sort(two.begin(), two.end());
  CHECK(two == iota(2));
}

TEST_CASE("sampler: past the listed size the order is computed, a permutation fixed by (seed, epoch)") {
  // The same sizes computed instead of listed (listed_max 0): each a permutation, the
  // same for the same (seed, epoch), different across epochs and seeds, and shuffled.
  for (int64_t n : {1, 2, 3, 1000, 4096, 4097}) {
    CAPTURE(n);
    const auto o0 = list(EpochOrder(n, true, 42, 0, /*listed_max=*/0));
    auto sorted = o0;
    std::sort(sorted.begin(), sorted.end());
    CHECK(sorted == iota(n));
    CHECK(list(EpochOrder(n, true, 42, 0, 0)) == o0);
    if (n < 1000) continue;
    CHECK(o0 != iota(n));
    CHECK(list(EpochOrder(n, true, 42, 1, 0)) != o0);
    CHECK(list(EpochOrder(n, true, 43, 0, 0)) != o0);
    // Well mixed: neighbouring positions land far apart (a sorted run would be near 1),
    // and about half the samples land in the first half of the order.
    int64_t first_half = 0;
    double gaps = 0;
    for (int64_t i = 0; i < n; ++i) {
      first_half += o0[size_t(i)] < n / 2;
      if (i > 0) gaps += double(std::abs(o0[size_t(i)] - o0[size_t(i - 1)]));
    }
    CHECK(gaps / double(n - 1) == doctest::Approx(double(n) / 3).epsilon(0.1));
    CHECK(std::abs(first_half - n / 2) < n / 10);
  }
  // A corpus past the listed size costs no list: 1e9 windows, any position at once.
  const EpochOrder huge(1000000000, true, 7, 3);
  std::set<int64_t> some;
  for (int64_t i = 0; i < 1000; ++i) {
    const int64_t at = huge.at(i * 999983);
    CHECK(at >= 0);
    CHECK(at < 1000000000);
    some.insert(at);
  }
  CHECK(some.size() == 1000);
}

TEST_CASE("sampler: shuffle=false is the identity every epoch") {
  ShardedSampler s(17, 4, /*shuffle=*/false, 42);
  CHECK(list(s.epoch_order(0)) == iota(17));
  CHECK(list(s.epoch_order(5)) == iota(17));
  CHECK(to_vec(s.rank_indices(s.epoch_order(0), /*position=*/8)) == std::vector<int64_t>{8, 9, 10, 11});
}

TEST_CASE("sampler: a job's steps lie at step x batch of epoch step / steps_per_epoch") {
  const ShardedSampler s(103, 10, true, 7);
  for (int64_t step : {0, 1, 9, 10, 11, 25, 99}) {
    CAPTURE(step);
    CHECK(s.at(step).epoch == step / 10);
    CHECK(s.at(step).position == step % 10 * 10);
  }
}

// fault_tolerance.batch: shrink: the replicas that train deal batches of their number's
// size; every sample of an epoch is taken once, whatever the batch did meanwhile, and an
// epoch ends only where its rest is smaller than a batch (that tail dropped, as always).
TEST_CASE("sampler: a course of changing batches takes each sample of an epoch once") {
  const int64_t size = 100;
  const ShardedSampler job(size, 12, true, 3);
  // Three replicas of 4 samples, two from step 5, one from 9, three again from 30.
  const std::map<int64_t, int64_t> changes{{5, 8}, {9, 4}, {30, 12}};
  ShardedSampler course = job;
  std::map<int64_t, std::vector<int64_t>> seen;  // epoch -> samples taken
  int64_t last_epoch = 0, last_batch = 12;
  std::map<int64_t, int64_t> batch_at_end;       // epoch -> the batch it ended at
  for (int64_t step = 0; step < 60; ++step) {
    if (changes.count(step)) course = course.continued(step, changes.at(step));
    const int64_t k = course.global_batch() / 4;
    const BatchAt at = course.at(step);
    if (at.epoch != last_epoch) batch_at_end[last_epoch] = last_batch, last_epoch = at.epoch;
    last_batch = course.global_batch();
    const EpochOrder order = course.epoch_order(at.epoch);
    for (int64_t r = 0; r < k; ++r)
      for (int64_t i : to_vec(course.reshared(r, k).rank_indices(order, at.position)))
        seen[at.epoch].push_back(i);
  }
  REQUIRE(batch_at_end.size() >= 3);
  for (const auto& [epoch, batch] : batch_at_end) {
    CAPTURE(epoch);
    auto taken = seen.at(epoch);
    std::sort(taken.begin(), taken.end());
    CHECK(std::adjacent_find(taken.begin(), taken.end()) == taken.end());  // none twice
    CHECK(int64_t(taken.size()) > size - batch);  // only a tail smaller than a batch left
  }
  // The shrunk course's first step is where the job's own step 5 lies.
  CHECK(job.continued(5, 8).at(5).position == job.at(5).position);
  CHECK(job.continued(5, 8).at(6).position == job.at(5).position + 8);
}

TEST_CASE("sampler: steps_per_epoch drops the incomplete tail") {
  CHECK(ShardedSampler(10, 4, true, 1).steps_per_epoch() == 2);
  CHECK(ShardedSampler(12, 4, true, 1).steps_per_epoch() == 3);
  CHECK(ShardedSampler(60000, 64, true, 1).steps_per_epoch() == 937);
  CHECK(ShardedSampler(5, 5, true, 1).steps_per_epoch() == 1);
}

TEST_CASE("sampler: D ranks together take exactly the global batch, disjointly") {
  const int64_t n = 37, b = 8;  // 4 steps per epoch, 5 samples dropped
  for (int64_t d : {1, 2, 4, 8}) {
    CAPTURE(d);
    std::vector<ShardedSampler> ranks;
    for (int64_t r = 0; r < d; ++r) ranks.emplace_back(n, b, true, /*seed=*/7, r, d);
    for (int64_t epoch = 0; epoch < 3; ++epoch) {
      const auto order = list(ShardedSampler(n, b, true, 7).epoch_order(epoch));
      const int64_t steps = ranks[0].steps_per_epoch();
      CHECK(steps == 4);
      for (int64_t step = 0; step < steps; ++step) {
        CAPTURE(epoch);
        CAPTURE(step);
        std::vector<int64_t> all;
        for (int64_t r = 0; r < d; ++r) {
          CHECK(ranks[r].rank_batch() == b / d);
          auto mine = to_vec(ranks[r].rank_indices(ranks[r].epoch_order(epoch), step * b));
          CHECK(mine.size() == static_cast<size_t>(b / d));
          // The documented interleave: rank r takes elements r, r+D, ... of the global batch.
          for (size_t i = 0; i < mine.size(); ++i)
            CHECK(mine[i] == order[step * b + r + static_cast<int64_t>(i) * d]);
          all.insert(all.end(), mine.begin(), mine.end());
        }
        std::vector<int64_t> global(order.begin() + step * b, order.begin() + (step + 1) * b);
        std::sort(all.begin(), all.end());
        std::sort(global.begin(), global.end());
        CHECK(all == global);  // the union, and (same size, no repeats) disjoint
        CHECK(std::adjacent_find(all.begin(), all.end()) == all.end());
      }
    }
  }
}

// A fault-tolerant job's survivors deal the same global batch among fewer replicas: the
// shares may differ by one, and together they are the batch, each sample once.
TEST_CASE("sampler: a batch re-shared among survivors that do not divide it") {
  const int64_t n = 50, b = 10;
  const ShardedSampler four(n, b, true, /*seed=*/3, 0, 2);
  for (int64_t d : {1, 3, 4, 7, 10}) {
    CAPTURE(d);
    const auto order = list(four.epoch_order(2));
    std::vector<int64_t> all, sizes;
    for (int64_t r = 0; r < d; ++r) {
      const auto share = four.reshared(r, d);
      auto mine = to_vec(share.rank_indices(share.epoch_order(2), /*position=*/3 * b));
      CHECK(int64_t(mine.size()) == share.rank_batch());
      sizes.push_back(share.rank_batch());
      for (size_t i = 0; i < mine.size(); ++i)
        CHECK(mine[i] == order[3 * b + r + static_cast<int64_t>(i) * d]);
      all.insert(all.end(), mine.begin(), mine.end());
    }
    std::vector<int64_t> global(order.begin() + 3 * b, order.begin() + 4 * b);
    std::sort(all.begin(), all.end());
    std::sort(global.begin(), global.end());
    CHECK(all == global);
    // The first b % d shares one larger: 10 among 3 is 4, 3, 3; among 4, 3, 3, 2, 2.
    for (int64_t r = 0; r < d; ++r) CHECK(sizes[size_t(r)] == b / d + (r < b % d ? 1 : 0));
  }
  CHECK_THROWS_AS(four.reshared(3, 3), std::logic_error);
  CHECK_THROWS_AS(four.reshared(0, 11), std::logic_error);
}

TEST_CASE("sampler: impossible batch layouts throw ConfigError") {
  CHECK_THROWS_AS(ShardedSampler(100, 10, true, 1, 0, 4), ConfigError);  // 10 % 4 != 0
  CHECK_THROWS_AS(ShardedSampler(10, 11, true, 1), ConfigError);         // batch > data
  CHECK_NOTHROW(ShardedSampler(10, 10, true, 1));
  try {
    ShardedSampler(100, 10, true, 1, 0, 4);
  } catch (const ConfigError& e) {
    CHECK(std::string(e.what()).find("data.batch_size") != std::string::npos);
    CHECK(e.code == kExitBadSpec);
  }
}

}  // namespace unit_data_sampler
