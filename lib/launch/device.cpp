#include "launch/device.hpp"

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <optional>

#include <ATen/Context.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <fmt/format.h>
#include <torch/cuda.h>
#include <torch/version.h>

#include "util/error.hpp"

#ifdef DTRAIN_CUDA
#include <c10/cuda/CUDAFunctions.h>
#endif
#ifdef USE_C10D_NCCL
#include <nccl.h>  // NCCL_MAJOR: the version dtrain was compiled against
#endif

namespace dtrain {

c10::Device pick_device(const std::string& spec, int64_t local_rank, int64_t local_world,
                        int64_t visible) {
  if (spec == "cpu" || (spec == "auto" && visible == 0)) return c10::Device(c10::kCPU);
  const bool indexed = spec.rfind("cuda:", 0) == 0;
  const std::string n = indexed ? spec.substr(5) : "";
  const bool digits = !n.empty() && n.size() <= 4 &&
                      std::all_of(n.begin(), n.end(), [](unsigned char ch) { return std::isdigit(ch); });
  fail_if<ConfigError>(indexed ? !digits : spec != "cuda" && spec != "auto",
                       "train.device: expected auto, cpu, cuda or cuda:N (got '{}')", spec);
  const int64_t index = indexed ? std::stoll(n) : -1;  // -1: the local rank's own
  fail_if<ConfigError>(visible == 0,
                       "train.device: {}, but no CUDA device is visible to this process (use auto "
                       "or cpu)", spec);
  if (index >= 0) {
    fail_if<ConfigError>(index >= visible, "train.device: {}, but only {} CUDA device(s) are "
                                           "visible (cuda:0 to cuda:{})", spec, visible, visible - 1);
    return c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(index));
  }
  if (visible == 1) return c10::Device(c10::kCUDA, 0);  // each process sees its own GPU
  fail_if<ConfigError>(local_rank >= visible,
                       "train.device: {}: local rank {} of {} has no GPU of its own ({} visible); "
                       "start at most {} processes per machine, or give each process its GPU "
                       "with CUDA_VISIBLE_DEVICES", spec, local_rank, local_world, visible, visible);
  return c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(local_rank));
}

std::string pick_backend(const std::string& backend, c10::DeviceType type, bool nccl,
                         bool gpu_shared, const std::string& any_source) {
  const bool cuda = type == c10::kCUDA;
  if (backend == "auto") return cuda && nccl && !gpu_shared && any_source.empty() ? "nccl" : "gloo";
  if (backend == "nccl") {
    fail_if<ConfigError>(!any_source.empty(), "dist.backend: nccl has no receive-from-any, which "
                                              "{}; use gloo or auto", any_source);
    fail_if<ConfigError>(!cuda, "dist.backend: nccl moves CUDA tensors, but train.device is the "
                                "CPU; use gloo or auto");
    fail_if<ConfigError>(!nccl, "dist.backend: nccl, but this build of dtrain has no NCCL "
                                "(LibTorch without CUDA); use gloo or auto");
    fail_if<ConfigError>(gpu_shared, "dist.backend: nccl cannot place two processes on one GPU, "
                                     "and this machine's processes share its only one; use gloo "
                                     "or auto, or start one process per GPU");
  }
  return backend;
}

Devices Devices::here() { return {visible_gpus(), nccl_built()}; }

DevicePlan plan_device(const JobConfig& cfg, int64_t local_rank, int64_t local_world,
                       const std::string& any_source, const Devices& devices) {
  DevicePlan plan;
  const int64_t visible = devices.gpus;
  plan.device = pick_device(cfg.train.device, local_rank, local_world, visible);
  // Several local processes that each see the same single GPU, with nothing (SLURM's GPU
  // binding, the user) giving each its own through CUDA_VISIBLE_DEVICES: they share it.
  const bool shared = plan.device.is_cuda() && visible == 1 && local_world > 1 &&
                      std::getenv("CUDA_VISIBLE_DEVICES") == nullptr;
  plan.backend = pick_backend(cfg.dist.backend, plan.device.type(), devices.nccl, shared, any_source);
  fail_if<ConfigError>(cfg.precision.dtype == "fp16" && !plan.device.is_cuda(),
                       "precision.dtype: fp16 needs a CUDA device (train.device is the CPU "
                       "here); use bf16 for mixed precision on the CPU");
  return plan;
}

int64_t visible_gpus() {
  return torch::cuda::is_available() ? static_cast<int64_t>(torch::cuda::device_count()) : 0;
}

bool nccl_built() {
#ifdef USE_C10D_NCCL
  return true;
#else
  return false;
#endif
}

namespace {
// The CUDA runtime's version (e.g. 12040), or nothing where the CUDA hooks are not linked in
// (they answer only where LibTorch's CUDA library is).
std::optional<long> cuda_runtime_version() {
  try {
    return at::detail::getCUDAHooks().versionCUDART();
  } catch (const c10::Error&) {
    return std::nullopt;
  }
}
}  // namespace

bool cuda_linked() {
  // Asked once: without CUDA, each asking throws (and records a backtrace), and the plan
  // asks for every rank of every layout it weighs.
  static const bool linked = cuda_runtime_version().has_value();
  return linked;
}

std::string build_info() {
  std::string cuda = "no CUDA";
  if (const auto v = cuda_runtime_version()) cuda = fmt::format("CUDA {}.{}", *v / 1000, (*v % 1000) / 10);
#ifdef NCCL_MAJOR
  const std::string nccl = fmt::format("NCCL {}.{}.{}", NCCL_MAJOR, NCCL_MINOR, NCCL_PATCH);
#else
  const std::string nccl = nccl_built() ? "NCCL" : "no NCCL";
#endif
  return fmt::format("LibTorch {}, {}, {}", TORCH_VERSION, cuda, nccl);
}

void use_device(const c10::Device& device, const JobConfig& cfg) {
  if (!device.is_cuda()) return;
  sync_debug_mode();  // a bad DTRAIN_SYNC_DEBUG fails here, before training
  // The current device of this thread: where LibTorch allocates, and NCCL's GPU.
  c10::impl::getDeviceGuardImpl(c10::kCUDA)->setDevice(device);
  // PyTorch's allow_tf32 for matmul and cuDNN ("high" float32 matmul precision).
  at::globalContext().setFloat32MatmulPrecision(cfg.precision.tf32 ? "high" : "highest");
  at::globalContext().setAllowTF32CuDNN(cfg.precision.tf32);
}

SyncDebugScope::SyncDebugScope(const std::string& mode) {
  if (mode != "warn" && mode != "error") return;
#ifdef DTRAIN_CUDA
  auto& state = c10::cuda::warning_state();
  previous_ = static_cast<int>(state.get_sync_debug_mode());
  state.set_sync_debug_mode(mode == "warn" ? c10::cuda::SyncDebugMode::L_WARN
                                           : c10::cuda::SyncDebugMode::L_ERROR);
#endif
}

SyncDebugScope::~SyncDebugScope() {
#ifdef DTRAIN_CUDA
  if (previous_ >= 0)
    c10::cuda::warning_state().set_sync_debug_mode(static_cast<c10::cuda::SyncDebugMode>(previous_));
#endif
}

const std::string& sync_debug_mode() {
  static const std::string mode = [] {
    const char* v = std::getenv("DTRAIN_SYNC_DEBUG");
    std::string m = v && *v ? v : "off";
    fail_if<ConfigError>(m != "warn" && m != "error" && m != "off",
                         "DTRAIN_SYNC_DEBUG: expected warn, error or off (got '{}')", m);
    return m;
  }();
  return mode;
}

std::chrono::milliseconds hang_report_after(const DistConfig& dist) {
  if (dist.hang_report_s <= 0) return std::chrono::milliseconds(0);
  return std::min<std::chrono::milliseconds>(std::chrono::seconds(dist.hang_report_s),
                                             std::chrono::milliseconds(dist.timeout_s * 500));
}

}  // namespace dtrain
