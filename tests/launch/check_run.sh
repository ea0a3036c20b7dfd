# Sourced by the launcher tests: checks that RUN_DIR holds a completed two-rank run.
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
