#!/usr/bin/env bash
# The GPT of configs/gpt_text.yaml, side by side in one run: PyTorch eager on one process
# (scripts/baselines/gpt_text.py: the same network, optimizer and threads), dtrain on one
# process, and dtrain on 2 processes as tensor 2 and as data 2 (same global batch). Runs
# are interleaved and repeated; medians of tokens/s are reported, with ratios to PyTorch.
#
#   scripts/bench_gpt.sh [--repeats N] [--steps S] [--baseline current|debian] [--no-compile]
# --baseline: today's PyTorch (the default), eager and torch.compile'd (--no-compile: eager
# only), or Debian's, eager (scripts/baseline.sh; setup.sh --bench).
# DTRAIN_BIN=PATH benchmarks another dtrain binary the same way. Results: $OUT_DIR/bench_gpt.jsonl.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
OUT_DIR="${OUT_DIR:-/tmp/dtrain-bench-gpt}"
REPEATS=3 STEPS=60
source "$ROOT/scripts/baseline.sh"
baseline_flag "$@"  # WHICH and COMPILE
set -- "${REST[@]}"
while [ $# -gt 0 ]; do
  case "$1" in
    --repeats) REPEATS=$2; shift 2 ;;
    --steps) STEPS=$2; shift 2 ;;
    *) echo "usage: scripts/bench_gpt.sh [--repeats N] [--steps S] [--baseline current|debian] [--no-compile]" >&2; exit 2 ;;
  esac
done
PY=/usr/bin/python3   # the figures' arithmetic
BPY=$(baseline_python "$WHICH")
echo "baseline: torch $($BPY -c 'import torch; print(torch.__version__)')" >&2
DTRAIN="${DTRAIN_BIN:-$ROOT/build/dtrain}"  # another build (e.g. build-cuda/dtrain, LibTorch 2.15)
[ -x "$DTRAIN" ] || { echo "bench_gpt: build dtrain first (scripts/setup.sh)" >&2; exit 2; }
mkdir -p "$OUT_DIR"
: > "$OUT_DIR/bench_gpt.jsonl"

dtrain_run() {  # label, extra args...
  local label=$1; shift
  rm -rf "$OUT_DIR/run"
  "$DTRAIN" run "$ROOT/configs/gpt_text.yaml" --run-dir "$OUT_DIR/run" \
    --set train.max_steps="$STEPS" --set train.eval_every=100000 --set train.log_every=10 \
    --set logging.progress=off "$@" > /dev/null 2>&1
  $PY - "$label" "$OUT_DIR/run/metrics.jsonl" >> "$OUT_DIR/bench_gpt.jsonl" <<'PYEOF'
import json, sys
s = [json.loads(l) for l in open(sys.argv[2])][-1]
print(json.dumps({"who": sys.argv[1], "tokens_per_s": s["tokens_per_s"], "step_ms": s["step_ms_median"]}))
PYEOF
}

for r in $(seq 1 "$REPEATS"); do
  echo "== repeat $r/$REPEATS" >&2
  torch_side=("$ROOT/scripts/baselines/gpt_text.py" --steps "$STEPS" --threads 2)
  $BPY "${torch_side[@]}" >> "$OUT_DIR/bench_gpt.jsonl"
  if [ "$COMPILE" = yes ]; then
    $BPY "${torch_side[@]}" --compile 2> "$OUT_DIR/compile.err" >> "$OUT_DIR/bench_gpt.jsonl" ||
      { echo "bench_gpt: torch.compile failed, see $OUT_DIR/compile.err" >&2; exit 1; }
  fi
  dtrain_run "dtrain 1 process" --set train.threads=2
  dtrain_run "dtrain tensor 2" --nproc 2 --set parallel.tensor=2 --set train.threads=1
  dtrain_run "dtrain data 2" --nproc 2 --set train.threads=1
done

$PY - "$OUT_DIR/bench_gpt.jsonl" <<'PYEOF'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
who = list(dict.fromkeys(r["who"] for r in rows))
med = {w: statistics.median(r["tokens_per_s"] for r in rows if r["who"] == w) for w in who}
ms = {w: statistics.median(r["step_ms"] for r in rows if r["who"] == w) for w in who}
base, compiled = med["pytorch"], med.get("pytorch compiled")
print(f"{'run':20} {'tokens/s':>10} {'step ms':>8} {'vs PyTorch 1 process':>21}"
      + (f" {'vs compiled':>12}" if compiled else ""))
for w in who:
    print(f"{w:20} {med[w]:10.0f} {ms[w]:8.1f} {med[w] / base:21.2f}"
          + (f" {med[w] / compiled:12.2f}" if compiled else ""))
PYEOF
