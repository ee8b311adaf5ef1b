"""Where a call's host time goes before its launch, layer by layer: perf_counter stamps
at the first entry of each layer (forward: check, the autograd Function, the dispatch,
the Gluon forward, hopper.Launcher, the launch, prepared or not; backward: the
Function, the dispatch, the Gluon path, its first Launcher and launch (the preprocess),
the Gluon kernel's wrapper), medians over calls with the GPU synced before each (or,
--warm, a loop of small calls); forwards with autograd recording and without. bf16,
16k tokens. --profile adds cProfile's table of the same calls (by own time);
--functions, instead of the stamps, each function's time in a call, its callees included
(FUNCTIONS: the layers, allocations, checks and each kernel's launch), without
cProfile's overhead.

    python tools/host_layers.py [--shapes 256x512,128x1024c] [--backward] [--warm] [--profile]
                                [--functions]

do_bench counts the host's time before a launch beyond its ~90 µs L2 flush: this says
which layer to trim.
"""

import argparse
import collections
import cProfile
import pstats
import statistics
import sys
import time

import torch

import memattn
from memattn import ops
from memattn.kernels import backward as tiles_backward
from memattn.kernels import backward_sm90, dispatch, forward_sm90, hopper

STAMPS = {}
TOTALS = collections.Counter()  # --functions: seconds in each, over the timed calls
# --functions' functions (module, names), called through their modules' attributes
FUNCTIONS = (
    (ops, ("_check_user_call", "_skips_dispatcher", "_run_backward")),
    (dispatch, ("forward", "backward", "gluon_forward", "gluon_backward", "kernel_spec")),
    (forward_sm90, ("forward",)),
    (backward_sm90, ("run", "row_stats_buffer", "dq_tiles", "new_output", "backward",
                     "dq_from_tiles_launch")),
    (tiles_backward, ("delta_launch",)),
    (hopper, ("plan_with_schedule", "tensor_key", "aligned")),
)


def stamped(name, fn):
    def wrapper(*args, **kwargs):
        STAMPS.setdefault(name, time.perf_counter())
        return fn(*args, **kwargs)

    return wrapper


def instrument():
    ops._check_user_call = stamped("check", ops._check_user_call)
    ops._Attention.forward = staticmethod(stamped("Function.forward", ops._Attention.forward))
    dispatch.forward = stamped("dispatch.forward", dispatch.forward)
    forward_sm90.forward = stamped("forward_sm90", forward_sm90.forward)
    hopper.Launcher.__call__ = stamped("Launcher", hopper.Launcher.__call__)
    real_arguments, real_prepared = hopper._Compiled.arguments, hopper.Launcher.launch_prepared

    def launched(t):  # every launch: launch, launch#2, ...
        n = sum(name.startswith("launch") for name in STAMPS)
        STAMPS[f"launch#{n + 1}" if n else "launch"] = t

    def arguments(*args, **kwargs):  # a launch that makes its arguments
        launched(time.perf_counter())
        return real_arguments(*args, **kwargs)

    def launch_prepared(*args, **kwargs):  # one that found them prepared
        t = time.perf_counter()
        found = real_prepared(*args, **kwargs)
        if found:
            launched(t)
        return found

    hopper._Compiled.arguments = arguments
    hopper.Launcher.launch_prepared = launch_prepared
    ops._Attention.backward = staticmethod(stamped("Function.backward",
                                                   ops._Attention.backward))  # fmt: skip
    dispatch.backward = stamped("dispatch.backward", dispatch.backward)
    backward_sm90.run = stamped("backward_sm90.run", backward_sm90.run)
    backward_sm90.backward = stamped("backward_sm90", backward_sm90.backward)


def timed(name, fn):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            TOTALS[name] += time.perf_counter() - start

    return wrapper


def instrument_functions():
    """--functions: FUNCTIONS, the autograd Function's passes and each kernel's launches
    (hopper.Launcher's, by kernel; "prepared": the lookup of a prepared launch) timed."""
    for module, names in FUNCTIONS:
        for name in names:
            label = f"{module.__name__.rsplit('.', 1)[-1]}.{name}"
            setattr(module, name, timed(label, getattr(module, name)))
    for name in ("forward", "backward"):
        method = getattr(ops._Attention, name)
        setattr(ops._Attention, name, staticmethod(timed(f"Function.{name}", method)))
    launch, prepared = hopper.Launcher.__call__, hopper.Launcher.launch_prepared
    hopper.Launcher.__call__ = lambda self, *args, **kwargs: timed(
        f"launch {self.fn.__name__}", launch)(self, *args, **kwargs)
    hopper.Launcher.launch_prepared = lambda self, *args: timed(
        f"prepared {self.fn.__name__}", prepared)(self, *args)


def function_times(call, n=300) -> tuple[float, list[tuple[str, float]]]:
    """--functions: µs a call in a loop of ``n`` (the GPU synced after), and in each
    instrumented function, most first."""
    TOTALS.clear()
    start = time.perf_counter()
    for _ in range(n):
        call()
    whole = (time.perf_counter() - start) / n * 1e6
    torch.cuda.synchronize()
    return whole, [(name, seconds / n * 1e6) for name, seconds in TOTALS.most_common()]


def medians(call, n=60, warm=False) -> dict:
    rows = []
    for _ in range(n):
        if not warm:
            torch.cuda.synchronize()
        STAMPS.clear()
        t0 = time.perf_counter()
        call()
        STAMPS["return"] = time.perf_counter()
        rows.append({name: (t - t0) * 1e6 for name, t in STAMPS.items()})
    return {name: statistics.median(r[name] for r in rows) for name in rows[0]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="256x512,256x1024c,128x1024c",
                    help="DxS, c for causal")  # fmt: skip
    ap.add_argument("--backward", action="store_true",
                    help="stamp out.backward(grad) instead of the forward")  # fmt: skip
    ap.add_argument("--warm", action="store_true",
                    help="B=1, H=2 and no sync between calls: the host path as a loop of "
                         "calls meets it, warm, with the GPU never the bound")  # fmt: skip
    ap.add_argument("--profile", action="store_true",
                    help="also cProfile 200 calls of each shape, by own time")  # fmt: skip
    ap.add_argument("--functions", action="store_true",
                    help="instead of the stamps, each function's µs a call, callees "
                         "included (FUNCTIONS)")  # fmt: skip
    args = ap.parse_args()
    if args.functions:
        instrument_functions()
    else:
        instrument()
    for shape in args.shapes.split(","):
        causal = shape.endswith("c")
        d, s = map(int, shape.rstrip("c").split("x"))
        b, h = (1, 2) if args.warm else (max(1, 16384 // s), 2048 // d)
        q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16,
                               requires_grad=True) for _ in range(3))  # fmt: skip
        call = lambda: memattn.attention(q, k, v, causal=causal)  # noqa: E731
        modes = (("autograd", True), ("no_grad", False))
        if args.backward:
            out = call()
            grad_out = torch.randn_like(out)

            def call():  # as the bench's do_bench runs it: grads set to None first
                q.grad = k.grad = v.grad = None
                out.backward(grad_out, retain_graph=True)

            modes = (("backward", True),)
        for _ in range(5):
            call()
        for label, grad in modes:
            if args.functions:
                with torch.set_grad_enabled(grad):
                    whole, times = function_times(call)
                cells = ", ".join(f"{name} {us:.1f}" for name, us in times)
                print(f"D{d} S{s}{' causal' if causal else ''} {label}: {whole:.0f} µs a "
                      f"call; in each function: {cells}", flush=True)  # fmt: skip
                continue
            with torch.set_grad_enabled(grad):
                stamps = medians(call, n=300 if args.warm else 60, warm=args.warm)
            cells = ", ".join(f"{name} {us:.0f}" for name, us in stamps.items())
            print(f"D{d} S{s}{' causal' if causal else ''} {label}: µs from the call: {cells}",
                  flush=True)  # fmt: skip
        if args.profile:
            with cProfile.Profile() as profile:
                for _ in range(200):
                    call()
            pstats.Stats(profile, stream=sys.stdout).sort_stats("tottime").print_stats(30)


if __name__ == "__main__":
    main()
