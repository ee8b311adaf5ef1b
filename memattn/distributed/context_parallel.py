"""Context parallelism: one sequence split across the ranks of a torch.distributed group,
attention computed as a ring (ring attention).

Each rank holds its shard of q, k and v along the sequence. The K/V shards travel
around the ring (rank r sends to r + 1 and receives from r - 1, by
``torch.distributed.batch_isend_irecv``); in the forward the next transfer starts
before the local attention on the current shard, so that compute hides it. Each step's
partial result (``memattn.ops.forward``: out and lse) is merged exactly through the lse.
The backward sends the K/V shards around again, now with their dK/dV accumulators (fp32),
and calls ``memattn.ops.backward`` with the merged (global) out and lse; after a full
turn each accumulator is back on the rank that owns its shard (the last hop in the
shards' dtype: the sums are complete by then). There too the K/V shard goes on before
the step's compute, and the accumulators, added to after it, arrive during it. The
kernels run inside ``memattn.sharing_sms`` on two ranks or more: NCCL's transfers hold
SMs while they run.

Layouts: "contiguous" (rank r holds tokens [r·S/W, (r+1)·S/W)) and "zigzag" (the
sequence in 2W chunks, rank r holding chunks r and 2W-1-r, so that under a causal mask
every rank does the same work). A pair of chunks is attended whole, under the causal
diagonal, or skipped (a chunk a query chunk cannot see is never computed). Each block
runs at its global positions (ops.forward's ``positions``), so ALiBi's distances and
dropout's mask are the whole sequence's.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import Tensor

from .. import dropout as _dropout
from .. import ops
from ..kernels import sharing_sms
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
    window: tuple[int, int] | None = None,
    align: str = "top_left",
    softcap: float = 0.0,
    scale: float | None = None,
    return_lse: bool = False,
    deterministic: bool = False,
    alibi_slopes: Tensor | None = None,
    dropout_p: float = 0.0,
    rng_state: Tensor | None = None,
):
    """Attention over a sequence split across the ranks of ``group`` (default: the
    world). q (B, S/W, H, Dqk), k (B, S/W, Hkv, Dqk), v (B, S/W, Hkv, Dv): this rank's
    shards as :func:`shard` cuts them (``layout``); returns this rank's shard of
    ``memattn.attention`` on the whole sequence, out (B, S/W, H, Dv) (and lse
    (B, H, S/W) with ``return_lse``), differentiable with respect to q, k and v.
    causal masks and sliding windows (Sq = Sk: both alignments agree), softcap, scale,
    GQA, ALiBi, dropout and deterministic gradients hold as in ``memattn.attention``:
    each block runs at its global positions, so ALiBi's distances and dropout's mask are
    the whole call's. ``rng_state``: dropout's int64 [seed, offset] for the whole call
    (``memattn.ops.forward`` with it gives the same mask); drawn on the group's first
    rank and broadcast when None. Dropout needs chunks (S/W contiguous, S/2W zigzag) of a
    multiple of 8 tokens and no window bounded on the left (a block's first key must sit
    at a multiple of 8: dropout draws eight keys at a time).

    Not supported (ValueError): a bias and packed (varlen) batches (memattn.attention's
    arguments of that name do not exist here).
    """
    _check_layout(layout)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a 4-D (B, S/W, H, D) tensor")
    if not q.shape[1] == k.shape[1] == v.shape[1]:
        raise ValueError(f"q, k and v must hold shards of one length, got {q.shape[1]}, "
                         f"{k.shape[1]}, {v.shape[1]}")  # fmt: skip
    # Every other argument checked as memattn.attention checks it; causal folds into the
    # window's right side.
    spec = check_call(q, k, v, causal=causal, window=window, align=align, softcap=softcap,
                      scale=scale, deterministic=deterministic, alibi_slopes=alibi_slopes,
                      dropout_p=dropout_p)  # fmt: skip
    per_rank = 2 if layout == "zigzag" else 1
    if q.shape[1] % per_rank:
        raise ValueError(f"a zigzag shard holds two chunks: its length must be even, got "
                         f"{q.shape[1]}")  # fmt: skip
    if spec.dropout_p > 0:
        chunk = q.shape[1] // per_rank
        if chunk % 8:
            raise ValueError(f"dropout_p needs chunks of a multiple of 8 tokens (dropout "
                             f"draws eight keys at a time), got {chunk}")  # fmt: skip
        if spec.window_left >= 0:
            raise ValueError("dropout_p with a window bounded on the left is not supported "
                             "across shards: a block's first key could sit off a multiple "
                             "of 8")  # fmt: skip
    world, rank = _world(group)
    if spec.dropout_p > 0:
        rng_state = _shared_rng_state(rng_state, q.device, group)
    options = dict(softcap=softcap, scale=scale, deterministic=deterministic,
                   alibi_slopes=alibi_slopes, dropout_p=dropout_p,
                   rng_state=rng_state if spec.dropout_p > 0 else None)  # fmt: skip
    band = (spec.window_left, spec.window_right)
    out, lse = _Ring.apply(q, k, v, (group, world, rank, layout, band, options))
    return (out, lse) if return_lse else out


def _shared_rng_state(rng_state: Tensor | None, device, group) -> Tensor:
    """Dropout's [seed, offset], the same on every rank: the given one, or one drawn on
    the group's first rank and broadcast."""
    if rng_state is not None:
        return rng_state
    rng_state = _dropout.new_rng_state(device)
    first = dist.get_global_rank(group, 0) if group is not None else 0
    dist.broadcast(rng_state, src=first, group=group)
    return rng_state


# ------------------------------------------------------------------ the ring


def _block(d: int, c: int, left: int, right: int):
    """How query chunk and key chunk of c tokens each, the query chunk d tokens after the
    key chunk in the sequence, see each other under the band (left, right) (-1:
    unbounded): key j visible from query i when i + d - left <= j <= i + d + right.
    Returns None where no pair is visible (the block is skipped), else (q_lo, q_hi, k_lo,
    k_hi, window): the rows and keys that take part, and the window that is the band on
    them, top-left aligned (memattn's windows reach only sides >= -1 from the diagonal,
    so a band off the diagonal is cut to the rows and keys it covers)."""
    a = None if left < 0 else d - left  # j >= i + a
    b = None if right < 0 else d + right  # j <= i + b
    if (a is not None and a >= c) or (b is not None and b <= -c):
        return None
    q_lo = 0 if b is None else max(0, -b)
    q_hi = c if a is None else min(c, c - a)
    k_lo = 0 if a is None else max(0, q_lo + a)
    k_hi = c if b is None else min(c, q_hi - 1 + b + 1)
    if q_lo >= q_hi or k_lo >= k_hi:
        return None
    left = -1 if a is None else k_lo - q_lo - a
    right = -1 if b is None else q_lo + b - k_lo
    # A side that binds no pair of the cut block is unbounded: a whole block runs unmasked.
    if left >= q_hi - q_lo - 1:
        left = -1
    if right >= k_hi - k_lo - 1:
        right = -1
    return q_lo, q_hi, k_lo, k_hi, (left, right)


def _blocks(rank: int, source: int, world: int, layout: str, c: int, band):
    """The blocks of this rank's query chunks against ``source``'s key chunks:
    [(q slot, k slot, positions, (q_lo, q_hi, k_lo, k_hi, window))], slots indexing the
    shards' chunks, positions the global (first query, first key) of the block; blocks
    the band leaves empty are not listed."""
    blocks = []
    for qs, qc in enumerate(_chunks_of(rank, world, layout)):
        for ks, kc in enumerate(_chunks_of(source, world, layout)):
            view = _block((qc - kc) * c, c, *band)
            if view is not None:
                blocks.append((qs, ks, (qc * c + view[0], kc * c + view[2]), view))
    return blocks


def _beside_transfers(world: int):
    """memattn.sharing_sms where the ring has transfers (NCCL's kernels hold SMs while
    they run); a one-rank ring has none, and its kernels keep their persistent programs."""
    return sharing_sms() if world > 1 else contextlib.nullcontext()


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
        # lazily, as ops imports the kernels: Triton picks its interpreter at decoration
        from ..kernels.merge import merge_into

        group, world, rank, layout, band, options = call
        per_rank = 2 if layout == "zigzag" else 1
        c = q.shape[1] // per_rank
        b, _, h, dv = q.shape[0], q.shape[1], q.shape[2], v.shape[3]
        q_chunks = q.chunk(per_rank, dim=1)
        out = torch.zeros(b, q.shape[1], h, dv, dtype=torch.float32, device=q.device)
        lse = torch.full((b, h, q.shape[1]), float("-inf"), device=q.device)
        out_c, lse_c = out.chunk(per_rank, dim=1), lse.chunk(per_rank, dim=2)
        kv = [k, v]
        for step in range(world):
            source = (rank - step) % world
            ring = _RingStep(kv, group, world, rank) if step + 1 < world else None
            k_chunks, v_chunks = (t.chunk(per_rank, dim=1) for t in kv)
            for qs, ks, positions, (q_lo, q_hi, k_lo, k_hi, window) in _blocks(
                rank, source, world, layout, c, band
            ):
                with _beside_transfers(world):
                    part_out, part_lse, _ = ops.forward(
                        q_chunks[qs][:, q_lo:q_hi], k_chunks[ks][:, k_lo:k_hi],
                        v_chunks[ks][:, k_lo:k_hi], window=window, positions=positions,
                        **options)  # fmt: skip
                merge_into(out_c[qs][:, q_lo:q_hi], lse_c[qs][:, :, q_lo:q_hi], part_out,
                           part_lse)  # fmt: skip
            if ring is not None:
                kv = ring.wait()
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.call = call
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        q, k, v, out, lse = ctx.saved_tensors
        group, world, rank, layout, band, options = ctx.call
        per_rank = 2 if layout == "zigzag" else 1
        c = q.shape[1] // per_rank
        if grad_out is None:
            grad_out = torch.zeros_like(out)
        split = lambda t, dim=1: t.chunk(per_rank, dim=dim)  # noqa: E731
        q_c, o_c, go_c, lse_c = split(q), split(out), split(grad_out), split(lse, 2)
        glse_c = split(grad_lse, 2) if grad_lse is not None else [None] * per_rank
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dq_c = split(dq)
        # Each step: the K/V shard in hand goes on to rank + 1 at once (the next step's),
        # its dK/dV parts are computed, then added to the shard's accumulators (fp32),
        # which arrive from rank - 1 meanwhile (this rank starts them at the first step),
        # and go on after the adds.
        kv, arriving = [k, v], None
        for step in range(world):
            source = (rank - step) % world
            ring = _RingStep(kv, group, world, rank) if step + 1 < world else None
            k_c, v_c = split(kv[0]), split(kv[1])
            parts = []  # (key slot, keys, dK part, dV part)
            for qs, ks, positions, (q_lo, q_hi, k_lo, k_hi, window) in _blocks(
                rank, source, world, layout, c, band
            ):
                rows, keys = slice(q_lo, q_hi), slice(k_lo, k_hi)
                g_lse = glse_c[qs]
                with _beside_transfers(world):
                    dq_p, dk_p, dv_p, _ = ops.backward(
                        go_c[qs][:, rows], q_c[qs][:, rows], k_c[ks][:, keys],
                        v_c[ks][:, keys], o_c[qs][:, rows], lse_c[qs][:, :, rows].contiguous(),
                        window=window,
                        grad_lse=None if g_lse is None else g_lse[:, :, rows].contiguous(),
                        positions=positions, **options)  # fmt: skip
                dq_c[qs][:, rows].add_(dq_p)
                parts.append((ks, keys, dk_p, dv_p))
            if arriving is None:
                dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
                dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
            else:  # what earlier ranks added for this shard
                dk, dv = arriving.wait()
            dk_c, dv_c = split(dk), split(dv)
            for ks, keys, dk_p, dv_p in parts:
                dk_c[ks][:, keys].add_(dk_p)
                dv_c[ks][:, keys].add_(dv_p)
            accumulators = [dk, dv]
            if step + 1 == world:  # complete: the final hop home carries them in their
                # dtype, half the bytes of fp32 and the same values
                accumulators = [dk.to(k.dtype), dv.to(v.dtype)]
            if world > 1:
                arriving = _RingStep(accumulators, group, world, rank)
            if ring is not None:
                kv = ring.wait()
        if arriving is not None:
            accumulators = arriving.wait()
        dk, dv = accumulators
        return dq.to(q.dtype), dk, dv, None
