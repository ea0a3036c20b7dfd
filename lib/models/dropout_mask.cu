// Seeded dropout's mask on a GPU: one kernel that hashes each unit as the CPU's loop does
// (models/dropout_mask.hpp), where tensor operations took ~27 kernels and int64 temporaries
// the size of the layer (attention weights: batch x heads x seq^2 x 8 bytes each).
#include "models/dropout_mask.hpp"

#include <cuda_runtime.h>

namespace dtrain::dropout_mask {
namespace {

template <class Bits>
__global__ void fill(const int64_t* positions, const int64_t* units, Bits* out, int64_t total,
                     int64_t n, Draw<Bits> d) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += stride)
    out[i] = value(units[i % n], row_hash(positions[i / n], d.key), d);
}

template <class Bits>
void launch(const int64_t* positions, const int64_t* units, void* out, int64_t rows, int64_t n,
            Draw<Bits> d, cudaStream_t stream) {
  constexpr int kThreads = 256;
  const int64_t total = rows * n;
  const int64_t blocks = (total + kThreads - 1) / kThreads;
  const unsigned grid = unsigned(blocks < 65535 * 8 ? blocks : 65535 * 8);  // then grid-stride
  fill<Bits><<<grid, kThreads, 0, stream>>>(positions, units, static_cast<Bits*>(out), total, n, d);
}

}  // namespace

const char* fill_cuda(const int64_t* positions, const int64_t* units, void* out, int64_t rows,
                      int64_t n, int64_t element_size, uint32_t key, int64_t threshold,
                      uint32_t kept, void* stream) {
  if (rows * n == 0) return nullptr;
  const auto s = static_cast<cudaStream_t>(stream);
  if (element_size == 2)
    launch<uint16_t>(positions, units, out, rows, n, {key, threshold, uint16_t(kept)}, s);
  else
    launch<uint32_t>(positions, units, out, rows, n, {key, threshold, kept}, s);
  const cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? nullptr : cudaGetErrorString(e);
}

}  // namespace dtrain::dropout_mask
