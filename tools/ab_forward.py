"""A/B the Hopper Gluon forward (kernels/forward_sm90.py) against the tile kernel
(kernels/forward.py) on the device: same inputs, errors against the float64 reference,
do_bench medians, bf16, 16k tokens per shape.

    python tools/ab_forward.py [--dims 64,128] [--seqlens 1024,4096,16384] [--stages 2,3]

--stages times the Gluon kernel once per K/V ring depth (one column each).
"""

import argparse

import torch
import triton

import memattn
from memattn import reference
from memattn.check import relative_error
from memattn.kernels import forward_sm90


def run(q, k, v, gluon: bool, **kw):
    forward_sm90.enabled = gluon
    try:
        return memattn.attention(q, k, v, return_lse=True, **kw)
    finally:
        forward_sm90.enabled = True


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dims", default="64,128")
    ap.add_argument("--seqlens", default="1024,2048,4096,8192,16384")
    ap.add_argument("--stages", default=str(forward_sm90.STAGES))
    args = ap.parse_args()
    forward_sm90.MIN_KEYS_PER_QUERY = 0  # A/B the kernels themselves, at every size
    torch.manual_seed(0)
    stages = [int(n) for n in args.stages.split(",")]
    print(f"{'shape':24s} {'err tile':>9s} {'err gluon':>9s} {'lse diff':>9s} {'tile':>6s} "
          + " ".join(f"{f'gluon/{n}':>8s}" for n in stages) + "  TFLOP/s fwd")
    for d in map(int, args.dims.split(",")):
        for s in map(int, args.seqlens.split(",")):
            for causal in (False, True):
                b, h = max(1, 16384 // s), 2048 // d
                q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)
                           for _ in range(3))
                kw = dict(causal=causal)
                (o_t, l_t), (o_g, l_g) = run(q, k, v, False, **kw), run(q, k, v, True, **kw)
                if s <= 4096:  # the float64 reference at 16k tokens x 16k keys is slow
                    ref = reference.attention(q[:1].double(), k[:1].double(), v[:1].double(),
                                              **kw)
                    e_t, e_g = relative_error(o_t[:1], ref), relative_error(o_g[:1], ref)
                else:
                    e_t = e_g = float("nan")
                lse_diff = (l_t - l_g).abs().max().item()
                flops = 4 * b * h * s * s * d / (2 if causal else 1)
                ms_t = triton.testing.do_bench(lambda: run(q, k, v, False, **kw))
                ms_g = []
                for n in stages:
                    forward_sm90.STAGES = n
                    ms_g.append(triton.testing.do_bench(lambda: run(q, k, v, True, **kw)))
                forward_sm90.STAGES = stages[0]
                name = f"D{d} S{s}{' causal' if causal else ''}"
                print(f"{name:24s} {e_t:9.2e} {e_g:9.2e} {lse_diff:9.2e} "
                      f"{flops / ms_t / 1e9:6.0f} "
                      + " ".join(f"{flops / ms / 1e9:8.0f}" for ms in ms_g), flush=True)


if __name__ == "__main__":
    main()
