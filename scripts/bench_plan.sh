#!/usr/bin/env bash
# How far `dtrain plan`'s step time is from the measured one, on this machine, in one run:
# each case is planned (`plan --json`'s step_s, with this machine's profile) and then
# trained for 60 steps (20 for the GPT in bf16, 9 s a step on a CPU without bf16
# instructions); the measured step is the median step_ms of rank 0's train lines after
# the first 10. The ratio printed is expected / measured (1 = exact; < 1 optimistic).
#   scripts/bench_plan.sh [FILTER]        # the cases whose name has FILTER (default: all)
#   scripts/bench_plan.sh --gpu [FILTER]  # the GPU cases (train.device=cuda): the step is the
#                                         # summary's median (only logged steps wait for the
#                                         # GPU), and rank 0's planned memory is set against
#                                         # the allocator's peak (peak_gpu_mb)
# The profile is measured first (`dtrain plan --measure --nproc 4`, kept under $OUT_DIR), so
# that it and the runs see the machine in the same state (a shared machine's speed drifts:
# this one's matmuls by up to 2x over an hour); DTRAIN_PROFILE=FILE uses FILE instead.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
OUT_DIR="${OUT_DIR:-/tmp/dtrain-bench-plan}"
PY=${PY:-$(command -v python3)}
BIN="${DTRAIN_BIN:-$ROOT/build/dtrain}"
[ -x "$BIN" ] || { echo "bench_plan: build dtrain first (scripts/setup.sh)" >&2; exit 2; }
gpu=0 gpt2=0
if [ "${1:-}" = "--gpu" ]; then gpu=1; shift; fi
if [ "${1:-}" = "--gpt2" ]; then gpt2=1; shift; fi
filter="${1:-}"
mkdir -p "$OUT_DIR"
if [ -z "${DTRAIN_PROFILE:-}" ]; then
  export DTRAIN_PROFILE=$OUT_DIR/machine.json
  "$BIN" plan --measure --nproc $((gpu ? 2 : 4)) > /dev/null
fi
rows=$OUT_DIR/bench_plan.jsonl
: > "$rows"
MLP=$ROOT/configs/fashion_mnist_mlp.yaml CNN=$ROOT/configs/fashion_mnist_cnn.yaml GPT=$ROOT/configs/gpt_text.yaml
# name | job | processes | --set words | steps (default 60)
cases=(
  "mlp|$MLP|1|"
  "mlp d2|$MLP|2|"
  "mlp d4|$MLP|4|"
  "mlp d2 bf16|$MLP|2|precision.dtype=bf16"
  "cnn|$CNN|1|"
  "cnn d2|$CNN|2|"
  "gpt|$GPT|1|"
  "gpt bf16|$GPT|1|precision.dtype=bf16|20"
  "gpt d2|$GPT|2|"
  "gpt t2|$GPT|2|parallel.tensor=2"
  "gpt p2 1f1b x4|$GPT|2|parallel.pipeline=2 train.grad_accum=4"
  "gpt d2 zero3|$GPT|2|parallel.zero=3"
  "gpt d4|$GPT|4|"
  "gpt d2 t2|$GPT|4|parallel.tensor=2"
  "gpt t2 p2 x4|$GPT|4|parallel.tensor=2 parallel.pipeline=2 train.grad_accum=4"
  "gpt d2 p2 1f1b x1|$GPT|4|parallel.pipeline=2"
  "gpt d2 p2 inter x8|$GPT|4|parallel.pipeline=2 parallel.schedule=interleaved_1f1b parallel.virtual_stages=2 train.grad_accum=8"
  "gpt p4 1f1b x4|$GPT|4|parallel.pipeline=4 train.grad_accum=4"
)
GPT2=$ROOT/configs/gpt2_small.yaml
if [ $gpt2 = 1 ]; then
  small="data.batch_size=4 model.seq_len=64"
  # GPT-2's vocabulary on a narrow model (the head is 16 blocks' FLOPs): split by
  # parameters stage 0 holds the embedding alone
  narrow="data.batch_size=8 model.seq_len=128 model.dim=256 model.heads=4 model.layers=6"
  cases=(
    "gpt2 4x64|$GPT2|1|$small|4"
    "gpt2 4x64 d2 zero1|$GPT2|2|$small parallel.zero=1|4"
    "gpt2 4x64 p2 1f1b x4|$GPT2|2|$small parallel.pipeline=2 train.grad_accum=4|4"
    "gpt2 4x64 p2 x4 flops|$GPT2|2|$small parallel.pipeline=2 train.grad_accum=4 parallel.balance=flops|4"
    "d256 x6 p2 x4|$GPT2|2|$narrow parallel.pipeline=2 train.grad_accum=4|8"
    "d256 x6 p2 x4 flops|$GPT2|2|$narrow parallel.pipeline=2 train.grad_accum=4 parallel.balance=flops|8"
    "gpt2 4x64 t2|$GPT2|2|$small parallel.tensor=2|4"
  )
fi
if [ $gpu = 1 ]; then
  cases=(
    "gpu mlp|$MLP|1|train.device=cuda|200"
    "gpu mlp bf16|$MLP|1|train.device=cuda precision.dtype=bf16|200"
    "gpu cnn|$CNN|1|train.device=cuda|200"
    "gpu mlp d2 (one GPU)|$MLP|2|train.device=cuda|200"
    "gpu gpt2 4 layers bf16|$GPT2|1|train.device=cuda model.layers=4 precision.dtype=bf16|40"
    "gpu gpt2 bf16|$GPT2|1|train.device=cuda precision.dtype=bf16|30"
    "gpu gpt2 4 layers fp32|$GPT2|1|train.device=cuda model.layers=4 precision.dtype=fp32|30"
  )
fi
for c in "${cases[@]}"; do
  IFS='|' read -r name job nproc words steps <<< "$c"
  [[ -z "$filter" || "$name" == *"$filter"* ]] || continue
  # On a GPU only logged steps wait for it: log once, at the end.
  sets=(--set train.max_steps=${steps:-60} --set train.log_every=$((gpu ? ${steps:-60} : 1))
        --set train.eval_every=0 --set checkpoint.every_steps=0 --set logging.progress=off)
  for w in $words; do sets+=(--set "$w"); done
  "$BIN" plan "$job" --nproc "$nproc" --json "${sets[@]}" > "$OUT_DIR/plan.json"
  rm -rf "$OUT_DIR/run"
  log=$OUT_DIR/run.log
  "$BIN" run "$job" --nproc "$nproc" --run-dir "$OUT_DIR/run" "${sets[@]}" > "$log" 2>&1 ||
    { tail -n 5 "$log" >&2; exit 1; }
  $PY - "$name" "$nproc" "$OUT_DIR/plan.json" "$OUT_DIR/run/metrics.jsonl" >> "$rows" <<'PYEOF'
import json, statistics, sys
plan = json.load(open(sys.argv[3]))
lines = [json.loads(l) for l in open(sys.argv[4])]
train = [l for l in lines if l["kind"] == "train"]
steady = train[10:] if len(train) >= 20 else train[1:]  # a short run: all but the first
summary = [l for l in lines if l["kind"] == "summary"][-1]
rank0 = plan["ranks"][0]
row = {"case": sys.argv[1], "nproc": int(sys.argv[2]), "planned_s": plan["step_s"],
       "planned_mb": rank0["memory_mb"]["total"], "planned_bytes": rank0["comm_bytes"],
       "planned_bubble": rank0["bubble"]}
if "peak_gpu_mb" in summary:  # a GPU: the steps' median, the allocator's peak
    row.update(measured_s=summary["step_ms_median"] / 1000, comm_s=0, measured_mb=summary["peak_gpu_mb"])
else:
    row.update(measured_s=statistics.median(l["step_ms"] for l in steady) / 1000,
               comm_s=statistics.median(l.get("comm_ms", 0) for l in steady) / 1000,
               measured_mb=train[-1]["peak_rss_mb"])
if "comm_bytes" in train[-1]:
    row["measured_bytes"] = statistics.median(l["comm_bytes"] for l in steady)
if "bubble" in train[-1]:
    row["measured_bubble"] = statistics.mean(l["bubble"][0] for l in steady)
print(json.dumps(row))
PYEOF
  tail -n 1 "$rows"
done
$PY - "$rows" "$(nproc)" <<'PYEOF'
import json, sys
print(f"\n{'case':24} {'procs':>5} {'planned ms':>10} {'measured ms':>11} {'of it comm':>10} {'ratio':>6}"
      f" {'planned MB':>10} {'peak MB':>8} {'ratio':>6} {'bytes ratio':>11} {'bubble':>13}  ({sys.argv[2]} cores)")
nan = float("nan")
for l in open(sys.argv[1]):
    r = json.loads(l)
    p = r["planned_s"]
    sent = (f"{r['planned_bytes'] / r['measured_bytes']:11.3f}"
            if r.get("planned_bytes") and r.get("measured_bytes") else f"{'-':>11}")
    bubble = (f"{r['planned_bubble']:6.3f}/{r['measured_bubble']:6.3f}"
              if "measured_bubble" in r else f"{'-':>13}")
    print(f"{r['case']:24} {r['nproc']:5} {p * 1e3 if p else nan:10.2f} {r['measured_s'] * 1e3:11.2f} "
          f"{r['comm_s'] * 1e3:10.2f} {p / r['measured_s'] if p else nan:6.2f}"
          f" {r['planned_mb']:10.1f} {r['measured_mb']:8.1f} {r['planned_mb'] / r['measured_mb']:6.2f}"
          f" {sent} {bubble}")
PYEOF
