// Stable hashes of names and the splitmix64 generator: the same on every machine, build and
// run (std::hash and std::'s engines are not), so values derived from a name or a seed (a
// dropout site, a parameter's initial weights, PowerSGD's first Q, data order) agree across
// ranks and resumes.
#pragma once
#include <cstdint>
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

// Mixes a seed with a name's hash so that nearby seeds give unrelated streams.
inline uint64_t mix_seed(uint64_t seed, uint64_t hash) {
  return splitmix64_mix(seed + kGoldenGamma * (hash | 1));
}

}  // namespace dtrain
