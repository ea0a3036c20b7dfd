#!/usr/bin/env bash
# Builds dtrain, tests included, as the CUDA build of the pinned LibTorch (scripts/setup.sh
# --cuda: today's torch wheel whole, scripts/libtorch.sh --cuda) against this machine's CUDA
# 13 toolkit, with the NCCL backend, then runs CPU tests with no GPU visible. No GPU is
# needed: this is how every landing proves the GPU path still compiles (CI runs it after
# the Debian 12 and 13 lines).
#   scripts/build-cuda.sh                 fetch (cached), build into build-cuda/, test
#   scripts/build-cuda.sh --no-tests      build only
#   scripts/build-cuda.sh --all-tests     the whole CPU suite (ctest -LE cuda), not CI's subset
# LibTorch links the toolkit's own libraries under CUDA_HOME (/usr/local/cuda, 13.0: the
# same sonames as torch's 13.2); only NCCL (torch calls symbols of 2.30 that the toolkit's
# older NCCL lacks) and the three the toolkit does not have (cuSPARSELt, NVSHMEM's host
# library, cuFile) come from their own pinned wheels (third_party/libtorch.txt). Wheels and
# their unpacked files stay in the user's cache (~/.cache/dtrain, DTRAIN_CACHE), outside
# the checkout, so that a fresh clone (CI's) neither downloads nor unpacks them again.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
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
step "packages, LibTorch $(sed -n 's/^torch==\([^ ]*\) .*/\1/p' third_party/libtorch.txt) with CUDA, configure ($BUILD)"
DTRAIN_BUILD_DIR="$BUILD" scripts/setup.sh --test --cuda --no-build

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
