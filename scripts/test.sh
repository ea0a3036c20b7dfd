#!/usr/bin/env bash
# Sets up (scripts/setup.sh --test: the launcher tests need SLURM and OpenMPI), builds the
# tests, and runs them all with ctest.
# Extra arguments go to ctest, e.g. scripts/test.sh -L unit
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --test
cmake --build build -j "$(nproc)"
# Side by side, as many cores as the machine has (tests/CMakeLists.txt says which use two).
ctest --test-dir build --output-on-failure -j "$(nproc)" "$@"
