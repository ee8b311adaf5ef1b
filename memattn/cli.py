"""The ``memattn`` command: ``memattn check`` and ``memattn bench``."""

from __future__ import annotations

import argparse
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
    device = _prepare_device()
    import torch
    from rich.console import Console
    from rich.table import Table

    from . import check as checks

    if device == "cuda":
        from .check import gpu_sized

        cases = [gpu_sized(c) for c in checks.FEATURE_CASES]
        dtypes = [torch.bfloat16, torch.float16]
    else:
        cases = checks.FEATURE_CASES
        dtypes = [torch.float32, torch.float16]
    console = Console()
    table = Table(title=f"memattn check on {device} ({'GPU' if device == 'cuda' else 'Triton interpreter'})")
    for col in ("feature", "shape", "dtype", "tensor", "error", "allowed", "result"):
        table.add_column(col)
    failures = 0
    start = time.perf_counter()
    with console.status("checking...") as status:
        for case in cases:
            for dtype in dtypes:
                status.update(f"{case.name} {dtype}")
                for run in checks.RUNS:
                    for r in run(case, dtype, device):
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


def bench(args) -> int:
    from . import bench as _bench

    return _bench.main(args)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="memattn", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("check", help="check the kernels against the float64 reference")
    p = sub.add_parser("bench", help="time memattn against torch's attention backends")
    p.add_argument("--quick", action="store_true", help="a subset that runs in ~2 minutes")
    p.add_argument("--json", default="bench.json", help="where to write the results")
    args = parser.parse_args(argv)
    return {"check": check, "bench": bench}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
