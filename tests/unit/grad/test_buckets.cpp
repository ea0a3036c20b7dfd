// GradBuckets: the slices of the flat gradient handed out during backward, in launch order
// (from the buffer's end), each once per step, and the rest at flush.
#include <doctest/doctest.h>

#include <utility>
#include <vector>

#include <torch/torch.h>

#include "parallel/flat_params.hpp"
#include "grad/buckets.hpp"

namespace unit_grad_buckets {

using namespace dtrain;

namespace {
// Handed-out slices cover [0, total) once, from the end to the start.
void check_cover(const std::vector<std::pair<int64_t, int64_t>>& got, int64_t total) {
  int64_t end = total;
  for (const auto& [offset, numel] : got) {
    CHECK(offset + numel == end);
    CHECK(numel > 0);
    end = offset;
  }
  CHECK(end == 0);
}
}  // namespace

TEST_CASE("grad buckets: final slices during backward, in order, each once a step") {
  torch::manual_seed(1);
  torch::nn::Sequential m(torch::nn::Linear(8, 16), torch::nn::ReLU(), torch::nn::Linear(16, 4));
  FlatParams flat(*m);
  const int64_t total = flat.grad().numel();  // 8*16 + 16 + 16*4 + 4 = 212
  std::vector<std::pair<int64_t, int64_t>> got;
  GradBuckets buckets(flat, /*bucket_mb=*/32.0 / (1024 * 1024),  // 8 floats a bucket
                      [&](int64_t offset, int64_t numel) { got.emplace_back(offset, numel); });
  auto backward = [&] { m->forward(torch::randn({3, 8})).sum().backward(); };

  backward();  // armed: buckets go out as backward makes them final
  CHECK(!got.empty());
  CHECK(got.front().first + got.front().second == total);  // the last layer's first
  buckets.flush();
  check_cover(got, total);
  CHECK(got.size() == size_t((total + 7) / 8));

  got.clear();
  buckets.arm(false);  // an earlier micro-batch: nothing goes out
  backward();
  CHECK(got.empty());
  buckets.arm(true);
  backward();
  buckets.flush();
  check_cover(got, total);

  got.clear();  // the last layer unused this step: its buckets come first in launch order,
  m[0]->as<torch::nn::Linear>()->forward(torch::randn({3, 8})).sum().backward();
  CHECK(got.empty());  // so nothing goes out before them
  buckets.flush();     // and all of it at flush, still in order
  check_cover(got, total);
}

}  // namespace unit_grad_buckets
