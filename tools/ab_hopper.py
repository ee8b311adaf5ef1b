"""A/B the Hopper Gluon kernels (kernels/forward_sm90.py, backward_sm90.py) against
the tile kernels (forward.py, backward.py) on the device: same inputs, errors against
the float64 reference, do_bench medians, bf16, 16k tokens per shape.

    python tools/ab_hopper.py [--pass fwd|bwd] [--dims 64,128] [--seqlens 1024,4096]

Errors are relative (check.relative_error) on the first batch, at S <= 4096 (the
float64 reference is slow beyond); TFLOP/s count 4·B·H·S²·D (fwd), 2.5× that (bwd),
halved when causal.
"""

import argparse
import contextlib

import torch
import triton

import memattn
from memattn import reference
from memattn.check import relative_error
from memattn.kernels import backward_sm90, forward_sm90, hopper


@contextlib.contextmanager
def gluon_kernels(on: bool):
    """Calls inside run the Gluon kernels where they apply (on) or the tile kernels."""
    hopper.enabled = on
    try:
        yield
    finally:
        hopper.enabled = True


def forward(q, k, v, gluon: bool, **kw):
    with gluon_kernels(gluon):
        return memattn.attention(q, k, v, return_lse=True, **kw)


def backward(out, inputs, do, gluon: bool):
    with gluon_kernels(gluon):
        return torch.autograd.grad(out, inputs, do, retain_graph=True)


def gradients(q, k, v, do, gluon: bool, **kw):
    """(dq, dk, dv), the forward always by the same (Gluon where it runs) kernel."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    return backward(memattn.attention(q, k, v, **kw), (q, k, v), do, gluon)


def reference_result(q, k, v, do, backward: bool, **kw):
    q, k, v, do = (t[:1].double().requires_grad_() for t in (q, k, v, do))
    out, lse = reference.attention(q, k, v, return_lse=True, **kw)
    if not backward:
        return out, lse
    return torch.autograd.grad(out, (q, k, v), do)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pass", dest="which", choices=("fwd", "bwd"), default="fwd")
    ap.add_argument("--dims", default="64,128")
    ap.add_argument("--seqlens", default="1024,2048,4096,8192,16384")
    args = ap.parse_args()
    is_bwd = args.which == "bwd"
    # A/B the kernels themselves, at every size
    forward_sm90.MIN_KEYS_PER_QUERY = dict.fromkeys(forward_sm90.HEAD_DIMS, 0)
    backward_sm90.MIN_KEYS_PER_QUERY = dict.fromkeys(backward_sm90.HEAD_DIMS, 0)
    torch.manual_seed(0)
    what = "dq/dk/dv" if is_bwd else "out"
    print(f"{'shape':20s} {'err tile (' + what + ')':>30s} {'err gluon':>30s} "
          f"{'tile':>6s} {'gluon':>6s}  TFLOP/s {args.which}")
    for d in map(int, args.dims.split(",")):
        for s in map(int, args.seqlens.split(",")):
            for causal in (False, True):
                b, h = max(1, 16384 // s), 2048 // d
                q, k, v, do = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)
                               for _ in range(4))
                kw = dict(causal=causal)
                if is_bwd:
                    def step(gluon):
                        return gradients(q, k, v, do, gluon, **kw)
                else:
                    def step(gluon):
                        return forward(q, k, v, gluon, **kw)[:1]
                tile, gluon = step(False), step(True)
                if s <= 4096:
                    ref = reference_result(q, k, v, do, is_bwd, **kw)[:len(tile)]
                    errs = [" ".join(f"{relative_error(x[:1], r):.1e}" for x, r in zip(res, ref))
                            for res in (tile, gluon)]
                else:
                    errs = ["-", "-"]
                flops = 4 * b * h * s * s * d / (2 if causal else 1) * (2.5 if is_bwd else 1)
                if is_bwd:  # the backward alone: one recorded graph, replayed
                    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
                    out = memattn.attention(qg, kg, vg, **kw)
                    ms = [triton.testing.do_bench(lambda g=g: backward(out, (qg, kg, vg), do, g))
                          for g in (False, True)]
                else:
                    ms = [triton.testing.do_bench(lambda g=g: forward(q, k, v, g, **kw))
                          for g in (False, True)]
                name = f"D{d} S{s}{' causal' if causal else ''}"
                print(f"{name:20s} {errs[0]:>30s} {errs[1]:>30s} "
                      + " ".join(f"{flops / t / 1e9:6.0f}" for t in ms), flush=True)


if __name__ == "__main__":
    main()
