#!/usr/bin/env bash
# dtrain against PyTorch (scripts/baselines/gpu.py) on one GPU, side by side in one
# run: the MLP and the CNN on Fashion-MNIST at batch 64 (SGD, fp32 with TF32, as the
# baseline), and GPT-2 small's shape at batch 16 x 1024 tokens (bf16 autocast, AdamW,
# clipping at 1.0). Prints one JSON line per run and a table of ratios; MFU as the
# baseline counts it (6 N per token + attention, against --peak-tflops 989); and the GPT
# step's phases with the GPU synchronised at each end, the baseline's (scripts/gpt_phases.py)
# beside dtrain's logged steps, to show where a gap is.
#   scripts/bench_gpu.sh BUILD_DIR [DATA_DIR]
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
BUILD=${1:?usage: scripts/bench_gpu.sh BUILD_DIR [DATA_DIR]}
DATA=${2:-/usr/share/datasets/fashion-mnist}
BASELINE=${BASELINE:-$ROOT/scripts/baselines/gpu.py}
OUT_DIR=${OUT_DIR:-/tmp/dtrain-bench-gpu}
mkdir -p "$OUT_DIR"
rows=$OUT_DIR/bench_gpu.jsonl
: > "$rows"
export PYTHONUNBUFFERED=1

dtrain_run() {  # model, config, extra args...
  local model=$1 cfg=$2; shift 2
  rm -rf "$OUT_DIR/run"
  "$BUILD/dtrain" run "$ROOT/configs/$cfg" --run-dir "$OUT_DIR/run" --set train.device=cuda \
    --set logging.progress=off --set train.eval_every=100000 "$@" > "$OUT_DIR/$model.log" 2>&1 ||
    { cat "$OUT_DIR/$model.log" >&2; return 1; }
  python3 - "$model" "$OUT_DIR/run/metrics.jsonl" >> "$rows" <<'PYEOF'
import json, statistics, sys
lines = [json.loads(l) for l in open(sys.argv[2])]
s = lines[-1]
row = {"who": "dtrain", "model": sys.argv[1], "samples_per_s": s["samples_per_s"],
       "step_ms": s["step_ms_median"], "device": s["device"]}
if "tokens_per_s" in s:
    row["tokens_per_s"] = s["tokens_per_s"]
# A logged step's phases are the GPU's (it waits at each phase's end): the later ones.
train = [l for l in lines if l["kind"] == "train"][1:]
for k in ("forward_ms", "backward_ms", "optim_ms"):
    if train:
        row[k] = statistics.median(l[k] for l in train)
print(json.dumps(row))
PYEOF
}

for model in mlp cnn; do
  python3 "$BASELINE" --model $model --batch 64 --steps 300 --data-dir "$DATA" |
    python3 -c 'import json,sys; r=json.loads(sys.stdin.read()); r["who"]="pytorch"; print(json.dumps(r))' >> "$rows"
  dtrain_run $model fashion_mnist_$model.yaml --set data.path="$DATA" --set train.max_steps=900 \
    --set data.batch_size=64 --set train.log_every=100
done
python3 "$BASELINE" --model gpt --batch 16 --steps 30 |
  python3 -c 'import json,sys; r=json.loads(sys.stdin.read()); r["who"]="pytorch"; print(json.dumps(r))' >> "$rows"
# 80 steps, the first 16 left out of the rate; two logged (they wait at each phase).
dtrain_run gpt gpt2_small.yaml --set precision.dtype=bf16 --set train.max_steps=80 \
  --set train.log_every=40
# The baseline's GPT step phase by phase, to set beside dtrain's logged steps.
python3 "$ROOT/scripts/gpt_phases.py" "$BASELINE" --batch 16 --steps 20 >> "$rows" ||
  echo "bench_gpu: gpt_phases.py failed" >&2

python3 - "$rows" <<'PYEOF'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
print("\n".join(json.dumps(r) for r in rows))
by = {(r["who"], r["model"]): r for r in rows}
print(f"{'model':6} {'pytorch':>14} {'dtrain':>14} {'dtrain/pytorch':>15}")
for m in ("mlp", "cnn", "gpt"):
    key = "tokens_per_s" if m == "gpt" else "samples_per_s"
    p, d = by.get(("pytorch", m)), by.get(("dtrain", m))
    if not p or not d:
        continue
    print(f"{m:6} {p[key]:14.0f} {d[key]:14.0f} {d[key] / p[key]:15.2f}   ({key})")
    # The baseline times its median step; dtrain's rate is the mean over its steady steps.
    print(f"{'':6} median step ms: pytorch {p['step_ms']:.2f}, dtrain {d['step_ms']:.2f}"
          f" (dtrain/pytorch by medians {p['step_ms'] / d['step_ms']:.2f})")
    if m == "gpt":
        n, seq = p["params"], p["seq"]
        flops_per_token = 6 * n + 12 * 12 * 768 * seq
        print(f"   MFU: pytorch {p['mfu']:.1%}, dtrain {d[key] * flops_per_token / 1e12 / 989:.1%}")
        # Phases with the GPU synchronised at each end (pytorch: gpt_phases.py; dtrain: its
        # logged steps). The baseline's norm belongs to dtrain's optim phase.
        ph = by.get(("pytorch", "gpt-phases"))
        if ph and "forward_ms" in d:
            print("   phases ms (pytorch / dtrain): forward %.2f / %.2f, backward %.2f / %.2f, "
                  "norm+clip+update %.2f / %.2f" % (ph["forward_ms"], d["forward_ms"],
                  ph["backward_ms"], d["backward_ms"], ph["norm_ms"] + ph["optim_ms"], d["optim_ms"]))
PYEOF
