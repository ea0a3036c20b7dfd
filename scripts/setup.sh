#!/usr/bin/env bash
# Installs everything dtrain needs from Debian's packages (the toolchain too: a fresh
# Debian 12 has no compiler), then configures and builds dtrain into build/dtrain
# (the tests are built by scripts/test.sh).
# Idempotent: rerunning installs nothing new and rebuilds only what changed.
#   scripts/setup.sh            install + build
#   scripts/setup.sh --test     also what the tests use: SLURM, munge, OpenMPI, torchrun, and
#                               the pinned Python packages of scripts/requirements-test.txt in .venv/
#                               (and GPT-2's BPE ranks for scripts/prepare_tokens.py)
#   scripts/setup.sh --bench    also the baselines' PyTorch: Debian's, and today's pinned in
#                               .venv-bench/ (scripts/requirements-bench.txt)
#   scripts/setup.sh --no-build only the packages (scripts/build-cuda.sh builds elsewhere)
set -euo pipefail
cd "$(dirname "$0")/.."

packages=(build-essential cmake pkg-config
          libtorch-dev libgloo-dev libcli11-dev libyaml-cpp-dev libfmt-dev nlohmann-json3-dev
          doctest-dev zlib1g-dev
          dataset-fashion-mnist fortunes   # Fashion-MNIST; English text for configs/gpt_text.yaml
          libopenblas0-openmp)   # LibTorch calls libblas.so.3: the reference BLAS is ~19x slower
build=yes venv=no bench=no
for arg in "$@"; do
  case "$arg" in
    --no-build) build=no ;;
    --test) packages+=(slurm-wlm munge openmpi-bin python3-torch   # launchers: SLURM, mpirun, torchrun
                       python3-matplotlib                             # scripts/plot.py
                       python3-protobuf       # decodes TensorBoard's files independently
                       python3-venv python3-pip)   # .venv: scripts/requirements-test.txt
       venv=yes ;;
    --bench) packages+=(python3 python3-torch python3-numpy        # Debian's PyTorch (--baseline debian)
                        python3-venv python3-pip python3-dev)         # today's, and Inductor's C++
       bench=yes ;;
    *) echo "usage: scripts/setup.sh [--test] [--bench] [--no-build]" >&2; exit 2 ;;
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

# The tests' Python packages (transformers, safetensors, tensorboard: the libraries users
# read dtrain's files with), pinned, in a git-ignored environment that also sees Debian's
# python3-torch. Reinstalls only when the pins change.
if [ "$venv" = yes ]; then
  stamp=.venv/requirements-test.txt
  if ! cmp -s scripts/requirements-test.txt "$stamp"; then
    [ -x .venv/bin/python ] || /usr/bin/python3 -m venv --system-site-packages .venv
    .venv/bin/python -m pip install --quiet --disable-pip-version-check -r scripts/requirements-test.txt
    cp scripts/requirements-test.txt "$stamp"
  fi
  # GPT-2's BPE ranks for scripts/prepare_tokens.py. tiktoken downloads them from a host of
  # its own at first use; the package index has them inside Whisper's source package
  # (whisper/assets/gpt2.tiktoken, byte for byte tiktoken's r50k_base: the script checks
  # its sha256), so only that file is taken, nothing installed.
  bpe=.venv/share/dtrain/gpt2.tiktoken
  if [ ! -f "$bpe" ]; then
    tmp=$(mktemp -d)
    .venv/bin/python -m pip download --quiet --disable-pip-version-check --no-deps \
      --no-binary :all: --dest "$tmp" openai-whisper==20250625
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

# The benchmarks' current PyTorch (scripts/requirements-bench.txt), in its own environment.
if [ "$bench" = yes ] && ! cmp -s scripts/requirements-bench.txt .venv-bench/requirements-bench.txt; then
  [ -x .venv-bench/bin/python ] || /usr/bin/python3 -m venv .venv-bench
  .venv-bench/bin/python -m pip install --quiet --disable-pip-version-check -r scripts/requirements-bench.txt
  cp scripts/requirements-bench.txt .venv-bench/requirements-bench.txt
fi

[ "$build" = yes ] || exit 0
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release
cmake --build build --target dtrain -j "$(nproc)"
