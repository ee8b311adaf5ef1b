"""Context parallelism: one sequence split across the ranks of a torch.distributed group,
attention computed as a ring (ring attention).

Each rank holds its shard of q, k and v along the sequence. The K/V shards travel
around the ring (rank r sends to r + 1 and receives from r - 1, by
``torch.distributed.batch_isend_irecv``); in the forward the next transfer starts
before the local attention on the current shard, so that compute hides it. Each step's
partial result (``memattn.ops.forward``: out and lse) is merged exactly through the lse.
The backward sends the K/V shards around again, now with their dK/dV accumulators (fp32),
and calls ``memattn.ops.backward`` with the merged (global) out and lse; after a full
turn each accumulator is back on the rank that owns its shard. There too the K/V shard
goes on before the step's compute, and the accumulators, added to after it, arrive
during it.

Layouts: "contiguous" (rank r holds tokens [r·S/W, (r+1)·S/W)) and "zigzag" (the
sequence in 2W chunks, rank r holding chunks r and 2W-1-r, so that under a causal mask
every rank does the same work). A pair of chunks is attended whole, under the causal
diagonal, or skipped (a chunk a query chunk cannot see is never computed).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from .. import ops
from ..spec import check_call

LAYOUTS = ("zigzag", "contiguous")


def _world(group) -> tuple[int, int]:
    return dist.get_world_size(group), dist.get_rank(group)


def _chunks_of(rank: int, world: int, layout: str) -> tuple[int, ...]:
    """The global chunk indices rank ``rank`` holds, in the order its shard holds them."""
    return (rank, 2 * world - 1 - rank) if layout == "zigzag" else (rank,)


def _check_layout(layout) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    return layout


def shard(x: Tensor, *, group=None, layout: str = "zigzag", dim: int = 1) -> Tensor:
    """This rank's shard of a whole-sequence tensor ``x`` (sequence along ``dim``; q, k
    and v are (B, S, H, D): dim 1). S must divide into 2W chunks (zigzag) or W
    (contiguous). Returns a new contiguous tensor."""
    _check_layout(layout)
    world, rank = _world(group)
    parts = 2 * world if layout == "zigzag" else world
    if x.shape[dim] % parts:
        raise ValueError(f"x.shape[{dim}] = {x.shape[dim]} must be a multiple of {parts} "
                         f"({layout} layout over {world} ranks)")  # fmt: skip
    chunks = x.chunk(parts, dim=dim)
    return torch.cat([chunks[c] for c in _chunks_of(rank, world, layout)], dim=dim)


def unshard(x: Tensor, *, group=None, layout: str = "zigzag", dim: int = 1) -> Tensor:
    """The whole-sequence tensor from every rank's shard ``x`` (an all_gather): the
    inverse of :func:`shard`. Not differentiable."""
    _check_layout(layout)
    world, _ = _world(group)
    gathered = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(gathered, x.contiguous(), group=group)
    per_rank = 2 if layout == "zigzag" else 1
    chunks = {}
    for rank, part in enumerate(gathered):
        for c, piece in zip(_chunks_of(rank, world, layout), part.chunk(per_rank, dim=dim)):
            chunks[c] = piece
    return torch.cat([chunks[c] for c in sorted(chunks)], dim=dim)


def context_parallel_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    group=None,
    layout: str = "zigzag",
    causal: bool = False,
    softcap: float = 0.0,
    scale: float | None = None,
    return_lse: bool = False,
    deterministic: bool = False,
    window=None,
    align: str = "top_left",
    alibi_slopes: Tensor | None = None,
    dropout_p: float = 0.0,
):
    """Attention over a sequence split across the ranks of ``group`` (default: the
    world). q (B, S/W, H, Dqk), k (B, S/W, Hkv, Dqk), v (B, S/W, Hkv, Dv): this rank's
    shards as :func:`shard` cuts them (``layout``); returns this rank's shard of
    ``memattn.attention`` on the whole sequence, out (B, S/W, H, Dv) (and lse
    (B, H, S/W) with ``return_lse``), differentiable with respect to q, k and v.
    causal masks (Sq = Sk: top-left and bottom-right agree), softcap, scale, GQA and
    deterministic gradients hold as in ``memattn.attention``.

    Not yet across shards (ValueError): sliding windows, ALiBi and dropout, which need
    the kernels to take global positions (a window's band and ALiBi's distance cross
    shard boundaries; dropout's Philox counters key on positions), a bias and packed
    (varlen) batches.
    """
    for name, given in (("window", window is not None), ("alibi_slopes", alibi_slopes is not None),
                        ("dropout_p", dropout_p != 0.0)):  # fmt: skip
        if given:
            raise ValueError(
                f"{name} is not supported by context_parallel_attention yet: the kernels "
                "take positions inside the shard, not global ones"
            )
    _check_layout(layout)
    if align not in ("top_left", "bottom_right"):
        raise ValueError(f"align must be 'top_left' or 'bottom_right', got {align!r}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a 4-D (B, S/W, H, D) tensor")
    if not q.shape[1] == k.shape[1] == v.shape[1]:
        raise ValueError(f"q, k and v must hold shards of one length, got {q.shape[1]}, "
                         f"{k.shape[1]}, {v.shape[1]}")  # fmt: skip
    world, rank = _world(group)
    per_rank = 2 if layout == "zigzag" else 1
    if q.shape[1] % per_rank:
        raise ValueError(f"a zigzag shard holds two chunks: its length must be even, got "
                         f"{q.shape[1]}")  # fmt: skip
    options = dict(softcap=softcap, scale=scale, deterministic=deterministic)
    check_call(q, k, v, causal=causal, **options)  # every other argument, as attention's
    out, lse = _Ring.apply(q, k, v, (group, world, rank, layout, causal, options))
    return (out, lse) if return_lse else out


# ------------------------------------------------------------------ the ring


def _pairs(rank: int, source: int, world: int, layout: str, causal: bool):
    """Which (query chunk, key chunk) pairs of this rank's queries and ``source``'s keys
    to attend: [(q slot, k slot, diagonal)], slots indexing the shards' chunks. Under a
    causal mask a key chunk after the query chunk is skipped, the same chunk is the
    diagonal (causal), an earlier one is attended whole."""
    pairs = []
    for qs, qc in enumerate(_chunks_of(rank, world, layout)):
        for ks, kc in enumerate(_chunks_of(source, world, layout)):
            if not causal or kc < qc:
                pairs.append((qs, ks, False))
            elif kc == qc:
                pairs.append((qs, ks, True))
    return pairs


def _merge(out, lse, part_out, part_lse):
    """(out, lse) and a partial (out_p, lse_p) over other keys merged exactly: lse =
    log(e^lse + e^lse_p), out = e^(lse - lse') out + e^(lse_p - lse') out_p; fp32 out."""
    if out is None:
        return part_out.float(), part_lse
    new = torch.logaddexp(lse, part_lse)
    safe = torch.where(torch.isneginf(new), torch.zeros_like(new), new)
    w_old = torch.exp(lse - safe).transpose(1, 2).unsqueeze(-1)  # (B, S, H, 1)
    w_new = torch.exp(part_lse - safe).transpose(1, 2).unsqueeze(-1)
    return out * w_old + part_out.float() * w_new, new


class _RingStep:
    """Sends this rank's current blocks to rank + 1 and receives rank - 1's, started
    at once and waited for when the next step needs them."""

    def __init__(self, tensors: list[Tensor], group, world: int, rank: int):
        self.received = [torch.empty_like(t) for t in tensors]
        to, frm = (rank + 1) % world, (rank - 1) % world
        ranks = [dist.get_global_rank(group, r) if group is not None else r for r in (to, frm)]
        p2p = [dist.P2POp(dist.isend, t.contiguous(), ranks[0], group) for t in tensors]
        p2p += [dist.P2POp(dist.irecv, t, ranks[1], group) for t in self.received]
        self.requests = dist.batch_isend_irecv(p2p)

    def wait(self) -> list[Tensor]:
        for request in self.requests:
            request.wait()
        return self.received


class _Ring(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, call):
        group, world, rank, layout, causal, options = call
        per_rank = 2 if layout == "zigzag" else 1
        q_chunks = q.chunk(per_rank, dim=1)
        outs, lses = [None] * per_rank, [None] * per_rank
        kv = [k, v]
        for step in range(world):
            source = (rank - step) % world
            ring = _RingStep(kv, group, world, rank) if step + 1 < world else None
            k_chunks, v_chunks = (t.chunk(per_rank, dim=1) for t in kv)
            for qs, ks, diagonal in _pairs(rank, source, world, layout, causal):
                part_out, part_lse, _ = ops.forward(
                    q_chunks[qs], k_chunks[ks], v_chunks[ks], causal=diagonal, **options)
                outs[qs], lses[qs] = _merge(outs[qs], lses[qs], part_out, part_lse)
            if ring is not None:
                kv = ring.wait()
        out = torch.cat(outs, dim=1).to(q.dtype)
        lse = torch.cat(lses, dim=2)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.call = call
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        q, k, v, out, lse = ctx.saved_tensors
        group, world, rank, layout, causal, options = ctx.call
        per_rank = 2 if layout == "zigzag" else 1
        if grad_out is None:
            grad_out = torch.zeros_like(out)
        split = lambda t, dim=1: t.chunk(per_rank, dim=dim)  # noqa: E731
        q_c, o_c, go_c, lse_c = split(q), split(out), split(grad_out), split(lse, 2)
        glse_c = split(grad_lse, 2) if grad_lse is not None else [None] * per_rank
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dq_c = split(dq)
        # Each step: the K/V shard in hand goes on to rank + 1 at once (the next step's),
        # its dK/dV part is computed, then added to the shard's accumulators (fp32), which
        # arrive from rank - 1 meanwhile and go on after the add.
        kv, accumulators, arriving = [k, v], None, None
        for step in range(world):
            source = (rank - step) % world
            ring = _RingStep(kv, group, world, rank) if step + 1 < world else None
            k_c, v_c = split(kv[0]), split(kv[1])
            dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
            dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
            dk_c, dv_c = split(dk), split(dv)
            for qs, ks, diagonal in _pairs(rank, source, world, layout, causal):
                dq_p, dk_p, dv_p, _ = ops.backward(
                    go_c[qs], q_c[qs], k_c[ks], v_c[ks], o_c[qs], lse_c[qs].contiguous(),
                    causal=diagonal, grad_lse=None if glse_c[qs] is None
                    else glse_c[qs].contiguous(), **options)  # fmt: skip
                dq_c[qs].add_(dq_p)
                dk_c[ks].add_(dk_p)
                dv_c[ks].add_(dv_p)
            if arriving is not None:  # what earlier ranks added for this shard
                dk_in, dv_in = arriving.wait()
                dk.add_(dk_in)
                dv.add_(dv_in)
            accumulators = [dk, dv]
            if world > 1:  # after the last step, a final hop takes them home
                arriving = _RingStep(accumulators, group, world, rank)
            if ring is not None:
                kv = ring.wait()
        if arriving is not None:
            accumulators = arriving.wait()
        dk, dv = accumulators
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None
