// The product every dense layer runs (x W^T + b), with the CPU's fp32 kernel chosen once per
// process (train.cpu_matmul).
//
// ATen's linear takes the BLAS LibTorch was built with. The pinned LibTorch's is MKL, which
// on AMD CPUs runs its AVX2 code: on 2 cores of an AMD EPYC (Zen 5) about 220 GFLOP/s
// for the MLP's and the GPT's shapes, where oneDNN's matmul, in the same LibTorch, runs
// AVX-512 at 400-490 (scripts/bench_matmul.py). `auto` takes oneDNN's on AMD CPUs, where
// LibTorch has it, and ATen's elsewhere (MKL uses AVX-512 on Intel's own CPUs). The choice
// is fixed for the process and by the CPU, so a run and its resume compute alike.
// oneDNN's sums in another order than MKL's: the same product agrees to fp32's rounding
// (about 1e-6 relative), not bit for bit.
#pragma once
#include <string>

#include <torch/types.h>

namespace dtrain {

// x [..., in] W^T [in, out] + b: ATen's linear, or under oneDNN an autograd function whose
// forward and both backward products are oneDNN's (fp32 CPU tensors outside autocast;
// anything else goes to ATen's as before).
torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& weight,
                     const torch::Tensor& bias = {});

// train.cpu_matmul: "auto", "onednn" or "aten". Throws ConfigError for onednn where this
// LibTorch has no oneDNN matmul. Returns the kernel taken, for the start line.
std::string use_cpu_matmul(const std::string& choice);

// Whether this LibTorch has oneDNN's matmul (mkldnn::_linear_pointwise), and whether the
// CPU is AMD's (what `auto` decides by).
bool onednn_matmul_available();
bool amd_cpu();

}  // namespace dtrain
