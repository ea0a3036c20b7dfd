#!/usr/bin/env bash
# logging.tensorboard on real runs, decoded by tests/check_tensorboard.py twice (Python's
# protobuf against the published field numbers, not dtrain's encoder; and tensorboard's own
# EventAccumulator, pinned in scripts/requirements-test.txt): a GPT run's scalars
# (train/loss, train/lr, train/tokens_per_s, eval/perplexity, ...) match metrics.jsonl;
# and a run resumed from an earlier checkpoint than its last step rewrites its event file
# with no step twice.
#   tests/check_tensorboard.sh DTRAIN SOURCE_DIR
set -uo pipefail
dtrain=${1:?usage: check_tensorboard.sh DTRAIN SOURCE_DIR} src=${2:?usage: check_tensorboard.sh DTRAIN SOURCE_DIR}
/usr/bin/python3 -c "import google.protobuf" 2>/dev/null ||
  { echo "check_tensorboard: needs python3-protobuf (scripts/setup.sh --test)" >&2; exit 1; }
py=${DTRAIN_PYTHON:-$src/.venv/bin/python}
"$py" -c "import tensorboard" 2>/dev/null ||
  { echo "check_tensorboard: needs tensorboard in $py (scripts/setup.sh --test)" >&2; exit 1; }
# Both readers: the one built here from the published field numbers, and TensorBoard's own.
check() {
  timeout 60 /usr/bin/python3 "$src/tests/check_tensorboard.py" "$1" &&
    timeout 120 "$py" "$src/tests/check_tensorboard.py" --tensorboard "$1"
}
dir=$(mktemp -d /tmp/dtrain-tb.XXXXXX)
trap 'rm -rf "$dir"' EXIT
fail() { echo "check_tensorboard: $*" >&2; exit 1; }
cat > "$dir/job.yaml" <<'YAML'
name: tb-check
seed: 1
data: {dataset: synthetic_tokens, samples: 256, test_samples: 32, seq_len: 16, batch_size: 8, workers: 1}
model: {arch: gpt, layers: 1, heads: 2, dim: 16, seq_len: 16, vocab: 64}
optimizer: {name: adamw, lr: 0.003}
train: {max_steps: 20, log_every: 2, eval_every: 10, threads: 1}
checkpoint: {every_steps: 10, keep_last: 5}
logging: {progress: "off", tensorboard: true}
YAML
timeout 120 "$dtrain" run "$dir/job.yaml" --run-dir "$dir/a" > "$dir/a.log" 2>&1 || fail "run failed: $(tail -1 "$dir/a.log")"
check "$dir/a" || fail "run a"
grep -q '"tokens_per_s"' "$dir/a/metrics.jsonl" || fail "no tokens_per_s to check"
# Steps 11-20 again from the step-10 checkpoint: the event file holds each step once.
timeout 120 "$dtrain" run "$dir/job.yaml" --run-dir "$dir/a" --resume "$dir/a/checkpoints/step-00000010" \
  > "$dir/b.log" 2>&1 || fail "resume failed: $(tail -1 "$dir/b.log")"
check "$dir/a" || fail "after the resume"
echo "check_tensorboard: ok"
