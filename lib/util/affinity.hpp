// CPU pinning for the intra-op (OpenMP) team: each local rank gets its own slice of the
// CPUs this process may use, so ranks sharing a machine do not trade cores (measured on
// 2 cores, 2 ranks x 1 thread: MLP 20.5k samples/s pinned, 18.5k unpinned; one process
// is the same either way). train.pin_threads turns it off.
#pragma once
#include <cstdint>
#include <string>

namespace dtrain {

// Pins thread t of the OpenMP team (thread 0 is the caller) to the t-th CPU of slice
// `local_rank` of `local_world` equal slices of the allowed CPUs. Does nothing when the
// slice would have fewer CPUs than `threads`. Returns a description for the start-up line.
std::string pin_compute_threads(int64_t threads, int64_t local_rank, int64_t local_world);

// Gives the calling thread back every CPU the process was allowed at start (for helper
// threads created by a pinned thread, which would inherit its single CPU).
void unpin_this_thread();

}  // namespace dtrain
