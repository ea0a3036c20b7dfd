"""Hugging Face GPT-2 in and out, checked with transformers itself (tests/check_hf.sh).

    check_hf.py make DIR           a random GPT-2 saved by transformers (DIR/hf0), token shards
                                   (DIR/train.bin, DIR/val.bin) and its losses (DIR/hf0.json)
    check_hf.py loss MODEL SHARD   transformers' mean next-token loss over SHARD's windows
    check_hf.py load MODEL OUT     loads MODEL as transformers' users do (no key missing or
                                   unexpected), saves it again to OUT
"""
import json
import sys

import numpy as np
import torch
from transformers import GPT2Config, GPT2LMHeadModel

SEQ, VOCAB, WINDOWS = 16, 64, 4


def windows(shard):
    # dtrain's token windows: seq + 1 tokens every seq (lib/data/tokens.cpp).
    tokens = torch.from_numpy(np.fromfile(shard, dtype=np.uint16).astype(np.int64))
    n = (len(tokens) - 1) // SEQ
    return torch.stack([tokens[i * SEQ:i * SEQ + SEQ + 1] for i in range(n)])


def loss(model_dir, shard):
    model = GPT2LMHeadModel.from_pretrained(model_dir).eval()
    w = windows(shard)
    with torch.no_grad():
        logits = model(w[:, :-1]).logits
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)),
                                                 w[:, 1:].reshape(-1)).item()


def make(d):
    torch.manual_seed(3)
    cfg = GPT2Config(n_embd=32, n_layer=2, n_head=2, n_positions=SEQ, vocab_size=VOCAB,
                     attn_pdrop=0.0, embd_pdrop=0.0, resid_pdrop=0.0)
    GPT2LMHeadModel(cfg).save_pretrained(f"{d}/hf0")
    rng = np.random.default_rng(5)
    for name in ("train", "val"):
        rng.integers(0, VOCAB, WINDOWS * SEQ + 1, dtype=np.uint16).tofile(f"{d}/{name}.bin")
    json.dump({"train": loss(f"{d}/hf0", f"{d}/train.bin")}, open(f"{d}/hf0.json", "w"))


def load(model_dir, out):
    model, info = GPT2LMHeadModel.from_pretrained(model_dir, output_loading_info=True)
    bad = {k: v for k, v in info.items() if v and k != "missing_keys"}
    # The head is tied: the only key a tied GPT-2 may miss is lm_head.weight.
    missing = [k for k in info["missing_keys"] if k != "lm_head.weight"]
    if missing or bad:
        sys.exit(f"check_hf: {model_dir}: missing {missing}, {bad}")
    if not torch.equal(model.lm_head.weight, model.transformer.wte.weight):
        sys.exit(f"check_hf: {model_dir}: the head is not the token embedding")
    model.save_pretrained(out)


if __name__ == "__main__":
    cmd = sys.argv[1]
    if cmd == "make":
        make(sys.argv[2])
    elif cmd == "loss":
        print(f"{loss(sys.argv[2], sys.argv[3]):.9g}")
    elif cmd == "load":
        load(sys.argv[2], sys.argv[3])
    else:
        sys.exit(__doc__)
