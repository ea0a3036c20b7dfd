// glibc malloc settings for training. By default an allocation above the mmap threshold
// (128 KiB, raised only when some chunk happens to be freed) is a fresh mmap, so every
// activation of a step page-faults and is zeroed by the kernel again: the CNN's step ran at
// 15-17 ms instead of 9-10 ms, varying from run to run with what the process had freed.
#pragma once

namespace dtrain {

// Keeps freed memory in the process for reuse (mmap threshold 32 MiB, trim at 1 GiB).
void tune_allocator();

}  // namespace dtrain
