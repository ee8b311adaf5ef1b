"""Host time per forward call on the Gluon path, layer by layer (no profiler: each row
is a loop of real calls at shapes whose kernels take less time than the host), a
backward call's, and what launching past JITFunction.run saves (hopper.Launcher). On
the device:

    python tools/probe_launch.py
"""
import statistics
import time

import torch
from triton import knobs
from triton.runtime import driver

import memattn
from memattn.kernels import backward_sm90, forward_sm90, hopper
from memattn.kernels import forward as forward_kernels
from memattn.spec import check_call

forward_sm90.MIN_KEYS_PER_QUERY = dict.fromkeys(forward_sm90.HEAD_DIMS, 0)
backward_sm90.MIN_KEYS_PER_QUERY = dict.fromkeys(backward_sm90.HEAD_DIMS, 0)


def per_call(fn, n=300):
    fn()
    torch.cuda.synchronize()
    runs = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        runs.append((time.perf_counter() - t0) / n * 1e6)
        torch.cuda.synchronize()
    return statistics.median(runs)


for s, h in ((128, 2), (1024, 16)):
    q, k, v = (torch.randn(1, s, h, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    spec = check_call(q, k, v, causal=True)
    out = torch.empty_like(q)
    lse = torch.empty(1, h, s, device="cuda", dtype=torch.float32)
    # The kernel's arguments as forward_sm90.forward builds them: caught from one call.
    caught = []
    launcher = forward_sm90._launch_forward
    forward_sm90._launch_forward = lambda grid, *a, **kw: caught.append((grid, a, kw))
    forward_sm90._launch_forward.launch_prepared = lambda programs, call: False
    forward_sm90.forward(spec, q, k, v, None, None, None, None, None, out, lse)
    forward_sm90._launch_forward = launcher
    grid, args, kwargs = caught[0]
    consts = {name: value for name, value in kwargs.items() if name != "num_warps"}
    kern = forward_sm90._fwd_sm90_kernel[grid](*args, **kwargs)
    dev = driver.active.get_current_device()

    def direct():
        stream = driver.active.get_current_stream(dev)
        kern.run(grid[0], 1, 1, stream, kern.function, kern.packed_metadata, None,
                 knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook,
                 *args, *consts.values())

    grad_out = torch.randn_like(q)
    graph_out = memattn.attention(q, k, v, causal=True)
    rows = {
        "attention, autograd": lambda: memattn.attention(q, k, v, causal=True),
        "backward (autograd.grad)": lambda: torch.autograd.grad(graph_out, (q, k, v), grad_out,
                                                                retain_graph=True),
        "attention, no_grad": lambda: torch.no_grad()(memattn.attention)(q, k, v, causal=True),
        "check_call": lambda: check_call(q, k, v, causal=True),
        "kernels.forward.forward": lambda: forward_kernels.forward(spec, q, k, v, None, None,
                                                                   None, None, None),
        "forward_sm90.supports": lambda: forward_sm90.supports(spec, q, k, v, None),
        "forward_sm90.forward": lambda: forward_sm90.forward(spec, q, k, v, None, None, None,
                                                             None, None, out, lse),
        "4 descriptors": lambda: [hopper.descriptor(q, 64), hopper.descriptor(k, 128),
                                  hopper.descriptor(v, 128), hopper.descriptor(out, 64)],
        "JITFunction[grid](...)": lambda: forward_sm90._fwd_sm90_kernel[grid](
            *args, **kwargs),
        "kernel.run direct": direct,
        "torch.empty x2": lambda: (torch.empty_like(q), torch.empty(1, h, s, device="cuda")),
    }
    print(f"S={s} H={h}")
    for name, fn in rows.items():
        print(f"  {name:28s} {per_call(fn):7.1f} us", flush=True)
