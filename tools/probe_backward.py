"""Where a backward call's GPU time goes, kernel by kernel (torch.profiler), for the
Gluon and the tile path: bf16, 16k tokens per shape.

    python tools/probe_backward.py [--dims 128] [--seqlens 1024,4096] [--causal]
"""

import argparse
import cProfile
import pstats
import time

import torch
from torch.profiler import ProfilerActivity, profile

import memattn
from memattn.kernels import hopper


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dims", default="128")
    ap.add_argument("--seqlens", default="1024,4096")
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--host", action="store_true", help="also cProfile the host side")
    args = ap.parse_args()
    for d in map(int, args.dims.split(",")):
        for s in map(int, args.seqlens.split(",")):
            b, h = max(1, 16384 // s), 2048 // d
            q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16,
                                   requires_grad=True) for _ in range(3))
            do = torch.randn_like(q)
            out = memattn.attention(q, k, v, causal=args.causal)
            for gluon in (False, True):
                hopper.enabled = gluon
                for _ in range(3):
                    torch.autograd.grad(out, (q, k, v), do, retain_graph=True)
                torch.cuda.synchronize()
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    for _ in range(10):
                        torch.autograd.grad(out, (q, k, v), do, retain_graph=True)
                    torch.cuda.synchronize()
                print(f"== D{d} S{s} causal={args.causal} gluon={gluon} (10 calls)")
                print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=8,
                                                max_name_column_width=60))
                start = time.perf_counter()
                for _ in range(20):
                    torch.autograd.grad(out, (q, k, v), do, retain_graph=True)
                enqueued = time.perf_counter() - start
                torch.cuda.synchronize()
                done = time.perf_counter() - start
                print(f"host enqueue {enqueued / 20 * 1e3:.3f} ms/call, "
                      f"with the GPU {done / 20 * 1e3:.3f} ms/call")
                if args.host and gluon:
                    with cProfile.Profile() as host:
                        for _ in range(20):
                            torch.autograd.grad(out, (q, k, v), do, retain_graph=True)
                    pstats.Stats(host).sort_stats("tottime").print_stats(18)
            hopper.enabled = True


if __name__ == "__main__":
    main()
