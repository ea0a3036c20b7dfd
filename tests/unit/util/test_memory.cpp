// The CPU block cache tune_allocator installs: a freed block of 32 MiB or more comes back
// for the next tensor of its size instead of a fresh mapping, and what it keeps stays
// within the most in use at once since keep_cpu_blocks().
#include <doctest/doctest.h>

#include <torch/torch.h>

#include "util/memory.hpp"

namespace unit_util_memory {

using namespace dtrain;

TEST_CASE("memory: a freed large CPU block is reused at its size, and given back for a larger one") {
  tune_allocator();
  keep_cpu_blocks();  // as a run does once set up
  const int64_t values = int64_t(10) << 20;  // 40 MiB of floats: above glibc's mmap threshold
  const int64_t before = allocated_bytes(torch::kCPU);
  void* first = nullptr;
  {
    auto t = torch::empty({values});
    first = t.data_ptr();
  }
  CHECK(kept_cpu_bytes() >= 4 * values);
  // Kept blocks are not counted as allocated.
  CHECK(std::abs(allocated_bytes(torch::kCPU) - before) < (int64_t(1) << 20));
  {
    auto again = torch::empty({values});
    CHECK(again.data_ptr() == first);  // the same block, not a new mapping
    auto second = torch::empty({values});  // one more of the size while the first is in use
    CHECK(second.data_ptr() != first);
  }
  CHECK(kept_cpu_bytes() >= 8 * values);
  // A block larger than all the tests ever held at once (1 GiB, never touched): the kept
  // blocks go back first, so the cache never holds more than the peak in use.
  {
    auto huge = torch::empty({int64_t(1) << 28});
    CHECK(kept_cpu_bytes() == 0);
  }
  CHECK(kept_cpu_bytes() == int64_t(1) << 30);
  // Called again: nothing kept, and the bound is what is in use from now on: a 40 MiB
  // block kept, then given back for an 80 MiB one.
  keep_cpu_blocks();
  CHECK(kept_cpu_bytes() == 0);
  { auto t = torch::empty({values}); }
  CHECK(kept_cpu_bytes() == 4 * values);
  {
    auto larger = torch::empty({2 * values});
    CHECK(kept_cpu_bytes() == 0);
  }
  // Small tensors are glibc's, as before.
  auto small = torch::ones({1000});
  CHECK(small.sum().item<float>() == 1000);
}

}  // namespace unit_util_memory
