"""Where the host time of a small call goes: cProfile over many forward (and backward)
calls at a shape whose kernels take about as long as the host, at 16k tokens.

    python tools/profile_host.py [DxS, c for causal: 128x1024c] [--forward-only]
"""
import argparse
import cProfile
import pstats
import sys
import time

import torch

import memattn

ap = argparse.ArgumentParser()
ap.add_argument("shape", nargs="?", default="128x1024c")
ap.add_argument("--forward-only", action="store_true")
args = ap.parse_args()
causal = args.shape.endswith("c")
d, s = map(int, args.shape.rstrip("c").split("x"))
b, h = 16384 // s, 2048 // d
q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
           for _ in range(3))
grad = torch.randn_like(q)
calls = 200


def forward():
    return memattn.attention(q, k, v, causal=causal)


out = forward()
out.backward(grad)
for name, fn in [("forward, autograd recording", forward),
                 ("forward, no grad", lambda: torch.no_grad()(forward)()),
                 ("forward + backward", lambda: forward().backward(grad))]:
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - t0) / calls * 1e6
    print(f"{name}: {host:.0f} us/call of host time (launch-bound loop)", flush=True)

profile = cProfile.Profile()
profile.enable()
for _ in range(calls):
    if args.forward_only:
        forward()
    else:
        forward().backward(grad)
profile.disable()
stats = pstats.Stats(profile, stream=sys.stdout)
stats.sort_stats("tottime").print_stats(30)
stats.sort_stats("cumulative").print_stats(45)
