#!/usr/bin/env bash
# Elastic training under the real torchrun: two agents on this machine (--nnodes 1:2, the
# c10d rendezvous).
#  1. Join, two workers per agent: agent A trains alone at world 2; agent B joins. torchrun
#     stops A's workers (dtrain writes a checkpoint) and starts all four at world 4 with the
#     same restart count; they resume from that checkpoint, as workers of the same elastic
#     run, and complete: both agents exit 0, every step is logged once, the summary says
#     world_size 4, and the losses after the join are those of a run resumed at world 4
#     from the same checkpoint by hand. (Each agent's workers are fewer than the world:
#     rank 0's store must listen beyond loopback, decided before it listens.)
#  2. Leave, one worker per agent: C and D train at world 2; D's agent and worker are
#     killed. C's worker fails (exit 4), C restarts it at world 1 (--max_restarts 1), it
#     resumes and completes: every step logged once, world_size 1.
# Exit 77 (skipped) without .venv's torch. Usage: test_elastic.sh DTRAIN_BINARY
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
dtrain=$(realpath "$1")
py=${DTRAIN_PYTHON:-$root/.venv/bin/python}   # today's torch, pinned (scripts/setup.sh --test)
$py -c 'import torch.distributed.run' 2>/dev/null || { echo "no torchrun at $py: run scripts/setup.sh --test"; exit 77; }
# torch 2.x's c10d rendezvous serves its store at this node's hostname: a host whose name
# does not resolve (a bare chroot without /etc/hosts, as the Debian 13 CI root) cannot run it.
getent hosts "$(hostname)" > /dev/null ||
  { echo "this host's name '$(hostname)' does not resolve: torchrun's c10d rendezvous needs it"; exit 77; }
work=$(mktemp -d /tmp/dtrain-elastic-test.XXXXXX)
trap 'kill -9 $(jobs -p) 2>/dev/null; [ -n "${KEEP:-}" ] || rm -rf "$work"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }
killtree() { local c; for c in $(pgrep -P "$1"); do killtree "$c"; done; kill -9 "$1" 2>/dev/null; }
port() { $py -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
listening() {  # PORT: a socket listens on it (/proc/net/tcp's state 0A), no connection made
  grep -qE ":$(printf '%04X' "$1") [0-9A-F]+:0000 0A " /proc/net/tcp /proc/net/tcp6 2>/dev/null
}
last_step() {  # the newest step in a run's metrics, or 0
  tail -n 1 "$1/metrics.jsonl" 2>/dev/null |
    $py -c 'import json,sys; print(json.loads(sys.stdin.read()).get("step", 0))' 2>/dev/null || echo 0
}
wait_for_step() {  # RUN_DIR STEP AGENT_PID: up to 120 s, while the agent lives
  for _ in $(seq 1 1200); do
    [ "$(last_step "$1")" -ge "$2" ] && return 0
    kill -0 "$3" 2>/dev/null || return 1
    sleep 0.1
  done
  return 1
}
# A constant learning rate: a resume by hand that stops early follows the same losses.
common=(--set model.hidden=[256,256] --set schedule.decay=constant --set train.log_every=10
        --set checkpoint.keep_last=100 --set dist.timeout_s=30)
# The join: rank 0 sleeps 10 ms a step, so that any machine is still short of the last step
# when B has joined (four workers on two cores run ~100 steps/s; two would run 450).
join_steps=2500
join_job=(run "$here/job.yaml" --set train.max_steps=$join_steps "${common[@]}"
          --set checkpoint.every_steps=250 --set train.debug_slow_rank=0 --set train.debug_slow_ms=10)
leave_steps=8000
leave_job=(run "$here/job.yaml" --set train.max_steps=$leave_steps "${common[@]}"
           --set checkpoint.every_steps=500)
agent() {  # ID RDZV_PORT MAX_RESTARTS LAST_CALL_S LOG RUN_DIR NPROC_PER_NODE JOB...
  local id=$1 port=$2 restarts=$3 last_call=$4 log=$5 dir=$6 nproc=$7
  shift 7
  timeout 300 "$py" "$root/scripts/torchrun" --nnodes 1:2 --nproc_per_node "$nproc" --rdzv_backend c10d \
    --rdzv_endpoint "127.0.0.1:$port" --rdzv_id "$id" --rdzv_conf last_call_timeout="$last_call" \
    --max_restarts "$restarts" --no_python "$dtrain" "$@" --run-dir "$dir" > "$log" 2>&1
}
each_step_once() {  # RUN_DIR WORLD_SIZE STEPS
  $py - "$1/metrics.jsonl" "$3" "$2" <<'PYEOF'
import json, sys
lines = [json.loads(l) for l in open(sys.argv[1])]
steps, world = int(sys.argv[2]), int(sys.argv[3])
train = [l["step"] for l in lines if l["kind"] == "train"]
s = lines[-1]
assert s["kind"] == "summary" and s["status"] == "completed" and s["steps"] == steps, s
assert s["world_size"] == world, s["world_size"]
assert train == list(range(10, steps + 1, 10)), "steps logged more than once or missing"
print(f"completed {steps} steps at world size {world}, each logged once")
PYEOF
}

# 1. Join.
p=$(port)
agent join "$p" 0 1 "$work/a.out" "$work/join" 2 "${join_job[@]}" &
a=$!
wait_for_step "$work/join" 300 $a || { cat "$work/a.out"; fail "agent A did not start training"; }
agent join "$p" 0 1 "$work/b.out" "$work/join" 2 "${join_job[@]}" &
b=$!
wait $a; ra=$?
wait $b; rb=$?
tail -n 5 "$work/a.out"
[ $ra -eq 0 ] && [ $rb -eq 0 ] || { tail -n 30 "$work/a.out" "$work/b.out"; fail "after a join the agents exited $ra and $rb"; }
at=$(sed -n 's/.*resumed at step \([0-9]*\).*/\1/p' "$work/a.out" "$work/b.out" | head -n 1)
[ -n "$at" ] || fail "the workers did not resume after the join"
each_step_once "$work/join" 4 $join_steps || fail "the joined run's log is not one run"
# The same checkpoint resumed at world 4 by hand: the same losses for 300 steps after it.
mkdir -p "$work/hand/checkpoints"
ckpt=$(printf 'step-%08d' "$at")
cp -r "$work/join/checkpoints/$ckpt" "$work/hand/checkpoints/"
echo "$ckpt" > "$work/hand/checkpoints/latest"
# (A multiple of log_every: the last step is logged whatever its number.)
timeout 300 "$dtrain" "${join_job[@]}" --set train.max_steps=$(((at + 300) / 10 * 10)) --set train.debug_slow_ms=0 \
  --run-dir "$work/hand" --nproc 4 --resume auto > "$work/hand.out" 2>&1 ||
  { tail -n 20 "$work/hand.out"; fail "resuming by hand at world 4 failed"; }
$py - "$work/join/metrics.jsonl" "$work/hand/metrics.jsonl" "$at" <<'PYEOF' || fail "the losses after the join differ from a resume by hand"
import json, sys
def losses(p): return {l["step"]: l["loss"] for l in map(json.loads, open(p)) if l["kind"] == "train"}
a, b, at = losses(sys.argv[1]), losses(sys.argv[2]), int(sys.argv[3])
after = [s for s in b if s > at]
assert after and all(s in a for s in after)
worst = max(abs(a[s] - b[s]) / abs(b[s]) for s in after)
print(f"joined at step {at}: {len(after)} logged steps after it, largest relative difference "
      f"from a resume by hand {worst:.1e}")
assert worst <= 1e-6
PYEOF

# 2. Leave. Agent C starts first and hosts the rendezvous (torchrun's c10d backend lives
# in the first agent: that one going away ends every agent); D joins it. C's rendezvous
# waits up to 20 s for D (last call) rather than 1: with 1 s, a D slow to import torch on a
# loaded machine found C training alone at world 1 (1500 steps/s), joined near the end,
# and the run finished before the leave (seen once in CI). The restart after the leave
# waits its 20 s too.
leave_call=20
p=$(port)
agent leave "$p" 1 $leave_call "$work/c.out" "$work/leave" 1 "${leave_job[@]}" &
c=$!
# D starts once C's store listens: a fixed delay let a slow start of C's torchrun (Python
# importing torch on a loaded machine) make D the host, and killing D then ended C too.
for _ in $(seq 1 600); do  # up to 60 s
  listening "$p" && break
  kill -0 $c 2>/dev/null || { cat "$work/c.out"; fail "agent C exited before its rendezvous listened"; }
  sleep 0.1
done
listening "$p" || { cat "$work/c.out"; fail "agent C's rendezvous store did not listen on port $p"; }
agent leave "$p" 1 $leave_call "$work/d.out" "$work/leave" 1 "${leave_job[@]}" &
d=$!
for _ in $(seq 1 1200); do  # up to 120 s for both to train together
  grep -qs "world 2 (" "$work/c.out" "$work/d.out" && break
  sleep 0.1
done
# grep the files, not `cat | grep -q`: under pipefail, grep leaving at its first match
# while cat still writes a large log makes the pipeline fail (SIGPIPE).
grep -qs "world 2 (" "$work/c.out" "$work/d.out" ||
  { tail -n 20 "$work/c.out" "$work/d.out"; fail "the agents did not train at world 2"; }
from=$(last_step "$work/leave")  # on past a checkpoint written at world 2
to=$(( (from / 500 + 1) * 500 + 100 ))
[ $to -lt $leave_steps ] ||
  { grep -h "world [12] (" "$work/c.out" "$work/d.out"; fail "world 2 began at step $from: too late to leave before step $leave_steps"; }
wait_for_step "$work/leave" $to $c || { tail -n 20 "$work/c.out"; fail "no progress at world 2 (from step $from to $to)"; }
# Agent D and its worker go away at once, as a node that fails does.
killtree "$d"
wait $c; rc=$?
tail -n 5 "$work/c.out"
[ $rc -eq 0 ] || { tail -n 30 "$work/c.out"; fail "after a node left, the surviving agent exited $rc"; }
grep -q "resumed at step" "$work/c.out" || fail "the surviving worker did not resume"
each_step_once "$work/leave" 1 $leave_steps || fail "the run after a leave is not one run"
echo "elastic: join and leave ok"
