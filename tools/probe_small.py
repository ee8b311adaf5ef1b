"""Host cost per call against GPU time at small shapes, where a host-bound call shows as
low TFLOP/s in `memattn bench`: per shape, forward and backward, TFLOP/s as the bench
times them (do_bench, autograd recording, grads set to None) beside the GPU alone (the
forward in a CUDA graph; the backward's kernels summed from torch.profiler) and the
host's µs per call in a loop; the flash backend timed as the bench does, for the ratio.

    python tools/probe_small.py [--shapes 256x512c,256x1024c,64x1024c]
"""
import argparse
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile
from triton.testing import do_bench, do_bench_cudagraph

import memattn


def host_us(fn, n=50) -> float:
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    host = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    return host


def kernels_ms(fn, n=20) -> float:
    """GPU time of fn's kernels, summed over one call (median-free: the mean of n)."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    return sum(e.device_time_total for e in prof.key_averages()) / n / 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="256x512c,256x1024c,64x1024c",
                    help="DxS, c for causal")  # fmt: skip
    args = ap.parse_args()
    for shape in args.shapes.split(","):
        causal = shape.endswith("c")
        d, s = map(int, shape.rstrip("c").split("x"))
        b, h = 16384 // s, 2048 // d
        q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16,
                               requires_grad=True) for _ in range(3))  # fmt: skip
        flops = 4 * b * h * s * s * d / (2 if causal else 1)
        leaves = [q, k, v]

        def ours():
            return memattn.attention(q, k, v, causal=causal)

        def flash():
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in leaves),
                                                      is_causal=causal)  # fmt: skip

        row = {}
        for name, fn in (("memattn", ours), ("flash", flash)):
            out = fn()
            grad = torch.randn_like(out)

            def bwd():
                out.backward(grad, retain_graph=True)

            def bwd_fresh():  # as do_bench runs it: the grads set to None first
                for t in leaves:
                    t.grad = None
                bwd()

            row[name, "fwd"] = do_bench(fn, return_mode="median")
            row[name, "bwd"] = do_bench(bwd, grad_to_none=leaves, return_mode="median")
            if name == "memattn":
                with torch.no_grad():
                    row["gpu", "fwd"] = do_bench_cudagraph(fn, return_mode="median")
                row["gpu", "bwd"] = kernels_ms(bwd_fresh)
                row["host", "fwd"] = host_us(fn)
                row["host", "bwd"] = host_us(bwd_fresh)
        for p, mult in (("fwd", 1.0), ("bwd", 2.5)):
            tf = {n: mult * flops / row[n, p] / 1e9 for n in ("memattn", "flash", "gpu")}
            print(f"D{d} S{s}{' causal' if causal else ''} {p}: memattn {tf['memattn']:.0f} "
                  f"TFLOP/s ({row['memattn', p] * 1e3:.0f} us; GPU alone {tf['gpu']:.0f}, "
                  f"{row['gpu', p] * 1e3:.0f} us; host {row['host', p]:.0f} us/call), flash "
                  f"{tf['flash']:.0f}: {tf['memattn'] / tf['flash']:.2f} x", flush=True)


if __name__ == "__main__":
    main()
