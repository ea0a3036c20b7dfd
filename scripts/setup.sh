#!/usr/bin/env bash
# Installs everything dtrain needs, then configures and builds dtrain into build/dtrain
# (scripts/test.sh builds the tests): the toolchain and the small libraries from Debian's
# packages (a fresh Debian has no compiler), and the pinned LibTorch, today's (2.15, the
# package index's torch wheel, version and checksum in third_party/libtorch.txt), fetched by
# scripts/libtorch.sh into the user's cache outside the checkout. On a machine without an
# NVIDIA GPU the build links LibTorch's CPU libraries only; where `nvidia-smi` lists a GPU,
# it is the CUDA build with the NCCL backend, against the CUDA toolkit under CUDA_HOME
# (/usr/local/cuda), as scripts/build-cuda.sh builds it in CI.
# Idempotent: rerunning installs nothing new and rebuilds only what changed.
#   scripts/setup.sh                 install + build
#   scripts/setup.sh --test          also what the tests use: SLURM, munge, OpenMPI, and the
#                                    pinned Python packages of scripts/requirements-test.txt
#                                    (today's torch with its torchrun, transformers,
#                                    safetensors, tensorboard, tiktoken) in .venv/, and GPT-2's
#                                    BPE ranks for scripts/prepare_tokens.py
#   scripts/setup.sh --bench         also the benchmarks' baselines (.venv's torch) and numpy
#   scripts/setup.sh --cpu | --cuda  the CPU or the CUDA build, whatever the machine has
#   scripts/setup.sh --system-libtorch   the distribution's own LibTorch (libtorch-dev)
#                                    instead of the pinned one: Debian 13's 2.6 is the oldest
#                                    line dtrain builds on (Debian 12's 1.13 is refused)
#   scripts/setup.sh --no-build      install and configure, compile nothing
# DTRAIN_BUILD_DIR builds elsewhere than build/ (scripts/build-cuda.sh: build-cuda/).
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${DTRAIN_BUILD_DIR:-build}
CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}

packages=(build-essential cmake pkg-config
          libgloo-dev libcli11-dev libyaml-cpp-dev libfmt-dev nlohmann-json3-dev
          doctest-dev zlib1g-dev
          python3 python3-pip               # scripts/libtorch.sh fetches with pip
          dataset-fashion-mnist fortunes)   # Fashion-MNIST; English text for configs/gpt_text.yaml
build=yes venv=no libtorch=pinned device=auto
for arg in "$@"; do
  case "$arg" in
    --no-build) build=no ;;
    --test) packages+=(slurm-wlm munge openmpi-bin   # launchers: SLURM, mpirun (torchrun: .venv)
                       python3-matplotlib           # scripts/plot.py
                       python3-protobuf             # decodes TensorBoard's files independently
                       python3-venv)                # .venv: scripts/requirements-test.txt
       venv=yes ;;
    --bench) packages+=(python3-venv python3-dev)   # .venv's torch, and Inductor's C++
       venv=yes ;;
    --cpu) device=cpu ;;
    --cuda) device=cuda ;;
    # A distribution's LibTorch calls libblas.so.3: the reference BLAS is ~19x slower.
    --system-libtorch) libtorch=system packages+=(libtorch-dev libopenblas0-openmp) ;;
    *) echo "usage: scripts/setup.sh [--test] [--bench] [--cpu | --cuda] [--system-libtorch] [--no-build]" >&2
       exit 2 ;;
  esac
done
if [ "$device" = auto ]; then
  device=cpu
  if command -v nvidia-smi > /dev/null && nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then device=cuda; fi
fi
if [ "$device" = cuda ]; then
  [ "$libtorch" = pinned ] || { echo "setup: --system-libtorch builds for the CPU only" >&2; exit 2; }
  [ -x "$CUDA_HOME/bin/nvcc" ] || {
    echo "setup: an NVIDIA GPU is to be used but there is no CUDA toolkit at $CUDA_HOME" \
         "(install CUDA 13, set CUDA_HOME, or build for the CPU with --cpu)" >&2; exit 1; }
fi

sudo=""
[ "$(id -u)" -eq 0 ] || sudo=sudo
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]}" >&2
  $sudo apt-get update
  $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${missing[@]}"
fi

# The tests' and benchmarks' Python packages, pinned with their checksums, in a git-ignored
# environment: today's torch (its torchrun, and what transformers runs GPT-2 with), the
# libraries users read dtrain's files with. Reinstalls only when the pins change.
if [ "$venv" = yes ]; then
  stamp=.venv/requirements-test.txt
  if ! cmp -s scripts/requirements-test.txt "$stamp"; then
    [ -x .venv/bin/python ] || /usr/bin/python3 -m venv .venv
    .venv/bin/python -m pip install --quiet --disable-pip-version-check --require-hashes \
      --only-binary=:all: -r scripts/requirements-test.txt
    cp scripts/requirements-test.txt "$stamp"
  fi
  # GPT-2's BPE ranks for scripts/prepare_tokens.py. tiktoken downloads them from a host of
  # its own at first use; the package index has them inside Whisper's source package
  # (whisper/assets/gpt2.tiktoken, byte for byte tiktoken's r50k_base: the script checks
  # its sha256), so only that file is taken, nothing installed.
  bpe=.venv/share/dtrain/gpt2.tiktoken
  if [ ! -f "$bpe" ]; then
    tmp=$(mktemp -d)
    printf 'openai-whisper==20250625 --hash=sha256:%s\n' \
      37a91a3921809d9f44748ffc73c0a55c9f366c85a3ef5c2ae0cc09540432eb96 > "$tmp/req"
    .venv/bin/python -m pip download --quiet --disable-pip-version-check --no-deps \
      --no-binary :all: --require-hashes --dest "$tmp" -r "$tmp/req"
    mkdir -p "$(dirname "$bpe")"
    .venv/bin/python - "$tmp"/openai_whisper-*.tar.gz "$bpe" <<'PY'
import sys, tarfile
with tarfile.open(sys.argv[1]) as t:
    member = next(m for m in t.getmembers() if m.name.endswith("whisper/assets/gpt2.tiktoken"))
    open(sys.argv[2] + ".part", "wb").write(t.extractfile(member).read())
PY
    mv "$bpe.part" "$bpe"
    rm -rf "$tmp"
  fi
fi

# LibTorch: the pinned one (its CPU part, or with a GPU all of it), or the distribution's.
config=(-DCMAKE_BUILD_TYPE=Release)
if [ "$libtorch" = system ]; then
  config+=(-DDTRAIN_LIBTORCH_CPU=)
elif [ "$device" = cpu ]; then
  config+=(-DDTRAIN_LIBTORCH_CPU="$(scripts/libtorch.sh)")
else
  torch=$(scripts/libtorch.sh --cuda)
  # LibTorch links the toolkit's own CUDA libraries (13.0: the same sonames as torch's
  # 13.2) and, from their wheels, NCCL, cuSPARSELt, NVSHMEM and cuFile. A CUDA LibTorch's
  # libraries carry no run path to the toolkit, so it is the executables' old DT_RPATH
  # (--disable-new-dtags), which also serves the libraries' own dependencies.
  libs="$torch/nvidia/nccl/lib:$torch/nvidia/cusparselt/lib:$torch/nvidia/nvshmem/lib:$torch/nvidia/cu13/lib:$CUDA_HOME/lib64"
  config+=(-DDTRAIN_LIBTORCH_CPU= -DCMAKE_PREFIX_PATH="$torch/torch/share/cmake"
           -DCUDAToolkit_ROOT="$CUDA_HOME" -DCMAKE_CUDA_COMPILER="$CUDA_HOME/bin/nvcc"
           -DDTRAIN_NCCL=ON -DDTRAIN_NCCL_INCLUDE="$torch/nvidia/nccl/include"
           -DCMAKE_BUILD_RPATH="${libs//:/;}"
           -DCMAKE_EXE_LINKER_FLAGS="-Wl,--disable-new-dtags -Wl,-rpath-link,$libs")
fi
mkdir -p "$BUILD"
log=$BUILD/configure.log
cmake -S . -B "$BUILD" "${config[@]}" > "$log" 2>&1 || { tail -30 "$log" >&2; exit 1; }
grep "dtrain:" "$log" >&2 || true
if [ "$device" = cuda ] && ! grep -q "dtrain: NCCL backend ON" "$log"; then
  echo "setup: the NCCL backend was not configured (see $log)" >&2; exit 1
fi
[ "$build" = yes ] || exit 0
cmake --build "$BUILD" --target dtrain -j "$(nproc)"
