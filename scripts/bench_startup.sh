#!/usr/bin/env bash
# A start's cost on a large token corpus: SIZE_GB of nanoGPT shards (random uint16 tokens,
# a vocabulary of 65536, 4 shards) and a small GPT, one step per start, an evaluation of
# 8 windows (train.eval_samples) so that neither training nor evaluation weighs. Reports,
# in one run, the time from the command to its first step's train line, for a first start
# on one process (it scans every shard and records the scan in the run directory), its
# resume (the record: no shard is read), a first start on two processes (each scans half
# the tokens), and its resume.
#   scripts/bench_startup.sh [SIZE_GB]      # default 4
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
SIZE_GB="${1:-4}"
OUT_DIR="${OUT_DIR:-/tmp/dtrain-bench-startup}"
[ -x "$ROOT/build/dtrain" ] || { echo "bench_startup: build dtrain first (scripts/setup.sh)" >&2; exit 2; }
mkdir -p "$OUT_DIR/data"
shard_mb=$((SIZE_GB * 1024 / 4))
for k in 0 1 2 3; do  # made once, kept between runs of the script
  f="$OUT_DIR/data/train_$k.bin"
  [ "$(stat -c %s "$f" 2>/dev/null || echo 0)" = $((shard_mb * 1024 * 1024)) ] ||
    head -c $((shard_mb * 1024 * 1024)) /dev/urandom > "$f"
done
cat > "$OUT_DIR/job.yaml" <<YAML
name: bench-startup
seed: 1
data: {dataset: tokens, path: '$OUT_DIR/data/train_*.bin', vocab: 65536, batch_size: 8, workers: 1}
model: {arch: gpt, layers: 2, heads: 2, dim: 32, vocab: 65536, seq_len: 64}
optimizer: {name: adamw, lr: 0.001}
train: {eval_every: 1, eval_samples: 8, eval_batch_size: 8, log_every: 1}
checkpoint: {every_steps: 1}
YAML
rm -rf "$OUT_DIR"/run-*
start() {  # label, run dir, steps, extra args...
  local label=$1 dir=$2 steps=$3; shift 3
  local t0
  t0=$(date +%s.%N)
  "$ROOT/build/dtrain" run "$OUT_DIR/job.yaml" --run-dir "$dir" --set train.max_steps="$steps" \
    --set logging.progress=off "$@" > "$OUT_DIR/$label.log" 2>&1 ||
    { tail -n 5 "$OUT_DIR/$label.log" >&2; exit 1; }
  /usr/bin/python3 - "$dir" "$t0" "$label" "$steps" <<'PYEOF'
import json, sys
run, t0, label, step = sys.argv[1], float(sys.argv[2]), sys.argv[3], int(sys.argv[4])
line = next(j for j in map(json.loads, open(run + "/metrics.jsonl"))
            if j["kind"] == "train" and j["step"] == step)
print(f"{label:28} {line['time'] - t0:8.1f} s")
PYEOF
}
# The shards are in the page cache (just written, or read by the last run): a cold read
# from disk would make the first starts slower still, not the resumes.
echo "$SIZE_GB GB of token shards: from the command to its first step's line"
start "1 process, first start" "$OUT_DIR/run-1" 1
start "1 process, resume" "$OUT_DIR/run-1" 2 --resume auto
start "2 processes, first start" "$OUT_DIR/run-2" 1 --nproc 2
start "2 processes, resume" "$OUT_DIR/run-2" 2 --nproc 2 --resume auto
