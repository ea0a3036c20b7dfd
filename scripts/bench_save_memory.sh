#!/usr/bin/env bash
# Rank 0's peak memory with GPT-2 small's shape (configs/gpt2_small.yaml: 124M parameters,
# AdamW) for a two-step run that writes its checkpoint, on one process, at pipeline 2 and
# at tensor 2, and at data 2 with ZeRO 0, 1, 2 and 3, in one run. Every rank writes only what
# it holds (model.ppN.tpT parts; under ZeRO its optimizer.dpD shard, under ZeRO-3 its
# model.dpD shard too; nothing gathered), so
# rank 0's peak follows its share of the model and of the optimizer state. "vs training":
# the peak with the checkpoint written against training's own (the last train line's). Short sequences
# (128 tokens, batch 2) keep activations small beside the model state; CPU, fp32.
#   scripts/bench_save_memory.sh
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
OUT_DIR="${OUT_DIR:-/tmp/dtrain-bench-save-memory}"
PY=/usr/bin/python3
[ -x "$ROOT/build/dtrain" ] || { echo "bench_save_memory: build dtrain first (scripts/setup.sh)" >&2; exit 2; }
mkdir -p "$OUT_DIR"
rows=$OUT_DIR/bench_save_memory.jsonl
: > "$rows"
run() {  # label, extra args...
  local label=$1; shift
  rm -rf "$OUT_DIR/run"
  "$ROOT/build/dtrain" run "$ROOT/configs/gpt2_small.yaml" --run-dir "$OUT_DIR/run" \
    --set data.batch_size=2 --set data.seq_len=128 --set model.seq_len=128 \
    --set data.samples=64 --set train.max_steps=2 --set train.eval_every=0 \
    --set train.threads=1 --set logging.progress=off "$@" > "$OUT_DIR/$label.log" 2>&1 ||
    { tail -n 5 "$OUT_DIR/$label.log" >&2; exit 1; }
  $PY - "$label" "$OUT_DIR/run" >> "$rows" <<'PYEOF'
import json, os, sys
run = sys.argv[2]
s = [json.loads(l) for l in open(run + "/metrics.jsonl")][-1]
ck = os.path.join(run, "checkpoints", open(run + "/checkpoints/latest").read().strip())
parts = sorted(f for f in os.listdir(ck) if f.endswith(".safetensors"))
train = [l for l in map(json.loads, open(run + "/metrics.jsonl")) if l["kind"] == "train"]
print(json.dumps({"who": sys.argv[1], "peak_rss_mb": s["peak_rss_mb"],
                  "train_peak_mb": train[-1]["peak_rss_mb"], "parts": parts}))
PYEOF
}
run "1 process"
run "pipeline 2" --nproc 2 --set parallel.pipeline=2
run "tensor 2" --nproc 2 --set parallel.tensor=2
run "data 2" --nproc 2
run "data 2 zero 1" --nproc 2 --set parallel.zero=1
run "data 2 zero 2" --nproc 2 --set parallel.zero=2
run "data 2 zero 3" --nproc 2 --set parallel.zero=3
run "data 4 zero 1" --nproc 4 --set parallel.zero=1 --set data.batch_size=4
$PY - "$rows" <<'PYEOF'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
base = rows[0]["peak_rss_mb"]
print(f"{'layout':14} {'rank 0 peak MiB':>16} {'vs 1 process':>13} {'vs training':>12}  files written")
for r in rows:
    print(f"{r['who']:14} {r['peak_rss_mb']:16.0f} {r['peak_rss_mb'] / base:13.2f} "
          f"{r['peak_rss_mb'] / r['train_peak_mb']:12.2f}  {' '.join(r['parts'])}")
PYEOF
