// Which BLAS the process uses: a distribution's LibTorch calls whatever libblas.so.3 the
// alternatives system points at, and the reference BLAS is ~19x slower on Linear layers;
// the torch wheel's (the pinned one) has MKL inside.
#pragma once
#include <string>

namespace dtrain {

// The path of the libblas.so.3 mapped into this process, else "MKL (in LibTorch)" where
// LibTorch has it, else "".
std::string loaded_blas();
// True for Debian's reference (netlib) BLAS.
bool is_reference_blas(const std::string& path);

}  // namespace dtrain
