"""Tile-configuration sweep on the GPU: each candidate is checked against the float64
reference first (Triton 3.6 has miscompiled one of ours), then timed with do_bench.

    python tools/sweep.py [--dims 64,128,256]
"""

import argparse

import torch
from triton.testing import do_bench

import memattn
from memattn.check import Case, check_backward, check_forward
from memattn.kernels import tuning
from memattn.kernels.tuning import BackwardConfig, Config

FWD = [Config(128, 64, 8, 3), Config(128, 128, 8, 3), Config(128, 64, 4, 3),
       Config(128, 128, 8, 2), Config(64, 64, 4, 3), Config(128, 32, 4, 4),
       Config(64, 128, 4, 3)]
BWD = [BackwardConfig(32, 128, 8, 1, 128, 32, 8, 2), BackwardConfig(64, 128, 8, 1, 128, 64, 8, 2),
       BackwardConfig(64, 64, 4, 1, 64, 64, 4, 2), BackwardConfig(32, 64, 4, 2, 64, 32, 4, 3),
       BackwardConfig(64, 128, 8, 2, 128, 64, 8, 3), BackwardConfig(32, 128, 4, 1, 128, 32, 4, 2),
       BackwardConfig(16, 128, 4, 2, 128, 16, 4, 3), BackwardConfig(64, 64, 8, 2, 64, 64, 8, 2)]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--dims", default="64,128,256")
    args = parser.parse_args()
    rows = []
    for d in map(int, args.dims.split(",")):
        b, h, s = 4, 16 if d == 128 else (32 if d == 64 else 8), 4096
        flops = 4 * b * h * s * s * d
        check_case = Case(f"D{d}", batch=2, heads=4, kv_heads=2, seqlen_q=777, seqlen_k=1024,
                          dqk=d, dv=d, options=dict(causal=True))
        q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16,
                               requires_grad=True) for _ in range(3))
        for causal in (False, True):
            f = flops / (2 if causal else 1)
            for cfg in FWD:
                tuning.forward_override = cfg
                try:
                    ok = all(r.passed for r in check_forward(check_case, torch.bfloat16, "cuda"))
                    ms = do_bench(lambda: memattn.attention(q, k, v, causal=causal),
                                  return_mode="median")
                    rows.append(("fwd", d, causal, cfg, ok, f / ms / 1e9))
                except Exception as e:  # noqa: BLE001
                    rows.append(("fwd", d, causal, cfg, f"error {type(e).__name__}", 0.0))
            tuning.forward_override = None
            out = memattn.attention(q, k, v, causal=causal)
            grad = torch.randn_like(out)
            for cfg in BWD:
                tuning.backward_override = cfg
                try:
                    ok = all(r.passed for r in check_backward(check_case, torch.bfloat16, "cuda"))
                    ms = do_bench(lambda: out.backward(grad, retain_graph=True),
                                  grad_to_none=[q, k, v], return_mode="median")
                    rows.append(("bwd", d, causal, cfg, ok, 2.5 * f / ms / 1e9))
                except Exception as e:  # noqa: BLE001
                    rows.append(("bwd", d, causal, cfg, f"error {type(e).__name__}", 0.0))
            tuning.backward_override = None
            for r in rows[-len(FWD) - len(BWD):]:
                print(f"{r[0]} D={r[1]} causal={r[2]} {r[3]} correct={r[4]} {r[5]:.0f} TFLOP/s",
                      flush=True)


if __name__ == "__main__":
    main()
