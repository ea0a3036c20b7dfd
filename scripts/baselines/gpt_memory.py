#!/usr/bin/env python3
"""PyTorch (Python, eager) reference for scripts/bench_memory.sh: the peak resident memory
of plain PyTorch training the GPT dtrain trains there (gpt_text.py's network: pre-LayerNorm
blocks, tied head; GPT-2's N(0, 0.02) weights), with plain SGD (no momentum, so no
optimizer state), `--steps` steps of `--micro` micro-batches of `--rows` windows of `--seq`
random tokens, fp32 on the CPU; `--compile`: the model through torch.compile (Inductor's
C++ on the CPU; its compile workers are processes of their own, not counted). Prints one
JSON line with the process's peak RSS in MiB (the kernel's high-water mark, as dtrain's
peak_rss_mb)."""
import argparse, json, resource

import torch

from gpt_text import GPT


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--rows", type=int, default=1, help="windows per micro-batch")
    p.add_argument("--micro", type=int, default=4, help="micro-batches per step")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--compile", action="store_true")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    model = GPT(a.vocab, a.seq, a.dim, a.layers, a.heads)
    with torch.no_grad():
        for t in model.parameters():
            if t.dim() >= 2:
                t.normal_(0.0, 0.02)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    run = torch.compile(model) if a.compile else model
    params = sum(t.numel() for t in model.parameters())
    losses = []
    for _ in range(a.steps):
        for _ in range(a.micro):
            x = torch.randint(0, a.vocab, (a.rows, a.seq + 1))
            loss = run(x[:, :-1], x[:, 1:]) / a.micro
            loss.backward()
            losses.append(loss.item() * a.micro)
        opt.step()
        opt.zero_grad(set_to_none=False)  # gradients kept, as dtrain's flat buffer keeps them
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"who": "pytorch", "torch": torch.__version__, "compile": a.compile, "parameters": params,
                      "peak_rss_mb": peak, "last_loss": losses[-1]}))


if __name__ == "__main__":
    main()
