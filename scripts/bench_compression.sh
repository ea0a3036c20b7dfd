#!/usr/bin/env bash
# Gradient compression and ZeRO at --nproc 2, side by side in one run.
#   speed:    the MLP (communication-bound) and configs/gpt_text.yaml's GPT: samples/s and
#             comm_bytes per step for none, fp16, bf16, sign, topk (1%), powersgd (rank 2)
#             and zero 1 and 2, with each one's ratio to none; and the same with loopback
#             throttled to RATE (default 1gbit; tc's netem, else its token bucket tbf, which
#             needs root; said so where neither can be set).
#   memory:   an MLP of six 2048-unit hidden layers (23M parameters, AdamW) at zero 0, 1, 2:
#             the gradient and optimizer state a rank keeps and rank 0's peak resident
#             memory during training (the last train line's, before any checkpoint).
#   accuracy: the Fashion-MNIST CNN (configs/fashion_mnist_cnn.yaml) for EPOCHS epochs at
#             2 ranks, each compression's test accuracy against none's.
# The speed tables run PyTorch's own counterpart beside each (scripts/baselines/ddp_comm.py
# under torchrun: DDP, its fp16/bf16/PowerSGD comm hooks, ZeroRedundancyOptimizer, FSDP2 as
# ZeRO-2; sign and top-k have none), same model, global batch and threads, and give
# dtrain's ratio to it, eager and torch.compile'd (ddp_comm.py --compile; --no-compile:
# eager only). --baseline current (the default: today's PyTorch, .venv/) or debian
# (python3-torch, eager only); see scripts/baseline.sh.
#   scripts/bench_compression.sh [speed|memory|accuracy|all] [EPOCHS] [--baseline current|debian]
#                                [--no-compile]
#   (default: all 3)
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
OUT_DIR="${OUT_DIR:-/tmp/dtrain-bench-compression}"
source "$ROOT/scripts/baseline.sh"
baseline_flag "$@"
WHAT=${REST[0]:-all} EPOCHS=${REST[1]:-3}
DTRAIN="${DTRAIN_BIN:-$ROOT/build/dtrain}"  # DTRAIN_BIN=PATH measures another build
[ -x "$DTRAIN" ] || { echo "bench_compression: build dtrain first (scripts/setup.sh)" >&2; exit 2; }
mkdir -p "$OUT_DIR"
STRATEGIES=(none fp16 bf16 sign topk powersgd zero1 zero2)
RATE=${RATE:-1gbit}

sets_of() {  # the --set flags of a strategy
  case $1 in
    zero1) echo "--set parallel.zero=1" ;;
    zero2) echo "--set parallel.zero=2" ;;
    # Compressed from the first step: the speed columns time compressed steps (the
    # accuracy runs below override it back to the default warm-up).
    *) echo "--set parallel.compression=$1 --set parallel.compression_warmup=0" ;;
  esac
}
# One run; prints "samples_per_s comm_bytes final_accuracy" from its metrics.
run() {  # JOB NAME EXTRA...
  local job=$1 name=$2; shift 2
  rm -rf "$OUT_DIR/$name"
  "$DTRAIN" run "$job" --nproc 2 --run-dir "$OUT_DIR/$name" --set logging.progress=off "$@" \
    > "$OUT_DIR/$name.log" 2>&1 || { echo "bench_compression: $name failed, see $OUT_DIR/$name.log" >&2; exit 1; }
  python3 - "$OUT_DIR/$name/metrics.jsonl" <<'PYEOF'
import json, sys
lines = [json.loads(l) for l in open(sys.argv[1])]
train = [l for l in lines if l["kind"] == "train"]
s = lines[-1]
print(s["samples_per_s"], train[-1].get("comm_bytes", 0), s.get("final_accuracy", float("nan")),
      train[-1]["peak_rss_mb"], s["gradient_mb"], s["optimizer_state_mb"])
PYEOF
}

speed_table() {  # TITLE EXTRA...
  local title=$1; shift
  echo
  echo "$title"
  printf '%-8s %-7s %12s %9s %14s %9s ' model how samples/s "vs none" comm_bytes "fewer"
  torch_headers compiled; echo
  for model in mlp gpt; do
    # dtrain's summary leaves its first min(20, steps/5) steps out; PyTorch's warm-up is the same.
    local job=$ROOT/configs/fashion_mnist_mlp.yaml extra=(--set train.max_steps=300 --set train.log_every=100)
    local timed=(--steps 280 --warmup 20)
    if [ $model = gpt ]; then
      job=$ROOT/configs/gpt_text.yaml
      extra=(--set train.max_steps=40 --set train.log_every=10 --set train.eval_every=100000)
      timed=(--steps 32 --warmup 8)
    fi
    local base_s="" base_b=""
    for how in "${STRATEGIES[@]}"; do
      local torch_s=nan torch_c=nan
      case $how in
        sign|topk) ;;
        *) torch_s=$(baseline_comm "$BPY" 2 --model $model --how $how "${timed[@]}")
           torch_c=$(baseline_comm_compiled "$BPY" 2 --model $model --how $how "${timed[@]}") ;;
      esac
      read -r sps bytes _ < <(run "$job" "speed-$model-$how" "${extra[@]}" $(sets_of $how) "$@")
      [ -z "$base_s" ] && base_s=$sps base_b=$bytes
      echo "$(python3 -c "import sys; m,h,s,b,bs,bb=sys.argv[1:]; s,b,bs,bb=map(float,(s,b,bs,bb)); print(f'{m:<8} {h:<7} {s:12.0f} {s/bs:8.2f}x {b:14.0f} {bb/b:8.1f}x')" \
        $model $how "$sps" "$bytes" "$base_s" "$base_b") $(torch_columns "$sps" "$torch_s" "$torch_c")"
    done
  done
}

if [ "$WHAT" = speed ] || [ "$WHAT" = all ]; then
  BPY=$(baseline_python "$WHICH")
  echo "baseline: PyTorch $($BPY -c 'import torch; print(torch.__version__)') (--baseline $WHICH)"
  speed_table "speed, --nproc 2 on loopback ($(nproc) cores)"
  if tc qdisc add dev lo root netem rate "$RATE" 2>/dev/null; then qdisc="tc netem"
  elif tc qdisc add dev lo root tbf rate "$RATE" burst 256kb latency 50ms 2>/dev/null; then qdisc="tc tbf"
  else qdisc=""; fi
  if [ -n "$qdisc" ]; then
    trap 'tc qdisc del dev lo root 2>/dev/null || true' EXIT
    speed_table "speed, --nproc 2 on loopback throttled to $RATE ($qdisc)"
    tc qdisc del dev lo root
  else
    echo
    echo "throttled: not measured (tc could set neither netem nor tbf on lo: it needs root)"
  fi
fi

if [ "$WHAT" = memory ] || [ "$WHAT" = all ]; then
  echo
  echo "memory, MLP 784-2048x6-10 (23M parameters), AdamW, --nproc 2, MiB per rank"
  printf '%-6s %10s %10s %14s\n' zero gradient optimizer "peak RSS (train)"
  for z in 0 1 2; do
    read -r _ _ _ rss grad opt < <(run "$ROOT/configs/fashion_mnist_mlp.yaml" "mem-zero$z" \
      --set 'model.hidden=[2048,2048,2048,2048,2048,2048]' --set optimizer.name=adamw --set train.max_steps=20 \
      --set train.log_every=20 --set parallel.zero=$z)
    python3 -c "import sys; z,g,o,r=sys.argv[1:]; print(f'{z:<6} {float(g):10.1f} {float(o):10.1f} {float(r):14.0f}')" $z "$grad" "$opt" "$rss"
  done
fi

if [ "$WHAT" = accuracy ] || [ "$WHAT" = all ]; then
  echo
  echo "accuracy, Fashion-MNIST CNN, $EPOCHS epochs, --nproc 2 (the default warm-up, compression_warmup: auto)"
  printf '%-7s %9s %10s\n' how accuracy "vs none"
  base=""
  for how in "${STRATEGIES[@]}"; do
    case $how in zero*) continue ;; esac
    read -r _ _ acc _ < <(run "$ROOT/configs/fashion_mnist_cnn.yaml" "acc-$how" \
      --set train.epochs="$EPOCHS" --set train.log_every=200 $(sets_of $how) \
      --set parallel.compression_warmup=auto)
    [ -z "$base" ] && base=$acc
    python3 -c "import sys; h,a,b=sys.argv[1:]; a,b=float(a),float(b); print(f'{h:<7} {100*a:8.2f}% {100*(a-b):+9.2f} pt')" $how "$acc" "$base"
  done
fi
