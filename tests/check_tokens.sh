#!/usr/bin/env bash
# scripts/prepare_tokens.py on the fortunes text (setup.sh --test's .venv: tiktoken and
# GPT-2's ranks), read back independently:
#  - GPT-2's own ids for known strings (published values, not the script's);
#  - every shard's llm.c header matches its size; decoded by tiktoken, the train and val
#    documents are the fortunes in their order, each opened by <|endoftext|>, none lost;
#  - val holds its fraction of the tokens;
#  - a document cut into pieces (a tiny --chunk-bytes) gives the same shards as whole;
#  - dtrain trains and evaluates a GPT on the shards;
#  - bad input is exit 2 naming it; a full disk exit 3, leaving no partial shard; a second
#    run into the same folder leaves none of the first's shards.
#   tests/check_tokens.sh DTRAIN SOURCE_DIR
set -uo pipefail
dtrain=${1:?usage: check_tokens.sh DTRAIN SOURCE_DIR} src=${2:?usage: check_tokens.sh DTRAIN SOURCE_DIR}
py=${DTRAIN_PYTHON:-$src/.venv/bin/python}
"$py" -c "import tiktoken" 2>/dev/null ||
  { echo "check_tokens: needs tiktoken in $py (scripts/setup.sh --test)" >&2; exit 1; }
fortunes=/usr/share/games/fortunes
[ -d "$fortunes" ] || { echo "check_tokens: needs $fortunes (scripts/setup.sh installs fortunes)" >&2; exit 1; }
dir=$(mktemp -d /tmp/dtrain-tokens.XXXXXX)
trap 'rm -rf "$dir"' EXIT
fail() { echo "check_tokens: $*" >&2; exit 1; }
prep() { timeout 300 "$py" "$src/scripts/prepare_tokens.py" "$@"; }

# Known ids: GPT-2's BPE of these strings, as OpenAI's tokenizer gives them.
mkdir "$dir/known"
printf 'Hello world' > "$dir/known/a.txt"
printf 'The quick brown fox jumps over the lazy dog.' > "$dir/known/b.txt"
prep "$dir/known" --out "$dir/known-out" --val-fraction 0 > "$dir/known.log" 2>&1 || fail "known: $(tail -1 "$dir/known.log")"
"$py" - "$dir/known-out/tokens_train_000000.bin" <<'PY' || fail "GPT-2's ids"
import array, sys
ids = array.array("H", open(sys.argv[1], "rb").read()[1024:]).tolist()
want = [50256, 15496, 995, 50256, 464, 2068, 7586, 21831, 18045, 625, 262, 16931, 3290, 13]
if ids != want:
    sys.exit(f"check_tokens: ids {ids}, GPT-2's {want}")
PY

# The fortunes, in shards of 200k tokens, 2% held out.
prep "$fortunes" --out "$dir/shards" --name fortunes --separator % --val-fraction 0.02 \
  --shard-tokens 200000 > "$dir/prep.log" 2>&1 || fail "fortunes: $(tail -1 "$dir/prep.log")"
grep -q "documents from" "$dir/prep.log" || fail "no summary line: $(tail -1 "$dir/prep.log")"
"$py" - "$fortunes" "$dir/shards" "$src/.venv/share/dtrain/gpt2.tiktoken" <<'PY' || fail "the shards do not hold the fortunes"
import array, base64, glob, os, sys
import tiktoken
from tiktoken_ext.openai_public import r50k_pat_str
folder, out, bpe = sys.argv[1:]
# The documents, read here the way the script's usage says: every text file of the folder
# (sorted; no hidden files, links or binaries), split at lines that are exactly "%".
docs = []
for name in sorted(os.listdir(folder)):
    path = os.path.join(folder, name)
    if name.startswith(".") or os.path.islink(path) or b"\0" in open(path, "rb").read():
        continue
    doc = []
    for line in open(path, encoding="utf-8", errors="replace", newline=""):
        if line.rstrip("\r\n") == "%":
            if doc: docs.append("".join(doc))
            doc = []
        else:
            doc.append(line)
    if doc: docs.append("".join(doc))
ranks = {}
for line in open(bpe, "rb").read().splitlines():
    t, r = line.split()
    ranks[base64.b64decode(t)] = int(r)
enc = tiktoken.Encoding(name="gpt2", pat_str=r50k_pat_str, mergeable_ranks=ranks,
                        special_tokens={"<|endoftext|>": 50256})
def split_docs(pattern):
    ids, paths = [], sorted(glob.glob(os.path.join(out, pattern)))
    for p in paths:
        raw = open(p, "rb").read()
        head = array.array("i", raw[:1024])
        assert head[0] == 20240520 and head[1] == 1, f"{p}: header {head[:3].tolist()}"
        assert len(raw) == 1024 + 2 * head[2], f"{p}: {len(raw)} bytes for {head[2]} tokens"
        ids += array.array("H", raw[1024:]).tolist()
    assert ids and ids[0] == 50256, f"{pattern}: does not open with <|endoftext|>"
    pieces, cur = [], []
    for i in ids[1:] + [50256]:
        if i == 50256:
            pieces.append(enc.decode(cur)); cur = []
        else:
            cur.append(i)
    return paths, ids, pieces
tpaths, tids, train = split_docs("fortunes_train_*.bin")
vpaths, vids, val = split_docs("fortunes_val_*.bin")
assert len(tpaths) >= 3, f"{len(tpaths)} train shard(s) of 200k tokens"
assert all(len(open(p, "rb").read()) == 1024 + 400000 for p in tpaths[:-1]), "a full shard is not 200k tokens"
# Every fortune once, in order, in one split or the other.
t = v = 0
for i, d in enumerate(docs):
    if t < len(train) and train[t] == d: t += 1
    elif v < len(val) and val[v] == d: v += 1
    else: sys.exit(f"check_tokens: fortune {i} ({d[:40]!r}) is in neither split at its place")
assert t == len(train) and v == len(val), f"{len(train) - t} train, {len(val) - v} val document(s) left over"
share = len(vids) / (len(vids) + len(tids))
assert 0.018 < share < 0.022, f"val holds {share:.4f} of the tokens, not 0.02"
print(f"check_tokens: {len(docs)} fortunes, {len(tids)} train and {len(vids)} val tokens ({share:.4f})")
PY

# One long document (blank lines, indents, trailing spaces) in 1 KB pieces and whole.
"$py" -c "
import random; r = random.Random(3); words = ['alpha', 'Beta', '  gamma', '\tdelta', '42', ' ', '\n', '\n\n', '.', 'x  ', '\r\n']
open('$dir/long.txt', 'w').write(''.join(r.choice(words) + (' ' if r.random() < .5 else '') for _ in range(60000)))"
prep "$dir/long.txt" --out "$dir/whole" --val-fraction 0 > "$dir/whole.log" 2>&1 || fail "whole: $(tail -1 "$dir/whole.log")"
prep "$dir/long.txt" --out "$dir/pieces" --val-fraction 0 --chunk-bytes 1000 > "$dir/pieces.log" 2>&1 || fail "pieces: $(tail -1 "$dir/pieces.log")"
cmp -s "$dir/whole/tokens_train_000000.bin" "$dir/pieces/tokens_train_000000.bin" || fail "a document in pieces is tokenized differently"
pieces=$("$py" -c "import sys; sys.path.insert(0, sys.argv[1]); import prepare_tokens as p; print(sum(1 for _ in p.documents([sys.argv[2]], None, 1000)))" \
         "$src/scripts" "$dir/long.txt")
[ "${pieces:-0}" -ge 50 ] || fail "the long document came in ${pieces:-no} piece(s), not cut"

# dtrain trains and evaluates on them.
cat > "$dir/job.yaml" <<YAML
name: tokens-check
seed: 1
data: {dataset: tokens, path: '$dir/shards/fortunes_train_*.bin', eval_path: '$dir/shards/fortunes_val_*.bin',
       seq_len: 32, batch_size: 4, workers: 1}
model: {arch: gpt, layers: 1, heads: 2, dim: 32, seq_len: 32, vocab: 50304}
optimizer: {name: adamw, lr: 0.001}
train: {max_steps: 3, log_every: 1, eval_every: 3, eval_samples: 32, threads: 1}
checkpoint: {every_steps: 0}
logging: {progress: "off"}
YAML
timeout 120 "$dtrain" run "$dir/job.yaml" --run-dir "$dir/run" > "$dir/run.log" 2>&1 || fail "dtrain run: $(tail -1 "$dir/run.log")"
grep -q '"kind":"eval".*"perplexity"' "$dir/run/metrics.jsonl" || fail "no evaluation in $(tail -2 "$dir/run/metrics.jsonl")"

# Bad input: exit 2 naming it.
refused() {
  local name=$1 want=$2; shift 2
  prep "$@" > "$dir/$name.log" 2>&1
  local rc=$?
  [ $rc -eq 2 ] || fail "$name: exit $rc, wanted 2: $(tail -1 "$dir/$name.log")"
  grep -q -e "$want" "$dir/$name.log" || fail "$name: the error does not name $want: $(tail -1 "$dir/$name.log")"
}
refused missing "$dir/nowhere" "$dir/nowhere" --out "$dir/x"
mkdir "$dir/binary" && printf 'a\0b' > "$dir/binary/x.dat"
refused binary "no text files" "$dir/binary" --out "$dir/x"
refused bpe "not GPT-2's" "$dir/long.txt" --out "$dir/x" --bpe "$dir/long.txt"
refused fraction "val-fraction" "$dir/long.txt" --out "$dir/x" --val-fraction 1
refused name "--name 'a/b'" "$dir/long.txt" --out "$dir/x" --name a/b
# A second run into the same --out with fewer shards leaves none of the first's behind (a
# folder data.path would read both corpora).
prep "$dir/long.txt" --out "$dir/again" --shard-tokens 5000 --val-fraction 0 > "$dir/again1.log" 2>&1 ||
  fail "again: $(tail -1 "$dir/again1.log")"
[ "$(ls "$dir/again" | wc -l)" -ge 3 ] || fail "the long text gave $(ls "$dir/again" | wc -l) shard(s) of 5000"
printf 'Hello world' > "$dir/short.txt"
prep "$dir/short.txt" --out "$dir/again" --val-fraction 0 > "$dir/again2.log" 2>&1 || fail "again: $(tail -1 "$dir/again2.log")"
[ "$(ls -A "$dir/again")" = tokens_train_000000.bin ] || fail "an earlier run's shards stayed: $(ls -A "$dir/again" | tr '\n' ' ')"
grep -q "removed $dir/again/tokens_train_000001.bin" "$dir/again2.log" || fail "the stale shards' removal is not said"
# A full disk: exit 3 naming the shard, no partial file (root: a tmpfs of its own).
if [ "$(id -u)" -eq 0 ] && mkdir "$dir/full" && mount -t tmpfs -o size=16k tmpfs "$dir/full" 2>/dev/null; then
  prep "$dir/long.txt" --out "$dir/full" --val-fraction 0 > "$dir/full.log" 2>&1
  rc=$?
  ls -A "$dir/full" > "$dir/full.ls"
  umount "$dir/full"
  [ $rc -eq 3 ] || fail "a full disk: exit $rc, wanted 3: $(tail -1 "$dir/full.log")"
  grep -q "cannot write '$dir/full/tokens_train_000000.bin'" "$dir/full.log" || fail "a full disk: $(tail -1 "$dir/full.log")"
  grep -q Traceback "$dir/full.log" && fail "a full disk: a traceback"
  [ ! -s "$dir/full.ls" ] || fail "a full disk left $(cat "$dir/full.ls")"
fi
: > "$dir/empty.txt"
refused empty "are empty" "$dir/empty.txt" --out "$dir/x"
# Bytes that are not UTF-8 are read as U+FFFD, and the file is named.
printf 'caf\xe9 au lait\n' > "$dir/latin1.txt"
prep "$dir/latin1.txt" --out "$dir/latin1" > "$dir/latin1.log" 2>&1 || fail "latin1: $(tail -1 "$dir/latin1.log")"
grep -q "latin1.txt: 1 byte(s) that are not UTF-8" "$dir/latin1.log" || fail "no warning naming latin1.txt: $(cat "$dir/latin1.log")"
echo "check_tokens: ok"
