"""The ``memattn`` command: ``memattn check`` and ``memattn bench``."""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time


def _prepare_device() -> str:
    """The best device present. Without CUDA, kernels run in Triton's interpreter, which
    must be chosen before they are decorated (memattn loads them lazily)."""
    import torch

    if torch.cuda.is_available():
        return "cuda"
    os.environ["TRITON_INTERPRET"] = "1"
    return "cpu"


def check(args) -> int:
    if args.random < 0:
        print(f"memattn check: --random must be >= 0 (0: the feature grid), got {args.random}",
              file=sys.stderr)
        return 2
    device = _prepare_device()
    import torch
    from rich.console import Console
    from rich.table import Table

    from . import check as checks

    if args.random:  # (case, run, dtype, seed) for each of --random calls
        calls = [(seed, checks.random_call(seed, gpu=device == "cuda"))
                 for seed in range(args.seed, args.seed + args.random)]  # fmt: skip
        jobs = [(c.case, run, c.dtype, seed)
                for seed, c in calls
                for run in (checks.check_forward,
                            functools.partial(checks.check_backward, bias_grad=c.bias_grad,
                                              lse_grad=c.lse_grad, frozen=c.frozen))]
    elif device == "cuda":
        jobs = [(checks.gpu_sized(case), run, dtype, 0) for case in checks.FEATURE_CASES
                for run in checks.RUNS for dtype in (torch.bfloat16, torch.float16)]
    else:  # the interpreter is slow: one batch, gradients in float32 only (the test
        # suite covers batch 2 and float16 gradients)
        runs = [(checks.check_forward, [torch.float32, torch.float16]),
                (checks.check_backward, [torch.float32])]  # fmt: skip
        jobs = [(case if case.varlen else case.scaled(batch=1), run, dtype, 0)
                for case in checks.FEATURE_CASES for run, dtypes in runs for dtype in dtypes]
    console = Console()
    where = "GPU" if device == "cuda" else "Triton interpreter"
    table = Table(title=f"memattn check on {device} ({where})")
    for col in ("feature", "shape", "dtype", "tensor", "error", "allowed", "result"):
        table.add_column(col)
    failures = 0
    start = time.perf_counter()
    with console.status("checking...") as status:
        for case, run, dtype, seed in jobs:
            status.update(f"{case.name} {dtype}")
            for r in run(case, dtype, device, seed=seed):
                failures += not r.passed
                table.add_row(
                    case.name, case.describe(), str(dtype).removeprefix("torch."),
                    r.what, f"{r.error:.2e}", f"{r.allowed:.2e}",
                    "[green]pass[/]" if r.passed else "[red]FAIL[/]",
                )  # fmt: skip
    console.print(table)
    console.print(f"{failures} failed, {table.row_count - failures} passed "
                  f"in {time.perf_counter() - start:.0f} s")  # fmt: skip
    return 1 if failures else 0


def info(args) -> int:
    """Versions, the device, which features run on it (each tried with a tiny call, not
    assumed), and the tuned configurations, in the style of `python -m xformers.info`."""
    device = _prepare_device()
    import platform

    import torch
    import triton
    from rich.console import Console
    from rich.table import Table

    import memattn

    from . import check as checks
    from .kernels import tuning
    from .spec import AttentionSpec

    console = Console()
    table = Table(title="memattn info", show_header=False)
    rows = [("memattn", memattn.__version__), ("python", platform.python_version()),
            ("torch", torch.__version__), ("triton", triton.__version__),
            ("cuda (torch)", str(torch.version.cuda))]  # fmt: skip
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        rows += [("device", f"{props.name}, sm_{props.major}{props.minor}, "
                            f"{props.multi_processor_count} SMs, "
                            f"{props.total_memory / 2**30:.0f} GiB")]  # fmt: skip
    else:
        rows += [("device", "CPU: kernels run in Triton's interpreter (slow; for tests)")]
    from .kernels.dispatch import backward_sm90, forward_sm90  # None without Gluon's API

    if forward_sm90 is None or not forward_sm90.hopper.enabled:
        hopper = "off (built for Triton 3.6's Gluon)"
    elif device == "cuda" and torch.cuda.get_device_capability(0)[0] == 9:
        fewest = ", ".join(f"at D={d} from {n}" for d, n in backward_sm90.MIN_KEYS_PER_QUERY.items()
                           if n > 0)  # fmt: skip
        hopper = (f"on: bf16/fp16, D 64/128/192/256, others as the next of them (the "
                  f"backward {fewest} keys a query); "
                  "memattn/kernels/dispatch.py says which calls; the rest run the tile "
                  "kernels")
    else:
        hopper = "off (needs sm_90)"
    rows += [("Hopper kernels (Gluon)", hopper)]
    from .kernels import decode

    rows += [("split-KV forward", f"Sq <= {decode.MAX_QUERIES} a sequence and Sk >= "
                                  f"{decode.MIN_KEYS} (decode, chunked prefill), any device")]
    for row in rows:
        table.add_row(*row)
    console.print(table)

    features = Table(title=f"features on {device} (a tiny call each, against the reference)")
    for col in ("feature", "dtype", "forward", "backward"):
        features.add_column(col)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    tiny = dict(seqlen_q=9, seqlen_k=12, dqk=16, dv=16)
    for case in checks.FEATURE_CASES:
        case = case.scaled(**tiny) if not case.varlen else case.scaled(dqk=16, dv=16)
        cells = []
        for run in checks.RUNS:
            try:
                ok = all(r.passed for r in run(case, dtype, device))
                cells.append("[green]yes[/]" if ok else "[red]WRONG[/]")
            except Exception as e:  # noqa: BLE001 - reported, not raised: this is a survey
                cells.append(f"[red]no: {type(e).__name__}[/]")
        features.add_row(case.name, str(dtype).removeprefix("torch."), *cells)
    console.print(features)

    configs = Table(title="tuned configurations (kernels/tuning.py)")
    for col in ("head dim", "forward BMxBN/warps/stages", "dK/dV", "dQ"):
        configs.add_column(col)
    for d in (64, 128, 256):
        spec = AttentionSpec(
            batch=1, heads=1, kv_heads=1, seqlen_q=1, seqlen_k=1, head_dim_qk=d, head_dim_v=d,
            varlen=False, window_left=-1, window_right=-1, bottom_right=False,
            scale=1.0, softcap=0.0, dropout_p=0.0, has_bias=False, has_alibi=False,
            deterministic=False, dtype=torch.bfloat16, device=torch.device(device),
        )  # fmt: skip
        f, b = tuning.forward_config(spec), tuning.backward_config(spec)
        configs.add_row(
            str(d), f"{f.block_m}x{f.block_n}/{f.num_warps}/{f.num_stages}",
            f"{b.block_m_dkdv}x{b.block_n_dkdv}/{b.num_warps_dkdv}/{b.num_stages_dkdv}",
            f"{b.block_m_dq}x{b.block_n_dq}/{b.num_warps_dq}/{b.num_stages_dq}",
        )  # fmt: skip
    console.print(configs)
    return 0


def bench(args) -> int:
    from . import bench as _bench

    return _bench.main(args)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="memattn", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("check", help="check the kernels against the float64 reference")
    p.add_argument("--random", type=int, default=0, metavar="N",
                   help="N calls with options drawn together at random "
                        "(memattn.check.random_call) instead of the feature grid")
    p.add_argument("--seed", type=int, default=0,
                   help="the first random call's seed (the test suite's ids)")
    sub.add_parser("info", help="versions, device, features that run here, tuned configs")
    p = sub.add_parser("bench", help="time memattn against torch's attention backends")
    p.add_argument("--quick", action="store_true", help="a subset that runs in ~2 minutes")
    p.add_argument("--json", help="where to write the results (default: a full run "
                                  "docs/bench/latest.json, a subset bench-out/bench.json)")
    p.add_argument("--plot", metavar="PATH",
                   help="where to save the plot (default: the --json path with .png)")
    p.add_argument("--rows", metavar="GLOBS",
                   help="only rows whose names match these comma-separated globs, "
                        "e.g. 'D128_*,gqa8' (see --list)")
    p.add_argument("--impls", metavar="NAMES",
                   help="only these implementations, comma-separated: memattn, "
                        "sdpa_flash, sdpa_efficient, sdpa_cudnn, flex, fa4 (where it imports)")
    p.add_argument("--resume", action="store_true",
                   help="continue the run whose JSON is at --json: rows it has for every "
                        "implementation asked are kept, not run again (a full run spread "
                        "over several calls on one machine); with --rows, the file's other "
                        "rows stay as they are")
    p.add_argument("--rounds", type=int, default=1, metavar="N",
                   help="time each row's implementations N times in turn, the order "
                        "rotated each round, and keep each one's median: the ratios then "
                        "rest on N samples each (a full run takes N times as long); with "
                        "N >= 2 a row whose rounds disagree gets up to 2 more")
    p.add_argument("--list", action="store_true", help="list the rows and exit")
    p.add_argument("--compile-workers", type=int, default=0, metavar="N",
                   help="first compile every row's kernels (memattn's and flex's) in N "
                        "worker processes, into the on-disk caches; the timing then runs "
                        "in this one process, as without it")
    args = parser.parse_args(argv)
    return {"check": check, "info": info, "bench": bench}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
