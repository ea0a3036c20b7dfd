#!/usr/bin/env bash
# What a `dtrain lighthouse` costs as the job grows: the CPU time it spends watching
# RANKS ranks (stand-ins that do what a rank does to the lighthouse's store: leave word of
# their process, then beat once a second, as a rank's watch does at the default
# dist.hang_report_s), over SECONDS, for each binary in DTRAIN_BINS side by side.
#   scripts/bench_lighthouse.sh [--ranks "64 512 2048"] [--seconds 10]
#   DTRAIN_BINS="/old/dtrain build/dtrain" scripts/bench_lighthouse.sh   # A/B in one run
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
RANKS="64 512 2048"
SECONDS_EACH=10
while [ $# -gt 0 ]; do
  case "$1" in
    --ranks) RANKS="$2"; shift 2 ;;
    --seconds) SECONDS_EACH="$2"; shift 2 ;;
    *) echo "bench_lighthouse: unknown argument $1" >&2; exit 2 ;;
  esac
done
BINS="${DTRAIN_BINS:-$ROOT/build/dtrain}"
OUT_DIR="${OUT_DIR:-/tmp/dtrain-bench-lighthouse}"
mkdir -p "$OUT_DIR"
most=$(for n in $RANKS; do echo "$n"; done | sort -n | tail -1)
ulimit -n $((most * 2 + 256)) 2> /dev/null || ulimit -n "$(ulimit -Hn)"
cat > "$OUT_DIR/job.yaml" <<YAML
name: bench-lighthouse
data: {dataset: synthetic, samples: $((most * 4)), test_samples: 64, input_shape: [8], classes: 4, batch_size: $most}
model: {arch: mlp, hidden: [8]}
optimizer: {name: sgd, lr: 0.1}
fault_tolerance: {mode: replicas}
YAML

# The stand-in ranks: dtrain's store protocol (comm/tcp_store.cpp), as a rank speaks it.
cat > "$OUT_DIR/ranks.py" <<'PYEOF'
import json, os, socket, struct, sys, time
port, count, seconds = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
ON_CLOSE, SET = 8, 1
def blob(b): return struct.pack("<I", len(b)) + b
def request(s, op, *args):
    body = bytes([op]) + b"".join(blob(a) for a in args)
    s.sendall(blob(body))
    n = struct.unpack("<I", s.recv(4, socket.MSG_WAITALL))[0]
    if n: s.recv(n, socket.MSG_WAITALL)
def connect():
    for _ in range(500):
        try: return socket.create_connection(("127.0.0.1", port))
        except OSError: time.sleep(0.02)
    sys.exit("bench_lighthouse: the lighthouse did not listen")
socks = []
for r in range(count):
    s = connect()
    request(s, ON_CLOSE, f"dtrain/ended/{r}".encode(), b"1")
    request(s, ON_CLOSE, f"dtrain/heartbeat/{r}".encode(), b"")
    request(s, SET, f"dtrain/process/{r}".encode(), f"{socket.gethostname()} {os.getpid()}".encode())
    socks.append(s)
print("ready", flush=True)
end, step = time.time() + seconds, 0
while time.time() < end:
    step += 1
    for r, s in enumerate(socks):
        beat = json.dumps({"at": time.time(), "step": step, "posted": {"world": step}, "waits": []})
        request(s, SET, f"dtrain/heartbeat/{r}".encode(), beat.encode())
    time.sleep(max(0.0, 1.0 - (time.time() % 1.0)))
PYEOF

cpu_s() {  # a process's user + system time so far, in seconds
  awk -v hz="$(getconf CLK_TCK)" '{ print ($14 + $15) / hz }' "/proc/$1/stat"
}

printf '%-44s %8s %14s\n' "binary" "ranks" "lighthouse CPU"
for n in $RANKS; do
  base=""
  for bin in $BINS; do
    port=$(/usr/bin/python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
    "$bin" lighthouse "$OUT_DIR/job.yaml" --replicas "$n" --port "$port" --set dist.timeout_s=60 \
      > "$OUT_DIR/lighthouse.log" 2>&1 &
    lh=$!
    # Warmed up: every stand-in connected and beating; then the lighthouse's time is counted.
    coproc RANKS_PROC { /usr/bin/python3 "$OUT_DIR/ranks.py" "$port" "$n" $((SECONDS_EACH + 5)); }
    read -r ready <&"${RANKS_PROC[0]}"
    sleep 2
    c0=$(cpu_s "$lh")
    sleep "$SECONDS_EACH"
    c1=$(cpu_s "$lh")
    wait "$RANKS_PROC_PID" || true
    kill "$lh" 2> /dev/null; wait "$lh" 2> /dev/null || true
    share=$(awk -v a="$c0" -v b="$c1" -v s="$SECONDS_EACH" 'BEGIN { printf "%.1f%%", 100 * (b - a) / s }')
    ratio=""
    [ -n "$base" ] && ratio=$(awk -v a="$base" -v b="$c1" -v c="$c0" 'BEGIN { if (b - c > 0) printf " (%.1fx less)", a / (b - c) }')
    [ -z "$base" ] && base=$(awk -v a="$c0" -v b="$c1" 'BEGIN { print b - a }')
    printf '%-44s %8s %14s%s\n' "$bin" "$n" "$share" "$ratio"
  done
done
echo "(the share of one core the lighthouse used while RANKS ranks beat; stand-ins' own time not counted)"
