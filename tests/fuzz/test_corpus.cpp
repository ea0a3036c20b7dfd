// Replays every saved fuzz input (seeds and the crashers the fuzzer found, which are
// regression tests) through its target with the normal build: no clang needed.
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "targets.hpp"

namespace {
void replay(const std::string& name, void (*target)(const uint8_t*, size_t)) {
  const auto dir = std::filesystem::path(DTRAIN_FUZZ_CORPUS) / name;
  int n = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    std::ifstream in(e.path(), std::ios::binary);
    std::stringstream ss;
    ss << in.rdbuf();
    const std::string bytes = ss.str();
    INFO(e.path().string());
    CHECK_NOTHROW(target(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size()));
    ++n;
  }
  CHECK(n > 0);
}
}  // namespace

TEST_CASE("fuzz corpus: job spec") { replay("job_spec", dtrain::fuzz::job_spec); }
TEST_CASE("fuzz corpus: IDX") { replay("idx", dtrain::fuzz::idx); }
TEST_CASE("fuzz corpus: safetensors") { replay("safetensors", dtrain::fuzz::safetensors); }
TEST_CASE("fuzz corpus: checkpoint manifest and trainer state") {
  replay("checkpoint", dtrain::fuzz::checkpoint);
}
