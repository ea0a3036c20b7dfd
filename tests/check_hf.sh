#!/usr/bin/env bash
# Hugging Face GPT-2 out and in, read and written by transformers itself (pinned in
# scripts/requirements-test.txt, installed into .venv by scripts/setup.sh --test):
#  - a random GPT-2 saved by transformers, trained one step by dtrain from model.init_from,
#    starts from the loss transformers computes on the same tokens;
#  - a checkpoint trained on tensor 2 and exported with --format hf loads in transformers
#    with no key missing or unexpected, the head tied, and its loss on held-out tokens is
#    dtrain's own evaluation's;
#  - the safetensors package reads every part of that checkpoint and its plain export
#    (tests/python/check_safetensors.py);
#  - a padded vocabulary goes both ways; a mismatch (heads, positions, architecture) and an
#    MLP's export are named errors.
#   tests/check_hf.sh DTRAIN SOURCE_DIR
set -uo pipefail
dtrain=${1:?usage: check_hf.sh DTRAIN SOURCE_DIR} src=${2:?usage: check_hf.sh DTRAIN SOURCE_DIR}
py=${DTRAIN_PYTHON:-$src/.venv/bin/python}
"$py" -c "import transformers" 2>/dev/null ||
  { echo "check_hf: needs transformers in $py (scripts/setup.sh --test)" >&2; exit 1; }
dir=$(mktemp -d /tmp/dtrain-hf.XXXXXX)
trap 'rm -rf "$dir"' EXIT
fail() { echo "check_hf: $*" >&2; exit 1; }
hf() { timeout 120 "$py" "$src/tests/python/check_hf.py" "$@"; }
# The value of KEY in the last metrics.jsonl line of KIND.
metric() { "$py" -c "import json,sys; print([l for l in map(json.loads, open(sys.argv[1])) if l['kind'] == sys.argv[2]][-1][sys.argv[3]])" "$1/metrics.jsonl" "$2" "$3"; }
close() { "$py" -c "import sys; a, b = map(float, sys.argv[1:]); sys.exit(abs(a - b) > 1e-4 * abs(b))" "$1" "$2" ||
            fail "$3: dtrain $1, transformers $2"
          echo "check_hf: $3: dtrain $1, transformers $2"; }
# Exit code $2 and a message naming $3.
refused() {
  local name=$1 code=$2 want=$3; shift 3
  timeout 60 "$@" > "$dir/$name.log" 2>&1
  local rc=$?
  [ $rc -eq "$code" ] || fail "$name: exit $rc, wanted $code: $(tail -1 "$dir/$name.log")"
  grep -q "$want" "$dir/$name.log" || fail "$name: the error does not name $want: $(tail -1 "$dir/$name.log")"
}

hf make "$dir" || fail "transformers could not make the model"
cat > "$dir/job.yaml" <<YAML
name: hf-check
seed: 1
data: {dataset: tokens, path: $dir/train.bin, eval_path: $dir/val.bin, token_format: nanogpt,
       seq_len: 16, batch_size: 4, workers: 1}
model: {arch: gpt, layers: 2, heads: 2, dim: 32, seq_len: 16, vocab: 64, init_from: $dir/hf0}
optimizer: {name: sgd, lr: 0.5}
train: {max_steps: 1, log_every: 1, eval_every: 100, threads: 1}
checkpoint: {every_steps: 0, keep_last: 1}
logging: {progress: "off"}
YAML
run() { local out=$1; shift; timeout 120 "$dtrain" run "$dir/job.yaml" --run-dir "$dir/$out" "$@" > "$dir/$out.log" 2>&1 ||
          fail "$out: $(tail -1 "$dir/$out.log")"; }

# In: dtrain's first loss is transformers' on the same batch (the 4 windows of train.bin).
run in
want=$("$py" -c "import json,sys; print(json.load(open(sys.argv[1]))['train'])" "$dir/hf0.json")
close "$(metric "$dir/in" train loss)" "$want" "the first step's loss from transformers' GPT-2"

# Out: trained on tensor 2 (the export merges the parts), loaded by transformers.
run out --nproc 2 --set parallel.tensor=2 --set train.max_steps=6
timeout 60 "$dtrain" export "$dir/out" "$dir/out-hf" --format hf > "$dir/export.log" 2>&1 ||
  fail "export: $(tail -1 "$dir/export.log")"
hf load "$dir/out-hf" "$dir/out-hf2" || fail "transformers does not load the export"
close "$(metric "$dir/out" eval loss)" "$(hf loss "$dir/out-hf" "$dir/val.bin")" "held-out loss of the export"
# The safetensors package reads every part of the tensor-2 checkpoint and the plain export.
timeout 60 "$dtrain" inspect "$dir/out" > "$dir/inspect-out.log" 2>&1 || fail "inspect: $(tail -1 "$dir/inspect-out.log")"
timeout 60 "$dtrain" export "$dir/out" "$dir/out.safetensors" > "$dir/export.log" 2>&1 ||
  fail "export: $(tail -1 "$dir/export.log")"
timeout 120 "$py" "$src/tests/python/check_safetensors.py" "$dir/out/checkpoints/$(cat "$dir/out/checkpoints/latest")" \
  "$dir/inspect-out.log" "$dir/out.safetensors" || fail "the safetensors package"
# What transformers saved again, dtrain reads as the same model.
timeout 60 "$dtrain" inspect "$dir/out-hf2" > "$dir/inspect.log" 2>&1 || fail "inspect: $(tail -1 "$dir/inspect.log")"
grep -q "h.1.attn.c_attn.weight *\[96, 32\]" "$dir/inspect.log" || fail "inspect: $(head -3 "$dir/inspect.log")"
run again --set model.init_from="$dir/out-hf2"
close "$(metric "$dir/again" train loss)" "$(hf loss "$dir/out-hf" "$dir/train.bin")" "init_from transformers' save of the export"

# A vocabulary padded for the tensor split: in from 64 rows, out as 64 again.
run padded --set model.vocab=128
timeout 60 "$dtrain" export "$dir/padded" "$dir/padded-hf" --format hf --vocab 64 > "$dir/export.log" 2>&1 ||
  fail "export --vocab: $(tail -1 "$dir/export.log")"
grep -q '"vocab_size": 64' "$dir/padded-hf/config.json" || fail "export --vocab 64: $(grep vocab "$dir/padded-hf/config.json")"
hf load "$dir/padded-hf" "$dir/padded-hf2" || fail "transformers does not load the padded export"

# Mismatches are exit 3 naming the field; an MLP has no GPT-2 layout (exit 2).
refused heads 3 n_head "$dtrain" run "$dir/job.yaml" --run-dir "$dir/x1" --set model.heads=4
refused positions 3 n_positions "$dtrain" run "$dir/job.yaml" --run-dir "$dir/x2" --set model.seq_len=32 --set data.seq_len=32 --set data.batch_size=2
cp -r "$dir/hf0" "$dir/hf-big"
"$py" -c "import json,sys; p = sys.argv[1]; c = json.load(open(p)); c['vocab_size'] = 128; json.dump(c, open(p, 'w'))" "$dir/hf-big/config.json"
refused vocab 3 vocab_size "$dtrain" run "$dir/job.yaml" --run-dir "$dir/x3" --set model.init_from="$dir/hf-big"
mkdir "$dir/bert" && echo '{"model_type": "bert", "hidden_size": 32}' > "$dir/bert/config.json"
refused arch 3 model_type "$dtrain" run "$dir/job.yaml" --run-dir "$dir/x4" --set model.init_from="$dir/bert"
timeout 60 "$dtrain" run "$src/configs/fashion_mnist_mlp.yaml" --run-dir "$dir/mlp" --set data.dataset=synthetic \
  --set data.samples=64 --set data.test_samples=16 --set train.max_steps=1 --set logging.progress=off > "$dir/mlp.log" 2>&1 ||
  fail "mlp: $(tail -1 "$dir/mlp.log")"
refused mlp-export 2 model.arch "$dtrain" export "$dir/mlp" "$dir/mlp-hf" --format hf
echo "check_hf: ok"
