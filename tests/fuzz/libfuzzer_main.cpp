// One libFuzzer executable per target: DTRAIN_FUZZ_TARGET names the function (see
// tests/CMakeLists.txt and scripts/fuzz.sh).
#include "targets.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  dtrain::fuzz::DTRAIN_FUZZ_TARGET(data, size);
  return 0;
}
