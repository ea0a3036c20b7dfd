#include "util/memory.hpp"

#include <malloc.h>

#include <fstream>
#include <limits>

#ifdef DTRAIN_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#endif

namespace dtrain {

void tune_allocator() {
  mallopt(M_MMAP_THRESHOLD, 32 << 20);  // glibc's largest; also turns off its dynamic threshold
  mallopt(M_TRIM_THRESHOLD, 1 << 30);
}

int64_t allocated_bytes(const c10::Device& device) {
#ifdef DTRAIN_CUDA
  if (device.is_cuda()) {
    const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(device.index());
    return stats.allocated_bytes[0].current;  // [0]: all pools together
  }
#else
  (void)device;
#endif
  const struct mallinfo2 m = mallinfo2();
  return int64_t(m.uordblks + m.hblkhd);  // in use from the arenas, and mmapped blocks
}

int64_t peak_allocated_bytes(const c10::Device& device) {
#ifdef DTRAIN_CUDA
  if (device.is_cuda())
    return c10::cuda::CUDACachingAllocator::getDeviceStats(device.index()).allocated_bytes[0].peak;
#else
  (void)device;
#endif
  return 0;
}

double proc_field_bytes(const std::string& file, const std::string& key) {
  std::ifstream in(file);
  std::string name;
  double kib = 0;
  while (in >> name)
    if (name == key && in >> kib) return kib * 1024;
    else in.ignore(std::numeric_limits<std::streamsize>::max(), '\n');
  return 0;
}

}  // namespace dtrain
