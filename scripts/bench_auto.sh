#!/usr/bin/env bash
# How close `parallel.auto` comes to the best layout chosen by hand, on this machine, in
# one run: gpt_text on 4 processes with `parallel.auto: true` and with each of d4, d2 x t2,
# d2 x p2, t4, p4 and t2 x p2 set by hand (the pipelines under 1F1B with the micro-batches
# a user would try), each trained for 60 steps; throughput is the summary's samples_per_s
# (its steady steps). Rounds run the cases in alternating order, so that a shared
# machine's drift falls on all of them alike; a layout's figure is its median over rounds.
# The ratio printed is auto / the best hand layout (issue 32's acceptance: >= 0.85).
#   scripts/bench_auto.sh [ROUNDS]     # default 2
# The profile is measured first (`dtrain plan --measure --nproc 4`, kept under $OUT_DIR)
# so that the choice and the runs see the machine in the same state; DTRAIN_PROFILE=FILE
# uses FILE instead.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
OUT_DIR="${OUT_DIR:-/tmp/dtrain-bench-auto}"
PY=${PY:-$(command -v python3)}
BIN="${DTRAIN_BIN:-$ROOT/build/dtrain}"
[ -x "$BIN" ] || { echo "bench_auto: build dtrain first (scripts/setup.sh)" >&2; exit 2; }
rounds="${1:-2}"
mkdir -p "$OUT_DIR"
if [ -z "${DTRAIN_PROFILE:-}" ]; then
  export DTRAIN_PROFILE=$OUT_DIR/machine.json
  "$BIN" plan --measure --nproc 4 > /dev/null
fi
JOB=$ROOT/configs/gpt_text.yaml
# name | --set words
cases=(
  "auto|parallel.auto=true"
  "d4|"
  "d4 zero1|parallel.zero=1"
  "d2 x t2|parallel.tensor=2"
  "d2 x p2 1f1b x1|parallel.pipeline=2"
  "d2 x p2 1f1b x4|parallel.pipeline=2 train.grad_accum=4"
  "t4|parallel.tensor=4"
  "p4 1f1b x4|parallel.pipeline=4 train.grad_accum=4"
  "p4 1f1b x8|parallel.pipeline=4 train.grad_accum=8"
  "t2 x p2 1f1b x4|parallel.tensor=2 parallel.pipeline=2 train.grad_accum=4"
)
rows=$OUT_DIR/bench_auto.jsonl
: > "$rows"
for ((r = 0; r < rounds; ++r)); do
  order=("${cases[@]}")
  if ((r % 2)); then  # every other round backwards
    order=(); for ((i = ${#cases[@]} - 1; i >= 0; --i)); do order+=("${cases[i]}"); done
  fi
  for c in "${order[@]}"; do
    IFS='|' read -r name words <<< "$c"
    sets=(--set train.max_steps=60 --set train.log_every=1 --set train.eval_every=0
          --set checkpoint.every_steps=0 --set logging.progress=off)
    for w in $words; do sets+=(--set "$w"); done
    rm -rf "$OUT_DIR/run"
    log=$OUT_DIR/run.log
    "$BIN" run "$JOB" --nproc 4 --run-dir "$OUT_DIR/run" "${sets[@]}" > "$log" 2>&1 ||
      { tail -n 5 "$log" >&2; exit 1; }
    choice=$(grep -o 'parallel.auto: .* (expected' "$log" | head -n 1 | sed 's/ (expected$//' || true)
    $PY - "$name" "$r" "${choice#parallel.auto: }" "$OUT_DIR/run/metrics.jsonl" >> "$rows" <<'PYEOF'
import json, sys
summary = [json.loads(l) for l in open(sys.argv[4]) if '"summary"' in l][-1]
print(json.dumps({"case": sys.argv[1], "round": int(sys.argv[2]), "chose": sys.argv[3].strip(),
                  "samples_per_s": summary["samples_per_s"]}))
PYEOF
    tail -n 1 "$rows"
  done
done
$PY - "$rows" "$(nproc)" <<'PYEOF'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
names = list(dict.fromkeys(r["case"] for r in rows))
rate = {n: statistics.median(r["samples_per_s"] for r in rows if r["case"] == n) for n in names}
runs = {n: ", ".join(f"{r['samples_per_s']:.0f}" for r in rows if r["case"] == n) for n in names}
print(f"\ngpt_text, 4 processes on {sys.argv[2]} cores; samples/s, median of the rounds (each round's)")
for n in names:
    print(f"{n:20} {rate[n]:8.1f}   ({runs[n]})")
chose = sorted({r["chose"] for r in rows if r["case"] == "auto"})
best = max((n for n in names if n != "auto"), key=rate.get)
print(f"auto chose: {'; '.join(chose)}")
print(f"auto / best by hand ({best}): {rate['auto'] / rate[best]:.2f}")
PYEOF
