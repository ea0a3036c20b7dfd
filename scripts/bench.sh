#!/usr/bin/env bash
# dtrain against the PyTorch (Python) baseline in ../shared/bench, side by side in one run:
# same model, global batch 64, SGD(lr 0.05, momentum 0.9, constant), same thread count,
# same data, one process. Runs are interleaved (baseline, dtrain, baseline, ...) so that
# machine noise hits both alike; medians are compared. Also measures the fp32 matmul peak
# in the same run and reports each model's achieved FLOP/s as a share of it.
#
#   scripts/bench.sh [--repeats N] [--models "mlp cnn"] [--threads T]
# Needs the baseline's packages: scripts/setup.sh --bench. Results: $OUT_DIR/bench.jsonl.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
BENCH="${DTRAIN_BASELINE:-$ROOT/../shared/bench}"
OUT_DIR="${OUT_DIR:-/tmp/dtrain-bench}"
REPEATS=3 MODELS="mlp cnn" THREADS=2
while [ $# -gt 0 ]; do
  case "$1" in
    --repeats) REPEATS=$2; shift 2 ;;
    --models) MODELS=$2; shift 2 ;;
    --threads) THREADS=$2; shift 2 ;;
    *) echo "usage: scripts/bench.sh [--repeats N] [--models \"mlp cnn\"] [--threads T]" >&2; exit 2 ;;
  esac
done
[ -f "$BENCH/ddp_baseline.py" ] || { echo "bench: no baseline at $BENCH (set DTRAIN_BASELINE)" >&2; exit 2; }
PY=/usr/bin/python3
$PY -c 'import torch, numpy' 2>/dev/null || { echo "bench: run scripts/setup.sh --bench first" >&2; exit 2; }
[ -x "$ROOT/build/dtrain" ] || { echo "bench: build dtrain first (scripts/setup.sh)" >&2; exit 2; }
mkdir -p "$OUT_DIR"
: > "$OUT_DIR/bench.jsonl"
echo "BLAS: $(update-alternatives --query libblas.so.3-x86_64-linux-gnu 2>/dev/null | sed -n 's/^Value: //p')" >&2

steps_for() { [ "$1" = mlp ] && echo 900 || echo 300; }

# fp32 matmul peak on the same thread count, in the same LibTorch.
$PY - "$THREADS" >> "$OUT_DIR/bench.jsonl" <<'PYEOF'
import json, sys, time, torch
torch.set_num_threads(int(sys.argv[1]))
a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
for _ in range(3): a.mm(b)
best = 0.0
for _ in range(10):
    t = time.perf_counter(); a.mm(b); dt = time.perf_counter() - t
    best = max(best, 2 * 2048**3 / dt)
print(json.dumps({"kind": "peak", "gflops": best / 1e9}))
PYEOF

for r in $(seq 1 "$REPEATS"); do
  for model in $MODELS; do
    steps=$(steps_for "$model")
    echo "== repeat $r/$REPEATS $model: baseline" >&2
    ( cd "$OUT_DIR" && $PY "$BENCH/ddp_baseline.py" --model "$model" --max-steps "$steps" \
        --threads "$THREADS" 2>/dev/null ) | grep '^{' | tail -1 |
      $PY -c 'import json,sys; d=json.loads(sys.stdin.read()); print(json.dumps({"kind":"run","who":"baseline","model":d["model"],"samples_per_s":d["samples_per_s"],"step_ms":d["step_ms_median"]}))' \
      >> "$OUT_DIR/bench.jsonl"
    echo "== repeat $r/$REPEATS $model: dtrain" >&2
    rm -rf "$OUT_DIR/run"
    "$ROOT/build/dtrain" run "$ROOT/configs/fashion_mnist_$model.yaml" --run-dir "$OUT_DIR/run" \
      --set train.max_steps="$steps" --set train.threads="$THREADS" --set schedule.decay=constant \
      --set schedule.warmup_steps=0 --set optimizer.lr=0.05 --set optimizer.momentum=0.9 \
      --set data.batch_size=64 --set train.log_every=100000 --set logging.progress=off 2>/dev/null
    tail -1 "$OUT_DIR/run/metrics.jsonl" |
      $PY -c 'import json,sys; d=json.loads(sys.stdin.read()); print(json.dumps({"kind":"run","who":"dtrain","model":sys.argv[1],"samples_per_s":d["samples_per_s"],"step_ms":d["step_ms_median"]}))' "$model" \
      >> "$OUT_DIR/bench.jsonl"
  done
done

$PY - "$OUT_DIR/bench.jsonl" <<'PYEOF'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
peak = next(r["gflops"] for r in rows if r["kind"] == "peak")
def flops_per_sample(model):
    # forward + weight gradients + input gradients (none for the first layer)
    if model == "mlp":
        layers = [2 * 784 * 512, 2 * 512 * 256, 2 * 256 * 10]
    else:
        layers = [2 * 1 * 32 * 9 * 28 * 28, 2 * 32 * 64 * 9 * 14 * 14, 2 * 3136 * 128, 2 * 128 * 10]
    return 2 * sum(layers) + sum(layers[1:])
print(f"fp32 matmul peak (2048x2048): {peak:.1f} GFLOP/s")
print(f"{'model':6} {'baseline/s':>11} {'dtrain/s':>10} {'ratio':>6} {'base step ms':>12} {'dtrain step ms':>14} {'dtrain % peak':>13}")
for model in dict.fromkeys(r["model"] for r in rows if r["kind"] == "run"):
    b = [r for r in rows if r.get("model") == model and r.get("who") == "baseline"]
    d = [r for r in rows if r.get("model") == model and r.get("who") == "dtrain"]
    bs, ds = statistics.median(r["samples_per_s"] for r in b), statistics.median(r["samples_per_s"] for r in d)
    bm, dm = statistics.median(r["step_ms"] for r in b), statistics.median(r["step_ms"] for r in d)
    share = ds * flops_per_sample(model) / (peak * 1e9)
    bshare = bs * flops_per_sample(model) / (peak * 1e9)
    print(f"{model:6} {bs:11.0f} {ds:10.0f} {ds / bs:6.2f} {bm:12.2f} {dm:14.2f} {100 * share:12.0f}%  (baseline {100 * bshare:.0f}%)")
    print(json.dumps({"kind": "ratio", "model": model, "baseline": bs, "dtrain": ds, "ratio": ds / bs,
                      "dtrain_peak_share": share, "baseline_peak_share": bshare}), file=sys.stderr)
PYEOF
