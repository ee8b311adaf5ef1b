"""Context parallelism's scaling: one attention layer, forward + backward, over the
launch's ranks at several sequence lengths: tokens per second, and how much of the
ring's communication its compute hides. Run once per world size, then plot them all:

    torchrun --nproc-per-node 4 tools/cp_scaling.py --json bench-out/cp_4.json
    python tools/cp_scaling.py --plot bench-out/cp_scaling.png bench-out/cp_*.json
    python tools/cp_scaling.py --beside 16 --seqlens 16384   # one GPU: beside()
    TRITON_INTERPRET=1 torchrun --nproc-per-node 2 tools/cp_scaling.py --device cpu \
        --seqlens 64,128 --heads 2 --head-dim 16 --repeats 1 --json bench-out/cp_cpu.json

Per length, medians over --repeats of three timings: the ring as it runs (ring); its
compute alone (compute: every transfer replaced by the tensors in hand, so each step
attends the same blocks to the same amount of work, on stale data); its transfers
alone (comm: the same sends and receives in the same order, nothing else). The compute
hides hidden = 1 - (ring - compute) / comm of the communication (1 on one rank).
"""

import argparse
import contextlib
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
import triton
import triton.language as tl

import memattn
from memattn import distributed as cp
from memattn.distributed import context_parallel as ring_module


class _NoTransfer:
    """A _RingStep that sends nothing: the next step gets the tensors it already has."""

    def __init__(self, tensors, group, world, rank):
        self.tensors = tensors

    def wait(self):
        return self.tensors


def _seconds(fn, repeats: int, cuda: bool) -> float:
    """Median wall time of fn() over ``repeats`` runs, every rank in step."""
    times = []
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
        dist.barrier()
        start = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        dist.barrier()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _measure(seqlen: int, args, device, dtype, world: int, rank: int) -> dict:
    cuda = device.type == "cuda"
    shard_len = seqlen // world
    shape = (1, shard_len, args.heads, args.head_dim)
    q, k, v, grad = (torch.randn(shape, device=device, dtype=dtype) for _ in range(4))
    shards = [t.requires_grad_() for t in (q, k, v)]

    def layer():
        out = cp.context_parallel_attention(*shards, layout=args.layout, causal=True)
        out.backward(grad)

    def transfers():  # the forward's K/V hops, the backward's K/V and dK/dV hops
        for _ in range(world - 1):
            ring_module._RingStep([k, v], None, world, rank).wait()
        accumulators = [torch.zeros(k.shape, dtype=torch.float32, device=device)] * 2
        for step in range(world):  # both in flight together, as in the backward, the
            # last hop in the shards' dtype
            sent = accumulators if step + 1 < world else [k, v]
            hops = [ring_module._RingStep(sent, None, world, rank)]
            if step + 1 < world:
                hops.append(ring_module._RingStep([k, v], None, world, rank))
            for hop in hops:
                hop.wait()

    layer()  # compiles, warms the allocator
    ring = _seconds(layer, args.repeats, cuda)
    real_step = ring_module._RingStep
    ring_module._RingStep = _NoTransfer
    try:
        compute = _seconds(layer, args.repeats, cuda)
    finally:
        ring_module._RingStep = real_step
    comm = _seconds(transfers, args.repeats, cuda) if world > 1 else 0.0
    hidden = 1.0 if comm == 0 else min(1.0, max(0.0, 1 - (ring - compute) / comm))
    return dict(seqlen=seqlen, ring_ms=ring * 1e3, compute_ms=compute * 1e3,
                comm_ms=comm * 1e3, tokens_per_s=seqlen / ring, hidden=hidden)  # fmt: skip


def run(args) -> None:
    cuda = args.device == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else \
        torch.device("cpu")  # fmt: skip
    if cuda:
        torch.cuda.set_device(device)
    dtype = torch.bfloat16 if cuda else torch.float32
    torch.manual_seed(rank)
    rows = []
    for seqlen in (int(s) for s in args.seqlens.split(",")):
        if seqlen % (2 * world):
            raise SystemExit(f"--seqlens: {seqlen} does not split into {2 * world} chunks")
        rows.append(_measure(seqlen, args, device, dtype, world, rank))
        if rank == 0:
            r = rows[-1]
            print(f"W={world} S={seqlen}: {r['ring_ms']:.1f} ms (compute {r['compute_ms']:.1f}, "
                  f"comm {r['comm_ms']:.1f}), {r['tokens_per_s']:,.0f} tokens/s, "
                  f"{r['hidden']:.0%} of communication hidden", flush=True)
    if rank == 0 and args.json:
        name = torch.cuda.get_device_name(device) if cuda else "CPU"
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(dict(world=world, device=name, heads=args.heads, head_dim=args.head_dim,
                           layout=args.layout, dtype=str(dtype), rows=rows), f, indent=1)
    dist.destroy_process_group()


@triton.jit
def busy_kernel(X, steps):
    """beside()'s stand-in for a transfer: each program holds its SM for ``steps``
    dependent FMAs."""
    acc = tl.load(X + tl.program_id(0))
    for _ in range(steps):
        acc = acc * 1.0000001 + 1e-7
    tl.store(X + tl.program_id(0), acc)


def beside(args) -> None:
    """One GPU, no ring: why the ring's kernels run inside memattn.sharing_sms. One layer
    on a whole sequence of each --seqlens (B1, forward + backward, causal and not),
    alone and with a kernel of ``--beside`` programs launched on a side stream just
    before it that holds their SMs for --busy-ms (a stand-in for NCCL's send/recv: 8-16
    programs of 640 threads for 2-5 ms a hop), its kernels persistent or inside
    sharing_sms. Each of the four cells timed in rounds of 5 layers, the cells' order
    rotated each round (the clock drifts as the board warms): medians of 25 layers, ms."""
    side, x = torch.cuda.Stream(), torch.ones(args.beside, device="cuda")
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def timed(fn, repeats=5) -> list[float]:
        times = []
        for _ in range(repeats):
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        return times

    steps = 1 << 20
    busy_kernel[(args.beside,)](x, steps, num_warps=16)  # compiled
    steps = int(steps * args.busy_ms / statistics.median(
        timed(lambda: busy_kernel[(args.beside,)](x, steps, num_warps=16), 3)))
    for seqlen in (int(s) for s in args.seqlens.split(",")):
        for causal in (False, True):
            shape = (1, seqlen, args.heads, args.head_dim)
            q, k, v, grad = (torch.randn(shape, device="cuda", dtype=torch.bfloat16)
                             for _ in range(4))  # fmt: skip
            leaves = [t.requires_grad_() for t in (q, k, v)]

            def layer(sharing: bool, busy: bool):
                if busy:
                    side.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(side):
                        busy_kernel[(args.beside,)](x, steps, num_warps=16)
                with memattn.sharing_sms() if sharing else contextlib.nullcontext():
                    out = memattn.attention(*leaves, causal=causal)
                    torch.autograd.grad(out, leaves, grad)
                torch.cuda.current_stream().wait_stream(side)

            cells = [(sharing, busy) for sharing in (False, True) for busy in (False, True)]
            times = {cell: [] for cell in cells}
            for cell in cells:
                layer(*cell)  # compiles, plans
            for r in range(5):
                for cell in cells[r % 4:] + cells[:r % 4]:
                    times[cell] += timed(lambda cell=cell: layer(*cell))
            ms = [statistics.median(times[cell]) for cell in cells]
            print(f"S={seqlen}{' causal' if causal else ''}, {args.beside} programs busy "
                  f"{args.busy_ms} ms beside: persistent {ms[0]:.2f} -> {ms[1]:.2f} ms, "
                  f"sharing_sms {ms[2]:.2f} -> {ms[3]:.2f} ms", flush=True)


def plot(path: str, inputs: list[str]) -> None:
    """Tokens per second against sequence length, a line per world size, each point
    labelled with the share of communication hidden."""
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("matplotlib is not installed: no plot (pip install matplotlib)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = sorted((json.load(open(p)) for p in inputs), key=lambda r: r["world"])
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for run_ in runs:
        xs = [r["seqlen"] for r in run_["rows"]]
        ys = [r["tokens_per_s"] for r in run_["rows"]]
        ax.plot(xs, ys, marker="o", label=f"{run_['world']} × {run_['device']}")
        for x, y, r in zip(xs, ys, run_["rows"]):
            if run_["world"] > 1:
                ax.annotate(f"{r['hidden']:.0%}", (x, y), textcoords="offset points",
                            xytext=(4, 4), fontsize=8)  # fmt: skip
    ax.set_xscale("log", base=2)
    ax.set_xlabel("sequence length (tokens)")
    ax.set_ylabel("tokens / s, one layer fwd + bwd")
    ax.set_title("memattn context parallel (causal, zigzag); labels: communication hidden")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seqlens", default="32768,131072,524288")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--layout", choices=cp.LAYOUTS, default="zigzag")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", help="where rank 0 writes the rows")
    ap.add_argument("--plot", metavar="PNG", help="plot the JSON files given after it")
    ap.add_argument("--beside", type=int, metavar="PROGRAMS",
                    help="one GPU, no ring: layers beside a kernel of this many programs "
                         "(beside())")  # fmt: skip
    ap.add_argument("--busy-ms", type=float, default=3.0, help="how long --beside's kernel runs")
    args, rest = ap.parse_known_args()
    if args.plot:
        plot(args.plot, rest)
    elif args.beside:
        beside(args)
    else:
        run(args)


if __name__ == "__main__":
    main()
