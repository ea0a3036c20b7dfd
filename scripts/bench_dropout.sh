#!/usr/bin/env bash
# What layout-independent dropout costs: configs/gpt_text.yaml's GPT with model.dropout 0
# and 0.1, dtrain against PyTorch eager (scripts/baselines/gpt_text.py --dropout, whose
# torch.nn.Dropout draws from one generator), side by side in one run, interleaved and
# repeated, one process, 2 threads. Reports each side's median step and the slowdown
# dropout brings it: dtrain's masks are hashes of (seed, step, sample, site, unit)
# (lib/models/dropout.hpp), PyTorch's bernoulli draws.
#   scripts/bench_dropout.sh [REPEATS [STEPS]]    (needs scripts/setup.sh --bench)
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
OUT_DIR="${OUT_DIR:-/tmp/dtrain-bench-dropout}"
REPEATS=${1:-3} STEPS=${2:-40}
source "$ROOT/scripts/baseline.sh"
PY=$(baseline_python current)   # today's PyTorch (.venv), eager
[ -x "$ROOT/build/dtrain" ] || { echo "bench_dropout: build dtrain first (scripts/setup.sh)" >&2; exit 2; }
mkdir -p "$OUT_DIR"
rows=$OUT_DIR/bench_dropout.jsonl
: > "$rows"

for r in $(seq 1 "$REPEATS"); do
  echo "== repeat $r/$REPEATS" >&2
  for p in 0 0.1; do
    $PY "$ROOT/scripts/baselines/gpt_text.py" --steps "$STEPS" --threads 2 --dropout $p |
      $PY -c 'import json,sys; r=json.loads(sys.stdin.read()); r["p"]=float(sys.argv[1]); print(json.dumps(r))' $p >> "$rows"
    rm -rf "$OUT_DIR/run"
    "$ROOT/build/dtrain" run "$ROOT/configs/gpt_text.yaml" --run-dir "$OUT_DIR/run" \
      --set train.max_steps="$STEPS" --set train.eval_every=100000 --set train.log_every=10 \
      --set logging.progress=off --set train.threads=2 --set model.dropout=$p > /dev/null 2>&1
    $PY - "$OUT_DIR/run/metrics.jsonl" $p >> "$rows" <<'PYEOF'
import json, sys
s = [json.loads(l) for l in open(sys.argv[1])][-1]
print(json.dumps({"who": "dtrain", "p": float(sys.argv[2]), "step_ms": s["step_ms_median"]}))
PYEOF
  done
done

$PY - "$rows" <<'PYEOF'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
ms = lambda who, p: statistics.median(r["step_ms"] for r in rows if r["who"] == who and r["p"] == p)
print(f"{'step ms (median)':18} {'dropout 0':>10} {'dropout 0.1':>12} {'slowdown':>9}")
for who in ("pytorch", "dtrain"):
    a, b = ms(who, 0.0), ms(who, 0.1)
    print(f"{who:18} {a:10.1f} {b:12.1f} {b / a:9.2f}")
print(f"dtrain vs pytorch at dropout 0.1: {ms('pytorch', 0.1) / ms('dtrain', 0.1):.2f}x")
PYEOF
