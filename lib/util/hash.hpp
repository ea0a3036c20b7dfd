// Stable hashes of names and the splitmix64 generator: the same on every machine, build and
// run (std::hash and std::'s engines are not), so values derived from a name or a seed (a
// dropout site, a parameter's initial weights, PowerSGD's first Q, data order) agree across
// ranks and resumes.
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

namespace dtrain {

// FNV-1a, 64 bits.
inline uint64_t fnv1a(const std::string& text) {
  uint64_t h = 0xcbf29ce484222325ULL;
  for (unsigned char ch : text) h = (h ^ ch) * 0x100000001b3ULL;
  return h;
}

// splitmix64's finaliser: every output bit depends on every input bit. Data order,
// augmentations and dropout masks are built on it, so it must never change.
inline uint64_t splitmix64_mix(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

constexpr uint64_t kGoldenGamma = 0x9e3779b97f4a7c15ULL;  // splitmix64's increment

// splitmix64: a small generator with a fixed, documented output.
struct SplitMix64 {
  uint64_t state;
  uint64_t next() { return splitmix64_mix(state += kGoldenGamma); }
};

// A hash of `n` bytes from `seed`: four independent lanes of splitmix64's mix, one 8-byte
// word each in turn, folded together at the end. One lane waits on each multiply of the
// last word's mix; four keep the multiplier busy (0.49 -> 0.20 s a GB on this machine's
// core): a joining replica hashes its whole state before it trains.
inline uint64_t bytes_hash(const unsigned char* p, size_t n, uint64_t seed) {
  uint64_t h[4] = {seed, seed + kGoldenGamma, seed + 2 * kGoldenGamma, seed + 3 * kGoldenGamma};
  size_t i = 0;
  for (uint64_t w[4]; i + sizeof(w) <= n; i += sizeof(w)) {
    std::memcpy(w, p + i, sizeof(w));
    for (int k = 0; k < 4; ++k) h[k] = splitmix64_mix(h[k] ^ w[k]);
  }
  uint64_t out = splitmix64_mix(n ^ seed);
  for (uint64_t lane : h) out = splitmix64_mix(out ^ lane);
  for (; i < n; ++i) out = splitmix64_mix(out ^ p[i]);
  return out;
}

// Mixes a seed with a name's hash so that nearby seeds give unrelated streams.
inline uint64_t mix_seed(uint64_t seed, uint64_t hash) {
  return splitmix64_mix(seed + kGoldenGamma * (hash | 1));
}

}  // namespace dtrain
