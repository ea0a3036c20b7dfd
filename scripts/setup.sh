#!/usr/bin/env bash
# Installs everything dtrain needs from Debian's packages (the toolchain too: a fresh
# Debian 12 has no compiler), then configures and builds dtrain into build/dtrain
# (the tests are built by scripts/test.sh).
# Idempotent: rerunning installs nothing new and rebuilds only what changed.
#   scripts/setup.sh            install + build
#   scripts/setup.sh --test     also what the launcher tests run: SLURM, munge, OpenMPI, torchrun
#   scripts/setup.sh --bench    also the PyTorch baseline's packages (scripts/bench.sh)
set -euo pipefail
cd "$(dirname "$0")/.."

packages=(build-essential cmake pkg-config
          libtorch-dev libgloo-dev libcli11-dev libyaml-cpp-dev libfmt-dev nlohmann-json3-dev
          doctest-dev zlib1g-dev
          dataset-fashion-mnist fortunes   # Fashion-MNIST; English text for configs/gpt_text.yaml
          libopenblas0-openmp)   # LibTorch calls libblas.so.3: the reference BLAS is ~19x slower
for arg in "$@"; do
  case "$arg" in
    --test) packages+=(slurm-wlm munge openmpi-bin python3-torch   # launchers: SLURM, mpirun, torchrun
                       python3-matplotlib                             # scripts/plot.py
                       python3-protobuf) ;;   # decodes TensorBoard's files independently
    --bench) packages+=(python3 python3-torch python3-numpy) ;;
    *) echo "usage: scripts/setup.sh [--test] [--bench]" >&2; exit 2 ;;
  esac
done

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

cmake -S . -B build -DCMAKE_BUILD_TYPE=Release
cmake --build build --target dtrain -j "$(nproc)"
