"""A/B the Gluon forward's own variants (kernels/forward_sm90.py's module knobs) against
each other and the tile kernel, three ways per shape: the GPU alone (CUDA graph
replay), as `memattn bench` times it (do_bench, autograd recording, host included),
and the host time per call. bf16, 16k tokens per shape.

    python tools/ab_forward_sm90.py [--dims 64,128] [--seqlens 1024,4096] \
        [--variants tile,default,rows128,fold_all,fold_none,one_q,grid,v9]

Correctness is ab_hopper.py's and the GPU suite's business; this is speed only.
"""

import argparse
import time

import torch
from triton.testing import do_bench, do_bench_cudagraph

import memattn
from memattn.kernels import forward_sm90, hopper

# name -> forward_sm90 knobs; "tile" runs forward.py
VARIANTS = {
    "tile": None,
    "default": {},
    "rows128": dict(BLOCK_M_D64=128),  # two warpgroups at D=64 too
    "fold_all": dict(FOLD=True),  # two query blocks per program, masked or not
    "fold_none": dict(FOLD=False),  # masked calls unfolded
    "one_q": dict(MAX_Q_STAGES=1),  # one Q buffer
    "grid": dict(PERSISTENT=False),  # a program per query block (per pair under a mask)
    "v9": dict(PERSISTENT=False, MAX_Q_STAGES=1),  # both, as v9 ran
    # masked calls a program per pair of blocks, as v10 ran
    "v10": dict(MASKED_PERSISTENT=dict.fromkeys(forward_sm90.HEAD_DIMS, False)),
}


def use(knobs):
    hopper.enabled = knobs is not None
    forward_sm90.FOLD, forward_sm90.BLOCK_M_D64 = "masked", 192
    forward_sm90.PERSISTENT, forward_sm90.MAX_Q_STAGES = True, 2
    forward_sm90.MASKED_PERSISTENT = {64: True, 128: True, 256: False}
    for name, value in (knobs or {}).items():
        setattr(forward_sm90, name, value)
    hopper.forget_plans()  # plans are made from the knobs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dims", default="64,128")
    ap.add_argument("--seqlens", default="1024,2048,4096,16384")
    ap.add_argument("--variants", default="tile,default,rows128,fold_all,fold_none")
    args = ap.parse_args()
    names = args.variants.split(",")
    forward_sm90.MIN_KEYS_PER_QUERY = dict.fromkeys(forward_sm90.HEAD_DIMS, 0)
    cols = " ".join(f"{n:>9s}" for n in names)
    print(f"{'shape':18s} GPU alone: {cols} | bench: {cols} | host us: {cols}")
    for d in map(int, args.dims.split(",")):
        for s in map(int, args.seqlens.split(",")):
            for causal in (False, True):
                b, h = max(1, 16384 // s), 2048 // d
                q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16,
                                       requires_grad=True) for _ in range(3))
                flops = 4 * b * h * s * s * d / (2 if causal else 1)
                graph, bench, host = [], [], []
                for name in names:
                    use(VARIANTS[name])
                    f = lambda: memattn.attention(q, k, v, causal=causal)  # noqa: E731
                    f()
                    with torch.no_grad():
                        graph.append(flops / do_bench_cudagraph(f) / 1e9)
                    bench.append(flops / do_bench(f) / 1e9)
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    for _ in range(30):
                        f()
                    host.append((time.perf_counter() - t0) / 30 * 1e6)
                    torch.cuda.synchronize()
                use({})
                row = (" ".join(f"{x:9.0f}" for x in graph), " ".join(f"{x:9.0f}" for x in bench),
                       " ".join(f"{x:9.0f}" for x in host))
                name = f"D{d} S{s}{' causal' if causal else ''}"
                print(f"{name:18s}            {row[0]} |        {row[1]} |          {row[2]}",
                      flush=True)


if __name__ == "__main__":
    main()
