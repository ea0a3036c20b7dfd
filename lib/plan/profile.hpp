// A machine profile for `dtrain plan`'s time estimates (`dtrain plan --measure`): how fast
// this machine multiplies matrices (by size, on one thread and on all cores), how fast it
// streams memory, and what Gloo's all-reduce and send cost between local processes; where
// a GPU is visible, the same of the GPU (and the time the host takes to launch a kernel).
// Kept as JSON under the user's cache folder.
#pragma once
#include <chrono>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace dtrain {

struct MachineProfile {
  std::string host, build;   // where and with what it was measured
  int64_t cores = 1;
  // Matrix multiplies whose smallest side is `size`: flop/s on one thread and on all `cores`
  // threads. `matmul`: a tall operand times a square one ([R, size] x [size, size], R rows
  // enough for a few dozen MFLOP: activations times a weight). `bmm`: a batch of small
  // products [4 size, size] x [size, 4 size] (attention's, head by head).
  struct Matmul {
    double size = 0, one = 0, all = 0;
  };
  std::vector<Matmul> matmul, bmm;
  // The same in bf16 (precision.dtype bf16's autocast); may be empty.
  std::vector<Matmul> matmul_bf16, bmm_bf16;
  double memory_one = 0, memory_all = 0;  // bytes/s an in-place add streams, 1 and all threads
  // Elementwise kernels writing a new tensor of 2^21 values (past the caches, as a layer's
  // activations are): the values a second of a sum writes, and of GELU (tanh: what exp and
  // tanh cost), on one thread and on all; in fp32 and in bf16.
  struct Elementwise {
    double plain_one = 0, plain_all = 0, transcendental_one = 0, transcendental_all = 0;
  };
  Elementwise elementwise, elementwise_bf16;
  // A collective between `ranks` local processes over Gloo: a fixed cost per operation and
  // the bytes per second a rank sends (counted as comm_bytes counts them).
  struct Link {
    int64_t ranks = 2;
    double latency_s = 0, bytes_per_s = 0;
  };
  std::vector<Link> all_reduce, send;
  // Where local ranks outnumber the cores (`ranks` of them on `cores`): the seconds a wait
  // on another rank costs beyond its bytes, the waiting rank woken by them but waiting for
  // a core back: a pipeline's hand-off, a tensor group's all-reduce. 0 where not measured
  // (machines of more than 8 cores).
  struct Crowded {
    int64_t ranks = 0;
    double handoff_s = 0, all_reduce_s = 0;
  };
  Crowded crowded;

  // The first visible GPU's, where there was one.
  struct Gpu {
    std::string name;
    int64_t count = 1;     // GPUs visible: ranks beyond it share one
    double memory = 0;     // bytes the device has
    // Products [R, size] x [size, size] of `work` multiply-adds a call (R = work / size^2;
    // batched: attention's [4 size, size] x [size, 4 size], work / 16 size^3 of them), by
    // dtype: "fp32", "tf32" (fp32 with precision.tf32), "bf16", "fp16". A GPU's rate
    // depends on the call's work as much as its shape: small calls leave SMs idle.
    struct Rate {
      double size = 0, work = 0, flops = 0;
    };
    std::map<std::string, std::vector<Rate>> matmul, bmm;
    double memory_bytes_per_s = 0;  // an in-place add over the device's memory
    double launch_s = 0;            // the host's time to launch a small kernel, back to back
    // Between 2 and `count` GPUs with NCCL, or between ranks sharing the one GPU with Gloo
    // (through the host): `backend` says which.
    std::string backend;
    std::vector<Link> all_reduce, send;

    // Interpolated in log(size) and log(work); where `dtype` was not measured, fp32's.
    double matmul_flops(double size, double work, const std::string& dtype, bool batched) const;
  };
  std::optional<Gpu> gpu;

  // Interpolated in log(size) and linearly in threads between 1 and `cores`; bf16's rates
  // where asked and measured, else fp32's. `batched`: the bmm table where measured, else
  // the matmul one.
  double matmul_flops(double size, double threads, bool bf16 = false, bool batched = false) const;
  double memory_bytes(double threads) const;
  // Values per second of elementwise kernels at `threads` (as matmul_flops interpolates).
  double elementwise_values(double threads, bool bf16, bool transcendental) const;
  // The measured link nearest `ranks` (all-reduce's cost grows with the ranks).
  const Link* link(const std::vector<Link>& links, int64_t ranks) const;
};

// Measures this machine (about 20 s on 2 cores): matmuls, memory, elementwise kernels, and
// the collectives between 2 to `max_ranks` local ranks (threads of this process over Gloo
// on loopback, as between processes); the first GPU too where one is visible (a few
// seconds more).
MachineProfile measure_machine(int64_t max_ranks);

// measure_machine in a child dtrain (`dtrain plan --measure`, this executable), for a
// process that goes on to train or supervise: what measuring starts (OpenMP's threads, a
// CUDA context on every GPU, NCCL's communicators) ends with the child. Throws Error
// naming what the child said where it fails, or outlives `timeout`.
MachineProfile measure_in_child(int64_t max_ranks,
                                std::chrono::seconds timeout = std::chrono::seconds(600));

// $DTRAIN_PROFILE, else $XDG_CACHE_HOME/dtrain/machine.json, else ~/.cache/dtrain/machine.json.
std::string default_profile_path();
void save_profile(const MachineProfile& p, const std::string& path);
// nullopt where there is no file, or one of the first version's; RunDirError naming the
// file where it does not parse.
std::optional<MachineProfile> load_profile(const std::string& path);

}  // namespace dtrain
