// What differs between the LibTorch versions dtrain builds against (Debian's 1.13, the
// CUDA 2.x inside a Python torch). Code asks these, never the version numbers.
#pragma once
#include <torch/version.h>

// at::scaled_dot_product_attention (fused attention) exists from 2.0 on.
#define DTRAIN_HAS_FUSED_ATTENTION (TORCH_VERSION_MAJOR >= 2)
