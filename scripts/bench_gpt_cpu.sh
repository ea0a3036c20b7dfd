#!/usr/bin/env bash
# dtrain's GPT against PyTorch eager's on this machine's CPU, side by side in one run,
# interleaved: the GPU baseline's own model (scripts/baselines/gpu.py, through
# scripts/gpt_phases.py) and dtrain's gpt at one small shape (4 layers, 256 wide, 4 heads,
# 128 tokens, GPT-2's vocabulary of 50304), batch 8, fp32, AdamW (decay on every
# parameter, as torch.optim's single group), clipping at 1.0, 2 threads. Medians of the
# step and of its phases. It checks that the two do the same work per step: on a GPU the
# kernels are the same, so a gap there is elsewhere (see scripts/bench_gpu.sh's phases).
# (scripts/bench_gpt.sh measures configs/gpt_text.yaml's byte-level GPT against its own
# Python copy; this one is the GPU benchmark's model, whose LM head dominates as GPT-2's.)
#   scripts/bench_gpt_cpu.sh [REPEATS] [--baseline current|debian] [--no-compile]
#   (scripts/setup.sh --bench)
# --baseline: today's PyTorch (the default), eager and torch.compile'd (--no-compile: eager
# only), or Debian's, eager (scripts/baseline.sh).
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
REPEATS=3
source "$ROOT/scripts/baseline.sh"
baseline_flag "$@"  # WHICH and COMPILE
set -- "${REST[@]}"
while [ $# -gt 0 ]; do
  case "$1" in
    [0-9]*) REPEATS=$1; shift ;;
    *) echo "usage: scripts/bench_gpt_cpu.sh [REPEATS] [--baseline current|debian] [--no-compile]" >&2; exit 2 ;;
  esac
done
BASELINE=${BASELINE:-$ROOT/scripts/baselines/gpu.py}
PY=/usr/bin/python3   # the figures' arithmetic
BPY=$(baseline_python "$WHICH")
echo "baseline: torch $($BPY -c 'import torch; print(torch.__version__)')" >&2
DTRAIN="${DTRAIN_BIN:-$ROOT/build/dtrain}"
OUT_DIR=${OUT_DIR:-/tmp/dtrain-bench-gpt-cpu}
mkdir -p "$OUT_DIR"
rows=$OUT_DIR/bench_gpt_cpu.jsonl
: > "$rows"
cat > "$OUT_DIR/job.yaml" <<'EOF'
name: gpt-cpu-bench
seed: 1
data: {dataset: synthetic_tokens, samples: 512, test_samples: 8, batch_size: 8, workers: 1,
       seq_len: 128, vocab: 50304}
model: {arch: gpt, layers: 4, heads: 4, dim: 256, vocab: 50304, seq_len: 128}
optimizer: {name: adamw, lr: 0.0006, beta2: 0.95, weight_decay: 0.1, grad_clip: 1.0,
            decay_1d: true}
schedule: {decay: constant}
train: {max_steps: 23, eval_every: 100000, log_every: 1, threads: 2}
checkpoint: {every_steps: 100000}
logging: {progress: off}
EOF
torch_side=("$ROOT/scripts/gpt_phases.py" "$BASELINE" --device cpu --dtype fp32 --layers 4 --dim 256
            --heads 4 --seq 128 --batch 8 --threads 2 --warmup 3 --steps 20)
for r in $(seq "$REPEATS"); do
  echo "== repeat $r/$REPEATS: pytorch" >&2
  $BPY "${torch_side[@]}" >> "$rows"
  if [ "$COMPILE" = yes ]; then
    echo "== repeat $r/$REPEATS: pytorch compiled" >&2
    $BPY "${torch_side[@]}" --compile 2> "$OUT_DIR/compile.err" >> "$rows" ||
      { echo "bench_gpt_cpu: torch.compile failed, see $OUT_DIR/compile.err" >&2; exit 1; }
  fi
  echo "== repeat $r/$REPEATS: dtrain" >&2
  rm -rf "$OUT_DIR/run"
  "$DTRAIN" run "$OUT_DIR/job.yaml" --run-dir "$OUT_DIR/run" > /dev/null 2>&1
  $PY - "$OUT_DIR/run/metrics.jsonl" >> "$rows" <<'PYEOF'
import json, statistics, sys
lines = [json.loads(l) for l in open(sys.argv[1])]
train = [l for l in lines if l["kind"] == "train"][3:]  # as the baseline: 3 warm-up steps
row = {"who": "dtrain", "model": "gpt-phases", "step_ms": lines[-1]["step_ms_median"]}
for k in ("forward_ms", "backward_ms", "optim_ms"):
    row[k] = statistics.median(l[k] for l in train)
print(json.dumps(row))
PYEOF
done
$PY - "$rows" <<'PYEOF'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
med = lambda who, k: statistics.median(r[k] for r in rows if r["who"] == who)
whos = [w for w in ("pytorch", "pytorch compiled") if any(r["who"] == w for r in rows)]
cols = {w: {} for w in whos + ["dtrain"]}
for w in cols:
    for k in ("step_ms", "forward_ms", "backward_ms"):
        cols[w][k] = med(w, k)
    cols[w]["norm+update"] = (med(w, "optim_ms") if w == "dtrain" else
                              statistics.median(r["norm_ms"] + r["optim_ms"] for r in rows if r["who"] == w))
print(f"{'ms (median)':14}" + "".join(f" {w:>17}" for w in cols))
for k in cols["dtrain"]:
    print(f"{k:14}" + "".join(f" {cols[w][k]:17.1f}" for w in cols))
d = cols["dtrain"]["step_ms"]
print(json.dumps({"kind": "ratio", "model": "gpt-cpu", "pytorch_step_ms": cols["pytorch"]["step_ms"],
                  "dtrain_step_ms": d, "ratio": cols["pytorch"]["step_ms"] / d,
                  "ratio_compiled": (cols["pytorch compiled"]["step_ms"] / d
                                     if "pytorch compiled" in cols else None)}))
PYEOF
