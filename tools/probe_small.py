"""Host cost per call against GPU time at small shapes, where a host-bound call shows
as low TFLOP/s in `memattn bench` (its forward is timed with autograd recording)."""
import time

import torch
from triton.testing import do_bench, do_bench_cudagraph

import memattn

for d, s, causal in [(64, 1024, False), (128, 1024, True), (256, 1024, False)]:
    b, h = 16384 // s, 2048 // d
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    flops = 4 * b * h * s * s * d / (2 if causal else 1)
    f = lambda: memattn.attention(q, k, v, causal=causal)  # noqa: E731
    f()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(50):
        f()
    host = (time.perf_counter() - t0) / 50 * 1e3
    torch.cuda.synchronize()
    ms = do_bench(f, return_mode="median")
    with torch.no_grad():
        graph_ms = do_bench_cudagraph(f, return_mode="median")
    print(f"D{d} S{s} causal={causal}: recording autograd {flops / ms / 1e9:.0f} TFLOP/s, "
          f"GPU alone {flops / graph_ms / 1e9:.0f}; host {host:.3f} ms/call", flush=True)
