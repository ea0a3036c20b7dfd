#include "util/memory.hpp"

#include <malloc.h>

namespace dtrain {

void tune_allocator() {
  mallopt(M_MMAP_THRESHOLD, 32 << 20);  // glibc's largest; also turns off its dynamic threshold
  mallopt(M_TRIM_THRESHOLD, 1 << 30);
}

}  // namespace dtrain
