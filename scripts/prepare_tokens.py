#!/usr/bin/env python3
# Text files to llm.c token shards with GPT-2's BPE, for `data.dataset: tokens`
# (configs/gpt2_tokens.yaml). Each document starts with <|endoftext|> (id 50256), as GPT-2
# and llm.c train; a share of the documents (--val-fraction of the tokens, spread over the
# whole input) goes to the val shards, the rest to train. A shard is llm.c's format: a
# 256 x int32 header (magic 20240520, version 1, token count), then uint16 ids.
#   scripts/prepare_tokens.py INPUT... --out DIR [--name NAME] [--separator LINE]
#       [--val-fraction F] [--shard-tokens N] [--bpe FILE]
# INPUT is a file or a folder (its files, sorted; hidden files, links and binary files are
# skipped, as dtrain's `text` dataset does). A document is a whole file, or with
# --separator the lines between two lines equal to LINE (`%` in fortune files).
# Needs tiktoken (scripts/setup.sh --test puts it into .venv, with GPT-2's BPE ranks, so
# nothing is downloaded at run time): .venv/bin/python scripts/prepare_tokens.py ...
import argparse
import array
import base64
import codecs
import hashlib
import os
import re
import sys
import time

MAGIC, VERSION, HEADER_INTS = 20240520, 1, 256
EOT = 50256
# GPT-2's merge ranks (tiktoken's r50k_base and gpt2 encodings); the file setup.sh installs
# is checked against it, so a different vocabulary is named rather than written.
GPT2_RANKS_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"
DEFAULT_BPE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".venv",
                           "share", "dtrain", "gpt2.tiktoken")


def fail(message, code=2):
    """One line, and exit 2 (bad arguments) or 3 (a file that cannot be read or written)."""
    print(f"prepare_tokens: {message}", file=sys.stderr)
    sys.exit(code)


def gpt2_encoding(bpe_path):
    """tiktoken's GPT-2 encoding: from BPE_PATH (or the file setup.sh installs) when there
    is one, else tiktoken's own download."""
    try:
        import tiktoken
        from tiktoken_ext.openai_public import r50k_pat_str
    except ImportError:
        fail("needs tiktoken: run scripts/setup.sh --test, then use .venv/bin/python")
    path = bpe_path or (DEFAULT_BPE if os.path.isfile(DEFAULT_BPE) else None)
    if path is None:
        return tiktoken.get_encoding("gpt2")
    try:
        data = open(path, "rb").read()
    except OSError as e:
        fail(f"--bpe '{path}': {e.strerror}")
    if hashlib.sha256(data).hexdigest() != GPT2_RANKS_SHA256:
        fail(f"'{path}' is not GPT-2's BPE ranks (sha256 differs)")
    ranks = {}
    for line in data.splitlines():
        token, rank = line.split()
        ranks[base64.b64decode(token)] = int(rank)
    return tiktoken.Encoding(name="gpt2", pat_str=r50k_pat_str, mergeable_ranks=ranks,
                             special_tokens={"<|endoftext|>": EOT}, explicit_n_vocab=EOT + 1)


def input_files(inputs):
    files, skipped = [], 0
    for given in inputs:
        if os.path.isfile(given):
            files.append(given)
        elif os.path.isdir(given):
            for name in sorted(os.listdir(given)):
                path = os.path.join(given, name)
                if name.startswith(".") or os.path.islink(path) or not os.path.isfile(path):
                    skipped += 1
                    continue
                with open(path, "rb") as f:
                    if b"\0" in f.read(65536):   # binary (fortune's .dat indexes)
                        skipped += 1
                        continue
                files.append(path)
        else:
            fail(f"input '{given}' does not exist")
    if not files:
        fail(f"no text files in {' '.join(inputs)} ({skipped} skipped: hidden, links or binary)")
    return files


# Bytes that are not UTF-8 become U+FFFD; the files that had any are named at the end.
not_utf8, _current = {}, [None]


def _count_and_replace(error):
    not_utf8[_current[0]] = not_utf8.get(_current[0], 0) + (error.end - error.start)
    return "\ufffd", error.end


codecs.register_error("dtrain-count", _count_and_replace)


def documents(files, separator, chunk_bytes):
    """Yields (new_document, text) pieces. A document longer than chunk_bytes comes in
    pieces, cut only where a lone "\n" stands between two characters that are not white
    space: GPT-2's pre-tokenizer ends a piece there whether or not text follows (after a
    longer run of white space it would not), so the ids are those of the whole document."""
    for path in files:
        with open(path, encoding="utf-8", errors="dtrain-count", newline="") as f:
            _current[0] = path
            piece, size, new = [], 0, True
            for line in f:
                if separator is not None and line.rstrip("\r\n") == separator:
                    if piece:
                        yield new, "".join(piece)
                    piece, size, new = [], 0, True
                    continue
                if (piece and size >= chunk_bytes and line[:1].strip() and len(piece[-1]) >= 2 and
                        piece[-1][-1] == "\n" and not piece[-1][-2].isspace()):
                    yield new, "".join(piece)
                    piece, size, new = [], 0, False
                piece.append(line)
                size += len(line)
            if piece:
                yield new, "".join(piece)


class Shards:
    """Writes one split's shards of at most shard_tokens ids each: NAME_SPLIT_000000.bin..."""

    def __init__(self, out, name, split, shard_tokens):
        self.out, self.prefix, self.limit = out, f"{name}_{split}", shard_tokens
        self.buffer, self.index, self.written, self.paths = array.array("H"), 0, 0, []

    @property
    def tokens(self):
        """Every id added so far, written or not."""
        return self.written + len(self.buffer)

    def add(self, ids):
        self.buffer.extend(ids)
        while len(self.buffer) >= self.limit:
            self.flush(self.limit)

    def flush(self, count=None):
        count = len(self.buffer) if count is None else count
        if count == 0:
            return
        ids = self.buffer[:count]
        del self.buffer[:count]
        if sys.byteorder != "little":
            ids.byteswap()
        header = array.array("i", [MAGIC, VERSION, count] + [0] * (HEADER_INTS - 3))
        if sys.byteorder != "little":
            header.byteswap()
        path = os.path.join(self.out, f"{self.prefix}_{self.index:06d}.bin")
        # Written beside under a hidden name (which dtrain's folder and glob data.path skip),
        # then renamed: a run stopped part-way, or a full disk, leaves no short shard.
        part = os.path.join(self.out, f".{self.prefix}_{self.index:06d}.bin.part")
        try:
            with open(part, "wb") as f:
                header.tofile(f)
                ids.tofile(f)
            os.replace(part, path)
        except OSError as e:
            try:
                os.remove(part)
            except OSError:
                pass
            fail(f"cannot write '{path}': {e.strerror}", code=3)
        self.index += 1
        self.written += count
        self.paths.append((path, count))


def main():
    p = argparse.ArgumentParser(description="Text files to llm.c token shards (GPT-2 BPE).")
    p.add_argument("inputs", nargs="+", metavar="INPUT", help="text files or folders of them")
    p.add_argument("--out", required=True, help="folder for the shards (made if missing)")
    p.add_argument("--name", default="tokens", help="shard name prefix (default: tokens)")
    p.add_argument("--separator", help="a line that ends a document (default: one per file)")
    p.add_argument("--val-fraction", type=float, default=0.01,
                   help="share of the tokens in the val shards (default 0.01; 0 = none)")
    p.add_argument("--shard-tokens", type=int, default=100_000_000,
                   help="ids per shard (default 100M, llm.c's)")
    p.add_argument("--bpe", help="GPT-2's ranks as a .tiktoken file (default: setup.sh's)")
    p.add_argument("--chunk-bytes", type=int, default=1 << 20, help=argparse.SUPPRESS)
    a = p.parse_args()
    if not 0 <= a.val_fraction < 1:
        fail(f"--val-fraction {a.val_fraction}: must be in [0, 1)")
    if a.shard_tokens < 1:
        fail(f"--shard-tokens {a.shard_tokens}: must be at least 1")
    if a.separator is not None and "\n" in a.separator:
        fail("--separator is one line")
    if not re.fullmatch(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}", a.name):
        fail(f"--name '{a.name}': a file-name prefix of letters, digits, '.', '_' or '-', "
             "not starting with '.'")
    files = input_files(a.inputs)
    enc = gpt2_encoding(a.bpe)
    try:
        os.makedirs(a.out, exist_ok=True)
    except OSError as e:
        fail(f"--out '{a.out}': {e.strerror}")

    splits = {s: Shards(a.out, a.name, s, a.shard_tokens) for s in ("train", "val")}
    total_bytes = sum(os.path.getsize(f) for f in files)
    done_bytes, docs, split = 0, 0, "train"
    bar = sys.stderr.isatty()
    last_draw = 0.0

    def write(batch):
        nonlocal docs, split, done_bytes, last_draw
        # tiktoken encodes a batch on every core; the pieces are then placed in order.
        encoded = enc.encode_ordinary_batch([text for _, _, text in batch], num_threads=threads)
        for (new, size, _), ids in zip(batch, encoded):
            if new:
                # A document goes to val while val holds less than its share of the tokens
                # so far: the val set is spread over every file, its size the fraction's.
                val, train = splits["val"].tokens, splits["train"].tokens
                split = "val" if val < a.val_fraction * (train + val) else "train"
                splits[split].add([EOT])
                docs += 1
            splits[split].add(ids)
            done_bytes += size
        if bar and time.monotonic() - last_draw > 0.2:
            last_draw = time.monotonic()
            share = min(done_bytes / max(total_bytes, 1), 1.0)
            tokens = sum(s.tokens for s in splits.values())
            print(f"\rprepare_tokens [{'#' * int(share * 30):<30}] {share:4.0%} "
                  f"{done_bytes / 1e6:.1f}/{total_bytes / 1e6:.1f} MB, {tokens:,} tokens",
                  end="", file=sys.stderr, flush=True)

    threads = os.cpu_count() or 1
    batch, batch_bytes = [], 0
    for new, text in documents(files, a.separator, a.chunk_bytes):
        size = len(text.encode("utf-8", errors="replace"))
        batch.append((new, size, text))
        batch_bytes += size
        if batch_bytes >= 8 * a.chunk_bytes:
            write(batch)
            batch, batch_bytes = [], 0
    write(batch)
    if bar:
        print(file=sys.stderr)
    for s in splits.values():
        s.flush()
    if docs == 0:
        fail(f"no text in {' '.join(a.inputs)}: the files are empty")
    for path, count in not_utf8.items():
        print(f"prepare_tokens: warning: {path}: {count} byte(s) that are not UTF-8, read as "
              "U+FFFD", file=sys.stderr)
    # An earlier run's shards of the same name that this one did not write again (fewer, or
    # no val split now) would be read with these by a folder or glob data.path: removed.
    written = {path for s in splits.values() for path, _ in s.paths}
    stale = sorted(os.path.join(a.out, f) for f in os.listdir(a.out)
                   if re.fullmatch(re.escape(a.name) + r"_(train|val)_\d{6}\.bin", f)
                   and os.path.join(a.out, f) not in written)
    for path in stale:
        try:
            os.remove(path)
        except OSError as e:
            fail(f"cannot remove '{path}', an earlier run's shard: {e.strerror}", code=3)
    for s in splits.values():
        for path, count in s.paths:
            print(f"prepare_tokens: wrote {path} ({count:,} tokens)")
    for path in stale:
        print(f"prepare_tokens: removed {path} (an earlier run's, not written again)")
    print(f"prepare_tokens: {docs:,} documents from {len(files)} file(s): "
          f"{splits['train'].written:,} train tokens, {splits['val'].written:,} val tokens")


if __name__ == "__main__":
    main()
