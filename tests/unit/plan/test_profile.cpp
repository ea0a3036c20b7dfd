// The machine profile's GPU rates: interpolated between measured points by a product's
// smallest side and its work a call, held at the ends, fp32's where a dtype is missing.
#include <doctest/doctest.h>

#include <cmath>

#include <nlohmann/json.hpp>

#include "plan/profile.hpp"
#include "temp_dir.hpp"
#include "util/error.hpp"

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

TEST_CASE("profile: saved and read back alike; a missing field does not read") {
  dtrain::test::TempDir dir("dtrain-profile");
  MachineProfile p;
  p.host = "h", p.build = "b", p.cores = 2;
  p.matmul = {{32, 1e9, 2e9}, {64, 3e9, 5e9}};
  p.bmm_bf16 = {{16, 1e8, 2e8}};
  p.memory_one = 1e10, p.memory_all = 2e10;
  p.elementwise = {1, 2, 3, 4};
  p.elementwise_bf16 = {5, 6, 7, 8};
  p.all_reduce = {{2, 1e-4, 1e9}, {4, 2e-4, 5e8}};
  p.send = {{2, 5e-5, 2e9}};
  p.crowded = {4, 1e-3, 2e-3};
  MachineProfile::Gpu g;
  g.name = "gpu", g.count = 2, g.memory = 8e10;
  g.matmul["fp32"] = {{64, 1e6, 1e12}, {64, 1e8, 4e12}};
  g.bmm["bf16"] = {{32, 1e6, 5e11}};
  g.memory_bytes_per_s = 2e12, g.launch_s = 5e-6, g.backend = "nccl";
  g.all_reduce = {{2, 1e-5, 1e11}};
  p.gpu = g;
  const std::string path = dir / "machine.json";
  dtrain::save_profile(p, path);
  const auto back = dtrain::load_profile(path);
  REQUIRE(back);
  CHECK(back->cores == 2);
  CHECK(back->matmul.size() == 2);
  CHECK(back->matmul[1].all == 5e9);
  CHECK(back->bmm_bf16[0].size == 16);
  CHECK(back->elementwise_bf16.transcendental_all == 8);
  CHECK(back->all_reduce[1].ranks == 4);
  CHECK(back->all_reduce[1].latency_s == 2e-4);
  CHECK(back->send[0].bytes_per_s == 2e9);
  CHECK(back->crowded.ranks == 4);
  CHECK(back->crowded.all_reduce_s == 2e-3);
  REQUIRE(back->gpu);
  CHECK(back->gpu->matmul.at("fp32")[1].flops == 4e12);
  CHECK(back->gpu->bmm.at("bf16")[0].work == 1e6);
  CHECK(back->gpu->all_reduce[0].bytes_per_s == 1e11);
  CHECK(back->gpu->send.empty());
  // Saved again, the same bytes.
  dtrain::save_profile(*back, dir / "again.json");
  CHECK(dtrain::test::read_bytes(dir / "again.json") == dtrain::test::read_bytes(path));

  // A field left out: the profile does not read, naming the file.
  auto j = nlohmann::json::parse(dtrain::test::read_bytes(path));
  j["crowded"].erase("handoff_s");
  dtrain::test::write_bytes(path, j.dump());
  CHECK_THROWS_AS(dtrain::load_profile(path), dtrain::RunDirError);
  j = nlohmann::json::parse(dtrain::test::read_bytes(dir / "again.json"));
  j["gpu"]["all_reduce"][0].erase("ranks");
  dtrain::test::write_bytes(path, j.dump());
  CHECK_THROWS_WITH_AS(dtrain::load_profile(path), doctest::Contains("'ranks' not found"), dtrain::RunDirError);
  j["gpu"] = nullptr;  // no GPU measured
  dtrain::test::write_bytes(path, j.dump());
  CHECK_FALSE(dtrain::load_profile(path)->gpu);
}
