#!/usr/bin/env bash
# Training modes side by side in one run (parallel.mode).
#   speed:    the Fashion-MNIST MLP with 2 and 4 workers: samples/s and the bytes all ranks
#             put on the wire per sample for sync, local_sgd (average every 8) and async_ps
#             (one more process: its server; staleness 4), each mode's ratio to sync; then
#             the same with one worker slowed (rank 1 sleeps SLOW_MS before each step,
#             train.debug_slow_rank), where sync waits for it at every step, local SGD only
#             where the replicas meet, and async_ps only as far as the staleness bound.
#   accuracy: the MLP and the CNN (configs/fashion_mnist_*.yaml) for EPOCHS epochs with 2
#             workers: test accuracy of local_sgd and async_ps against sync, same samples.
# The speed tables run PyTorch's own counterpart beside sync and local_sgd
# (scripts/baselines/ddp_comm.py under torchrun: DDP, and model_averaging's
# PeriodicModelAverager every EVERY steps; PyTorch has no parameter server), same model,
# global batch, threads and slowed rank, and give dtrain's ratio to it, eager and
# torch.compile'd (ddp_comm.py --compile; --no-compile: eager only). --baseline current (the
# default: today's PyTorch, .venv/) or debian (python3-torch, eager only); both need
# scripts/setup.sh --bench.
#   scripts/bench_modes.sh [speed|accuracy|all] [EPOCHS] [--baseline current|debian] [--no-compile]
#   (default: all 1)
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
OUT_DIR="${OUT_DIR:-/tmp/dtrain-bench-modes}"
source "$ROOT/scripts/baseline.sh"
baseline_flag "$@"
WHAT=${REST[0]:-all} EPOCHS=${REST[1]:-1}
DTRAIN="${DTRAIN_BIN:-$ROOT/build/dtrain}"  # DTRAIN_BIN=PATH measures another build
[ -x "$DTRAIN" ] || { echo "bench_modes: build dtrain first (scripts/setup.sh)" >&2; exit 2; }
mkdir -p "$OUT_DIR"
MODES=(sync local_sgd async_ps)
STALENESS=${STALENESS:-4}
SLOW_MS=${SLOW_MS:-4}
EVERY=${EVERY:-8}

# Processes for WORKERS workers in MODE: async_ps adds its server.
procs() { [ "$1" = async_ps ] && echo $(($2 + 1)) || echo "$2"; }

# One run; prints "samples_per_s wire_bytes_per_sample final_accuracy" from its summary:
# the bytes all ranks sent (a sync or local_sgd summary counts its rank's, the same on every
# rank; an async_ps summary counts every push and reply).
run() {  # JOB NAME NPROC EXTRA...
  local job=$1 name=$2 nproc=$3; shift 3
  rm -rf "$OUT_DIR/$name"
  "$DTRAIN" run "$job" --nproc "$nproc" --run-dir "$OUT_DIR/$name" --set logging.progress=off "$@" \
    > "$OUT_DIR/$name.log" 2>&1 || { echo "bench_modes: $name failed, see $OUT_DIR/$name.log" >&2; exit 1; }
  python3 - "$OUT_DIR/$name/metrics.jsonl" <<'PYEOF'
import json, sys
s = [json.loads(l) for l in open(sys.argv[1])][-1]
per_rank = "servers" not in s["layout"]
wire = s["comm_bytes_per_sample"] * (s["world_size"] if per_rank else 1)
print(s["samples_per_s"], wire, s.get("final_accuracy", float("nan")))
PYEOF
}

speed_table() {  # TITLE SLOW_MS (rank 1 sleeps that long before each step; 0: nobody)
  local title=$1 slow=$2
  local slowed=() torch_slowed=()
  if [ "$slow" != 0 ]; then
    slowed=(--set train.debug_slow_rank=1 --set train.debug_slow_ms=$slow)
    torch_slowed=(--slow-rank 1 --slow-ms "$slow")
  fi
  echo
  echo "$title"
  printf '%-7s %-10s %12s %9s %15s %9s ' workers mode samples/s "vs sync" bytes/sample "fewer"
  torch_headers compiled; echo
  for workers in 2 4; do
    local base_s="" base_b=""
    for mode in "${MODES[@]}"; do
      # dtrain's summary leaves its first 20 steps out; PyTorch's warm-up is the same.
      local torch_s=nan torch_c=nan torch_args=()
      case $mode in
        sync) torch_args=(--how none) ;;
        local_sgd) torch_args=(--how local_sgd --every "$EVERY") ;;
      esac
      if [ ${#torch_args[@]} -gt 0 ]; then
        torch_s=$(baseline_comm "$BPY" "$workers" "${torch_args[@]}" --steps 580 "${torch_slowed[@]}")
        torch_c=$(baseline_comm_compiled "$BPY" "$workers" "${torch_args[@]}" --steps 580 "${torch_slowed[@]}")
      fi
      read -r sps bytes _ < <(run "$ROOT/configs/fashion_mnist_mlp.yaml" "speed-$workers-$mode" \
        "$(procs $mode $workers)" \
        --set train.max_steps=600 --set train.log_every=100 --set train.eval_every=100000 \
        --set parallel.mode=$mode --set parallel.average_every=$EVERY \
        --set parallel.staleness=$STALENESS "${slowed[@]}")
      [ -z "$base_s" ] && base_s=$sps base_b=$bytes
      echo "$(python3 -c "import sys; n,m,s,b,bs,bb=sys.argv[1:]; s,b,bs,bb=map(float,(s,b,bs,bb)); print(f'{n:<7} {m:<10} {s:12.0f} {s/bs:8.2f}x {b:15.0f} {bb/b:8.2f}x')" \
        $workers $mode "$sps" "$bytes" "$base_s" "$base_b") $(torch_columns "$sps" "$torch_s" "$torch_c")"
    done
  done
}

if [ "$WHAT" = speed ] || [ "$WHAT" = all ]; then
  BPY=$(baseline_python "$WHICH")
  echo "baseline: PyTorch $($BPY -c 'import torch; print(torch.__version__)') (--baseline $WHICH)"
  speed_table "speed, MLP, local_sgd averaging every $EVERY steps, async_ps 1 server at staleness $STALENESS ($(nproc) cores, loopback)" 0
  speed_table "speed, the same with rank 1 sleeping $SLOW_MS ms before each step" "$SLOW_MS"
fi

if [ "$WHAT" = accuracy ] || [ "$WHAT" = all ]; then
  echo
  echo "accuracy, Fashion-MNIST, $EPOCHS epoch(s), 2 workers, local_sgd averaging every $EVERY steps, async_ps staleness $STALENESS"
  printf '%-5s %-10s %9s %9s\n' model mode accuracy "vs sync"
  for model in mlp cnn; do
    base=""
    for mode in "${MODES[@]}"; do
      read -r _ _ acc < <(run "$ROOT/configs/fashion_mnist_$model.yaml" "acc-$model-$mode" \
        "$(procs $mode 2)" --set train.epochs="$EPOCHS" --set train.log_every=200 \
        --set parallel.mode=$mode --set parallel.average_every=$EVERY \
        --set parallel.staleness=$STALENESS)
      [ -z "$base" ] && base=$acc
      python3 -c "import sys; m,h,a,b=sys.argv[1:]; a,b=float(a),float(b); print(f'{m:<5} {h:<10} {100*a:8.2f}% {100*(a-b):+7.2f} pt')" $model $mode "$acc" "$base"
    done
  done
fi
