#!/usr/bin/env bash
# What checkpoints cost training, synchronous against checkpoint.async, in one run, on
# GPT-2 small's shape (configs/gpt2_small.yaml: 124M parameters, AdamW, so each
# checkpoint holds about 1.5 GB: weights and two moments) with 128-token windows, batch 2,
# one process (threads: 1, so that the background writer has the other core). Three runs
# of STEPS steps: a checkpoint every EVERY steps written synchronously, the same under
# checkpoint.async, and one that saves only at the end (every run's last save is
# synchronous). Reports each run's wall time, the time its saves held training up (the
# summary's checkpoint_stall_ms), and what saving every EVERY steps added to the wall time
# over the end-only run, with async's ratios to sync. The two runs' checkpoints are
# compared byte for byte (the same state must be written either way).
#   scripts/bench_checkpoint.sh [STEPS] [EVERY] [--set KEY=VALUE]...   # default 16, 2
# (e.g. --set train.device=cuda on a GPU, where the copy goes to pinned memory)
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
STEPS="${1:-16}"
EVERY="${2:-2}"
shift $(($# < 2 ? $# : 2))
EXTRA=("$@")
OUT_DIR="${OUT_DIR:-/tmp/dtrain-bench-checkpoint}"
PY=/usr/bin/python3
[ -x "$ROOT/build/dtrain" ] || { echo "bench_checkpoint: build dtrain first (scripts/setup.sh)" >&2; exit 2; }
rm -rf "$OUT_DIR"
mkdir -p "$OUT_DIR"
run() {  # label, extra args...
  local label=$1; shift
  local t0 t1
  t0=$(date +%s.%N)
  "$ROOT/build/dtrain" run "$ROOT/configs/gpt2_small.yaml" --run-dir "$OUT_DIR/$label" \
    --set data.batch_size=2 --set data.seq_len=128 --set model.seq_len=128 \
    --set data.samples=256 --set train.max_steps="$STEPS" --set train.eval_every=100000 \
    --set train.threads=1 --set checkpoint.keep_last=100 --set logging.progress=off \
    ${EXTRA[@]+"${EXTRA[@]}"} "$@" \
    > "$OUT_DIR/$label.log" 2>&1 || { tail -n 5 "$OUT_DIR/$label.log" >&2; exit 1; }
  t1=$(date +%s.%N)
  echo "$label $t0 $t1" >> "$OUT_DIR/times"
}
run end-only --set checkpoint.every_steps=100000
run sync --set checkpoint.every_steps="$EVERY"
run async --set checkpoint.every_steps="$EVERY" --set checkpoint.async=true
for f in "$OUT_DIR"/sync/checkpoints/step-*/*.safetensors "$OUT_DIR"/sync/checkpoints/step-*/trainer.json; do
  cmp -s "$f" "${f/\/sync\//\/async\/}" || { echo "bench_checkpoint: $f differs under async" >&2; exit 1; }
done
"$PY" - "$OUT_DIR" "$STEPS" "$EVERY" <<'PYEOF'
import json, sys
out, steps, every = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
times = {l.split()[0]: float(l.split()[2]) - float(l.split()[1]) for l in open(out + "/times")}
saves = steps // every + (steps % every != 0)
rows = {}
for who in ("end-only", "sync", "async"):
    lines = [json.loads(l) for l in open(f"{out}/{who}/metrics.jsonl")]
    s = lines[-1]
    rows[who] = (times[who], s["checkpoint_stall_ms"] / 1000, s["step_ms_median"] / 1000,
                 s["peak_rss_mb"])
base = rows["end-only"][0]
print(f"GPT-2 small's shape, {steps} steps, a checkpoint every {every} ({saves} saves; "
      "every run's last one synchronous)")
print(f"{'':9} {'wall s':>8} {'stalled s':>10} {'added s':>8} {'step s':>7} {'peak MiB':>9}")
for who, (wall, stall, step, rss) in rows.items():
    print(f"{who:9} {wall:8.1f} {stall:10.2f} {wall - base:8.1f} {step:7.2f} {rss:9.0f}")
(sw, ss, _, _), (aw, as_, _, _) = rows["sync"], rows["async"]
print(f"async/sync: time held up {as_ / ss:.2f}x, wall time added {(aw - base) / (sw - base):.2f}x; "
      "the checkpoints are identical")
PYEOF
