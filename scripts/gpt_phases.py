#!/usr/bin/env python3
"""Where PyTorch eager's GPT-2 small step spends its GPU time, phase by phase.

The baseline's own model and update (scripts/baselines/gpu.py: bf16 autocast, fused
AdamW, clipping at 1.0), with the device synchronised after each phase, so that the phases
line up with a logged dtrain step's forward_ms, backward_ms and optim_ms (norm, clip,
update, zeroing; norm_ms + optim_ms here). scripts/bench_gpu.sh prints the two side by
side; a phase where dtrain is slower is where to look.

    python3 scripts/gpt_phases.py BASELINE_PY [--batch 16] [--steps 20]
Prints one JSON line of median milliseconds per phase. --device cpu, a smaller shape
(--layers, --dim, --heads, --seq) and --dtype fp32 run it on a CPU (scripts/bench_gpt_cpu.sh;
a torch without scaled_dot_product_attention gets the plain causal attention dtrain uses).
--compile: the model through torch.compile (compiled in the warm-up steps; its forward and
backward are then Inductor's, the norm and the update eager as before).
"""
import argparse
import importlib.util
import inspect
import json
import math
import statistics
import time

import torch
import torch.nn.functional as F


def plain_causal_attention(q, k, v, is_causal=True):
    t = q.size(-2)
    scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.size(-1)))
    future = torch.ones(t, t, dtype=torch.bool, device=q.device).triu(1)
    return torch.softmax(scores.masked_fill(future, float("-inf")), -1) @ v


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("baseline")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--dim", type=int, default=768)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--device", default="cuda")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    a = p.parse_args()
    spec = importlib.util.spec_from_file_location("gpu_baseline", a.baseline)
    base = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(base)
    if not hasattr(F, "scaled_dot_product_attention"):  # torch < 2.0
        F.scaled_dot_product_attention = plain_causal_attention

    dev = torch.device(a.device)
    cuda = dev.type == "cuda"
    if a.threads:
        torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = True
    model = base.GPT(vocab=a.vocab, ctx=a.seq, d=a.dim, layers=a.layers, heads=a.heads).to(dev)
    # The fused kernel wherever the torch has it: CUDA from 2.0, the CPU from 2.4.
    fused = cuda or "fused" in inspect.signature(torch.optim.AdamW).parameters
    opt = torch.optim.AdamW(model.parameters(), lr=6e-4, betas=(0.9, 0.95), weight_decay=0.1,
                            **({"fused": True} if fused else {}))
    idx = torch.randint(0, a.vocab, (a.batch, a.seq + 1), device=dev)
    forward = torch.compile(model) if a.compile else model
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    phases = {"forward_ms": [], "backward_ms": [], "norm_ms": [], "optim_ms": [], "step_ms": []}

    def step(record):
        times = {}
        sync()
        t0 = t = time.perf_counter()

        def lap(name):
            nonlocal t
            sync()
            now = time.perf_counter()
            times[name] = (now - t) * 1e3
            t = now

        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=a.dtype == "bf16"):
            loss = forward(idx[:, :-1], idx[:, 1:])
        lap("forward_ms")
        loss.backward()
        lap("backward_ms")
        # clip_grad_norm_(params, 1.0) in its two halves (torch >= 2.6), to time the norm
        grads = [q.grad for q in model.parameters()]
        if hasattr(torch.nn.utils, "get_total_norm"):
            norm = torch.nn.utils.get_total_norm(grads)
        else:
            norm = torch.norm(torch.stack([g.norm() for g in grads]))
        lap("norm_ms")
        if hasattr(torch.nn.utils, "clip_grads_with_norm_"):
            torch.nn.utils.clip_grads_with_norm_(model.parameters(), 1.0, norm)
        else:
            for g in grads:
                g.mul_((1.0 / (norm + 1e-6)).clamp(max=1.0))
        opt.step()
        opt.zero_grad(set_to_none=True)
        lap("optim_ms")
        times["step_ms"] = (time.perf_counter() - t0) * 1e3
        if record:
            for k, v in times.items():
                phases[k].append(v)

    for i in range(a.warmup + a.steps):
        step(i >= a.warmup)
    print(json.dumps({"who": "pytorch compiled" if a.compile else "pytorch", "model": "gpt-phases",
                      **{k: statistics.median(v) for k, v in phases.items()}}), flush=True)


if __name__ == "__main__":
    main()
