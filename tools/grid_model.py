"""The Gluon forward's grid, modelled on a CPU machine: how evenly its programs end, from
the plan the kernel would launch (forward_sm90.plan, under tools/ab.py's knobs) and the
orders its programs walk (hopper.work_items, work_item and rank_major_item, run in
Python). A block's work is its key tiles (a causal block sees the keys up to its last
query); a grid of no more programs than SMs ends with its busiest program, a larger one
hands each next program to the SM that frees first (the hardware's in-order dispatch).
Prints per shape and variant when the grid ends, as a multiple of its work spread evenly
over the SMs: what a change of schedule can win or lose, before any device time.

    python tools/grid_model.py [--shapes 64x16384c,256x16384c] [--variants default,fwd_by_rank0]
                               [--overhead 2] [--sms 132] [--persistent]

--overhead: key tiles' worth of time a program spends on its start (its first Q and K
tiles, the pipeline's fill), paid once a program: a persistent program overlaps its later
blocks' starts with the previous blocks' ends, a program per block or pair cannot.
--persistent: also each variant's programs taken in order by persistent ones (a start
paid once an SM): a schedule worked out on the host, or handed out by tickets.
Shapes are tools/ab.py's dense ones ("DxS", "c" for causal; B = 16384 / S, H = 2048 / D).

With --overhead 2 it matched the H200's A/B of a program per block rank by rank
against folded pairs (tools/ab.py, medians of 3-5) to about a point: D128 S4096 causal
-7.6 % (measured -7.4 %), S8192 -2.6 % (-2.0 %), S16384 0 (+0.7 %), D64 S8192 +1.3 %
(+0.4 to +1.8 %), S16384 +0.2 % (+0.6 %), D256 S16384 +2.0 % (+2.3 to +2.6 %). Between
persistent schedules it reads high: the host's deal (a plan's TABLE, modelled from its
schedule) over folded pairs at D=128 causal, +3 % modelled, measured nothing (S4096 to
S16384); over a program per block at D=64, +2-5 % modelled, +2-3 % measured.
"""

import argparse
import heapq
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import ab  # noqa: E402

from memattn.kernels import forward_sm90, hopper  # noqa: E402
from memattn.kernels.common import cdiv  # noqa: E402
from memattn.spec import check_call  # noqa: E402


def spec_of(shape: str):
    """The AttentionSpec of a dense bf16 shape "DxS[c]" (meta tensors: no memory)."""
    causal = shape.endswith("c")
    d, s = (int(x) for x in shape.removesuffix("c").split("x"))
    b, h = max(1, 16384 // s), 2048 // d
    q, k, v = (torch.empty(b, s, h, d, device="meta", dtype=torch.bfloat16) for _ in range(3))
    return check_call(q, k, v, causal=causal)


def program_blocks(plan: hopper.Plan) -> list[list[int]]:
    """Each program's query blocks, as ranks (0: the last block, the most work under a
    causal mask), in the order the kernel walks them."""
    num_m, num_items = plan.counts
    fold, by_rank = plan.constexprs["FOLD"], plan.constexprs["BY_RANK"]
    programs = plan.programs
    if plan.constexprs["TABLE"]:  # the host's deal (hopper.rank_table)
        table = plan.schedule
        return [[item % num_m for item in table[table[p]:table[p + 1]]]
                for p in range(programs)]  # fmt: skip
    walks = []
    for pid in range(programs):
        if by_rank:
            pid = hopper.rank_major_item.fn(pid, programs, num_m, cdiv(by_rank, num_m))
        items = hopper.work_items.fn(pid, programs, num_items, fold)
        walks.append([hopper.work_item.fn(pid, j, programs, num_m, fold)[1]
                      for j in range(items)])  # fmt: skip
    return walks


def rank_tiles(spec, plan: hopper.Plan) -> list[int]:
    """Key tiles of a head's query blocks by rank (top-left causal mask, or none)."""
    block_m, block_n = plan.constexprs["BLOCK_M"], plan.constexprs["BLOCK_N"]
    num_m = plan.counts[0]
    if spec.window_right >= 0:
        return hopper.right_bound_tiles(spec, num_m, block_m, block_n)
    return [cdiv(spec.seqlen_k, block_n)] * num_m


def grid_end(spec, plan: hopper.Plan, sms: int, overhead: float,
             persistent: bool = False) -> tuple[float, float]:  # fmt: skip
    """(when the grid ends, its key tiles spread evenly over ``sms``), in key tiles: the
    same even spread for every schedule of a shape, the programs' starts not in it.
    persistent: a grid of more programs than SMs run as ``sms`` persistent programs that
    take its programs in order as each frees (a start paid once an SM), as if a list
    schedule worked out on the host, or tickets, handed them out."""
    by_rank = rank_tiles(spec, plan)
    tiles = [sum(by_rank[r] for r in walk) for walk in program_blocks(plan)]
    times = [(0.0 if persistent else overhead) + t for t in tiles]
    if len(times) <= sms:
        return max(times) + (overhead if persistent else 0.0), sum(tiles) / sms
    free = [overhead if persistent else 0.0] * sms  # each SM's next free time
    for t in times:  # programs go out in order
        heapq.heappush(free, heapq.heappop(free) + t)
    return max(free), sum(tiles) / sms


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="64x8192c,64x16384c,128x4096c,128x16384c,256x4096c,"
                                        "256x16384c,128x16384")
    ap.add_argument("--variants", default="default,fwd_by_rank0")
    ap.add_argument("--overhead", type=float, default=2.0)
    ap.add_argument("--sms", type=int, default=132)
    ap.add_argument("--persistent", action="store_true",
                    help="also each variant's programs taken in order by persistent ones")
    args = ap.parse_args()
    hopper.sm_count = lambda device_index: args.sms  # the plans' persistent grid size
    print(f"{'shape':12s} {'variant':16s} {'programs':>8s} {'blocks':>7s}  ends at (x even)")
    for shape in args.shapes.split(","):
        spec = spec_of(shape)
        for name in args.variants.split(","):
            ab.use(ab.VARIANTS[name])
            plan = forward_sm90.plan(spec, False, (0, 0), 0, 0)
            end, even = grid_end(spec, plan, args.sms, args.overhead)
            line = (f"{shape:12s} {name:16s} {plan.programs:8d} {plan.counts[1]:7d}  "
                    f"{end / even:.3f}")
            if args.persistent:
                end, even = grid_end(spec, plan, args.sms, args.overhead, persistent=True)
                line += f"  persistent {end / even:.3f}"
            print(line)
        ab.use({})


if __name__ == "__main__":
    main()
