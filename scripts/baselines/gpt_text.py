#!/usr/bin/env python3
"""PyTorch (Python, eager) reference for configs/gpt_text.yaml's model on the CPU, written as
a PyTorch 2.x user writes it (nanoGPT's model.py): the same GPT-2-shaped network
(pre-LayerNorm blocks, causal attention through F.scaled_dot_product_attention, tanh GELU,
tied head), AdamW with weight decay on >= 2-D parameters as the fused kernel where the
torch has one (fused=True), clipping at 1.0, fp32; --dropout P adds GPT-2's dropout
(embeddings, attention weights, both residual branches) as dtrain's model.dropout does. Random byte tokens (loading is not what is measured). Prints one JSON
line: tokens/s over the steady state (median step after warm-up). --compile: the model
through torch.compile (PyTorch >= 2.0, Inductor's C++ on the CPU), compiled in the warm-up."""
import argparse, inspect, json, statistics, time

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, d, h, p):
        super().__init__()
        self.h = h
        self.drop = nn.Dropout(p)
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.h, d // self.h).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, dropout_p=self.drop.p if self.training else 0.0,
                                           is_causal=True)
        x = x + self.drop(self.proj(a.transpose(1, 2).reshape(b, t, d)))
        return x + self.drop(self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh")))


class GPT(nn.Module):
    def __init__(self, vocab, ctx, d, layers, heads, p=0.0):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(ctx, d)
        self.drop = nn.Dropout(p)
        self.blocks = nn.ModuleList(Block(d, heads, p) for _ in range(layers))
        self.ln = nn.LayerNorm(d)

    def forward(self, idx, targets):
        x = self.drop(self.tok(idx) + self.pos(torch.arange(idx.shape[1])))
        for blk in self.blocks:
            x = blk(x)
        logits = F.linear(self.ln(x), self.tok.weight)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    model = GPT(256, a.seq, a.dim, a.layers, a.heads, a.dropout)
    decay = [q for q in model.parameters() if q.dim() >= 2]
    other = [q for q in model.parameters() if q.dim() < 2]
    fused = "fused" in inspect.signature(torch.optim.AdamW).parameters  # 2.4+ on the CPU
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
                            lr=2e-3, betas=(0.9, 0.99), **({"fused": True} if fused else {}))
    data = torch.randint(0, 256, (a.steps + a.warmup, a.batch, a.seq + 1))
    forward = torch.compile(model) if a.compile else model
    times = []
    for i in range(a.steps + a.warmup):
        t0 = time.perf_counter()
        loss = forward(data[i, :, :-1], data[i, :, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i >= a.warmup:
            times.append(time.perf_counter() - t0)
    s = statistics.median(times)
    print(json.dumps({"who": "pytorch compiled" if a.compile else "pytorch", "tokens_per_s": a.batch * a.seq / s, "step_ms": s * 1e3,
                      "params": sum(q.numel() for q in model.parameters()), "torch": torch.__version__}))


if __name__ == "__main__":
    main()
