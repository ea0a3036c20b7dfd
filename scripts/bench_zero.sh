#!/usr/bin/env bash
# Rank 0's training peak memory and samples/s under ZeRO 0, 1, 2 and 3 at data 2 and 4, in
# one run, on two models with AdamW (CPU; fp32, or PRECISION=bf16 for autocast's bf16,
# where ZeRO-3 holds and gathers the weights in bf16):
#   a wide MLP: 6 hidden layers of 4096 on 32 x 32 inputs (~89M parameters), batch 32
#   a GPT: dim 512, 8 layers, 8 heads, GPT-2's vocabulary (50304), 128-token windows
#     (~51M parameters), batch 8
# Each row is a few steps; the peak is the last train line's peak_rss_mb (the process's
# high-water mark, before the final checkpoint), reported against ZeRO 0's at the same
# data degree. samples/s is the run's (every rank on this machine's cores, so the ratios
# say what the stage costs in time here, not on a cluster).
# Also the bytes rank 0 sent in the last step (comm_bytes).
#   [PRECISION=bf16] scripts/bench_zero.sh [MODEL...]     # mlp, gpt (default: both)
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
OUT_DIR="${OUT_DIR:-/tmp/dtrain-bench-zero}"
PY=/usr/bin/python3
BIN="${DTRAIN_BIN:-$ROOT/build/dtrain}"
PRECISION="${PRECISION:-fp32}"
[ -x "$BIN" ] || { echo "bench_zero: build dtrain first (scripts/setup.sh)" >&2; exit 2; }
models=("$@")
[ ${#models[@]} -gt 0 ] || models=(mlp gpt)
mkdir -p "$OUT_DIR"
rows=$OUT_DIR/bench_zero.jsonl
: > "$rows"
cat > "$OUT_DIR/mlp.yaml" <<'YAML'
name: zero-mlp
seed: 1
data: {dataset: synthetic, samples: 1024, test_samples: 32, input_shape: [1, 32, 32], classes: 10, batch_size: 32, workers: 1}
model: {arch: mlp, hidden: [4096, 4096, 4096, 4096, 4096, 4096]}
optimizer: {name: adamw, lr: 0.0001, weight_decay: 0.01}
schedule: {decay: constant}
train: {max_steps: 6, log_every: 1, eval_every: 0, threads: 1}
checkpoint: {every_steps: 0, keep_last: 1}
YAML
cat > "$OUT_DIR/gpt.yaml" <<'YAML'
name: zero-gpt
seed: 1
data: {dataset: synthetic_tokens, samples: 256, test_samples: 8, seq_len: 128, batch_size: 8, workers: 1}
model: {arch: gpt, layers: 8, heads: 8, dim: 512, vocab: 50304, seq_len: 128}
optimizer: {name: adamw, lr: 0.0001, weight_decay: 0.01}
schedule: {decay: constant}
train: {max_steps: 4, log_every: 1, eval_every: 0, threads: 1}
checkpoint: {every_steps: 0, keep_last: 1}
YAML
for model in "${models[@]}"; do
  for data in 2 4; do
    for zero in 0 1 2 3; do
      rm -rf "$OUT_DIR/run"
      log=$OUT_DIR/$model-d$data-z$zero.log
      "$BIN" run "$OUT_DIR/$model.yaml" --nproc $data --run-dir "$OUT_DIR/run" \
        --set parallel.zero=$zero --set precision.dtype=$PRECISION --set logging.progress=off > "$log" 2>&1 ||
        { tail -n 5 "$log" >&2; exit 1; }
      $PY - "$model" $data $zero "$OUT_DIR/run" >> "$rows" <<'PYEOF'
import json, sys
lines = [json.loads(l) for l in open(sys.argv[4] + "/metrics.jsonl")]
train = [l for l in lines if l["kind"] == "train"]
s = lines[-1]
print(json.dumps({"model": sys.argv[1], "data": int(sys.argv[2]), "zero": int(sys.argv[3]),
                  "peak_rss_mb": train[-1]["peak_rss_mb"], "samples_per_s": s["samples_per_s"],
                  "parameters_mb": s["parameters_mb"], "gradient_mb": s["gradient_mb"],
                  "optimizer_state_mb": s["optimizer_state_mb"], "loss": train[-1]["loss"],
                  "comm_mb": train[-1]["comm_bytes"] / 2**20}))
PYEOF
    done
  done
done
$PY - "$rows" <<'PYEOF'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
print(f"{'model':5} {'data':>4} {'zero':>4} {'rank 0 peak MiB':>16} {'vs zero 0':>10} "
      f"{'samples/s':>10} {'vs zero 0':>10} {'params/grad/optim MiB':>22} {'sent MiB':>9}  last loss")
for r in rows:
    base = next(b for b in rows if b["model"] == r["model"] and b["data"] == r["data"] and b["zero"] == 0)
    state = f"{r['parameters_mb']:.0f}/{r['gradient_mb']:.0f}/{r['optimizer_state_mb']:.0f}"
    print(f"{r['model']:5} {r['data']:4} {r['zero']:4} {r['peak_rss_mb']:16.0f} "
          f"{r['peak_rss_mb'] / base['peak_rss_mb']:10.2f} {r['samples_per_s']:10.1f} "
          f"{r['samples_per_s'] / base['samples_per_s']:10.2f} {state:>22} {r['comm_mb']:9.1f}  {r['loss']:.6f}")
PYEOF
