// Checkpoints written by an earlier dtrain (tests/fixtures/checkpoints, made by its make.sh
// at 98dea94) still resume: each is resumed with today's code on the layout that wrote it,
// and the steps after it must log the losses that earlier run logged. The references come
// from that code, not from the code under test; they cover one process, a GPT at data 2 x
// pipeline 2 x tensor 2 with PowerSGD's residuals and Q matrices, local SGD's per-replica
// optimizer state and async_ps's two servers' shards with the worker's data position.
#include <doctest/doctest.h>

#include <filesystem>

#include <fmt/format.h>

#include "run.hpp"

namespace e2e::fixtures_tests {

namespace {
std::string fixture(const std::string& name) {
  return std::string(DTRAIN_FIXTURES) + "/checkpoints/" + name;
}

void resumes_as_written(const std::string& name, double rtol) {
  const auto dir = temp_dir("fixture-" + name);
  const auto expected = nlohmann::json::parse(slurp(fixture(name) + "/expected.json"));
  const int64_t nproc = expected["nproc"], step = expected["checkpoint"];
  // A copy: resuming must not depend on writing into the fixture.
  const auto from = fmt::format("{}/step-{:08d}", dir, step);
  std::filesystem::copy(fmt::format("{}/step-{:08d}", fixture(name), step), from,
                        std::filesystem::copy_options::recursive);
  run_ok(fmt::format("run {}/job.yaml --nproc {} --run-dir {}/run --resume {}", fixture(name),
                     nproc, dir, from));
  std::map<int64_t, double> want;
  for (const auto& [k, v] : expected["losses"].items()) want[std::stoll(k)] = v.get<double>();
  const auto got = train_losses(dir + "/run");
  CHECK(got.begin()->first == step + 1);  // nothing before the checkpoint was trained again
  check_losses_close(want, got, rtol, name);
}
}  // namespace

TEST_SUITE("fixtures") {
  TEST_CASE("an earlier dtrain's checkpoints resume to the losses it logged") {
    resumes_as_written("mlp", 1e-6);
    resumes_as_written("gpt_d2_p2_t2_powersgd", 1e-5);
    resumes_as_written("local_sgd", 1e-6);
    resumes_as_written("async_ps", 1e-6);
  }
}

}  // namespace e2e::fixtures_tests
