#!/usr/bin/env python3
"""PyTorch's side of scripts/bench.sh: the shipped MLP or CNN on Fashion-MNIST on the CPU,
one process, or DistributedDataParallel over Gloo when started by torchrun (WORLD_SIZE >
1); `--compile`: the model through torch.compile (PyTorch >= 2.0; Inductor's C++ on the CPU). The same work per step as dtrain's job: `--batch` samples per rank gathered from the
decoded set in memory, SGD (lr 0.05, momentum 0.9), `--threads` intra-op threads.
Prints one JSON line from rank 0: model, world_size, batch, samples_per_s (the global
batch over the median step), step_ms_median."""
import argparse
import json
import os
import statistics
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", choices=["mlp", "cnn"], default="mlp")
    p.add_argument("--batch", type=int, default=64, help="samples per rank per step")
    p.add_argument("--max-steps", type=int, default=300)
    p.add_argument("--warmup-steps", type=int, default=20)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--data-dir", default=common.FASHION)
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world > 1:
        dist.init_process_group("gloo")
    torch.manual_seed(0)
    x, y = common.fashion_mnist("train", a.data_dir)
    net = common.model(a.model)  # PyTorch's default layout, as a user writes it
    if a.compile:  # compiled on the first steps, which the warm-up leaves out
        net = torch.compile(net)
    if world > 1:
        net = torch.nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    # This rank's share of a fixed permutation, batch by batch.
    order = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(1))
    per_step = a.batch * world
    position = [0]

    def step():
        start = position[0] % (x.shape[0] - per_step)
        idx = order[start + rank * a.batch:start + (rank + 1) * a.batch]
        position[0] += per_step
        loss = F.cross_entropy(net(x.index_select(0, idx)), y.index_select(0, idx))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    times = common.step_times(step, a.max_steps, a.warmup_steps)
    seconds = statistics.median(times)
    if rank == 0:
        # samples_per_s_mean: what the steps gave over their whole time, as dtrain's
        # summary says it; on a shared machine far from the median's figure.
        print(json.dumps({"model": a.model, "world_size": world, "batch": a.batch,
                          "torch": torch.__version__, "compile": a.compile,
                          "samples_per_s": per_step / seconds, "step_ms_median": seconds * 1e3,
                          "samples_per_s_mean": per_step * len(times) / sum(times)}),
              flush=True)
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
