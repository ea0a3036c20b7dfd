#!/usr/bin/env python3
"""PyTorch's side of scripts/bench_compression.sh and scripts/bench_modes.sh: what PyTorch
itself offers for each of dtrain's ways to communicate less, on the same model, global batch
and threads, started by torchrun (Gloo, WORLD_SIZE ranks) on the CPU:
  none      DistributedDataParallel as it comes (bucketed fp32 all-reduce)
  fp16/bf16 DDP with default_hooks.fp16_compress_hook / bf16_compress_hook
  powersgd  DDP with powerSGD_hook (rank --rank, error feedback and warm start, as dtrain's;
            PyTorch compresses from its step 2 at the earliest, inside the warm-up here)
  zero1     DDP with torch.distributed.optim.ZeroRedundancyOptimizer
  zero2     FSDP2's fully_shard(reshard_after_forward=False) per layer: FSDP's SHARD_GRAD_OP,
            the ZeRO-2 of PyTorch's documentation (it shards the parameters between steps too)
  local_sgd no DDP: each rank steps alone and model_averaging's PeriodicModelAverager averages
            the parameters every --every steps (dtrain's parallel.mode: local_sgd)
sign and top-k have no PyTorch counterpart. Models: the Fashion-MNIST MLP of
configs/fashion_mnist_mlp.yaml (SGD lr 0.05, momentum 0.9; the decoded set in memory) or
configs/gpt_text.yaml's GPT (gpt_text.py's network, AdamW, clipping at 1.0; random byte
windows). --batch is the global batch, split over the ranks. --slow-rank/--slow-ms: that
rank sleeps before each step (dtrain's train.debug_slow_rank). Prints one JSON line from
rank 0; samples_per_s is the global batch times the timed steps over their time, after
--warmup steps, as dtrain's summary counts it. --compile: the wrapped model through
torch.compile (PyTorch >= 2.0, Inductor's C++ on the CPU), compiled in the warm-up; DDP is
compiled around, as PyTorch's documentation has it, so that its buckets still overlap the
backward."""
import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
from gpt_text import GPT  # noqa: E402

HOWS = ["none", "fp16", "bf16", "powersgd", "zero1", "zero2", "local_sgd"]


def optimizer(model_name):
    if model_name == "mlp":
        return torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}
    return torch.optim.AdamW, {"lr": 2e-3, "betas": (0.9, 0.99), "weight_decay": 0.1}


def wrap(net, how, model_name, a):
    """The model as PyTorch's way `how` trains it, and its optimizer."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    kind, kwargs = optimizer(model_name)
    if how == "local_sgd":
        return net, kind(net.parameters(), **kwargs)
    if how == "zero2":
        from torch.distributed.fsdp import fully_shard
        # One unit per GPT block or MLP layer, as FSDP is used; the root holds the rest (the
        # GPT's tied embedding, which a unit of its own would not see used by the head).
        units = list(net.blocks) if model_name == "gpt" else [m for m in net if isinstance(m, torch.nn.Linear)]
        for m in units:
            fully_shard(m, reshard_after_forward=False)
        fully_shard(net, reshard_after_forward=False)
        return net, kind(net.parameters(), **kwargs)
    ddp = DDP(net)
    if how in ("fp16", "bf16"):
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        ddp.register_comm_hook(None, getattr(default_hooks, f"{how}_compress_hook"))
    elif how == "powersgd":
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ps
        state = ps.PowerSGDState(process_group=None, matrix_approximation_rank=a.rank,
                                 start_powerSGD_iter=2, use_error_feedback=True, warm_start=True)
        ddp.register_comm_hook(state, ps.powerSGD_hook)
    if how == "zero1":
        from torch.distributed.optim import ZeroRedundancyOptimizer
        return ddp, ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=kind, **kwargs)
    return ddp, kind(ddp.parameters(), **kwargs)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=["mlp", "gpt"], default="mlp")
    p.add_argument("--how", choices=HOWS, default="none")
    p.add_argument("--batch", type=int, help="global batch (default: the shipped job's, 64 or 32)")
    p.add_argument("--steps", type=int, default=300, help="timed steps")
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--threads", type=int, default=0, help="per rank (0: the cores over the ranks)")
    p.add_argument("--rank", type=int, default=2, help="PowerSGD's rank")
    p.add_argument("--every", type=int, default=8, help="local SGD's averaging period")
    p.add_argument("--slow-rank", type=int, default=-1)
    p.add_argument("--slow-ms", type=float, default=0.0)
    p.add_argument("--data-dir", default=common.FASHION)
    p.add_argument("--compile", action="store_true", help="torch.compile the wrapped model")
    a = p.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    torch.set_num_threads(a.threads or max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    batch = a.batch or (64 if a.model == "mlp" else 32)
    per_rank = batch // world
    if a.model == "mlp":
        x, y = common.fashion_mnist("train", a.data_dir)
        net = common.model("mlp")
        order = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(1))

        def loss_of(i):
            start = (i * batch) % (x.shape[0] - batch) + rank * per_rank
            idx = order[start:start + per_rank]
            return F.cross_entropy(net_(x.index_select(0, idx)), y.index_select(0, idx))
    else:
        net = GPT(256, 128, 128, 4, 4)
        tokens = torch.randint(0, 256, (64, per_rank, 129), generator=torch.Generator().manual_seed(rank))

        def loss_of(i):
            w = tokens[i % tokens.shape[0]]
            return net_(w[:, :-1], w[:, 1:])
    net_, opt = wrap(net, a.how, a.model, a)
    if a.compile:
        net_ = torch.compile(net_)
    averager = None
    if a.how == "local_sgd":
        from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
        averager = PeriodicModelAverager(period=a.every, warmup_steps=0)

    def step(i):
        if rank == a.slow_rank:
            time.sleep(a.slow_ms / 1000)
        loss = loss_of(i)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if a.model == "gpt":
            torch.nn.utils.clip_grad_norm_(net_.parameters(), 1.0)
        opt.step()
        if averager:
            averager.average_parameters(net_.parameters())

    for i in range(a.warmup):
        step(i)
    dist.barrier()
    t0 = time.perf_counter()
    for i in range(a.warmup, a.warmup + a.steps):
        step(i)
    seconds = time.perf_counter() - t0
    if rank == 0:
        print(json.dumps({"model": a.model, "how": a.how, "world_size": world, "batch": batch,
                          "torch": torch.__version__, "compile": a.compile, "samples_per_s": batch * a.steps / seconds,
                          "step_ms_mean": seconds / a.steps * 1e3}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
