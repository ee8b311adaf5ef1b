"""One attention layer over a sequence split across processes (ring attention), checked
against the whole sequence on one process and timed.

    torchrun --nproc-per-node 2 examples/context_parallel.py            # GPUs, NCCL
    TRITON_INTERPRET=1 torchrun --nproc-per-node 2 examples/context_parallel.py \
        --device cpu --seqlen 64 --heads 2 --head-dim 16                # CPUs, gloo
"""

import argparse
import os
import time

import torch
import torch.distributed as dist

import memattn
from memattn import distributed as cp


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seqlen", type=int, default=32768)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--layout", choices=cp.LAYOUTS, default="zigzag")
    args = ap.parse_args()
    cuda = args.device == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else "cpu"
    if cuda:
        torch.cuda.set_device(device)
    dtype = torch.bfloat16 if cuda else torch.float32

    torch.manual_seed(0)  # every rank makes the same whole sequence, then keeps its shard
    shape = (1, args.seqlen, args.heads, args.head_dim)
    q, k, v, grad = (torch.randn(shape, device=device, dtype=dtype) for _ in range(4))
    shards = [cp.shard(t, layout=args.layout).requires_grad_() for t in (q, k, v)]

    def step():
        out = cp.context_parallel_attention(*shards, layout=args.layout, causal=True)
        out.backward(cp.shard(grad, layout=args.layout))
        return out

    out = step()
    if rank == 0:  # the whole sequence on one process, for the check
        ref = memattn.attention(q, k, v, causal=True)
    whole = cp.unshard(out.detach(), layout=args.layout)
    if rank == 0:
        err = ((whole.float() - ref.float()).norm() / ref.float().norm()).item()
        print(f"{world} ranks, {args.layout}: relative difference from one process {err:.2e}")

    steps = 3
    if cuda:
        torch.cuda.synchronize()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    if cuda:
        torch.cuda.synchronize()
    dist.barrier()
    seconds = (time.perf_counter() - start) / steps
    if rank == 0:
        print(f"forward + backward: {seconds * 1e3:.1f} ms, {args.seqlen / seconds:,.0f} tokens/s")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
