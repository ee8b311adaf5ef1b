"""A/B the Gluon forward's schedules on packed sequences (bench's varlen_causal_docs
row: 13 documents of mixed lengths in 16,384 tokens, H=16, D=128, causal), GPU-bound
do_bench medians: persistent folded (the default under a mask), persistent strided,
and a program per block.

    python tools/ab_varlen_schedule.py
"""

import torch
import triton

import memattn
from memattn import bench
from memattn.kernels import forward_sm90, hopper

SCHEDULES = {"persistent folded": dict(FOLD="masked", PERSISTENT=True),
             "persistent strided": dict(FOLD=False, PERSISTENT=True),
             "a program per block": dict(FOLD=False, PERSISTENT=False)}


def main():
    lengths = bench.DOC_LENGTHS
    total = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32,
                      device="cuda")
    q, k, v = (torch.randn(total, 16, 128, device="cuda", dtype=torch.bfloat16)
               for _ in range(3))
    kw = dict(causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(lengths),
              max_seqlen_k=max(lengths))
    flops = sum(4 * 16 * 128 * n * (n + 1) / 2 for n in lengths)
    ref = None
    for name, flags in SCHEDULES.items():
        for attr, value in flags.items():
            setattr(forward_sm90, attr, value)
        hopper.forget_plans()  # plans are made from the knobs
        out = memattn.attention(q, k, v, **kw)
        ref = out if ref is None else ref
        same = torch.equal(out, ref)
        ms = triton.testing.do_bench(lambda: memattn.attention(q, k, v, **kw))
        print(f"{name:22s} {flops / ms / 1e9:6.0f} TFLOP/s  {ms * 1000:7.1f} us  "
              f"same output: {same}", flush=True)


if __name__ == "__main__":
    main()
