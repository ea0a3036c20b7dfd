#!/usr/bin/env bash
# The binaries must not call std::filesystem::remove_all: the CUDA LibTorch 2.x inside
# Python's torch exports a copy of it that the dynamic linker binds such calls to, and that
# copy jumps to address 0 (SIGSEGV, seen with LibTorch 2.11). util/files.hpp's remove_tree
# replaces it.
# Usage: check_symbols.sh BINARY...
set -uo pipefail
status=0
for bin in "$@"; do
  if nm -D --undefined-only "$bin" | c++filt | grep -q 'std::filesystem::.*remove_all'; then
    echo "FAIL: $bin calls std::filesystem::remove_all; use dtrain::remove_tree" >&2
    status=1
  fi
done
[ $status -eq 0 ] && echo "PASS: no std::filesystem::remove_all in $*"
exit $status
