#!/usr/bin/env bash
# On a GPU machine whose LibTorch is the one inside Python's torch (2.x with CUDA): builds
# dtrain against it, runs the CUDA tests, the GPU benchmark against PyTorch
# (scripts/bench_gpu.sh), the plan's time and memory against runs (scripts/bench_plan.sh
# --gpu), a fault-tolerant replica's rejoin (scripts/bench_faults.sh) and the whole CPU
# suite with the GPU hidden, in that order, each bounded, logs under $OUT (default
# /tmp/dtrain-gpu-check). About 8 minutes on 16 cores; more where BUDGET allows.
#   scripts/gpu-check.sh
# Brings along (a machine without a package manager or network): third_party/debs
# (third_party/fetch.sh, run on a Debian 13 machine) and .devdata/ holding the
# Fashion-MNIST .gz files and fortunes/ (Debian's /usr/share/games/fortunes,
# the GPT tests' corpus).
set -uo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
OUT=${OUT:-/tmp/dtrain-gpu-check}
mkdir -p "$OUT"
JOBS=$(nproc)
BUDGET=${BUDGET:-560}  # seconds for everything; the CPU suite gets what is left
START=$(date +%s)
left() { echo $((BUDGET - ($(date +%s) - START))); }
step() { echo "== $(date +%T) (+$(($(date +%s) - START)) s) $*"; }

step "machine"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
TP=$(python3 -c 'import torch; print(torch.utils.cmake_prefix_path)') || exit 1
python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl", torch.cuda.nccl.version())'

step "small dependencies"
if [ ! -d third_party/prefix/usr ]; then
  for deb in third_party/debs/*.deb; do dpkg-deb -x "$deb" third_party/prefix; done
fi
DATA=/usr/share/datasets/fashion-mnist  # where the tests look
if [ ! -f $DATA/train-images-idx3-ubyte.gz ] && [ -d .devdata ]; then
  mkdir -p $DATA && cp .devdata/*-ubyte.gz $DATA/
fi
if [ ! -e /usr/share/games/fortunes ] && [ -d .devdata/fortunes ]; then
  mkdir -p /usr/share/games && cp -r .devdata/fortunes /usr/share/games/
fi

step "build"
build() {
  cmake -S . -B build-gpu -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$TP" "$@" > "$OUT/cmake.log" 2>&1 &&
    cmake --build build-gpu -j"$JOBS" > "$OUT/build.log" 2>&1
}
if ! build; then
  grep -E 'error|Error' "$OUT/build.log" "$OUT/cmake.log" | head -30
  step "build failed; again without the NCCL backend"
  build -DDTRAIN_NCCL=OFF || { grep -E 'error|Error' "$OUT/build.log" | head -30; exit 1; }
fi
grep 'dtrain:' "$OUT/cmake.log"

step "CUDA tests"
timeout 120 build-gpu/tests/unit_tests --test-suite=cuda 2>&1 | tail -15
timeout 260 ctest --test-dir build-gpu -L cuda --output-on-failure > "$OUT/ctest-cuda.log" 2>&1
grep -E 'tests passed|ERROR|FAILED|Skipped' "$OUT/ctest-cuda.log" | head -30

step "does a steady step wait for the GPU? (DTRAIN_SYNC_DEBUG=warn, GPT-2 small's shape, 4 layers)"
# Each operation LibTorch sees making the host wait warns; where there are any, cuda-gdb
# shows who asks for the first ones.
SYNC_ARGS="run configs/gpt2_small.yaml --run-dir $OUT/sync-run --set train.device=cuda
  --set model.layers=4 --set train.max_steps=8 --set train.log_every=100 --set train.eval_every=100000
  --set logging.progress=off --set precision.dtype=bf16"
rm -rf "$OUT/sync-run"
DTRAIN_SYNC_DEBUG=warn timeout 120 build-gpu/dtrain $SYNC_ARGS > "$OUT/sync.log" 2>&1
echo "exit $?; $(grep -c 'synchroniz' "$OUT/sync.log") warning(s) of a synchronizing operation"
if grep -q 'synchroniz' "$OUT/sync.log" && command -v cuda-gdb > /dev/null; then
  rm -rf "$OUT/sync-run"
  DTRAIN_SYNC_DEBUG=warn timeout 100 cuda-gdb -batch -ex 'set pagination off' -ex 'set breakpoint pending on' \
    -ex 'break c10::cuda::warn_or_error_on_sync' -ex run -ex 'bt 14' -ex continue -ex 'bt 14' \
    -ex continue -ex 'bt 14' --args build-gpu/dtrain $SYNC_ARGS 2>&1 | grep -E '^#' | head -45
fi

step "benchmark"
OUT_DIR=$OUT/bench timeout 200 scripts/bench_gpu.sh build-gpu $DATA 2>&1 | tail -20
cp $OUT/bench/bench_gpu.jsonl $OUT/ 2>/dev/null

step "the plan against runs on the GPU (its profile measured first; scripts/bench_plan.sh --gpu)"
DTRAIN_BIN=build-gpu/dtrain OUT_DIR=$OUT/plan timeout 180 scripts/bench_plan.sh --gpu 2>&1 | tail -12
cp $OUT/plan/machine.json $OUT/machine.json 2>/dev/null

step "fault tolerance: a killed replica's rejoin at GPT-2 small's shape (target: 5 s; four replicas share the GPU over Gloo)"
# The rejoin column is the restarted process's start to its joining with the others' state.
# Before the CPU suite, which CI runs anyway: up to 200 s of what is left of BUDGET.
FT_TIME=$(( $(left) < 200 ? $(left) - 20 : 200 ))
if [ "$FT_TIME" -gt 90 ]; then
  OUT_DIR=$OUT/faults DTRAIN_BIN=build-gpu/dtrain timeout $FT_TIME \
    scripts/bench_faults.sh --model gpt2 --launchers replicas --steps 80 --every 10 \
    --set train.device=cuda:0 --set dist.backend=gloo 2>&1 | tail -8
  cp $OUT/faults/faults.jsonl $OUT/faults.jsonl 2>/dev/null
else
  echo "skipped: $(left) s of BUDGET left"
fi

step "the whole suite on the CPU (GPU hidden), in what is left of BUDGET"
[ "$(left)" -gt 60 ] || { step "no time left for it"; exit 0; }
CUDA_VISIBLE_DEVICES= timeout $(($(left) - 5)) ctest --test-dir build-gpu -j6 -LE cuda --output-on-failure \
  > "$OUT/ctest-cpu.log" 2>&1
grep -E 'tests passed|Failed|\*\*\*|Not Run|Skipped' "$OUT/ctest-cpu.log" | head -30
step "done"
