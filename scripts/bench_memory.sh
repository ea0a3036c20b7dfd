#!/usr/bin/env bash
# Peak resident memory of training a 253M-parameter GPT (dim 1024, 16 layers, 16 heads,
# vocabulary 50304, 128-token windows), plain SGD, 2 steps of 4 micro-batches of one
# window, fp32 on the CPU: plain PyTorch (scripts/baselines/gpt_memory.py) beside dtrain on
# one process and rank 0 of pipeline 4 and of tensor 4, in one run. The figure is the
# process's high-water mark (peak_rss_mb of dtrain's last train line, before the final
# checkpoint; the kernel's ru_maxrss for PyTorch), reported against PyTorch's eager.
# PyTorch runs eager and torch.compile'd with --baseline current (the default: today's
# PyTorch, .venv/); --baseline debian: the distribution's python3-torch, eager. Needs
# scripts/setup.sh --bench.
#   scripts/bench_memory.sh [--baseline current|debian]
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
source "$ROOT/scripts/baseline.sh"
baseline_flag "$@"
[ ${#REST[@]} -eq 0 ] || { echo "usage: scripts/bench_memory.sh [--baseline current|debian]" >&2; exit 2; }
BPY=$(baseline_python "$WHICH")
PY=/usr/bin/python3   # the figures' arithmetic
OUT_DIR="${OUT_DIR:-/tmp/dtrain-bench-memory}"
DTRAIN="${DTRAIN_BIN:-$ROOT/build/dtrain}"  # DTRAIN_BIN=PATH measures another build
[ -x "$DTRAIN" ] || { echo "bench_memory: build dtrain first (scripts/setup.sh)" >&2; exit 2; }
mkdir -p "$OUT_DIR"
rows=$OUT_DIR/rows.jsonl
: > "$rows"
job=$OUT_DIR/job.yaml
cat > "$job" <<'YAML'
name: gpt-memory
seed: 1
data: {dataset: synthetic_tokens, samples: 64, test_samples: 4, seq_len: 128, batch_size: 4, workers: 1}
model: {arch: gpt, layers: 16, heads: 16, dim: 1024, vocab: 50304, seq_len: 128}
optimizer: {name: sgd, lr: 0.001, momentum: 0}
schedule: {decay: constant}
train: {max_steps: 2, grad_accum: 4, log_every: 1, eval_every: 1000, threads: 1}
checkpoint: {keep_last: 1}
YAML
pytorch() {  # PYTHON [--compile]: a row named by the run's own torch and compile fields
  local py=$1; shift
  (cd "$ROOT/scripts/baselines" && "$py" gpt_memory.py --threads 1 "$@") |
    "$PY" -c 'import json, sys; d = json.loads(sys.stdin.read()); d["who"] = "PyTorch " + d["torch"].split("+")[0] + (" compiled" if d["compile"] else " eager"); print(json.dumps(d))' >> "$rows"
}
pytorch "$BPY"   # the first row: what the others are reported against
[ "$WHICH" = current ] && pytorch "$BPY" --compile
run() {  # label, extra args...
  local label=$1; shift
  rm -rf "$OUT_DIR/run"
  "$DTRAIN" run "$job" --run-dir "$OUT_DIR/run" --set logging.progress=off "$@" \
    > "$OUT_DIR/$label.log" 2>&1 || { tail -n 5 "$OUT_DIR/$label.log" >&2; exit 1; }
  "$PY" - "$label" "$OUT_DIR/run" >> "$rows" <<'PYEOF'
import json, sys
lines = [json.loads(l) for l in open(sys.argv[2] + "/metrics.jsonl")]
train = [l for l in lines if l["kind"] == "train"]
print(json.dumps({"who": sys.argv[1], "peak_rss_mb": train[-1]["peak_rss_mb"],
                  "last_loss": train[-1]["loss"]}))
PYEOF
}
run "dtrain 1 process"
run "dtrain pipeline 4" --nproc 4 --set parallel.pipeline=4
run "dtrain tensor 4" --nproc 4 --set parallel.tensor=4
"$PY" - "$rows" <<'PYEOF'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
base = rows[0]["peak_rss_mb"]
print(f"{'who':26} {'rank 0 peak MiB':>16} {'vs ' + rows[0]['who']:>24}")
for r in rows:
    print(f"{r['who']:26} {r['peak_rss_mb']:16.0f} {r['peak_rss_mb'] / base:24.2f}")
PYEOF
