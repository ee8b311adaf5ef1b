"""Where the host time of a small call goes: cProfile over many forward and backward
calls at a shape whose kernels take less time than the host (D=128, S=1024, causal)."""
import cProfile
import pstats
import sys
import time

import torch

import memattn

b, s, h, d = 16, 1024, 16, 128
q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
           for _ in range(3))
grad = torch.randn_like(q)
calls = 200


def forward():
    return memattn.attention(q, k, v, causal=True)


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
    forward().backward(grad)
profile.disable()
stats = pstats.Stats(profile, stream=sys.stdout)
stats.sort_stats("tottime").print_stats(30)
stats.sort_stats("cumulative").print_stats(45)
