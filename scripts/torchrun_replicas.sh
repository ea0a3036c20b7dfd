#!/usr/bin/env bash
# fault_tolerance: replicas under torchrun on this machine, as a script for several nodes
# would start them (docs/fault-tolerance.md): a `dtrain lighthouse`, then one torchrun agent
# per replica (or per K replicas: --per-agent K), each restarting its own replicas' workers.
# Waits for the agents, then the lighthouse; exits 0 when some replica completed the run
# (the run's summary says so), else 4.
#   scripts/torchrun_replicas.sh --replicas N [--per-agent K] [--max-restarts R] [--python PY] \
#                                DTRAIN JOB [dtrain run options: --run-dir DIR, --set k=v, ...]
# Each replica is fault_tolerance.replica_data x parallel.tensor x parallel.pipeline workers
# of the job (--set applies to the lighthouse too). An agent of K replicas stops all of its
# workers when one fails (its other replicas leave the job after a step's notice) and
# restarts them together; they join the others alike. PY: a Python with torch (default
# .venv's, scripts/setup.sh --test).
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
replicas=2 per_agent=1 restarts=10 py=$root/.venv/bin/python
while [ $# -gt 0 ]; do
  case "$1" in
    --replicas) replicas=$2; shift 2 ;;
    --per-agent) per_agent=$2; shift 2 ;;
    --max-restarts) restarts=$2; shift 2 ;;
    --python) py=$2; shift 2 ;;
    *) break ;;
  esac
done
[ $# -ge 2 ] || { echo "usage: torchrun_replicas.sh --replicas N [--per-agent K] [--max-restarts R] [--python PY] DTRAIN JOB [run options]" >&2; exit 2; }
[ $((replicas % per_agent)) -eq 0 ] || { echo "torchrun_replicas.sh: --per-agent $per_agent does not divide --replicas $replicas" >&2; exit 2; }
dtrain=$1 job=$2; shift 2
sets=() run_dir=""
args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do
  case "${args[i]}" in
    --set) sets+=(--set "${args[i + 1]}") ;;
    --run-dir) run_dir=${args[i + 1]} ;;
  esac
done
[ -n "$run_dir" ] || { echo "torchrun_replicas.sh: pass --run-dir (the replicas share it)" >&2; exit 2; }
port() { "$py" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
lp=$(port)
# The lighthouse names the replica size it serves (fault_tolerance.replica_data x
# parallel.tensor x parallel.pipeline) as it starts; each agent starts that many workers.
said=$(mktemp)
"$dtrain" lighthouse "$job" --replicas "$replicas" --port "$lp" ${sets[@]+"${sets[@]}"} \
  2> >(tee "$said" >&2) &
lighthouse=$!
size="" tries=0
while [ -z "$size" ] && [ $((tries++)) -lt 300 ]; do
  size=$(sed -n 's/^dtrain lighthouse: [0-9]* replica(s) of \([0-9]*\) rank(s).*/\1/p' "$said")
  [ -n "$size" ] && break
  kill -0 "$lighthouse" 2>/dev/null || { wait "$lighthouse"; exit $?; }
  sleep 0.1
done
[ -n "$size" ] || { echo "torchrun_replicas.sh: the lighthouse did not start" >&2; kill "$lighthouse"; exit 4; }
trap 'kill $(jobs -p) 2>/dev/null; rm -f "$said"' EXIT
agents=()
for ((r = 0; r < replicas; r += per_agent)); do  # an agent's first replica
  DTRAIN_LIGHTHOUSE=127.0.0.1:$lp DTRAIN_REPLICA=$r "$py" "$root/scripts/torchrun" \
    --nproc_per_node $((size * per_agent)) --max_restarts "$restarts" --master_port "$(port)" --no_python \
    "$dtrain" run "$job" "$@" &
  agents+=($!)
done
for a in "${agents[@]}"; do wait "$a"; done
wait "$lighthouse"
trap - EXIT
rm -f "$said"
tail -n 1 "$run_dir/metrics.jsonl" 2>/dev/null | grep -q '"status":"completed"' && exit 0
exit 4
