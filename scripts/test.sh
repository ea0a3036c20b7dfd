#!/usr/bin/env bash
# Sets up (scripts/setup.sh --test: the launcher tests need SLURM, OpenMPI and torchrun),
# builds the tests, and runs them all with ctest.
#   scripts/test.sh [--system-libtorch] [CTEST ARGS]
# --system-libtorch builds against the distribution's own LibTorch (Debian 13's 2.6, as CI's
# second line does); other arguments go to ctest, e.g. scripts/test.sh -L unit
set -euo pipefail
cd "$(dirname "$0")/.."
setup=(--test)
if [ "${1:-}" = --system-libtorch ]; then setup+=(--system-libtorch); shift; fi
scripts/setup.sh "${setup[@]}"
cmake --build "${DTRAIN_BUILD_DIR:-build}" -j "$(nproc)"
# Side by side, as many cores as the machine has (tests/CMakeLists.txt says which use two).
ctest --test-dir "${DTRAIN_BUILD_DIR:-build}" --output-on-failure -j "$(nproc)" "$@"
