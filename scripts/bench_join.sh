#!/usr/bin/env bash
# What one live recovery costs the replica that joins, at GPT-2 small's shape (124M
# weights, 1.5 GB of state with AdamW's moments; a 256-token window per process): a
# fault-tolerant job of 2 replicas (`--nproc 2 --max-restarts`), replica 1 killed as step 3
# starts (fault_tolerance.debug_kill_*) and restarted by the supervisor, 6 steps. Per run:
# the joiner's own account (its start and build, the wait for the others' vote, the
# state's transfer and load, its hash, from its process's start to joining) and every
# process's peak resident memory (VmHWM, polled every 0.2 s), the joiner's against its
# peers'. With --baseline BIN the two binaries run alternately (A B B A, --repeats pairs),
# in one run, so a change is measured against the binary before it.
#   scripts/bench_join.sh [--baseline BIN] [--repeats N]
# DTRAIN_BIN=PATH measures another binary. Results: $OUT_DIR/join.jsonl.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
OUT_DIR="${OUT_DIR:-/tmp/dtrain-bench-join}"
BIN="${DTRAIN_BIN:-$ROOT/build/dtrain}"
BASE="" REPEATS=1
while [ $# -gt 0 ]; do
  case "$1" in
    --baseline) BASE=$2; shift 2 ;;
    --repeats) REPEATS=$2; shift 2 ;;
    *) echo "usage: scripts/bench_join.sh [--baseline BIN] [--repeats N]" >&2; exit 2 ;;
  esac
done
for b in "$BIN" ${BASE:+"$BASE"}; do
  [ -x "$b" ] || { echo "bench_join.sh: no dtrain at $b (scripts/setup.sh builds it)" >&2; exit 2; }
done
mkdir -p "$OUT_DIR"
: > "$OUT_DIR/join.jsonl"
export OMP_NUM_THREADS=1

# LABEL BIN RUN_DIR: one job, its processes' peaks polled while it runs; one JSON line.
one() {
  local label=$1 bin=$2 dir=$3
  rm -rf "$dir" "$dir.log"
  "$bin" run "$ROOT/configs/gpt2_small.yaml" --run-dir "$dir" --nproc 2 --max-restarts 2 \
    --set fault_tolerance.mode=replicas --set fault_tolerance.debug_kill_rank=1 \
    --set fault_tolerance.debug_kill_step=3 --set model.seq_len=256 --set data.batch_size=2 \
    --set train.eval_batch_size=1 --set data.test_samples=2 --set train.max_steps=6 \
    --set train.eval_every=6 --set logging.progress=off --set checkpoint.every_steps=0 \
    > "$dir.log" 2>&1 &
  local job=$! p h
  declare -A peak=() first=()
  local seen=0
  while kill -0 "$job" 2>/dev/null; do
    for p in $(pgrep -P "$job" 2>/dev/null); do  # the supervisor's ranks, each restart too
      h=$(awk '/^VmHWM/{print $2}' "/proc/$p/status" 2>/dev/null || true)
      [ -n "$h" ] || continue
      [ -n "${first[$p]:-}" ] || { first[$p]=$seen; seen=$((seen + 1)); }
      [ "${peak[$p]:-0}" -ge "$h" ] || peak[$p]=$h
    done
    sleep 0.2
  done
  wait "$job" || { echo "bench_join.sh: the $label run failed (see $dir.log)" >&2; return 1; }
  # The ranks in the order they were first seen: the two first, then the joiner.
  local peaks=""
  for p in "${!first[@]}"; do peaks+="${first[$p]} ${peak[$p]}"$'\n'; done
  /usr/bin/python3 - "$label" "$dir.log" "$peaks" <<'EOF' | tee -a "$OUT_DIR/join.jsonl"
import json, re, sys
label, log, peaks = sys.argv[1], sys.argv[2], sys.argv[3]
kb = [int(k) for _, k in sorted(tuple(map(int, l.split())) for l in peaks.split("\n") if l)]
m = [re.search(r"joined at step \d+, ([\d.]+) s after its process began: built in ([\d.]+) s, "
               r"admitted ([\d.]+) s later.* of state.* in ([\d.]+) s, hashed it in ([\d.]+) s", l)
     for l in open(log, errors="replace")]
m = [x for x in m if x]
row = {"binary": label}
if m:
    row.update(zip(["rejoin_s", "built_s", "admitted_s", "state_s", "hash_s"],
                   map(float, m[0].groups())))
if len(kb) >= 3:
    row.update(joiner_peak_mb=round(kb[-1] / 1024), peers_peak_mb=[round(k / 1024) for k in kb[:2]])
print(json.dumps(row))
EOF
}

for i in $(seq "$REPEATS"); do
  one new "$BIN" "$OUT_DIR/new-a$i"
  [ -z "$BASE" ] || { one baseline "$BASE" "$OUT_DIR/base-b$i"; one baseline "$BASE" "$OUT_DIR/base-c$i"; }
  [ -z "$BASE" ] || one new "$BIN" "$OUT_DIR/new-d$i"
done
