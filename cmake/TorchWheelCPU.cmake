# LibTorch from a torch wheel's C++ side (scripts/libtorch.sh), linked for the CPU only: on a
# machine without an NVIDIA GPU dtrain needs the wheel's CPU library (torch_cpu, c10), not its
# CUDA one and the 3 GB of CUDA libraries that one links. The wheel's own TorchConfig.cmake
# describes the CUDA build and looks for a CUDA toolkit, so the target is described here as
# that file describes torch_cpu: its include folders, its definitions (the c10d backends it
# was built with), C++20. Sets what find_package(Torch) sets: TORCH_LIBRARIES,
# TORCH_INCLUDE_DIRS, TORCH_INSTALL_PREFIX, Torch_VERSION.
#   DTRAIN_LIBTORCH_CPU: the folder scripts/libtorch.sh prints (holding torch/)
set(TORCH_INSTALL_PREFIX "${DTRAIN_LIBTORCH_CPU}/torch")
foreach(lib torch_cpu c10)
  if(NOT EXISTS "${TORCH_INSTALL_PREFIX}/lib/lib${lib}.so")
    message(FATAL_ERROR "DTRAIN_LIBTORCH_CPU=${DTRAIN_LIBTORCH_CPU}: no torch/lib/lib${lib}.so "
                        "(scripts/libtorch.sh unpacks one)")
  endif()
endforeach()
file(STRINGS "${TORCH_INSTALL_PREFIX}/version.py" _version REGEX "^__version__")
string(REGEX REPLACE "^__version__ *= *'([0-9.]+).*" "\\1" Torch_VERSION "${_version}")
set(TORCH_INCLUDE_DIRS "${TORCH_INSTALL_PREFIX}/include"
                       "${TORCH_INSTALL_PREFIX}/include/torch/csrc/api/include")
add_library(c10 SHARED IMPORTED)
set_target_properties(c10 PROPERTIES IMPORTED_LOCATION "${TORCH_INSTALL_PREFIX}/lib/libc10.so")
add_library(torch SHARED IMPORTED)
set_target_properties(torch PROPERTIES
  IMPORTED_LOCATION "${TORCH_INSTALL_PREFIX}/lib/libtorch_cpu.so"
  INTERFACE_INCLUDE_DIRECTORIES "${TORCH_INCLUDE_DIRS}"
  INTERFACE_COMPILE_DEFINITIONS "USE_DISTRIBUTED;USE_C10D_GLOO;USE_RPC;USE_TENSORPIPE"
  INTERFACE_LINK_LIBRARIES c10)
target_compile_features(torch INTERFACE cxx_std_20)
set(TORCH_LIBRARIES torch)
message(STATUS "dtrain: LibTorch ${Torch_VERSION} (a torch wheel's, CPU only): ${TORCH_INSTALL_PREFIX}")
