#!/usr/bin/env bash
# fault_tolerance: replicas under the real torchrun, one agent a replica, the job's store at
# a `dtrain lighthouse` (docs/fault-tolerance.md):
#  1. two replicas; replica 1's worker killed at step 6 (fault_tolerance.debug_kill_rank):
#     replica 0 trains on without a restart, torchrun restarts replica 1's worker alone
#     (restart count 1), it joins with replica 0's state (no checkpoint read), and the run
#     logs one process's losses on the same global batch, each step once;
#  2. replica 1's worker stopped (SIGSTOP): the lighthouse kills it once its heartbeat is
#     stale, its agent restarts it, it joins, and the run completes;
#  3. scale-up: a job started with one replica (of up to two) is joined by the second;
#  4. a worker whose replica index the lighthouse does not serve fails with a clear line;
#  5. ZeRO-2 inside each replica of 2 data ranks (HSDP), started by
#     scripts/torchrun_replicas.sh (each agent as many workers as the lighthouse's replica
#     size): a rank of replica 1 killed, the replica restarted, its shards taken from
#     replica 0's ranks at their places, one process's losses;
#  6. local SGD (averages every 4 steps) under the same two agents: replica 1's worker
#     killed at step 6, replica 0 discards the interval since the average after step 4 and
#     trains it again alone, replica 1 restarts and joins at an average, each line once.
#  7. four replicas under two agents, two replicas each: replica 1's worker killed at step
#     6; its agent stops replica 0's worker (SIGTERM), which leaves the job after a step's
#     notice (the writer: replica 2 takes the run directory over), and restarts both, which
#     join replicas 2 and 3; those never restart, and the losses are one process's.
# Exit 77 (skipped) without .venv's torch. Usage: test_replicas.sh DTRAIN_BINARY
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
dtrain=$(realpath "$1")
py=${DTRAIN_PYTHON:-$root/.venv/bin/python}   # today's torch, pinned (scripts/setup.sh --test)
$py -c 'import torch.distributed.run' 2>/dev/null || { echo "no torchrun at $py: run scripts/setup.sh --test"; exit 77; }
work=$(mktemp -d /tmp/dtrain-replicas-test.XXXXXX)
# TERM, not KILL: `timeout` passes it on to the dtrain under it.
trap 'kill $(jobs -p) 2>/dev/null; [ -n "${KEEP:-}" ] || rm -rf "$work"' EXIT
source "$here/check_run.sh"
fail() { echo "FAIL: $*" >&2; exit 1; }
port() { $py -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
job=$work/job.yaml
cat > "$job" <<'EOF'
name: replicas-check
seed: 11
data: {dataset: synthetic, samples: 2048, test_samples: 256, input_shape: [1, 8, 8], classes: 4, batch_size: 30, workers: 1}
model: {arch: mlp, hidden: [64, 32]}
optimizer: {name: sgd, lr: 0.05, momentum: 0.9, weight_decay: 0.001}
schedule: {warmup_steps: 3, decay: cosine}
train: {max_steps: 300, log_every: 10, eval_every: 150, threads: 1}
dist: {timeout_s: 60}
logging: {progress: off}
fault_tolerance: {mode: replicas, heartbeat_s: 2}
EOF

# A lighthouse for two replicas, then one torchrun agent each (restarting its worker once);
# NAME's logs under $work. Waits for all three, bounded; sets rc0, rc1 and rcl.
run_job() {
  local name=$1; shift
  local lp; lp=$(port)
  timeout 200 "$dtrain" lighthouse "$job" --replicas 2 --port "$lp" > "$work/$name.lighthouse" 2>&1 &
  local lighthouse=$!
  local agents=()
  for r in 0 1; do
    DTRAIN_LIGHTHOUSE=127.0.0.1:$lp DTRAIN_REPLICA=$r timeout 200 "$py" "$root/scripts/torchrun" \
      --nproc_per_node 1 --max_restarts 1 --master_port "$(port)" --no_python \
      "$dtrain" run "$job" --run-dir "$work/$name" "$@" > "$work/$name.r$r" 2>&1 &
    agents+=($!)
  done
  echo "${agents[*]} $lighthouse" > "$work/$name.pids"
}
wait_job() {
  local name=$1 pids; read -r -a pids < "$work/$name.pids"
  wait "${pids[0]}"; rc0=$?
  wait "${pids[1]}"; rc1=$?
  wait "${pids[2]}"; rcl=$?
  for f in lighthouse r0 r1; do echo "--- $name.$f"; tail -n 25 "$work/$name.$f"; done
}
# RUN_DIR: the run logged one process's losses (the run in $work/one), each step once.
one_process_losses() { same_losses "$py" "$work/one" "$1" 30 1e-5 "one process"; }

# 1. A kill at step 6 of replica 1; one process's run is the reference.
timeout 200 "$dtrain" run "$job" --run-dir "$work/one" --set fault_tolerance.mode=off > "$work/one.out" 2>&1 ||
  { cat "$work/one.out"; fail "the one-process run failed"; }
run_job kill --set fault_tolerance.debug_kill_rank=1 --set fault_tolerance.debug_kill_step=6 \
  --set train.debug_slow_rank=0 --set train.debug_slow_ms=20
wait_job kill
[ $rc0 -eq 0 ] && [ $rc1 -eq 0 ] || fail "the agents exited $rc0 and $rc1"
[ $rcl -eq 0 ] || fail "the lighthouse exited $rcl"
grep -q "rank 1 (replica 1) has ended" "$work/kill.lighthouse" || fail "the lighthouse did not see rank 1 end"
grep -q "rank 1 (replica 1) runs again" "$work/kill.lighthouse" || fail "the lighthouse did not see rank 1 again"
grep -q "every rank has ended" "$work/kill.lighthouse" || fail "the lighthouse did not end with the job"
grep -q "replica(s) 1 joined at step" "$work/kill.r0" "$work/kill.r1" || fail "replica 1 did not join"
grep -q "no checkpoint read" "$work/kill.r0" "$work/kill.r1" || fail "the joiner's state did not come from its peer"
# torchrun's agents: replica 1's saw its worker fail (and restarted it: it ran again, above),
# replica 0's never did.
grep -q "failed (exitcode: -9)" "$work/kill.r1" || fail "replica 1's agent did not see its worker killed"
grep -q "failed (exitcode" "$work/kill.r0" && fail "replica 0's worker failed"
one_process_losses "$work/kill" || fail "the losses are not one process's"
tail -n 1 "$work/kill/metrics.jsonl" | grep -q '"status":"completed"' || fail "the run did not complete"
tail -n 1 "$work/kill/metrics.jsonl" | grep -q '"data":2' || fail "the run did not end with both replicas"

# 2. Replica 1's worker stopped once it trains: killed by the lighthouse, restarted, joined.
run_job stop --set train.max_steps=800 --set train.debug_slow_rank=0 --set train.debug_slow_ms=20
victim=""
for _ in $(seq 1 600); do  # up to 60 s for the run to train
  if grep -q '"step":20,' "$work/stop/metrics.jsonl" 2>/dev/null; then
    for p in /proc/[0-9]*; do
      { tr '\0' '\n' < "$p/environ"; } 2>/dev/null | grep -qx "DTRAIN_REPLICA=1" || continue
      { tr '\0' ' ' < "$p/cmdline"; } 2>/dev/null | grep -q "^$dtrain run" || continue
      victim=${p#/proc/}
    done
    break
  fi
  sleep 0.1
done
[ -n "$victim" ] || fail "no worker of replica 1 to stop"
kill -STOP "$victim"
wait_job stop
[ $rc0 -eq 0 ] && [ $rc1 -eq 0 ] && [ $rcl -eq 0 ] || fail "exits: agents $rc0 $rc1, lighthouse $rcl"
grep -q "rank 1 stopped answering (its heartbeat is stale): killed its process $victim" "$work/stop.lighthouse" ||
  fail "the lighthouse did not kill the stopped worker"
grep -q "replica(s) 1 joined at step" "$work/stop.r0" "$work/stop.r1" || fail "replica 1 did not join again"
tail -n 1 "$work/stop/metrics.jsonl" | grep -q '"status":"completed"' || fail "the run did not complete"

# 3. Scale-up: the job starts with one replica and may have two; replica 1 starts once
#    replica 0 trains, joins it with its state, and the run's losses stay one process's
#    (the global batch kept, dealt among more replicas).
lp=$(port)
timeout 200 "$dtrain" lighthouse "$job" --replicas 1 --max-replicas 2 --port "$lp" > "$work/up.lighthouse" 2>&1 &
lighthouse=$!
agent() {
  DTRAIN_LIGHTHOUSE=127.0.0.1:$lp DTRAIN_REPLICA=$1 timeout 200 "$py" "$root/scripts/torchrun" \
    --nproc_per_node 1 --master_port "$(port)" --no_python "$dtrain" run "$job" --run-dir "$work/up" \
    --set train.debug_slow_rank=0 --set train.debug_slow_ms=20 > "$work/up.r$1" 2>&1
}
agent 0 &
first=$!
for _ in $(seq 1 600); do grep -q '"step":20,' "$work/up/metrics.jsonl" 2>/dev/null && break; sleep 0.1; done
agent 1 &
second=$!
wait $first; rc0=$?
wait $second; rc1=$?
wait $lighthouse; rcl=$?
for f in up.lighthouse up.r0 up.r1; do echo "--- $f"; tail -n 8 "$work/$f"; done
[ $rc0 -eq 0 ] && [ $rc1 -eq 0 ] && [ $rcl -eq 0 ] || fail "scale-up exits: agents $rc0 $rc1, lighthouse $rcl"
grep -q "data 1 fault-tolerant replicas" "$work/up.r0" || fail "the job did not start with one replica"
grep -q "replica(s) 1 joined at step" "$work/up.r0" || fail "replica 1 did not join the running job"
tail -n 1 "$work/up/metrics.jsonl" | grep -q '"data":2' || fail "the run did not end with two replicas"
one_process_losses "$work/up" || fail "the scaled-up run's losses are not one process's"

# 4. A replica index the lighthouse does not serve.
lp=$(port)
timeout 60 "$dtrain" lighthouse "$job" --replicas 2 --port "$lp" > "$work/bad.lighthouse" 2>&1 &
lighthouse=$!
DTRAIN_LIGHTHOUSE=127.0.0.1:$lp DTRAIN_REPLICA=2 RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 LOCAL_WORLD_SIZE=1 \
  MASTER_ADDR=127.0.0.1 MASTER_PORT=$(port) timeout 60 "$dtrain" run "$job" --run-dir "$work/bad" > "$work/bad.out" 2>&1
rc=$?
cat "$work/bad.out"
kill "$lighthouse"; wait "$lighthouse"
[ $rc -eq 2 ] || fail "a replica index out of range exited $rc, not 2"
grep -q "DTRAIN_REPLICA: expected a replica from 0 to 1" "$work/bad.out" || fail "no clear line for DTRAIN_REPLICA"
# 5. HSDP through the script; the global batch a multiple of its 4 data ranks.
timeout 200 "$dtrain" run "$job" --run-dir "$work/one32" --set fault_tolerance.mode=off \
  --set data.batch_size=32 > "$work/one32.out" 2>&1 || { cat "$work/one32.out"; fail "the one-process run failed"; }
timeout 200 "$root/scripts/torchrun_replicas.sh" --replicas 2 --max-restarts 1 --python "$py" "$dtrain" "$job" \
  --run-dir "$work/hsdp" --set data.batch_size=32 --set parallel.zero=2 \
  --set fault_tolerance.replica_data=2 --set fault_tolerance.debug_kill_rank=3 \
  --set fault_tolerance.debug_kill_step=6 --set train.debug_slow_rank=0 --set train.debug_slow_ms=20 \
  > "$work/hsdp.out" 2>&1
rc=$?
grep -v '"step"\|step [0-9]' "$work/hsdp.out" | tail -n 25
[ $rc -eq 0 ] || fail "torchrun_replicas.sh exited $rc"
grep -q "2 replica(s) of 2 rank(s)" "$work/hsdp.out" || fail "the lighthouse did not serve replicas of 2 ranks"
grep -q "replica(s) 1 joined at step" "$work/hsdp.out" || fail "replica 1 did not join with its shards"
same_losses "$py" "$work/one32" "$work/hsdp" 30 1e-5 "one process" || fail "the HSDP run's losses are not one process's"
tail -n 1 "$work/hsdp/metrics.jsonl" | grep -q '"data":4' || fail "the run did not end with both replicas' 4 data ranks"

# 6. Local SGD: the interval a replica died in trained again, then its rejoin at an average.
run_job local --set parallel.mode=local_sgd --set parallel.average_every=4 --set train.max_steps=300 \
  --set fault_tolerance.debug_kill_rank=1 --set fault_tolerance.debug_kill_step=6 \
  --set train.debug_slow_rank=0 --set train.debug_slow_ms=20
wait_job local
[ $rc0 -eq 0 ] && [ $rc1 -eq 0 ] && [ $rcl -eq 0 ] || fail "exits: agents $rc0 $rc1, lighthouse $rcl"
grep -q "steps 5 to 8 discarded: a replica failed before the replicas met (local SGD)" "$work/local.r0" ||
  fail "replica 0 did not train the interval again"
joined=$(grep -ho "replica(s) 1 joined at step [0-9]*" "$work/local.r0" "$work/local.r1" | head -n 1 | grep -o '[0-9]*$')
[ -n "$joined" ] || fail "replica 1 did not join"
[ $(( (joined - 1) % 4 )) -eq 0 ] || fail "replica 1 joined at step $joined, not after an average"
[ "$(grep -c '"kind":"train"' "$work/local/metrics.jsonl")" -eq 30 ] || fail "not every train line once"
tail -n 1 "$work/local/metrics.jsonl" | grep -q '"status":"completed"' || fail "the local SGD run did not complete"
# 7. Two agents of two replicas each (HSDP's one-process reference above: batch 32).
timeout 200 "$root/scripts/torchrun_replicas.sh" --replicas 4 --per-agent 2 --max-restarts 1 --python "$py" \
  "$dtrain" "$job" --run-dir "$work/pairs" --set data.batch_size=32 --set fault_tolerance.debug_kill_rank=1 \
  --set fault_tolerance.debug_kill_step=6 --set train.debug_slow_rank=2 --set train.debug_slow_ms=20 \
  > "$work/pairs.out" 2>&1
rc=$?
grep -v '"step"\|step [0-9]' "$work/pairs.out" | tail -n 30
[ $rc -eq 0 ] || fail "torchrun_replicas.sh --per-agent 2 exited $rc"
grep -q "dtrain: replica 0 leaves the job after step" "$work/pairs.out" || fail "replica 0 did not leave when its agent stopped it"
grep -q "replica(s) 0 left the job after step" "$work/pairs.out" || fail "the new writer did not say replica 0 left"
grep -q "dtrain: replica 0 joined at step" "$work/pairs.out" || fail "replica 0 did not join again"
grep -q "dtrain: replica 1 joined at step" "$work/pairs.out" || fail "replica 1 did not join again"
grep -q "rank 2 (replica 2) runs again\|rank 3 (replica 3) runs again" "$work/pairs.out" && fail "the other agent's replicas restarted"
same_losses "$py" "$work/one32" "$work/pairs" 30 1e-5 "one process" || fail "the two-agent run's losses are not one process's"
[ "$(grep -c '"kind":"train"' "$work/pairs/metrics.jsonl")" -eq 30 ] || fail "not every train line once"
tail -n 1 "$work/pairs/metrics.jsonl" | grep -q '"data":4' || fail "the run did not end with all four replicas"
echo "PASS"
