// The background loader: with any number of worker threads it yields exactly the batches the
// sampler prescribes, in step order, across epoch boundaries and from any starting step; and
// it never hangs, whether abandoned early or failing inside a worker.
#include <doctest/doctest.h>

#include <stdexcept>

#include <torch/torch.h>

#include "data/dataset.hpp"
#include "data/loader.hpp"
#include "data/sampler.hpp"

namespace unit_data_loader {

using namespace dtrain;

namespace {

// Sample i has features (3i, 3i+1, 3i+2) and label 1000 + i, so a batch shows its indices.
TensorDataset arange_dataset(int64_t n) {
  return {torch::arange(n * 3, torch::kFloat32).view({n, 3}), torch::arange(n) + 1000};
}

// What global step g must hold, computed from the sampler directly (no Loader involved).
Batch expected(const TensorDataset& data, const ShardedSampler& s, int64_t g) {
  const int64_t spe = s.steps_per_epoch();
  return data.gather(s.rank_indices(s.epoch_order(g / spe), g % spe * s.global_batch()));
}

}  // namespace

TEST_CASE("loader: workers 0, 1, 3 yield the sampler's batches in order") {
  const int64_t n = 23, b = 4;  // 5 steps per epoch, 3 samples dropped
  const auto data = arange_dataset(n);
  struct Range {
    int64_t first, end;
  };
  for (int64_t ranks : {1, 2}) {
    for (int64_t rank = 0; rank < ranks; ++rank) {
      ShardedSampler sampler(n, b, /*shuffle=*/true, /*seed=*/99, rank, ranks);
      REQUIRE(sampler.steps_per_epoch() == 5);
      // From the start; from mid-epoch across two boundaries; a single step; ending on one.
      for (Range r : {Range{0, 12}, Range{3, 17}, Range{7, 8}, Range{5, 10}}) {
        for (int64_t workers : {0, 1, 3}) {
          for (int64_t prefetch : {1, 4}) {
            CAPTURE(ranks);
            CAPTURE(rank);
            CAPTURE(r.first);
            CAPTURE(workers);
            CAPTURE(prefetch);
            Loader loader(data, sampler, r.first, r.end, workers, prefetch);
            for (int64_t g = r.first; g < r.end; ++g) {
              CAPTURE(g);
              double wait_ms = -1;
              Batch got = loader.next(&wait_ms);
              Batch want = expected(data, sampler, g);
              CHECK(wait_ms >= 0);
              REQUIRE(got.x.sizes() == torch::IntArrayRef{b / ranks, 3});
              CHECK(torch::equal(got.x, want.x));
              CHECK(torch::equal(got.y, want.y));
            }
            CHECK_THROWS_AS(loader.next(nullptr), std::logic_error);
          }
        }
      }
    }
  }
}

TEST_CASE("loader: an epoch boundary starts a new permutation") {
  const int64_t n = 8, b = 4;  // 2 steps per epoch, nothing dropped
  const auto data = arange_dataset(n);
  ShardedSampler sampler(n, b, true, /*seed=*/3);
  Loader loader(data, sampler, 0, 6, /*workers=*/2, /*prefetch=*/3);
  for (int64_t epoch = 0; epoch < 3; ++epoch) {
    auto a = loader.next(nullptr).y, c = loader.next(nullptr).y;
    // Each epoch covers every sample exactly once.
    auto all = std::get<0>(torch::sort(torch::cat({a, c})));
    CHECK(torch::equal(all, torch::arange(n) + 1000));
  }
}

TEST_CASE("loader: destroying it early does not hang") {
  const auto data = arange_dataset(64);
  ShardedSampler sampler(64, 8, true, 1);
  for (int64_t workers : {0, 1, 3}) {
    CAPTURE(workers);
    { Loader untouched(data, sampler, 0, 1000, workers, 2); }
    {
      Loader partly(data, sampler, 5, 1000, workers, 2);
      partly.next(nullptr);
      partly.next(nullptr);
    }
    { Loader empty_range(data, sampler, 4, 4, workers, 2); }
  }
}

TEST_CASE("loader: an error in a worker reaches next() and does not hang") {
  // The sampler thinks there are 40 samples; the data has 10: the gather fails.
  const auto small = arange_dataset(10);
  ShardedSampler sampler(40, 8, /*shuffle=*/false, 1);
  for (int64_t workers : {0, 2}) {
    CAPTURE(workers);
    Loader loader(small, sampler, 0, 4, workers, 2);
    // Step 0 (indices 0..7) exists, step 1 (8..15) does not. Even when a worker fails on
    // step 1 first, step 0 is delivered and the error surfaces at step 1.
    int64_t delivered = 0;
    bool threw = false;
    for (int64_t g = 0; g < 4 && !threw; ++g) {
      try {
        loader.next(nullptr);
        ++delivered;
      } catch (const std::exception&) {
        threw = true;
      }
    }
    CHECK(threw);
    CHECK(delivered == 1);
  }
}

}  // namespace unit_data_loader
