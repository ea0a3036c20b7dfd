#!/usr/bin/env bash
# Pipeline parallelism measured, in one run:
#   1. the bubble: each pipeline rank's share of the step spent waiting for its neighbours,
#      against the theory, (p-1)/(m+p-1) for 1F1B and (p-1)/(v m+p-1) interleaved over v
#      chunks, at p = 2, 4 stages and m = 4, 8, 16 micro-batches of 128 samples, averaged
#      over the steps after the first two; the model is an MLP of 8 equal 512-wide layers,
#      so the stages are balanced;
#   2. the activation memory each stage holds at its peak, for gpipe, 1f1b and 1f1b with
#      recompute (a 4-layer GPT, 2 stages, 8 micro-batches);
#   3. the GPT of configs/gpt_text.yaml in tokens/s on one process, pipeline 2, tensor 2
#      and data 2, the same global batch.
# Prints a table of each; rows go to $OUT_DIR/bench_pipeline.jsonl. Several processes share
# this machine's cores: a pipeline rank waiting for a neighbour gives its core to another
# rank, so on a machine with fewer cores than ranks the measured bubble is the waiting
# plus the time-sharing, and tokens/s compare layouts on this machine only.
#   scripts/bench_pipeline.sh [--steps N]
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
OUT_DIR="${OUT_DIR:-/tmp/dtrain-bench-pipeline}"
STEPS=12
while [ $# -gt 0 ]; do
  case "$1" in
    --steps) STEPS=$2; shift 2 ;;
    *) echo "usage: scripts/bench_pipeline.sh [--steps N]" >&2; exit 2 ;;
  esac
done
DTRAIN="${DTRAIN_BIN:-$ROOT/build/dtrain}"
[ -x "$DTRAIN" ] || { echo "bench_pipeline: build dtrain first (scripts/setup.sh)" >&2; exit 2; }
mkdir -p "$OUT_DIR"
rows=$OUT_DIR/bench_pipeline.jsonl
: > "$rows"

cat > "$OUT_DIR/mlp.yaml" <<'EOF'
name: bench-pipeline-mlp
seed: 1
data: {dataset: synthetic, samples: 8192, test_samples: 64, input_shape: [1, 16, 32], classes: 512,
       batch_size: 32, workers: 1}
model: {arch: mlp, hidden: [512, 512, 512, 512, 512, 512, 512]}
optimizer: {name: sgd, lr: 0.01}
train: {eval_every: 100000, threads: 1}
checkpoint: {every_steps: 100000}
logging: {progress: off}
EOF
cat > "$OUT_DIR/gpt.yaml" <<'EOF'
name: bench-pipeline-gpt
seed: 1
data: {dataset: synthetic_tokens, samples: 1024, test_samples: 16, batch_size: 64, workers: 1}
model: {arch: gpt, layers: 4, heads: 4, dim: 128, vocab: 256, seq_len: 64}
optimizer: {name: adamw, lr: 0.001}
train: {eval_every: 100000, grad_accum: 8}
checkpoint: {every_steps: 100000}
logging: {progress: off}
EOF

# run LABEL JOB NPROC [--set ...]: one run; its summary and last train line as a row.
run() {
  local label=$1 job=$2 nproc=$3; shift 3
  rm -rf "$OUT_DIR/run"
  "$DTRAIN" run "$job" --run-dir "$OUT_DIR/run" --nproc "$nproc" --set train.max_steps="$STEPS" \
    --set train.log_every=1 "$@" > "$OUT_DIR/run.log" 2>&1 ||
    { tail -5 "$OUT_DIR/run.log" >&2; exit 1; }
  python3 - "$label" "$OUT_DIR/run/metrics.jsonl" >> "$rows" <<'PYEOF'
import json, sys
lines = [json.loads(l) for l in open(sys.argv[2])]
steady, s = [l for l in lines if l["kind"] == "train"][2:], lines[-1]
row = {"label": sys.argv[1], "samples_per_s": s["samples_per_s"], "step_ms": s["step_ms_median"]}
if "tokens_per_s" in s:
    row["tokens_per_s"] = s["tokens_per_s"]
if "bubble" in steady[0]:  # per pipeline rank: the steady steps' mean bubble, the peak memory
    ranks = len(steady[0]["bubble"])
    row["bubble"] = [sum(l["bubble"][r] for l in steady) / len(steady) for r in range(ranks)]
    row["activation_mb"] = [max(l["activation_mb"][r] for l in steady) for r in range(ranks)]
print(json.dumps(row))
PYEOF
  echo "== $label" >&2
}

for p in 2 4; do
  for m in 4 8 16; do
    batch=$((128 * m))
    run "bubble 1f1b p$p m$m" "$OUT_DIR/mlp.yaml" $p --set parallel.pipeline=$p \
      --set parallel.schedule=1f1b --set train.grad_accum=$m --set data.batch_size=$batch
    run "bubble interleaved p$p m$m v2" "$OUT_DIR/mlp.yaml" $p --set parallel.pipeline=$p \
      --set parallel.schedule=interleaved_1f1b --set parallel.virtual_stages=2 \
      --set train.grad_accum=$m --set data.batch_size=$batch
  done
done
run "memory gpipe" "$OUT_DIR/gpt.yaml" 2 --set parallel.pipeline=2 --set parallel.schedule=gpipe
run "memory 1f1b" "$OUT_DIR/gpt.yaml" 2 --set parallel.pipeline=2 --set parallel.schedule=1f1b
run "memory 1f1b recompute" "$OUT_DIR/gpt.yaml" 2 --set parallel.pipeline=2 \
  --set parallel.schedule=1f1b --set train.recompute=blocks
GPT_TEXT=(--set train.eval_every=100000 --set checkpoint.every_steps=100000 --set logging.progress=off
          --set train.grad_accum=4)
run "gpt 1 process" "$ROOT/configs/gpt_text.yaml" 1 "${GPT_TEXT[@]}"
run "gpt pipeline 2" "$ROOT/configs/gpt_text.yaml" 2 "${GPT_TEXT[@]}" --set parallel.pipeline=2
run "gpt tensor 2" "$ROOT/configs/gpt_text.yaml" 2 "${GPT_TEXT[@]}" --set parallel.tensor=2
run "gpt data 2" "$ROOT/configs/gpt_text.yaml" 2 "${GPT_TEXT[@]}" --set parallel.data=2

python3 - "$rows" <<'PYEOF'
import json, re, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
print("\nbubble (mean over the pipeline's ranks) against the theory")
print(f"{'schedule':22} {'p':>2} {'m':>3} {'measured':>9} {'theory':>7}")
for r in rows:
    g = re.match(r"bubble (\S+) p(\d+) m(\d+)(?: v(\d+))?", r["label"])
    if not g: continue
    p, m, v = int(g[2]), int(g[3]), int(g[4] or 1)
    theory = (p - 1) / (v * m + p - 1)
    measured = sum(r["bubble"]) / len(r["bubble"])
    print(f"{g[1] + (f' v{v}' if v > 1 else ''):22} {p:2} {m:3} {measured:9.3f} {theory:7.3f}")
print("\nactivation memory held at the peak (MiB), stage 0 / stage 1")
for r in rows:
    if r["label"].startswith("memory"):
        print(f"{r['label'][7:]:22} {r['activation_mb'][0]:8.1f} {r['activation_mb'][1]:8.1f}")
print("\nconfigs/gpt_text.yaml, the same global batch")
base = next(r for r in rows if r["label"] == "gpt 1 process")
for r in rows:
    if r["label"].startswith("gpt "):
        print(f"{r['label'][4:]:22} {r['tokens_per_s']:10.0f} tokens/s {r['tokens_per_s'] / base['tokens_per_s']:6.2f}x")
PYEOF
