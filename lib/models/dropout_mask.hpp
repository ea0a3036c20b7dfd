// Seeded dropout's mask, element by element: the arithmetic the CPU's loop and the GPU's
// kernel share, so the two draw the same masks bit for bit. Plain C++ (no LibTorch): the
// CUDA compiler reads it too.
#pragma once
#include <cstdint>

#if defined(__CUDACC__)
#define DTRAIN_HOST_DEVICE __host__ __device__
#else
#define DTRAIN_HOST_DEVICE
#endif

namespace dtrain::dropout_mask {

// A 32-bit integer hash with good avalanche (two multiply-xorshift rounds).
DTRAIN_HOST_DEVICE inline uint32_t hash32(uint32_t x) {
  constexpr uint32_t kMul = 0x45d9f3b;
  x = ((x >> 16) ^ x) * kMul;
  x = ((x >> 16) ^ x) * kMul;
  return (x >> 16) ^ x;
}

// What one forward's mask depends on besides the rows' positions and the units' hashes.
// `kept` is the bit pattern, in the mask's dtype, of the scale a kept unit is multiplied by
// (a dropped one's, 0.0, is all zero bits in every float dtype).
template <class Bits>
struct Draw {
  uint32_t key = 0;        // the seed, step and site, mixed
  int64_t threshold = 0;   // a unit is dropped where its hash is below
  Bits kept = 0;
};

// The hash of a row at `position` in the step's global batch.
DTRAIN_HOST_DEVICE inline uint32_t row_hash(int64_t position, uint32_t key) {
  return hash32(uint32_t(position) + key);
}

// A unit's mask value in a row: `unit` is its place in the whole layer, hashed.
template <class Bits>
DTRAIN_HOST_DEVICE inline Bits value(int64_t unit, uint32_t row, const Draw<Bits>& d) {
  return int64_t(hash32(uint32_t(unit) ^ row)) < d.threshold ? Bits(0) : d.kept;
}

// The GPU's form: fills `out` ([rows, n] row-major, elements of 2 or 4 bytes; row r at
// `positions[r]`, unit j hashed `units[j]`) on `stream` (a cudaStream_t). Returns the CUDA
// error's text, or nullptr. Built where LibTorch has CUDA.
const char* fill_cuda(const int64_t* positions, const int64_t* units, void* out, int64_t rows,
                      int64_t n, int64_t element_size, uint32_t key, int64_t threshold,
                      uint32_t kept, void* stream);

}  // namespace dtrain::dropout_mask
