// The bytes' hash a joining replica checks its state with: its values pinned by a separate
// implementation (Python's integers, below), and every byte, the length and the seed
// counted, across the four lanes' boundaries and the tail after them.
#include <doctest/doctest.h>

#include <cstdint>
#include <vector>

#include "util/hash.hpp"

namespace unit_util_hash {

using namespace dtrain;

std::vector<unsigned char> counting(size_t n) {
  std::vector<unsigned char> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<unsigned char>(i);
  return v;
}

TEST_CASE("hash: bytes_hash's values, as a Python transcription of its definition gives them") {
  // mix = splitmix64's finaliser; lanes h[k] = seed + k * golden gamma; each 32 bytes, lane
  // k mixes in its little-endian word k; then out = mix(n ^ seed), out = mix(out ^ h[k])
  // for k = 0..3, out = mix(out ^ byte) for each byte of the tail.
  CHECK(bytes_hash(counting(0).data(), 0, 7) == 0xd1299fe542c2f251ULL);
  CHECK(bytes_hash(counting(5).data(), 5, 7) == 0x31feb693f743a195ULL);
  CHECK(bytes_hash(counting(32).data(), 32, 7) == 0xfea7fc117f1b4c2aULL);
  CHECK(bytes_hash(counting(100).data(), 100, 7) == 0x110122928079edd9ULL);
}

TEST_CASE("hash: every byte, the length and the seed change bytes_hash") {
  for (size_t n : {1, 7, 31, 32, 33, 64, 70}) {
    auto v = counting(n);
    const uint64_t base = bytes_hash(v.data(), n, 1);
    CHECK(bytes_hash(v.data(), n, 2) != base);
    if (n > 1) CHECK(bytes_hash(v.data(), n - 1, 1) != base);
    for (size_t i = 0; i < n; ++i) {
      v[i] ^= 0x10;
      CHECK_MESSAGE(bytes_hash(v.data(), n, 1) != base, "byte ", i, " of ", n);
      v[i] ^= 0x10;
    }
  }
}

}  // namespace unit_util_hash
