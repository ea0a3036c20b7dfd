// Where a rank computes and how it talks: decided once, from train.device, dist.backend,
// the launcher's local rank and the GPUs this process sees. The pure choices take what
// they depend on as arguments (tested on any machine); plan_device asks LibTorch.
#pragma once
#include <chrono>
#include <cstdint>
#include <string>

#include <c10/core/Device.h>

#include "config/config.hpp"
#include "launch/world.hpp"

namespace dtrain {

// train.device for local rank `local_rank` of `local_world` processes on a machine where
// this process sees `visible` GPUs:
//   cpu     the CPU
//   auto    cuda when a GPU is visible, else cpu
//   cuda    the local rank's own GPU: cuda:local_rank; or cuda:0 when each process sees
//           exactly one (SLURM's --gpus-per-task, CUDA_VISIBLE_DEVICES per rank)
//   cuda:N  that GPU
// Throws ConfigError naming train.device when the GPU is not there.
c10::Device pick_device(const std::string& spec, int64_t local_rank, int64_t local_world,
                        int64_t visible);

// dist.backend for tensors on `type`: auto is NCCL for CUDA (where LibTorch has it), Gloo
// otherwise, and Gloo when local ranks share one GPU (`gpu_shared`), which NCCL refuses, or
// when the job receives from whichever rank sends first (`any_source`: non-empty, saying
// who does; a training mode's ModeSpec), which NCCL cannot. Throws ConfigError naming
// dist.backend for NCCL without CUDA, without NCCL, shared, or asked to receive from any
// rank.
std::string pick_backend(const std::string& backend, c10::DeviceType type, bool nccl_built,
                         bool gpu_shared = false, const std::string& any_source = "");

// The devices a job's device and backend are chosen among: this machine's (`here`:
// LibTorch says which GPUs this process sees), or a GPU machine's seen from elsewhere
// (`plan --device cuda` on a login node), whose dtrain is taken to be a CUDA build with
// NCCL.
struct Devices {
  int64_t gpus = 0;
  bool nccl = false;
  static Devices here();
  static Devices gpu_machine(int64_t gpus) { return {gpus, true}; }
};

// The job's device and backend among `devices`; throws ConfigError (train.device,
// dist.backend, precision.dtype) for what cannot run there, e.g. fp16 on the CPU.
struct DevicePlan {
  c10::Device device = c10::Device(c10::kCPU);
  std::string backend = "gloo";
};
DevicePlan plan_device(const JobConfig& cfg, int64_t local_rank, int64_t local_world,
                       const std::string& any_source = "", const Devices& devices = Devices::here());

// How long a wait runs before it is named (comm/watch.hpp): dist.hang_report_s, or half
// of dist.timeout_s where that is shorter, so that the report comes before the timeout
// ends the job; 0: never.
std::chrono::milliseconds hang_report_after(const DistConfig& dist);

int64_t visible_gpus();
bool nccl_built();  // this build of dtrain has LibTorch's NCCL process group

// LibTorch's CUDA library is linked in (whether or not a GPU is there); asks without
// starting CUDA.
bool cuda_linked();
// This build, for --version and bug reports: the LibTorch it was compiled against, CUDA's
// runtime version where that LibTorch has CUDA, and NCCL where dtrain was built with it,
// e.g. "LibTorch 2.15.0, no CUDA, no NCCL".
std::string build_info();

// Makes `device` this thread's current CUDA device and applies the job's CUDA settings
// (TF32). Nothing for the CPU.
void use_device(const c10::Device& device, const JobConfig& cfg);

// PyTorch's CUDA sync debug mode (torch.cuda.set_sync_debug_mode) over a scope: "warn"
// warns at each operation that makes the host wait for the GPU, "error" throws there;
// anything else changes nothing, and so does a build without CUDA. The step puts the steps that
// never wait by design under DTRAIN_SYNC_DEBUG's mode (sync_debug_mode()), so that a GPU
// run checks the claim; tests/e2e/test_cuda.cpp does. PyTorch's check covers its own
// waits (a read of a value, a blocking copy, a stream or device synchronize), not
// c10d's.
class SyncDebugScope {
 public:
  explicit SyncDebugScope(const std::string& mode);
  ~SyncDebugScope();
  SyncDebugScope(const SyncDebugScope&) = delete;
  SyncDebugScope& operator=(const SyncDebugScope&) = delete;

 private:
  int previous_ = -1;  // the mode to restore; -1: nothing was changed
};
// DTRAIN_SYNC_DEBUG (warn | error | off, the default), read once; throws ConfigError for
// another value.
const std::string& sync_debug_mode();

}  // namespace dtrain
