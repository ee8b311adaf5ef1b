"""Tile-configuration sweep on the GPU: each candidate is checked against the float64
reference first (Triton 3.6 has miscompiled some of ours), then timed with do_bench.

The checks run in worker processes, which also compile every kernel variant the timing
needs into Triton's on-disk cache; the timing then runs alone in this process.

    python tools/sweep.py [--dims 64,128,256] [--only fwd|bwd] [--rows plain,causal,bias,dropout]
                          [--dtype bfloat16|float32] [--tf32x3]

On Hopper, bf16/fp16 calls the Gluon kernels take never reach these tiles; float32
always does (checked against the reference with allow_tf32 off and on, whose tolerance
follows it; the kernels' dots do not: forward.dot_precision).
"""

import argparse
import os
import sys
from concurrent.futures import ProcessPoolExecutor

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from memattn.kernels.tuning import BackwardConfig as B  # noqa: E402
from memattn.kernels.tuning import Config as F  # noqa: E402

FWD = {
    64: [F(128, 64, 8, 3), F(128, 128, 8, 3), F(128, 64, 4, 3), F(128, 128, 8, 2),
         F(256, 64, 8, 3), F(128, 128, 8, 4)],
    128: [F(128, 128, 8, 3), F(128, 64, 8, 3), F(128, 64, 8, 4), F(128, 64, 8, 2),
          F(128, 64, 4, 3), F(64, 64, 4, 3), F(128, 32, 8, 3), F(256, 64, 8, 2)],
    256: [F(64, 64, 4, 3), F(64, 64, 4, 2), F(128, 64, 8, 2), F(128, 32, 8, 3),
          F(64, 32, 4, 3)],
}
BWD = {
    64: [B(64, 64, 4, 1, 64, 64, 4, 2), B(64, 128, 8, 2, 128, 64, 8, 2),
         B(64, 128, 8, 3, 128, 64, 8, 3), B(64, 128, 4, 3, 128, 64, 4, 3),
         B(32, 128, 4, 3, 128, 32, 4, 3), B(64, 128, 8, 4, 128, 64, 8, 4),
         B(128, 128, 8, 2, 128, 128, 8, 2)],
    128: [B(64, 128, 8, 3, 128, 64, 8, 3), B(64, 128, 8, 3, 128, 64, 8, 2),
          B(64, 128, 8, 3, 128, 128, 8, 2), B(64, 128, 8, 3, 64, 64, 4, 3),
          B(64, 128, 8, 4, 128, 64, 8, 3), B(64, 128, 8, 3, 64, 128, 4, 3),
          B(64, 128, 8, 2, 128, 64, 8, 3), B(32, 128, 8, 3, 128, 64, 8, 3)],
    256: [B(64, 64, 8, 2, 64, 64, 8, 2), B(64, 64, 8, 1, 64, 64, 8, 1),
          B(64, 64, 8, 3, 64, 64, 8, 3), B(32, 64, 8, 2, 64, 32, 8, 2),
          B(32, 64, 8, 3, 64, 32, 8, 3), B(64, 64, 8, 2, 64, 32, 8, 3),
          B(64, 64, 8, 2, 128, 32, 8, 2)],
}
# float32: twice the bytes a tile, its dots 3xTF32 (forward.dot_precision; --tf32x3 for
# the backward past 128 columns too): the shipped config first in each list, then
# larger tiles than the IEEE sweep could hold.
FWD_FP32 = {
    64: [F(128, 64, 8, 2), F(64, 64, 4, 2), F(64, 64, 4, 3), F(128, 32, 8, 2),
         F(64, 32, 4, 2), F(128, 64, 8, 1)],
    128: [F(32, 64, 8, 1), F(64, 64, 4, 2), F(64, 64, 8, 2), F(64, 64, 4, 1),
          F(128, 64, 8, 1), F(64, 32, 4, 2), F(128, 32, 8, 2), F(32, 32, 4, 2)],
    256: [F(32, 32, 8, 1), F(64, 32, 4, 1), F(64, 32, 8, 1), F(32, 64, 4, 1),
          F(64, 64, 8, 1), F(32, 32, 4, 2)],
}
BWD_FP32 = {
    64: [B(32, 64, 8, 1, 64, 32, 8, 1), B(64, 64, 4, 1, 64, 64, 4, 1),
         B(64, 64, 8, 2, 64, 64, 8, 2), B(32, 128, 8, 1, 128, 32, 8, 1),
         B(64, 128, 8, 1, 128, 64, 8, 1), B(32, 64, 4, 2, 64, 32, 4, 2)],
    128: [B(32, 64, 8, 1, 64, 32, 8, 1), B(64, 64, 4, 1, 64, 64, 4, 1),
          B(64, 64, 8, 1, 64, 64, 8, 1), B(32, 128, 8, 1, 128, 32, 8, 1),
          B(32, 64, 4, 2, 64, 32, 4, 2), B(64, 64, 8, 2, 64, 64, 8, 2)],
    256: [B(32, 32, 8, 1, 32, 32, 8, 1), B(32, 32, 4, 1, 32, 32, 4, 1),
          B(16, 32, 4, 1, 32, 16, 4, 1), B(32, 64, 8, 1, 64, 32, 8, 1),
          B(64, 32, 8, 1, 32, 64, 8, 1)],
}
ROWS = {  # name: (causal, bias that needs a gradient, dropout_p)
    "plain": (False, False, 0.0), "causal": (True, False, 0.0), "bias": (False, True, 0.0),
    "dropout": (False, False, 0.1),
}


def _install(cfg, tf32x3=False):
    from memattn.kernels import forward, tuning

    if tf32x3:  # float32's dots as 3xTF32 in every kernel, the backward past 128 too
        forward.IEEE_FLOAT32_PAST = {}

    # Workers are reused across jobs: clear the other pass's override too.
    tuning.backward_override = cfg if isinstance(cfg, B) else None
    tuning.forward_override = cfg if isinstance(cfg, F) else None


def _inputs(d, causal, bias, dropout_p, tokens=16384, seqlen=4096, dtype=torch.bfloat16):
    b, h = tokens // seqlen, 2048 // d
    q, k, v = (torch.randn(b, seqlen, h, d, device="cuda", dtype=dtype, requires_grad=True)
               for _ in range(3))
    kwargs = dict(causal=causal, dropout_p=dropout_p)
    if bias:
        kwargs["bias"] = torch.randn(b, h, seqlen, seqlen, device="cuda", dtype=dtype,
                                     requires_grad=True)
    flops = 4 * b * h * seqlen * seqlen * d / (2 if causal else 1)
    return q, k, v, kwargs, flops


def check_and_compile(job):
    """Worker: the reference check (causal, GQA, odd lengths), then one small call per
    timed row so that its kernels are compiled into the cache."""
    import memattn
    from memattn.check import Case, check_backward, check_forward

    d, cfg, rows, dtype, tf32x3 = job
    dtype = getattr(torch, dtype)
    _install(cfg, tf32x3)
    bwd = isinstance(cfg, B)
    try:
        checks = [Case(f"D{d}", batch=2, heads=4, kv_heads=2, seqlen_q=777, seqlen_k=1024,
                       dqk=d, dv=d, options=dict(causal=True))]
        if "bias" in rows:
            checks.append(Case(f"D{d} bias", batch=2, heads=4, seqlen_q=555, seqlen_k=800,
                               dqk=d, dv=d, bias="BHQK"))
        if "dropout" in rows:
            checks.append(Case(f"D{d} dropout", batch=2, heads=4, seqlen_q=555, seqlen_k=800,
                               dqk=d, dv=d, options=dict(dropout_p=0.1)))
        run = check_backward if bwd else check_forward
        for allow_tf32 in (False, True) if dtype == torch.float32 else (False,):
            torch.backends.cuda.matmul.allow_tf32 = allow_tf32
            for case in checks:
                bad = [r for r in run(case, dtype, "cuda") if not r.passed]
                if bad:
                    return f"WRONG (allow_tf32={allow_tf32}) {bad[0]}"[:300]
        torch.backends.cuda.matmul.allow_tf32 = False
        for row in rows:
            q, k, v, kwargs, _ = _inputs(d, *ROWS[row], tokens=2048, seqlen=1024, dtype=dtype)
            out = memattn.attention(q, k, v, **kwargs)
            if bwd:
                out.backward(torch.randn_like(out))
        torch.cuda.synchronize()
        return "ok"
    except Exception as e:  # noqa: BLE001
        return f"error {type(e).__name__}: {str(e)[:200]}"


def time_config(d, cfg, row, dtype, tf32x3=False):
    from triton.testing import do_bench

    import memattn

    _install(cfg, tf32x3)
    q, k, v, kwargs, flops = _inputs(d, *ROWS[row], dtype=getattr(torch, dtype))
    if isinstance(cfg, F):
        with torch.no_grad():
            ms = do_bench(lambda: memattn.attention(q, k, v, **kwargs), return_mode="median")
        return flops / ms / 1e9
    out = memattn.attention(q, k, v, **kwargs)
    grad = torch.randn_like(out)
    leaves = [q, k, v] + ([kwargs["bias"]] if "bias" in kwargs else [])
    ms = do_bench(lambda: out.backward(grad, retain_graph=True), grad_to_none=leaves,
                  return_mode="median")
    return 2.5 * flops / ms / 1e9


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--dims", default="64,128,256")
    parser.add_argument("--only", choices=["fwd", "bwd"], default=None)
    parser.add_argument("--rows", default="plain,causal,bias")
    parser.add_argument("--workers", type=int, default=12)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--tf32x3", action="store_true",
                        help="float32: 3xTF32 dots where dot_precision keeps IEEE")
    args = parser.parse_args()
    rows = args.rows.split(",")
    fwd, bwd = (FWD_FP32, BWD_FP32) if args.dtype == "float32" else (FWD, BWD)
    jobs = []
    for d in map(int, args.dims.split(",")):
        if args.only != "bwd":
            jobs += [(d, cfg, rows, args.dtype, args.tf32x3) for cfg in fwd[d]]
        if args.only != "fwd":
            jobs += [(d, cfg, rows, args.dtype, args.tf32x3) for cfg in bwd[d]]
    ctx = torch.multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(args.workers, mp_context=ctx) as pool:
        verdicts = list(pool.map(check_and_compile, jobs))
    for (d, cfg, _, dtype, tf32x3), verdict in zip(jobs, verdicts):
        cells = []
        if verdict == "ok":
            for row in rows:
                try:
                    cells.append(f"{row} {time_config(d, cfg, row, dtype, tf32x3):.0f}")
                except Exception as e:  # noqa: BLE001
                    cells.append(f"{row} error {type(e).__name__}")
        kind = "bwd" if isinstance(cfg, B) else "fwd"
        print(f"{kind} D={d} {cfg}: {verdict if verdict != 'ok' else '  '.join(cells)}",
              flush=True)


if __name__ == "__main__":
    main()
