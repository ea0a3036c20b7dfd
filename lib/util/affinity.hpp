// CPU pinning for the intra-op (OpenMP) team: each local rank gets its own slice of the
// CPUs this process may use, so ranks sharing a machine do not trade cores (measured on
// 2 cores, 2 ranks x 1 thread: MLP 20.5k samples/s pinned, 18.5k unpinned; one process
// is the same either way). train.pin_threads turns it off.
#pragma once
#include <cstdint>
#include <string>

namespace dtrain {

// The CPUs this process may run on: its affinity mask at start (a container's or SLURM's
// cpuset, taskset), not every CPU of the machine.
int64_t usable_cpus();

// Intra-op threads per process: `configured` (train.threads) where it is not 0, else
// OMP_NUM_THREADS where it is set (the first of its values, as LibTorch and every OpenMP
// program read it; torchrun sets 1 for several processes a node), else `cpus` shared
// among `local_processes`. More threads than free cores cost far more than they give:
// OpenBLAS's threads wait on one another by yielding, so a 2-thread GPT step beside one
// busy process took 10x as long.
int64_t intra_op_threads(int64_t configured, int64_t cpus, int64_t local_processes);

// Pins thread t of the OpenMP team (thread 0 is the caller) to the t-th CPU of slice
// `local_rank` of `local_world` equal slices of the allowed CPUs. Does nothing unless the
// threads fill the slice: fewer leave CPUs to other work, which pinned threads could not
// move away from. Returns a description for the start-up line.
std::string pin_compute_threads(int64_t threads, int64_t local_rank, int64_t local_world);

// Gives the calling thread back every CPU the process was allowed at start (for helper
// threads created by a pinned thread, which would inherit its single CPU).
void unpin_this_thread();

}  // namespace dtrain
