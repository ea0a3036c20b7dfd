#!/usr/bin/env bash
# dtrain under the real torchrun (.venv's torch, through scripts/torchrun):
#  1. two workers join torchrun's agent store, complete with world size 2, and train the
#     same per-step losses as `dtrain run --nproc 2`;
#  2. a worker killed mid-run with --max-restarts 1: torchrun restarts both, they resume
#     from the newest checkpoint, the job ends at max_steps with each step logged once;
#  3. a worker that fails reports its one-line error through TORCHELASTIC_ERROR_FILE, and
#     its exit code, to torchrun's summary.
# Exit 77 (skipped) without .venv's torch. Usage: test_torchrun.sh DTRAIN_BINARY
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
dtrain=$1
py=${DTRAIN_PYTHON:-$root/.venv/bin/python}   # today's torch, pinned (scripts/setup.sh --test)
$py -c 'import torch.distributed.run' 2>/dev/null || { echo "no torchrun at $py: run scripts/setup.sh --test"; exit 77; }
work=$(mktemp -d /tmp/dtrain-torchrun-test.XXXXXX)
trap 'kill $(jobs -p) 2>/dev/null; rm -rf "$work"' EXIT
source "$here/check_run.sh"
fail() { echo "FAIL: $*" >&2; exit 1; }
port() { $py -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
torchrun() { timeout 300 "$py" "$root/scripts/torchrun" --nproc_per_node 2 --master_port "$(port)" "$@"; }

# 1. The same run as --nproc 2.
timeout 300 "$dtrain" run "$here/job.yaml" --nproc 2 --run-dir "$work/ref" --set train.log_every=1 \
  > "$work/ref.out" 2>&1 || { cat "$work/ref.out"; fail "--nproc 2 exited $?"; }
torchrun --no_python "$dtrain" run "$here/job.yaml" --run-dir "$work/run" --set train.log_every=1 \
  > "$work/run.out" 2>&1
rc=$?
cat "$work/run.out"
[ $rc -eq 0 ] || fail "torchrun exited $rc"
grep -q "launcher env" "$work/run.out" || fail "ranks not taken from torchrun's variables"
check_run "$work/run" || exit 1
same_losses "$py" "$work/ref" "$work/run" 30 1e-6 "--nproc 2" || fail "losses differ from --nproc 2"

# 2. Kill rank 1 mid-run; torchrun restarts both workers once.
steps=3000
torchrun --max_restarts 1 --no_python "$dtrain" run "$here/job.yaml" --run-dir "$work/kill" \
  --set train.max_steps=$steps --set checkpoint.every_steps=200 > "$work/kill.out" 2>&1 &
agent=$!
victim=""
for _ in $(seq 1 600); do   # up to 60 s for the run to pass step 400
  step=$(tail -n 1 "$work/kill/metrics.jsonl" 2>/dev/null | $py -c 'import json,sys; print(json.loads(sys.stdin.read()).get("step", 0))' 2>/dev/null || echo 0)
  if [ "${step:-0}" -ge 400 ]; then
    for p in /proc/[0-9]*; do   # the worker of rank 1, first attempt
      tr '\0' '\n' < "$p/environ" 2>/dev/null | grep -qx "RANK=1" || continue
      tr '\0' '\n' < "$p/environ" 2>/dev/null | grep -qx "TORCHELASTIC_RESTART_COUNT=0" || continue
      tr '\0' ' ' < "$p/cmdline" 2>/dev/null | grep -q "$work/kill" || continue
      victim=${p#/proc/}
    done
    break
  fi
  sleep 0.1
done
[ -n "$victim" ] || { cat "$work/kill.out"; fail "no worker of rank 1 to kill (step ${step:-0})"; }
echo "killing rank 1 (pid $victim) at step $step"
kill -9 "$victim"
wait $agent
rc=$?
tail -n 30 "$work/kill.out"
[ $rc -eq 0 ] || fail "torchrun with --max_restarts 1 exited $rc after a killed worker"
grep -q "resumed at step" "$work/kill.out" || fail "the restarted workers did not resume"
$py - "$work/kill/metrics.jsonl" $steps <<'PYEOF' || fail "the restarted run's log is not one run"
import json, sys
lines = [json.loads(l) for l in open(sys.argv[1])]
steps = int(sys.argv[2])
train = [l["step"] for l in lines if l["kind"] == "train"]
assert lines[-1]["kind"] == "summary" and lines[-1]["steps"] == steps, lines[-1]
assert train == list(range(10, steps + 1, 10)), "steps logged more than once or missing"
print(f"completed {steps} steps after a restart, each logged once")
PYEOF

# 3. A failing worker: its error and exit code reach torchrun's summary.
torchrun --no_python "$dtrain" run "$here/job.yaml" --run-dir "$work/bad" \
  --set data.dataset=mnist --set data.path="$work/nowhere" > "$work/bad.out" 2>&1
rc=$?
cat "$work/bad.out"
[ $rc -ne 0 ] || fail "torchrun exited 0 although the workers failed"
grep -q "exitcode *: 3" "$work/bad.out" || fail "torchrun does not report dtrain's exit code 3"
grep -q "traceback *: dtrain: error: data.path" "$work/bad.out" || fail "torchrun's summary does not show dtrain's error"
echo "PASS"
