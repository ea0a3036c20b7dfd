#!/usr/bin/env python3
"""PyTorch's side of scripts/bench_gpu.sh (and, scaled down, of bench_gpt_cpu.sh and
gpt_phases.py): eager PyTorch on one device.
  mlp, cnn  the shipped Fashion-MNIST models, data on the device, SGD (lr 0.05, momentum
            0.9), fp32 with TF32 allowed
  gpt       GPT-2 small's shape (12 layers, 12 heads, 768 wide, 1024 positions, vocabulary
            50304, 124M parameters, head tied to the token embedding), random tokens, bf16
            autocast, fused AdamW (lr 6e-4, betas 0.9/0.95, weight decay 0.1), clipping at
            1.0, scaled_dot_product_attention; --compile adds torch.compile
Prints one JSON line: model, batch, samples_per_s (tokens_per_s for gpt) over the median
step, step_ms, peak_mem_gib, and for gpt params, seq, tflops and mfu against
--peak-tflops (6 N per token plus attention's 12 L d T)."""
import argparse
import inspect
import json
import math
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402


def causal_attention(q, k, v):
    if hasattr(F, "scaled_dot_product_attention"):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    t = q.size(-2)  # torch < 2.0: the plain form
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.size(-1))
    future = torch.ones(t, t, dtype=torch.bool, device=q.device).triu(1)
    return scores.masked_fill(future, float("-inf")).softmax(-1) @ v


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.c_attn, self.attn_proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.c_fc, self.mlp_proj = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2)
                   for z in self.c_attn(self.ln_1(x)).split(d, dim=2))
        x = x + self.attn_proj(causal_attention(q, k, v).transpose(1, 2).reshape(b, t, d))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class GPT(nn.Module):
    """Token ids [b, t] and their next tokens -> the mean cross-entropy."""

    def __init__(self, vocab=50304, ctx=1024, d=768, layers=12, heads=12):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(ctx, d)
        self.h = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=["mlp", "cnn", "gpt"], default="gpt")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--compile", action="store_true")
    p.add_argument("--peak-tflops", type=float, default=989.0)
    p.add_argument("--data-dir", default=common.FASHION)
    p.add_argument("--device", default="cuda")
    a = p.parse_args()
    dev = torch.device(a.device)
    cuda = dev.type == "cuda"
    torch.manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    out = {"model": a.model, "batch": a.batch, "compile": a.compile, "torch": torch.__version__,
           "device": torch.cuda.get_device_name() if cuda else "cpu"}
    if a.model in ("mlp", "cnn"):
        x, y = common.fashion_mnist("train", a.data_dir)
        x, y = x.to(dev), y.to(dev)
        net = common.model(a.model).to(dev)
        run = torch.compile(net) if a.compile else net
        opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
        position = [0]

        def step():
            i = position[0]
            position[0] = (i + a.batch) % (x.shape[0] - a.batch)
            loss = F.cross_entropy(run(x[i:i + a.batch]), y[i:i + a.batch])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()

        seconds = common.median_step(step, a.steps, a.warmup, sync)
        out.update(samples_per_s=a.batch / seconds, step_ms=seconds * 1e3)
    else:
        net = GPT(ctx=a.seq).to(dev)
        params = sum(q.numel() for q in net.parameters())
        run = torch.compile(net) if a.compile else net
        # The fused kernel wherever the torch has it: CUDA from 2.0, the CPU from 2.4.
        fused = cuda or "fused" in inspect.signature(torch.optim.AdamW).parameters
        opt = torch.optim.AdamW(net.parameters(), lr=6e-4, betas=(0.9, 0.95), weight_decay=0.1,
                                **({"fused": True} if fused else {}))
        idx = torch.randint(0, 50304, (a.batch, a.seq + 1), device=dev)

        def step():
            with torch.autocast(dev.type, dtype=torch.bfloat16):
                loss = run(idx[:, :-1], idx[:, 1:])
            loss.backward()
            torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)

        seconds = common.median_step(step, a.steps, a.warmup, sync)
        tokens = a.batch * a.seq
        flops = 6 * params * tokens + 12 * 12 * 768 * a.seq * tokens
        out.update(params=params, seq=a.seq, tokens_per_s=tokens / seconds, step_ms=seconds * 1e3,
                   tflops=flops / seconds / 1e12, mfu=flops / seconds / 1e12 / a.peak_tflops)
    if cuda:
        out["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
