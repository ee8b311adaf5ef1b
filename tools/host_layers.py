"""Where a forward call's host time goes before its launch, layer by layer: perf_counter
stamps at the entry of each layer (check, the autograd Function, the kernel dispatch,
the Gluon forward, hopper.Launcher, Triton's CudaLauncher), medians over calls with
the GPU synced before each, with autograd recording and without. bf16, 16k tokens.

    python tools/host_layers.py [--shapes 256x512,128x1024c]

do_bench counts the host's time before a launch beyond its ~90 µs L2 flush
(PERFORMANCE.md v10, v11): this says which layer to trim.
"""

import argparse
import statistics
import time

import torch
from triton.backends.nvidia import driver as nvidia_driver

import memattn
from memattn import ops
from memattn.kernels import forward as forward_kernels
from memattn.kernels import forward_sm90, hopper

STAMPS = {}


def stamped(name, fn):
    def wrapper(*args, **kwargs):
        STAMPS.setdefault(name, time.perf_counter())
        return fn(*args, **kwargs)

    return wrapper


def instrument():
    ops._check_user_call = stamped("check", ops._check_user_call)
    ops._Attention.forward = staticmethod(stamped("Function.forward", ops._Attention.forward))
    forward_kernels.forward = stamped("kernels.forward", forward_kernels.forward)
    forward_sm90.forward = stamped("forward_sm90", forward_sm90.forward)
    hopper.Launcher.__call__ = stamped("Launcher", hopper.Launcher.__call__)
    nvidia_driver.CudaLauncher.__call__ = stamped("CudaLauncher",
                                                  nvidia_driver.CudaLauncher.__call__)


def medians(call, n=60) -> dict:
    rows = []
    for _ in range(n):
        torch.cuda.synchronize()
        STAMPS.clear()
        t0 = time.perf_counter()
        call()
        STAMPS["return"] = time.perf_counter()
        rows.append({name: (t - t0) * 1e6 for name, t in STAMPS.items()})
    return {name: statistics.median(r[name] for r in rows) for name in rows[0]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="256x512,256x1024c,128x1024c",
                    help="DxS, c for causal")  # fmt: skip
    args = ap.parse_args()
    instrument()
    for shape in args.shapes.split(","):
        causal = shape.endswith("c")
        d, s = map(int, shape.rstrip("c").split("x"))
        b, h = max(1, 16384 // s), 2048 // d
        q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16,
                               requires_grad=True) for _ in range(3))  # fmt: skip
        call = lambda: memattn.attention(q, k, v, causal=causal)  # noqa: E731
        for _ in range(5):
            call()
        for label, grad in (("autograd", True), ("no_grad", False)):
            with torch.set_grad_enabled(grad):
                stamps = medians(call)
            cells = ", ".join(f"{name} {us:.0f}" for name, us in stamps.items())
            print(f"D{d} S{s}{' causal' if causal else ''} {label}: µs from the call: {cells}",
                  flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
