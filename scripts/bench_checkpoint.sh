#!/usr/bin/env bash
# What checkpoints cost training, synchronous against checkpoint.async, in one run: a GPT of
# 51M parameters (dim 512, 8 layers, vocabulary 50304) with AdamW, so that each checkpoint
# holds about 0.6 GB (weights and two moments), saved every SAVE_EVERY steps on one process
# (threads: 1, so that the background writer has the other core). Reports, for each, the
# run's wall time, the time saves held training up (the summary's checkpoint_stall_ms) and
# its mean per save, and async's ratios to sync. The checkpoints of both are compared byte
# for byte (the same state must be written either way).
#   scripts/bench_checkpoint.sh [STEPS] [SAVE_EVERY]     # default 12 steps, a save every 3
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
STEPS="${1:-12}"
EVERY="${2:-3}"
OUT_DIR="${OUT_DIR:-/tmp/dtrain-bench-checkpoint}"
PY=/usr/bin/python3
[ -x "$ROOT/build/dtrain" ] || { echo "bench_checkpoint: build dtrain first (scripts/setup.sh)" >&2; exit 2; }
rm -rf "$OUT_DIR"
mkdir -p "$OUT_DIR"
job=$OUT_DIR/job.yaml
cat > "$job" <<YAML
name: bench-checkpoint
seed: 1
data: {dataset: synthetic_tokens, samples: 256, test_samples: 4, seq_len: 128, batch_size: 2, workers: 1}
model: {arch: gpt, layers: 8, heads: 8, dim: 512, vocab: 50304, seq_len: 128}
optimizer: {name: adamw, lr: 0.0003}
schedule: {decay: constant}
train: {max_steps: $STEPS, log_every: 1, eval_every: 100000, threads: 1}
checkpoint: {every_steps: $EVERY, keep_last: 100}
YAML
run() {  # label, extra args...
  local label=$1; shift
  local t0 t1
  t0=$(date +%s.%N)
  "$ROOT/build/dtrain" run "$job" --run-dir "$OUT_DIR/$label" --set logging.progress=off "$@" \
    > "$OUT_DIR/$label.log" 2>&1 || { tail -n 5 "$OUT_DIR/$label.log" >&2; exit 1; }
  t1=$(date +%s.%N)
  echo "$label $t0 $t1" >> "$OUT_DIR/times"
}
run sync
run async --set checkpoint.async=true
for f in "$OUT_DIR"/sync/checkpoints/step-*/*.safetensors "$OUT_DIR"/sync/checkpoints/step-*/trainer.json; do
  cmp -s "$f" "${f/\/sync\//\/async\/}" || { echo "bench_checkpoint: $f differs under async" >&2; exit 1; }
done
"$PY" - "$OUT_DIR" "$STEPS" "$EVERY" <<'PYEOF'
import json, sys
out, steps, every = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
times = {l.split()[0]: float(l.split()[2]) - float(l.split()[1]) for l in open(out + "/times")}
saves = steps // every + (steps % every != 0)
rows = {}
for who in ("sync", "async"):
    lines = [json.loads(l) for l in open(f"{out}/{who}/metrics.jsonl")]
    s = lines[-1]
    train = [l for l in lines if l["kind"] == "train"]
    rows[who] = (times[who], s["checkpoint_stall_ms"] / 1000, s["step_ms_median"] / 1000,
                 train[-1]["peak_rss_mb"])
print(f"{steps} steps, a checkpoint every {every} ({saves} saves, the last one synchronous under async too)")
print(f"{'':6} {'wall s':>8} {'stalled s':>10} {'per save s':>11} {'step s':>7} {'peak MiB':>9}")
for who, (wall, stall, step, rss) in rows.items():
    print(f"{who:6} {wall:8.1f} {stall:10.2f} {stall / saves:11.2f} {step:7.2f} {rss:9.0f}")
(sw, ss, _, _), (aw, as_, _, _) = rows["sync"], rows["async"]
print(f"async/sync: wall {aw / sw:.2f}x, stalled {as_ / ss:.2f}x; the checkpoints are identical")
PYEOF
