#!/usr/bin/env bash
# Runs scripts/dtrain.sbatch with 2 tasks on a real single-node SLURM cluster (loopback)
# through `sbatch --wait`, and checks the run. Exit 77 (skipped) without slurm-wlm/munge.
# Usage: test_slurm.sh DTRAIN_BINARY
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
dtrain=$1
work=$(mktemp -d /tmp/dtrain-slurm-test.XXXXXX)
export DTRAIN_SLURM_DIR=$work/cluster
source "$here/check_run.sh"
cleanup() { "$root/scripts/slurm-local.sh" stop; rm -rf "$work"; }
trap cleanup EXIT
out=$("$root/scripts/slurm-local.sh" start) || exit $?
export "${out?}"
cd "$work"
DTRAIN=$dtrain timeout 300 sbatch --wait --ntasks 2 --output "$work/job.out" \
  "$root/scripts/dtrain.sbatch" "$here/job.yaml" --run-dir "$work/run"
rc=$?
cat "$work/job.out"
[ $rc -eq 0 ] || { echo "FAIL: sbatch --wait exited $rc" >&2; exit 1; }
grep -q "launcher slurm" "$work/job.out" || { echo "FAIL: ranks not taken from SLURM" >&2; exit 1; }
check_run "$work/run" || exit 1
echo "PASS: sbatch --wait"

# Preemption end to end: SLURM's warning signal (what --signal=USR1@120 sends before the
# time limit; sent at once here with scancel) makes both ranks checkpoint, rank 0 requeues
# the job, and the requeued job resumes from that checkpoint and completes.
job_state() { scontrol show job "$1" -o | grep -o 'JobState=[A-Z_]*' | cut -d= -f2; }
wait_until() {  # wait_until SECONDS COMMAND...: polls every 0.2 s
  local until=$((SECONDS + $1)); shift
  while ! "$@"; do [ $SECONDS -lt $until ] || return 1; sleep 0.2; done
}
logged_steps() { [ -f "$work/rq/metrics.jsonl" ] && [ "$(grep -c '"kind":"train"' "$work/rq/metrics.jsonl")" -ge 3 ]; }
requeued() { grep -q 'Restarts=1' <(scontrol show job "$id" -o) && [ "$(job_state "$id")" = PENDING ]; }
# A job still pending has its start moved to now again: SLURM may set the requeue hold after
# the first update, once the stopped job has finished completing (slow on a loaded machine).
completed() {
  local state; state=$(job_state "$id")
  [ "$state" = PENDING ] && scontrol update JobId="$id" StartTime=now 2>/dev/null
  [ "$state" = COMPLETED ]
}
id=$(DTRAIN=$dtrain sbatch --parsable --ntasks 2 --open-mode=append --output "$work/rq.out" \
  "$root/scripts/dtrain.sbatch" "$here/job.yaml" --run-dir "$work/rq" \
  --set train.max_steps=2000 --set train.log_every=10) || { echo "FAIL: sbatch" >&2; exit 1; }
fail() { cat "$work/rq.out"; scontrol show job "$id" 2>&1; scancel "$id" 2>/dev/null; echo "FAIL: $1" >&2; exit 1; }
wait_until 120 logged_steps || fail "the job did not start training"
scancel --signal=USR1 "$id"
wait_until 60 requeued || fail "the job was not requeued after SIGUSR1"
# SLURM holds a requeued job for about two minutes; a test need not wait for that.
scontrol update JobId="$id" StartTime=now
wait_until 240 completed || fail "the requeued job did not complete"
cat "$work/rq.out"
stopped=$(grep -o 'stopped by signal 10 after step [0-9]*' "$work/rq.out" | head -1 | awk '{print $NF}')
[ -n "$stopped" ] || fail "no checkpoint on SIGUSR1"
grep -q "requeued SLURM job $id; it resumes from step $stopped" "$work/rq.out" || fail "no requeue line"
grep -q "resumed at step $stopped from" "$work/rq.out" || fail "the requeued job did not resume at step $stopped"
last=$(tail -n 1 "$work/rq/metrics.jsonl")
grep -q '"status":"completed"' <<<"$last" && grep -q '"steps":2000' <<<"$last" || fail "not completed: $last"
echo "PASS: SIGUSR1 checkpoint, requeue, resume"

# fault_tolerance: replicas under SLURM: a lighthouse and one srun step per replica in one
# allocation; replica 1's task killed at step 6 (fault_tolerance.debug_kill_rank). srun
# restarts nothing: its step fails, and replica 0 completes the run alone.
cat > "$work/ft.sh" <<'SH'
#!/bin/bash
port=$((20000 + SLURM_JOB_ID % 20000 + 1))
"$DTRAIN" lighthouse "$JOB" --replicas 2 --port $port --set fault_tolerance.mode=replicas &
for r in 0 1; do
  DTRAIN_LIGHTHOUSE=127.0.0.1:$port DTRAIN_REPLICA=$r srun --ntasks 1 --exact "$DTRAIN" run "$JOB" \
    --run-dir "$RUN" --set fault_tolerance.mode=replicas --set train.max_steps=200 \
    --set fault_tolerance.debug_kill_rank=1 --set fault_tolerance.debug_kill_step=6 &
done
wait
SH
DTRAIN=$dtrain JOB=$here/job.yaml RUN=$work/ft timeout 300 sbatch --wait --ntasks 2 \
  --output "$work/ft.out" "$work/ft.sh"
cat "$work/ft.out"
ft_fail() { echo "FAIL: $1" >&2; exit 1; }
grep -q "rank 1 (replica 1) has ended" "$work/ft.out" || ft_fail "the lighthouse did not see rank 1 end"
grep -q "every rank has ended" "$work/ft.out" || ft_fail "the lighthouse did not end with the job"
last=$(tail -n 1 "$work/ft/metrics.jsonl")
grep -q '"status":"completed"' <<<"$last" && grep -q '"steps":200' <<<"$last" ||
  ft_fail "replica 0 did not complete the run alone: $last"
grep -q '"data":1' <<<"$last" || ft_fail "the run did not end with one replica: $last"
echo "PASS: replicas under srun, one killed, the other completes"
