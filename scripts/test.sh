#!/usr/bin/env bash
# Sets up (scripts/setup.sh), builds the tests, and runs them all with ctest.
# Extra arguments go to ctest, e.g. scripts/test.sh -L unit
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
cmake --build build -j "$(nproc)"
ctest --test-dir build --output-on-failure "$@"
