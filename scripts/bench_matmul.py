#!/usr/bin/env python3
"""The dense layers' fp32 products on this CPU, by the two kernels the pinned LibTorch has:
ATen's linear (its BLAS: MKL in the torch wheel) and oneDNN's matmul
(torch.ops.mkldnn._linear_pointwise, which dtrain's train.cpu_matmul: onednn calls), for
the forward and both backward products of the MLP's and the GPT's layers. Interleaved,
best of three sweeps, GFLOP/s and the ratio. The torch of .venv/ (scripts/setup.sh --bench)
is the wheel whose C++ side dtrain builds on, so the kernels are dtrain's.

    .venv/bin/python scripts/bench_matmul.py [--threads T]
"""
import argparse
import time

import torch


def seconds_per(call, budget=0.15):
    for _ in range(5):
        call()
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < budget:
        call()
        n += 1
    return (time.perf_counter() - start) / n


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=0, help="intra-op threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    onednn = torch.ops.mkldnn._linear_pointwise
    with open("/proc/cpuinfo") as f:
        model = next((l.split(":", 1)[1].strip() for l in f if l.startswith("model name")), "?")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {model}")
    # (rows, in, out): the MLP's layers at batch 64, the GPT's (gpt_text.yaml: 32 x 128
    # tokens, width 128) attention, projection and MLP layers.
    shapes = {"mlp 784->512": (64, 784, 512), "mlp 512->256": (64, 512, 256),
              "gpt qkv 128->384": (4096, 128, 384), "gpt fc 128->512": (4096, 128, 512),
              "gpt proj 512->128": (4096, 512, 128)}
    print(f"{'layer':18} {'product':8} {'ATen GF/s':>10} {'oneDNN GF/s':>12} {'ratio':>6}")
    for name, (m, k, n) in shapes.items():
        x, w, b, go = torch.randn(m, k), torch.randn(n, k), torch.randn(n), torch.randn(m, n)
        products = {
            "forward": (lambda: torch.nn.functional.linear(x, w, b),
                        lambda: onednn(x, w, b, "none", [], "")),
            "input": (lambda: go @ w, lambda: onednn(go, w.t(), None, "none", [], "")),
            "weight": (lambda: go.t() @ x, lambda: onednn(go.t(), x.t(), None, "none", [], "")),
        }
        for what, (aten, dnn) in products.items():
            torch.testing.assert_close(dnn(), aten(), rtol=1e-4, atol=1e-3)
            best = [float("inf"), float("inf")]
            for _ in range(3):
                best[0] = min(best[0], seconds_per(aten))
                best[1] = min(best[1], seconds_per(dnn))
            flops = 2 * m * k * n
            print(f"{name:18} {what:8} {flops / best[0] / 1e9:10.0f} {flops / best[1] / 1e9:12.0f} "
                  f"{best[0] / best[1]:5.2f}x", flush=True)


if __name__ == "__main__":
    main()
