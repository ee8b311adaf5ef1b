"""Race hunting on the device: one forward call repeated many times, in several processes
at once, each call's lse (and out, without dropout) against one float64 reference. A
race between warps, partitions or proxies shows in some calls only, and more often when
other processes keep the GPU busy; the GPU suite runs each case once. Prints, per
process, the calls that went wrong and where: the 128-row block, the warpgroup (64 rows)
and the warp (16 rows) of the rows off.

    python tools/stress.py [--dims 256] [--sq 333] [--sk 520] [--bias 1HQK] [--dropout 0.1]
                           [--causal] [--dtype float16] [--variant default] [--calls 40]
                           [--procs 12]

--variant takes tools/ab.py's knob sets (ab.VARIANTS: "rescale_always" takes out the
D=256 forward's lazy-rescale barriers, which keep a warpgroup's warps in step).

A race's test should fail on the kernel before the fix: run it from that tree's own
checkout (``git archive`` into a folder, the test copied in, pytest from there), since
pytest puts its rootdir ahead of PYTHONPATH on sys.path and would import this tree.
"""

import argparse
import os
import subprocess
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import ab  # noqa: E402

from memattn import check, ops  # noqa: E402


def worker(args) -> None:
    ab.use(ab.VARIANTS[args.variant])
    dqk, dv = (int(x) for x in (args.dims.split("/") * 2)[:2])
    options = dict(dropout_p=args.dropout, causal=args.causal)
    case = check.Case("stress", batch=2, seqlen_q=args.sq, seqlen_k=args.sk, dqk=dqk,
                      dv=dv, bias=args.bias or None, options=options)
    dtype = getattr(torch, args.dtype)
    x = check.make_inputs(case, dtype, args.device, seed=7)
    ref, ref_lse, out_allowed, lse_allowed = check.repeated_forward_reference(x, dtype)
    wrong = []
    for call in range(args.calls):
        out, lse, _ = ops.forward(x.q, x.k, x.v, **x.kwargs)
        off = (lse.double() - ref_lse).abs() > lse_allowed
        bad_out = out_allowed is not None and check.relative_error(out, ref) > out_allowed
        if off.any() or bad_out:
            rows = off.nonzero()[:, 2]  # lse is (B, H, Sq)
            where = (f"lse error {check.lse_error(lse, ref_lse):.1e} in {len(rows)} rows: "
                     f"blocks {sorted(set((rows // 128).tolist()))}, warpgroups "
                     f"{sorted(set((rows % 128 // 64).tolist()))}, warps "
                     f"{sorted(set((rows % 64 // 16).tolist()))}") if off.any() else "out"
            wrong.append(f"  call {call}: {where}")
    print(f"{len(wrong)} of {args.calls} calls wrong", *wrong[:3], sep="\n", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dims", default="256", help="Dqk[/Dv]")
    ap.add_argument("--sq", type=int, default=333)
    ap.add_argument("--sk", type=int, default=520)
    ap.add_argument("--bias", default="1HQK", help='"BHQK"-style letters, "" for none')
    ap.add_argument("--dropout", type=float, default=0.0)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--variant", default="default", choices=sorted(ab.VARIANTS))
    ap.add_argument("--calls", type=int, default=40)
    ap.add_argument("--procs", type=int, default=12)
    ap.add_argument("--device", default="cuda", help="cpu: the tile kernels, interpreted")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    command = [sys.executable, __file__, "--worker", *sys.argv[1:]]
    procs = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for _ in range(args.procs)]  # fmt: skip
    for i, p in enumerate(procs):
        print(f"process {i}: {p.communicate()[0].strip()}")


if __name__ == "__main__":
    main()
