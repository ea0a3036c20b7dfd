// The machine profile's GPU rates: interpolated between measured points by a product's
// smallest side and its work a call, held at the ends, fp32's where a dtype is missing.
#include <doctest/doctest.h>

#include <cmath>

#include "plan/profile.hpp"

using dtrain::MachineProfile;

TEST_CASE("profile: a GPU's matmul rate between its measured sizes and works") {
  MachineProfile::Gpu g;
  // Two sizes, each at two works (by size, then by work, as measured).
  g.matmul["fp32"] = {{64, 1e6, 1e12}, {64, 1e8, 4e12}, {256, 1e6, 2e12}, {256, 1e8, 8e12}};
  g.matmul["bf16"] = {{64, 1e6, 1e13}};
  // At the points themselves.
  CHECK(g.matmul_flops(64, 1e6, "fp32", false) == doctest::Approx(1e12));
  CHECK(g.matmul_flops(256, 1e8, "fp32", false) == doctest::Approx(8e12));
  // Halfway in log(work) at size 64: halfway between its two rates.
  CHECK(g.matmul_flops(64, 1e7, "fp32", false) == doctest::Approx(2.5e12));
  // Halfway in log(size) (128) and in log(work): the middle of 2.5e12 and 5e12.
  CHECK(g.matmul_flops(128, 1e7, "fp32", false) == doctest::Approx(3.75e12));
  // Held at the ends: smaller, larger, less and more work than measured.
  CHECK(g.matmul_flops(16, 1e3, "fp32", false) == doctest::Approx(1e12));
  CHECK(g.matmul_flops(4096, 1e12, "fp32", false) == doctest::Approx(8e12));
  // A dtype of its own, a missing one as fp32; batched without a bmm table as matmul.
  CHECK(g.matmul_flops(64, 1e6, "bf16", false) == doctest::Approx(1e13));
  CHECK(g.matmul_flops(64, 1e6, "fp16", false) == doctest::Approx(1e12));
  CHECK(g.matmul_flops(64, 1e6, "fp32", true) == doctest::Approx(1e12));
  g.bmm["fp32"] = {{32, 1e6, 5e11}};
  CHECK(g.matmul_flops(64, 1e6, "fp32", true) == doctest::Approx(5e11));
  // Nothing measured: no rate.
  CHECK(MachineProfile::Gpu{}.matmul_flops(64, 1e6, "fp32", false) == 0);
}
