#!/usr/bin/env bash
# Fuzzes dtrain's readers of outside bytes with libFuzzer: the job spec and its validation,
# IDX data files, safetensors files, and a checkpoint's manifest and trainer state
# (tests/fuzz/targets.hpp). Builds build-fuzz/ with clang, AddressSanitizer and UBSan,
# runs each target for SECONDS (default 60), and saves every crashing input into
# tests/fuzz/corpus/TARGET/ -- where the fuzz_corpus test replays it from then on.
# Usage: scripts/fuzz.sh [SECONDS] [TARGET...]    (targets: job_spec idx safetensors checkpoint)
# Exit 0 when nothing crashed, 1 when something did (the inputs are saved), 2 on misuse.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
seconds=${1:-60}
[[ $seconds =~ ^[0-9]+$ ]] || { echo "usage: scripts/fuzz.sh [SECONDS] [TARGET...]" >&2; exit 2; }
shift || true
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(job_spec idx safetensors checkpoint)

# clang with its fuzzer runtime (and LLVM's OpenMP, which clang links), from Debian.
if ! command -v clang++ >/dev/null || ! ls /usr/lib/llvm-*/lib/clang/*/lib/linux/libclang_rt.fuzzer-x86_64.a >/dev/null 2>&1; then
  [ "$(id -u)" = 0 ] || { echo "fuzz.sh: needs clang and libclang-rt-dev: apt-get install clang libclang-rt-14-dev libomp-dev" >&2; exit 2; }
  apt-get update -qq && apt-get install -y -qq clang libclang-rt-14-dev libomp-dev >/dev/null
fi

build=$root/build-fuzz
cmake -S "$root" -B "$build" -DCMAKE_CXX_COMPILER=clang++ -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DDTRAIN_FUZZ=ON >/dev/null
cmake --build "$build" -j"$(nproc)" --target "${targets[@]/#/fuzz_}"

crashed=0
for t in "${targets[@]}"; do
  work=$build/corpus/$t  # new interesting inputs go here, not into the repository
  mkdir -p "$work" "$build/artifacts/$t"
  echo "== fuzzing $t for ${seconds}s"
  # -malloc_limit_mb: no input may make a reader allocate a gigabyte it does not hold;
  # -rss_limit_mb: all told (LibTorch and ASan's quarantine take 1-2 GB); -timeout: no spin.
  if ! "$build/tests/fuzz_$t" -max_total_time="$seconds" -rss_limit_mb=4096 -malloc_limit_mb=1024 \
      -timeout=10 -print_final_stats=1 -artifact_prefix="$build/artifacts/$t/" \
      "$work" "$root/tests/fuzz/corpus/$t"; then
    crashed=1
  fi
  for a in "$build/artifacts/$t"/*; do
    [ -f "$a" ] || continue
    dest=$root/tests/fuzz/corpus/$t/$(basename "$a")
    cp "$a" "$dest"
    echo "fuzz.sh: $t crashed on an input, saved as $dest (now a regression test)" >&2
    crashed=1
  done
done
exit $crashed
