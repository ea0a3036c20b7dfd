// glibc malloc settings for training. By default an allocation above the mmap threshold
// (128 KiB, raised only when some chunk happens to be freed) is a fresh mmap, so every
// activation of a step page-faults and is zeroed by the kernel again: the CNN's step ran at
// 15-17 ms instead of 9-10 ms, varying from run to run with what the process had freed.
// And how much memory tensors hold, for the peak activation memory a pipeline reports.
#pragma once
#include <cstdint>
#include <string>

#include <c10/core/Device.h>

namespace dtrain {

// Keeps freed memory in the process for reuse: glibc's mmap threshold at 32 MiB (its
// largest) and trim at 1 GiB, and LibTorch's CPU blocks of 2 MiB or more, each mapped
// on its own and kept by size for the next of that size once keep_cpu_blocks() is
// called (memory.cpp).
void tune_allocator();

// From now on tune_allocator's cache keeps the large blocks freed, within the most in use
// at once from now on (what it kept before goes back): a run calls it between its setup,
// whose temporaries do not come back, and its steps, whose tensors do.
void keep_cpu_blocks();

// Bytes of freed CPU blocks that tune_allocator's cache keeps for reuse (0 before it).
int64_t kept_cpu_bytes();

// Bytes allocated now: on a GPU, LibTorch's caching allocator's (tensors alive on that
// device); on the CPU, glibc's in use (mallinfo2: every allocation of the process) and
// the large blocks tune_allocator's cache has handed out, tensors being nearly all of it
// during a step. Differences between two readings are what a stretch of code kept.
int64_t allocated_bytes(const c10::Device& device);

// The most LibTorch's caching allocator has held allocated at once on a GPU, bytes (what a
// plan's memory_mb.total compares with there); 0 on the CPU.
int64_t peak_allocated_bytes(const c10::Device& device);

// A field in kB of a /proc file such as /proc/meminfo or /proc/self/status (`key` with its
// colon: "MemAvailable:"), in bytes; 0 where it cannot be read.
double proc_field_bytes(const std::string& file, const std::string& key);

}  // namespace dtrain
