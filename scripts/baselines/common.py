"""What the baselines share: Fashion-MNIST decoded the way dtrain decodes it, the MLP and
CNN of configs/fashion_mnist_{mlp,cnn}.yaml, and a timer that reports the median step."""
import gzip
import os
import statistics
import time

import torch
import torch.nn as nn

FASHION = "/usr/share/datasets/fashion-mnist"


def read_idx(path):
    """An IDX file (gzip or not) as a uint8 tensor of its shape."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        raw = f.read()
    if raw[0] != 0 or raw[1] != 0 or raw[2] != 0x08:
        raise ValueError(f"{path}: not an unsigned-byte IDX file")
    ndim = raw[3]
    dims = [int.from_bytes(raw[4 + 4 * i:8 + 4 * i], "big") for i in range(ndim)]
    data = torch.frombuffer(bytearray(raw[4 + 4 * ndim:]), dtype=torch.uint8)
    return data.reshape(dims)


def fashion_mnist(split="train", data_dir=FASHION):
    """Images [n, 1, 28, 28] float32, normalised with Fashion-MNIST's mean and std (as
    dtrain does), and labels [n] int64."""
    prefix = "train" if split == "train" else "t10k"
    find = lambda stem: next(os.path.join(data_dir, stem + ext) for ext in (".gz", "")
                             if os.path.exists(os.path.join(data_dir, stem + ext)))
    x = read_idx(find(f"{prefix}-images-idx3-ubyte")).float().div_(255.0)
    y = read_idx(find(f"{prefix}-labels-idx1-ubyte")).long()
    return ((x - 0.2860) / 0.3530).unsqueeze(1).contiguous(), y


def model(name):
    """The MLP 784-512-256-10 and the CNN conv32-pool-conv64-pool-fc128-fc10 of the
    shipped Fashion-MNIST jobs."""
    if name == "mlp":
        return nn.Sequential(nn.Flatten(), nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 256),
                             nn.ReLU(), nn.Linear(256, 10))
    return nn.Sequential(nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Flatten(), nn.Linear(64 * 7 * 7, 128), nn.ReLU(), nn.Linear(128, 10))


def step_times(step, steps, warmup, sync=lambda: None):
    """Runs `step` warmup + steps times; the seconds of each timed one."""
    for _ in range(warmup):
        step()
    sync()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t0)
    return times


def median_step(step, steps, warmup, sync=lambda: None):
    """The median seconds of step_times'."""
    return statistics.median(step_times(step, steps, warmup, sync))
