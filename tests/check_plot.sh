#!/usr/bin/env bash
# scripts/plot.py on real runs: three short runs (one of them resumed, so its metrics.jsonl
# repeats no step but has a second leg; one rolled back, with a branch line) side by side
# make a PNG; a folder without metrics.jsonl is exit 2 naming the file.
#   tests/check_plot.sh DTRAIN SOURCE_DIR
set -uo pipefail
dtrain=${1:?usage: check_plot.sh DTRAIN SOURCE_DIR} src=${2:?usage: check_plot.sh DTRAIN SOURCE_DIR}
dir=$(mktemp -d /tmp/dtrain-plot.XXXXXX)
trap 'rm -rf "$dir"' EXIT
fail() { echo "check_plot: $*" >&2; exit 1; }
cat > "$dir/job.yaml" <<'YAML'
name: plot-check
seed: 1
data: {dataset: synthetic, samples: 512, test_samples: 64, input_shape: [1, 8, 8], classes: 4, batch_size: 32, workers: 1}
model: {arch: mlp, hidden: [16]}
optimizer: {name: sgd, lr: 0.05}
train: {max_steps: 20, log_every: 2, eval_every: 10, threads: 1}
checkpoint: {every_steps: 10}
logging: {progress: "off"}
YAML
timeout 120 "$dtrain" run "$dir/job.yaml" --run-dir "$dir/a" > /dev/null 2>&1 || fail "run a failed"
timeout 120 "$dtrain" run "$dir/job.yaml" --run-dir "$dir/b" --set train.max_steps=10 > /dev/null 2>&1 || fail "run b failed"
timeout 120 "$dtrain" run "$dir/job.yaml" --run-dir "$dir/b" --resume auto > /dev/null 2>&1 || fail "run b's resume failed"
# A rollback: c's metrics.jsonl has a branch line at step 10, drawn as a mark on the curve.
timeout 120 "$dtrain" run "$dir/job.yaml" --run-dir "$dir/c" > /dev/null 2>&1 || fail "run c failed"
timeout 120 "$dtrain" run "$dir/job.yaml" --run-dir "$dir/c" --set optimizer.lr=0.1 \
  --resume "$dir/c/checkpoints/step-00000010" > /dev/null 2>&1 || fail "run c's rollback failed"
grep -q '"kind":"branch"' "$dir/c/metrics.jsonl" || fail "c's rollback wrote no branch line"
out=$(timeout 120 /usr/bin/python3 "$src/scripts/plot.py" "$dir/a" "$dir/b" "$dir/c" -o "$dir/curves.png" --title check 2>&1) ||
  fail "plot.py failed: $out"
[ "$(head -c 8 "$dir/curves.png" | od -An -tx1 | tr -d ' \n')" = 89504e470d0a1a0a ] || fail "not a PNG"
[ "$(stat -c %s "$dir/curves.png")" -gt 20000 ] || fail "a PNG too small to hold the curves"
mkdir "$dir/empty"
err=$(timeout 60 /usr/bin/python3 "$src/scripts/plot.py" "$dir/empty" -o "$dir/x.png" 2>&1)
code=$?
[ $code -eq 2 ] || fail "a folder without metrics.jsonl: exit $code, not 2"
case "$err" in *"$dir/empty/metrics.jsonl' does not exist"*) ;; *) fail "unclear error: $err" ;; esac
# Damaged metrics files: exit 2 and a "plot: FILE:LINE" line, never a traceback.
bad() {  # name, content (printf format), what the message must say
  mkdir -p "$dir/$1"
  printf "$2" > "$dir/$1/metrics.jsonl"
  err=$(timeout 60 /usr/bin/python3 "$src/scripts/plot.py" "$dir/$1" -o "$dir/y.png" 2>&1)
  code=$?
  [ $code -eq 2 ] || fail "$1: exit $code, not 2: $err"
  case "$err" in *Traceback*) fail "$1: a traceback: $err" ;; esac
  case "$err" in *"$3"*) ;; *) fail "$1: unclear error: $err" ;; esac
}
bad array '[1, 2]\n' "metrics.jsonl:1: not a JSON object"
bad nostep '{"kind": "train", "loss": 1}\n' "metrics.jsonl:1: a train line without an integer step"
bad strstep '{"kind": "train", "step": "7", "loss": 1}\n' "without an integer step"
bad strloss '{"kind": "train", "step": 1, "loss": "x"}\n' "loss is not a number"
bad binary '{"kind": "train", "step": 1, "loss": 1}\n\377\376\n' "not UTF-8"
echo "check_plot: ok"
