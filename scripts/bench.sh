#!/usr/bin/env bash
# dtrain against PyTorch (scripts/baselines/cpu.py), side by side in one run:
# same model, 64 samples per rank per step, SGD(lr 0.05, momentum 0.9, constant), same
# threads per rank, same data. With --nproc N the baseline is DDP under torchrun with N
# ranks and dtrain runs `--nproc N` with the same global batch (64 N). Runs are interleaved
# (baseline, dtrain, baseline, ...) so that machine noise hits both alike; medians are
# compared. Also measures the fp32 matmul peak in the same run and reports each model's
# achieved FLOP/s as a share of it, and, for N > 1, the share of dtrain's step spent
# waiting on communication.
#
#   scripts/bench.sh [--repeats N] [--models "mlp cnn"] [--threads T] [--nproc N]
#                    [--baseline current|debian] [--no-compile] [--busy]
# samples/s is throughput on both sides (the samples over the timed steps' whole time: dtrain's
# summary, PyTorch's mean); step ms the median step. --busy runs one busy-looping process
# beside everything (a workstation that runs other things): there the two part ways.
# --baseline current (the default): today's PyTorch, pinned in scripts/requirements-test.txt
# (.venv/), eager and torch.compile'd (--no-compile: eager only); debian: the
# distribution's python3-torch, eager. Needs scripts/setup.sh --bench.
# Results: $OUT_DIR/bench.jsonl.
# DTRAIN_BIN=PATH benchmarks another dtrain binary (e.g. an older build) the same way.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
BASELINE="${DTRAIN_BASELINE:-$ROOT/scripts/baselines/cpu.py}"
OUT_DIR="${OUT_DIR:-/tmp/dtrain-bench}"
REPEATS=3 MODELS="mlp cnn" THREADS=2 NPROC=1 BUSY=no
source "$ROOT/scripts/baseline.sh"
baseline_flag "$@"  # WHICH and COMPILE
set -- "${REST[@]}"
while [ $# -gt 0 ]; do
  case "$1" in
    --repeats) REPEATS=$2; shift 2 ;;
    --models) MODELS=$2; shift 2 ;;
    --threads) THREADS=$2; shift 2 ;;
    --nproc) NPROC=$2; shift 2 ;;
    --busy) BUSY=yes; shift ;;
    *) echo "usage: scripts/bench.sh [--repeats N] [--models \"mlp cnn\"] [--threads T] [--nproc N] [--baseline current|debian] [--no-compile] [--busy]" >&2; exit 2 ;;
  esac
done
[ -f "$BASELINE" ] || { echo "bench: no baseline at $BASELINE (set DTRAIN_BASELINE)" >&2; exit 2; }
PY=/usr/bin/python3   # the figures' arithmetic; the baseline runs under BPY
BPY=$(baseline_python "$WHICH")
WHO="baseline"; [ "$COMPILE" = yes ] && WHO="baseline compiled"
echo "baseline: torch $($BPY -c 'import torch; print(torch.__version__)') ($WHO)" >&2
DTRAIN="${DTRAIN_BIN:-$ROOT/build/dtrain}"
[ -x "$DTRAIN" ] || { echo "bench: no dtrain at $DTRAIN (build it: scripts/setup.sh)" >&2; exit 2; }
mkdir -p "$OUT_DIR"
: > "$OUT_DIR/bench.jsonl"
if [ "$BUSY" = yes ]; then  # a neighbour that keeps one core busy, gone when this script is
  sh -c 'while :; do :; done' &
  trap 'kill $! 2>/dev/null' EXIT
  echo "a busy-looping neighbour runs beside everything" >&2
fi
echo "BLAS: $(update-alternatives --query libblas.so.3-x86_64-linux-gnu 2>/dev/null | sed -n 's/^Value: //p')" >&2

steps_for() { if [ "$1" = mlp ]; then echo $((900 / NPROC)); else echo $((300 / NPROC)); fi; }
PER_RANK_THREADS=$((THREADS / NPROC > 0 ? THREADS / NPROC : 1))

# fp32 matmul peak on the same thread count, in the baseline's LibTorch: the faster of its
# BLAS (ATen's mm) and oneDNN's matmul, which dtrain's dense layers take on AMD CPUs.
$BPY - "$THREADS" >> "$OUT_DIR/bench.jsonl" <<'PYEOF'
import json, sys, time, torch
torch.set_num_threads(int(sys.argv[1]))
a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
products = [lambda: a.mm(b)]
if hasattr(torch.ops, "mkldnn") and hasattr(torch.ops.mkldnn, "_linear_pointwise"):
    products.append(lambda: torch.ops.mkldnn._linear_pointwise(a, b, None, "none", [], ""))
best = 0.0
for product in products:
    for _ in range(3): product()
    for _ in range(10):
        t = time.perf_counter(); product(); dt = time.perf_counter() - t
        best = max(best, 2 * 2048**3 / dt)
print(json.dumps({"kind": "peak", "gflops": best / 1e9}))
PYEOF

for r in $(seq 1 "$REPEATS"); do
  for model in $MODELS; do
    steps=$(steps_for "$model")
    if [ "$NPROC" -gt 1 ]; then   # scripts/torchrun: torchrun that starts on Debian 12 and 13
      launch=("$ROOT/scripts/torchrun" --nproc_per_node "$NPROC" "$BASELINE")
    else
      launch=("$BASELINE")
    fi
    for who in $WHO; do
      echo "== repeat $r/$REPEATS $model: $who" >&2
      flag=(); [ "$who" = compiled ] && flag=(--compile)
      ( cd "$OUT_DIR" && $BPY "${launch[@]}" --model "$model" --max-steps "$steps" \
          --threads "$PER_RANK_THREADS" "${flag[@]}" 2>/dev/null ) | grep '^{' | tail -1 |
        $PY -c 'import json,sys; d=json.loads(sys.stdin.read()); print(json.dumps({"kind":"run","who":sys.argv[1],"model":d["model"],"samples_per_s":d["samples_per_s_mean"],"step_ms":d["step_ms_median"]}))' "$who" \
        >> "$OUT_DIR/bench.jsonl"
    done
    echo "== repeat $r/$REPEATS $model: dtrain" >&2
    rm -rf "$OUT_DIR/run"
    "$DTRAIN" run "$ROOT/configs/fashion_mnist_$model.yaml" --run-dir "$OUT_DIR/run" \
      --nproc "$NPROC" --set train.max_steps="$steps" --set train.threads="$PER_RANK_THREADS" \
      --set schedule.decay=constant --set schedule.warmup_steps=0 --set optimizer.lr=0.05 \
      --set optimizer.momentum=0.9 --set data.batch_size=$((64 * NPROC)) \
      --set train.log_every=25 --set logging.progress=off > /dev/null 2>&1
    $PY - "$model" "$OUT_DIR/run/metrics.jsonl" >> "$OUT_DIR/bench.jsonl" <<'PYEOF'
import json, sys
lines = [json.loads(l) for l in open(sys.argv[2])]
d = lines[-1]
train = [l for l in lines if l["kind"] == "train"][1:]  # the first window includes warm-up
comm = sum(l.get("comm_ms", 0) for l in train) / max(1e-9, sum(l["step_ms"] for l in train))
print(json.dumps({"kind": "run", "who": "dtrain", "model": sys.argv[1], "samples_per_s": d["samples_per_s"],
                  "step_ms": d["step_ms_median"], "comm_share": comm}))
PYEOF
  done
done

$PY - "$OUT_DIR/bench.jsonl" "$NPROC" "$($BPY -c 'import torch; print(torch.__version__)')" <<'PYEOF'
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
print(f"fp32 matmul peak (2048x2048): {peak:.1f} GFLOP/s; {sys.argv[2]} process(es); baseline PyTorch {sys.argv[3]}")
print(f"{'model':6} {'baseline/s':>11} {'dtrain/s':>10} {'ratio':>6} {'base step ms':>12} {'dtrain step ms':>14} {'dtrain comm wait':>16} {'dtrain % peak':>13}")
for model in dict.fromkeys(r["model"] for r in rows if r["kind"] == "run"):
    b = [r for r in rows if r.get("model") == model and r.get("who") == "baseline"]
    d = [r for r in rows if r.get("model") == model and r.get("who") == "dtrain"]
    bs, ds = statistics.median(r["samples_per_s"] for r in b), statistics.median(r["samples_per_s"] for r in d)
    bm, dm = statistics.median(r["step_ms"] for r in b), statistics.median(r["step_ms"] for r in d)
    comm = statistics.median(r.get("comm_share", 0) for r in d)
    share = ds * flops_per_sample(model) / (peak * 1e9)
    bshare = bs * flops_per_sample(model) / (peak * 1e9)
    print(f"{model:6} {bs:11.0f} {ds:10.0f} {ds / bs:6.2f} {bm:12.2f} {dm:14.2f} {100 * comm:15.0f}% {100 * share:12.0f}%  (baseline {100 * bshare:.0f}%)")
    c = [r for r in rows if r.get("model") == model and r.get("who") == "compiled"]
    cs = statistics.median(r["samples_per_s"] for r in c) if c else None
    if c:
        print(f"{'  (compiled)':12} {cs:5.0f} {'':10} {ds / cs:6.2f}")  # the same row, torch.compile'd
    print(json.dumps({"kind": "ratio", "model": model, "nproc": int(sys.argv[2]), "torch": sys.argv[3], "baseline": bs, "compiled": cs,
                      "dtrain": ds, "ratio": ds / bs, "ratio_compiled": ds / cs if cs else None, "comm_share": comm,
                      "dtrain_peak_share": share, "baseline_peak_share": bshare}), file=sys.stderr)
PYEOF
