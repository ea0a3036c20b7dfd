#!/usr/bin/env bash
# Builds dtrain, tests included, against the CUDA build of today's PyTorch (its LibTorch, from
# the Python package index) and this machine's CUDA 13 toolkit, with the NCCL backend, then
# runs CPU tests with no GPU visible. No GPU is needed: this is how every landing proves the
# GPU path still compiles (CI runs it after the LibTorch 1.13 and 2.6 lines).
#   scripts/build-cuda.sh                 download (cached), build into build-cuda/, test
#   scripts/build-cuda.sh --no-tests      build only
#   scripts/build-cuda.sh --all-tests     the whole CPU suite (ctest -LE cuda), not CI's subset
# The wheels are taken with --no-deps: LibTorch links the toolkit's own libraries under
# CUDA_HOME (/usr/local/cuda, 13.0: the same sonames as torch's 13.2); only NCCL (torch
# calls symbols of 2.30 that the toolkit's older NCCL lacks) and the three the toolkit does
# not have (cuSPARSELt, NVSHMEM's host library, cuFile) come from their own wheels. The wheels
# and their unpacked C++ side are cached in the user's cache folder (~/.cache/dtrain/cuda,
# 2.6 GB; DTRAIN_CUDA_CACHE moves it), outside the checkout, so that a fresh clone (CI's)
# neither downloads the 1 GB of wheels nor unpacks them again.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"

# Pinned: torch and the exact versions its metadata requires for the libraries below.
TORCH=2.15.0
LIB_WHEELS=(nvidia-nccl-cu13==2.30.7 nvidia-cusparselt-cu13==0.8.1 nvidia-nvshmem-cu13==3.7.2
            'nvidia-cufile==1.17.1.22.*')
LIBS=(libnccl.so.2 libcusparseLt.so.0 libnvshmem_host.so.3 libcufile.so.0)
CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
CACHE=${DTRAIN_CUDA_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/dtrain/cuda}
BUILD=${DTRAIN_CUDA_BUILD:-$ROOT/build-cuda}

tests=subset
for arg in "$@"; do
  case "$arg" in
    --no-tests) tests=none ;;
    --all-tests) tests=all ;;
    *) echo "usage: scripts/build-cuda.sh [--no-tests | --all-tests]" >&2; exit 2 ;;
  esac
done
step() { echo "== build-cuda: $* ($(date +%T))"; }

[ -x "$CUDA_HOME/bin/nvcc" ] || {
  echo "build-cuda: no CUDA toolkit at $CUDA_HOME (set CUDA_HOME)" >&2; exit 1; }
scripts/setup.sh --test --no-build   # the toolchain and small libraries, the tests' launchers
if ! /usr/bin/python3 -m pip --version > /dev/null 2>&1; then
  sudo=""; [ "$(id -u)" -eq 0 ] || sudo=sudo
  $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends python3-pip
fi

step "torch $TORCH (CUDA build) and ${LIBS[*]}"
mkdir -p "$CACHE/wheels" "$CACHE/lib" "$CACHE/include"
TORCH_DIR="$CACHE/torch-$TORCH"
if [ ! -f "$TORCH_DIR/done" ]; then
  /usr/bin/python3 -m pip download --quiet --no-deps --only-binary=:all: --dest "$CACHE/wheels" \
    --python-version 3.11 --platform manylinux_2_28_x86_64 "torch==$TORCH"
  rm -rf "$TORCH_DIR"
  # Only the C++ side: the libraries, headers and CMake files (1.1 GB of the wheel's 2.6).
  /usr/bin/python3 - "$CACHE/wheels/torch-$TORCH-"*.whl "$TORCH_DIR" <<'EOF'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    z.extractall(sys.argv[2], [n for n in z.namelist()
                               if n.startswith(("torch/lib/", "torch/include/", "torch/share/"))
                               or n == "torch/version.py"])
EOF
  touch "$TORCH_DIR/done"
fi
for lib in "${LIBS[@]}"; do
  if [ ! -f "$CACHE/lib/$lib" ]; then
    /usr/bin/python3 -m pip download --quiet --no-deps --only-binary=:all: --dest "$CACHE/wheels" "${LIB_WHEELS[@]}"
    /usr/bin/python3 - "$CACHE" "$CACHE/wheels"/nvidia_*.whl <<'EOF'
import os, sys, zipfile
wanted = {"libnccl.so.2": "lib", "nccl.h": "include", "libcusparseLt.so.0": "lib",
          "libnvshmem_host.so.3": "lib", "libcufile.so.0": "lib"}
for wheel in sys.argv[2:]:
    with zipfile.ZipFile(wheel) as z:
        for n in z.namelist():
            base = os.path.basename(n)
            if base in wanted:
                with open(os.path.join(sys.argv[1], wanted[base], base), "wb") as f:
                    f.write(z.read(n))
EOF
    break
  fi
done
grep -E "^__version__|^cuda" "$TORCH_DIR/torch/version.py"

step "configure ($BUILD)"
CUDA_LIB="$CUDA_HOME/lib64"
# The libraries LibTorch needs are found through the executables' run path, and at link time
# through -rpath-link. A CUDA LibTorch's libraries carry no run path of their own, so it must
# be the old DT_RPATH (--disable-new-dtags), which also serves the libraries' dependencies.
cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$TORCH_DIR/torch/share/cmake" \
  -DCUDAToolkit_ROOT="$CUDA_HOME" -DCMAKE_CUDA_COMPILER="$CUDA_HOME/bin/nvcc" \
  -DDTRAIN_NCCL=ON -DDTRAIN_NCCL_INCLUDE="$CACHE/include" \
  -DCMAKE_BUILD_RPATH="$CACHE/lib;$CUDA_LIB" \
  -DCMAKE_EXE_LINKER_FLAGS="-Wl,--disable-new-dtags -Wl,-rpath-link,$CACHE/lib:$CUDA_LIB" > "$CACHE/cmake.log" 2>&1 ||
  { tail -30 "$CACHE/cmake.log"; exit 1; }
grep "dtrain:" "$CACHE/cmake.log"
grep -q "dtrain: NCCL backend ON" "$CACHE/cmake.log" ||
  { echo "build-cuda: the NCCL backend was not configured (see $CACHE/cmake.log)" >&2; exit 1; }

step "build"
cmake --build "$BUILD" -j "$(nproc)"
"$BUILD/dtrain" --version
"$BUILD/dtrain" --version | grep -q "CUDA 13" ||
  { echo "build-cuda: dtrain --version does not name CUDA" >&2; exit 1; }

[ "$tests" = none ] && exit 0
step "CPU tests, no GPU visible"
export CUDA_VISIBLE_DEVICES=""
if [ "$tests" = all ]; then
  ctest --test-dir "$BUILD" -LE cuda --output-on-failure --timeout 900 -j "$(nproc)"
else
  # CI's subset (about 100 s; CI's 90 minutes hold no more): the unit tests, the fuzz
  # corpus, the symbol check (a CUDA LibTorch interposes its own remove_all), every parallel
  # layout against one process, checkpoint operations and old checkpoints, Hugging Face
  # GPT-2, the plan (a GPU's step worked out by hand: this LibTorch's fused kernels).
  # (The CLI's contract and exact resume also pass here: --all-tests.)
  ctest --test-dir "$BUILD" -LE cuda --output-on-failure --timeout 900 -j "$(nproc)" \
    -R '^(unit|fuzz_corpus|symbols|docs_keys|e2e_layouts|e2e_checkpoint_ops|e2e_fixtures|hf|e2e_plan)$'
fi
