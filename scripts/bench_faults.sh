#!/usr/bin/env bash
# What a failure costs a data-parallel job, side by side in one run: the job uninterrupted,
# then the same job with one worker SIGKILLed (or SIGSTOPped) every --every seconds, under
# each recovery path: restarted from its latest checkpoint by the launcher (dtrain's
# supervisor, `--nproc N --max-restarts`, or torchrun's elastic agent, `--max-restarts`),
# or, `replicas`, the others training on while the failed replica restarts alone and joins
# with their state (fault_tolerance: replicas; `lighthouse`: the same under torchrun, an
# agent a replica beside a `dtrain lighthouse`, scripts/torchrun_replicas.sh; `lighthouse2`:
# two agents of half the replicas each, whose agent stops a failed worker's agent-mates,
# which leave the job after a step's notice and join again with it). Per failure: the steps trained again (those
# since the checkpoint; under replicas the step in flight, trained again inside the same
# step), the stall (the kill to the next step logged), the time until the run is back past
# the step it had reached, and under replicas the detection (the kill to the supervisor's
# or the lighthouse's word, which the survivors act on) and the rejoin (the restarted
# process's start, or its torchrun agent's word on the failure, to its joining, its state
# taken over the group; and its parts, as the joiner says them: its start and build, the
# wait for the others' vote, the state's transfer and load, its hash); over the run: wall
# time and final accuracy against the uninterrupted run.
#
#   scripts/bench_faults.sh [--model mlp|gpt|gpt2] [--nproc N] [--every S] [--steps N]
#                           [--save-every N] [--launchers "nproc torchrun replicas lighthouse lighthouse2"]
#                           [--signal KILL|STOP] [--mode sync|local_sgd] [--set KEY=VALUE]...
# Defaults: mlp (the README's job), 4 processes, a kill every 30 s, a checkpoint every 500
# steps, mlp 20000 steps (gpt 1200; gpt2, GPT-2 small's 124M weights at a 256-token
# context and one window per process, which a CPU trains in seconds a step: 40), the
# paths nproc, torchrun and replicas, SIGKILL (SIGSTOP: a hung worker,
# which the restart paths notice only at dist.timeout_s). torchrun needs scripts/setup.sh
# --test (.venv's torch). --mode local_sgd trains every run as local SGD (averages every 8
# steps): under replicas a failure between averages costs the interval since the last one.
# --set passes a job key to every run (on one GPU, several replicas share it:
# --set train.device=cuda:0 --set dist.backend=gloo, as NCCL takes one rank a GPU).
# DTRAIN_BIN=PATH benchmarks another binary. Results:
# $OUT_DIR/faults.jsonl.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
OUT_DIR="${OUT_DIR:-/tmp/dtrain-bench-faults}"
BIN="${DTRAIN_BIN:-$ROOT/build/dtrain}"
PY="${DTRAIN_PYTHON:-$ROOT/.venv/bin/python}"
MODEL=mlp NPROC=4 EVERY=30 STEPS="" SAVE_EVERY=500 LAUNCHERS="nproc torchrun replicas" SIGNAL=KILL
USER_SETS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --model) MODEL=$2; shift 2 ;;
    --nproc) NPROC=$2; shift 2 ;;
    --every) EVERY=$2; shift 2 ;;
    --steps) STEPS=$2; shift 2 ;;
    --save-every) SAVE_EVERY=$2; shift 2 ;;
    --launchers) LAUNCHERS=$2; shift 2 ;;
    --signal) SIGNAL=$2; shift 2 ;;
    --mode) MODE=$2; shift 2 ;;
    --set) USER_SETS+=(--set "$2"); shift 2 ;;
    *) echo "usage: scripts/bench_faults.sh [--model mlp|gpt|gpt2] [--nproc N] [--every S]" \
            "[--steps N] [--save-every N] [--launchers \"nproc torchrun replicas\"]" \
            "[--signal KILL|STOP] [--mode sync|local_sgd] [--set KEY=VALUE]..." >&2; exit 2 ;;
  esac
done
case "$MODEL" in
  mlp) JOB=$ROOT/configs/fashion_mnist_mlp.yaml; STEPS=${STEPS:-20000} ;;
  gpt) JOB=$ROOT/configs/gpt_text.yaml; STEPS=${STEPS:-1200} ;;
  gpt2) JOB=$ROOT/configs/gpt2_small.yaml; STEPS=${STEPS:-40} ;;
  *) echo "bench_faults.sh: --model is mlp, gpt or gpt2" >&2; exit 2 ;;
esac
MODEL_SETS=()
[ "$MODEL" = gpt2 ] && MODEL_SETS=(--set model.seq_len=256 --set data.batch_size="$NPROC"
                                   --set train.eval_batch_size=1 --set data.test_samples=4)
[ -x "$BIN" ] || { echo "bench_faults.sh: no dtrain at $BIN (scripts/setup.sh builds it)" >&2; exit 2; }
[ -x "$PY" ] || PY=python3
mkdir -p "$OUT_DIR"
# Every step logged (the lost steps are counted exactly), one evaluation at the end, a
# constant learning rate (a restart's schedule cannot differ), the batch's threads alike.
SETS=(--set train.max_steps="$STEPS" --set train.log_every=1 --set train.eval_every="$STEPS"
      --set checkpoint.every_steps="$SAVE_EVERY" --set checkpoint.keep_last=2
      --set logging.progress=off --set dist.timeout_s=30 ${MODEL_SETS[@]+"${MODEL_SETS[@]}"})
case "${MODE:-sync}" in
  sync) ;;
  local_sgd) SETS+=(--set parallel.mode=local_sgd --set parallel.average_every=8) ;;
  *) echo "bench_faults.sh: --mode is sync or local_sgd" >&2; exit 2 ;;
esac
SETS+=(${USER_SETS[@]+"${USER_SETS[@]}"})
export OMP_NUM_THREADS=1

# LAUNCHER RUN_DIR MAX_RESTARTS: the job's command line under that launcher.
command_for() {
  case "$1" in
    nproc) echo "$BIN run $JOB --run-dir $2 --nproc $NPROC --max-restarts $3" ;;
    replicas) echo "$BIN run $JOB --run-dir $2 --nproc $NPROC --max-restarts $3" \
                   "--set fault_tolerance.mode=replicas" ;;
    torchrun) echo "$PY $ROOT/scripts/torchrun --standalone --nproc_per_node $NPROC" \
                   "--max_restarts $3 --no_python $BIN run $JOB --run-dir $2" ;;
    lighthouse) echo "$ROOT/scripts/torchrun_replicas.sh --replicas $NPROC --max-restarts $3" \
                     "--python $PY $BIN $JOB --run-dir $2 --set fault_tolerance.mode=replicas" ;;
    lighthouse2) echo "$ROOT/scripts/torchrun_replicas.sh --replicas $NPROC --per-agent $((NPROC / 2))" \
                      "--max-restarts $3 --python $PY $BIN $JOB --run-dir $2" \
                      "--set fault_tolerance.mode=replicas" ;;
  esac
}

# The workers of launcher process $1: the dtrain processes under it (the supervisor's
# forked "dtrain rank R", torchrun's exec'd dtrain, those of each replica's torchrun), not
# a lighthouse.
workers() {
  local p
  for p in $(pgrep -P "$1"); do
    case "$(cat /proc/"$p"/comm 2>/dev/null)" in
      dtrain*) [ "$({ tr '\0' '\n' < "/proc/$p/cmdline"; } 2> /dev/null | sed -n 2p)" = lighthouse ] ||
                 echo "$p" ;;
      *) workers "$p" ;;
    esac
  done
}

# RUN_DIR LAUNCHER KILL_EVERY (0: none): runs the job, killing a random worker every
# KILL_EVERY seconds; each kill's time and the step reached go to RUN_DIR.kills.
run_job() {
  local dir=$1 launcher=$2 every=$3
  rm -rf "$dir" "$dir.kills"
  touch "$dir.kills"
  date +%s.%N > "$dir.start"
  # Each line of the job's output with the time it came (the supervisor's words on a
  # failure, a replica joining).
  # shellcheck disable=SC2046
  $(command_for "$launcher" "$dir" 1000) "${SETS[@]}" 2>&1 |
    while IFS= read -r line; do printf '%s %s\n' "$(date +%s.%N)" "$line"; done > "$dir.log" &
  local job="" next=$(( $(date +%s) + every ))
  for _ in $(seq 600); do  # the launcher's process, the oldest with this run directory
    job=$(pgrep -o -f -- "--run-dir $dir " || true)
    [ -n "$job" ] && break
    sleep 0.1
  done
  while kill -0 "$job" 2>/dev/null; do
    sleep 0.2
    if [ "$every" -gt 0 ] && [ "$(date +%s)" -ge "$next" ]; then
      mapfile -t ws < <(workers "$job")
      if [ "${#ws[@]}" -eq "$NPROC" ]; then
        victim=${ws[$((RANDOM % ${#ws[@]}))]}
        # The step reached, read now: a restart rewrites metrics.jsonl up to its checkpoint.
        reached=$(tail -n 1 "$dir/metrics.jsonl" 2>/dev/null | grep -o '"step":[0-9]*' | cut -d: -f2)
        kill -"$SIGNAL" "$victim" 2>/dev/null && echo "$(date +%s.%N) ${reached:-0}" >> "$dir.kills"
      fi
      next=$(( $(date +%s) + every ))
    fi
  done
  wait || true
  grep -q '"kind":"summary".*"status":"completed"' "$dir/metrics.jsonl" ||
    echo "bench_faults.sh: the $launcher run did not complete (see $dir.log)" >&2
}

# RUN_DIR LABEL: one JSON line of figures from the run's metrics and kills.
figures() {
  "$PY" - "$1" "$2" <<'EOF'
import json, re, sys
d, label = sys.argv[1], sys.argv[2]
lines = [json.loads(l) for l in open(f"{d}/metrics.jsonl")]
train = [l for l in lines if l["kind"] == "train"]
kills = [(float(t), int(n)) for t, n in (k.split() for k in open(f"{d}.kills"))]
evals = [l for l in lines if l["kind"] == "eval"]
lost, stall, back = [], [], []
for t, reached in kills:
    after = [l for l in train if l["time"] > t]
    if not after:
        continue
    # A line written between reading the step reached and the kill is a step not lost.
    lost.append(max(0, reached - (after[0]["step"] - 1)))
    stall.append(after[0]["time"] - t)
    past = [l for l in after if l["step"] > reached]
    if past:
        back.append(past[0]["time"] - t)
mean = lambda xs: round(sum(xs) / len(xs), 2) if xs else None
start = float(open(f"{d}.start").read())
# Under replicas: the supervisor's (or the lighthouse's) word on each failure after its
# kill, and each restarted replica's joining after its restart (the supervisor's word, or
# its torchrun agent's on the failure, after which it restarts the worker at once).
said = [(float(l.split(" ", 1)[0]), l.split(" ", 1)[1]) for l in open(f"{d}.log") if " " in l]
noticed = [t for t, l in said if "the other replicas go on" in l or ") has ended" in l]
restarted = [t for t, l in said if "restarts to join them" in l or "failed (exitcode" in l]
joined = [t for t, l in said if "joined at step" in l]
detect = [min([n for n in noticed if n >= t], default=t) - t for t, _ in kills] if noticed else []
# Local SGD under replicas: a failure discards the interval since the last average, whose
# lines were never written; the survivors say which steps they train again.
discarded = [int(m.group(2)) - int(m.group(1)) + 1
             for _, l in said for m in [re.search(r"steps (\d+) to (\d+) discarded", l)] if m]
if discarded:
    lost = discarded
rejoin = [min([j for j in joined if j >= r], default=r) - r for r in restarted if any(j >= r for j in joined)]
# Replicas that left at a step boundary when their agent stopped them (an agent of several).
leavers = sum(1 for _, l in said if "leaves the job after step" in l)
# Where each rejoin's time went, as the joiner says: its start and build, the wait for the
# others' vote, the state's transfer and load, its hash.
parts = [m.groups() for _, l in said
         for m in [re.search(r"built in ([\d.]+) s, admitted ([\d.]+) s later.* in ([\d.]+) s, "
                             r"hashed it in ([\d.]+) s", l)] if m]
rejoin_parts = {k: mean([float(p[i]) for p in parts])
                for i, k in enumerate(["built", "admitted", "state", "hash"])} if parts else None
print(json.dumps({"run": label, "failures": len(kills), "steps": max(l["step"] for l in train),
                  "lost_steps_per_failure": mean(lost), "stall_s_per_failure": mean(stall),
                  "back_past_s_per_failure": mean(back), "detect_s": mean(detect),
                  "rejoin_s": mean(rejoin), "rejoin_parts_s": rejoin_parts, "leavers": leavers,
                  "wall_s": round(lines[-1]["time"] - start, 1),
                  "accuracy": evals[-1].get("accuracy") if evals else None,
                  "eval_loss": evals[-1].get("loss") if evals else None}))
EOF
}

: > "$OUT_DIR/faults.jsonl"
echo "== uninterrupted ($MODEL, $NPROC processes, $STEPS steps)" >&2
run_job "$OUT_DIR/whole" nproc 0
figures "$OUT_DIR/whole" "uninterrupted" >> "$OUT_DIR/faults.jsonl"
for launcher in $LAUNCHERS; do
  if [ "$launcher" != nproc ] && [ "$launcher" != replicas ] &&
     ! "$PY" -c 'import torch.distributed.run' 2> /dev/null; then
    echo "bench_faults.sh: no torchrun at $PY (scripts/setup.sh --test); skipped" >&2
    continue
  fi
  echo "== $launcher: a worker sent SIG$SIGNAL every $EVERY s" >&2
  run_job "$OUT_DIR/$launcher" "$launcher" "$EVERY"
  label="restart ($launcher)"
  [ "$launcher" = replicas ] && label="replicas (fault tolerance)"
  [ "$launcher" = lighthouse ] && label="replicas under torchrun"
  [ "$launcher" = lighthouse2 ] && label="replicas under 2 torchruns"
  figures "$OUT_DIR/$launcher" "$label" >> "$OUT_DIR/faults.jsonl"
done
"$PY" - "$OUT_DIR/faults.jsonl" "$SAVE_EVERY" <<'EOF'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
print(f"checkpoint every {sys.argv[2]} steps")
cols = ["run", "failures", "steps", "lost_steps_per_failure", "stall_s_per_failure",
        "back_past_s_per_failure", "detect_s", "rejoin_s", "leavers", "wall_s", "accuracy"]
print("  ".join(f"{c:>24}" if i == 0 else f"{c:>12}" for i, c in enumerate(cols)))
for r in rows:
    print("  ".join(f"{str(r[c]):>24}" if i == 0 else f"{str(r[c]):>12}" for i, c in enumerate(cols)))
for r in rows:
    if r.get("rejoin_parts_s"):
        print(f"{r['run']}: a rejoin's parts, s: " +
              ", ".join(f"{k} {v}" for k, v in r["rejoin_parts_s"].items()))
EOF
