# Sourced by the launcher tests. check_run RUN_DIR: it holds a completed two-rank run.
# same_losses PY REF_DIR RUN_DIR STEPS TOLERANCE LABEL: both runs logged the same STEPS
# steps, every loss within TOLERANCE (relative) of REF_DIR's.
check_run() {
  local run_dir=$1 last
  last=$(tail -n 1 "$run_dir/metrics.jsonl")
  echo "summary: $last"
  grep -q '"kind":"summary"' <<<"$last" || { echo "FAIL: no summary line" >&2; return 1; }
  grep -q '"status":"completed"' <<<"$last" || { echo "FAIL: not completed" >&2; return 1; }
  grep -q '"world_size":2' <<<"$last" || { echo "FAIL: world_size is not 2" >&2; return 1; }
  grep -q '"steps":30' <<<"$last" || { echo "FAIL: not 30 steps" >&2; return 1; }
  [ -f "$run_dir/checkpoints/step-00000030/manifest.json" ] || { echo "FAIL: no checkpoint" >&2; return 1; }
}

same_losses() {
  "$1" - "$2/metrics.jsonl" "$3/metrics.jsonl" "$4" "$5" "$6" <<'PYEOF'
import json, sys
def losses(p): return {l["step"]: l["loss"] for l in map(json.loads, open(p)) if l["kind"] == "train"}
a, b = losses(sys.argv[1]), losses(sys.argv[2])
steps, tolerance, label = int(sys.argv[3]), float(sys.argv[4]), sys.argv[5]
assert len(a) == steps and a.keys() == b.keys(), (len(a), len(b))
worst = max(abs(a[s] - b[s]) / abs(a[s]) for s in a)
print(f"{steps} logged steps, largest relative difference from {label}: {worst:.2e}")
assert worst <= tolerance
PYEOF
}
