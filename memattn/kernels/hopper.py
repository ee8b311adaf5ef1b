"""What the two Gluon kernels (forward_sm90, backward_sm90) share: whether Gluon runs
here (dispatch.py says which calls they take), TMA descriptors over our (B, S, H, D)
tensors and over a bias, their shared-memory rings, dropout's keep bits in wgmma
layouts, the one Gluon builtin Triton 3.6 lacks (TMA reduce-add), and a launcher."""

from __future__ import annotations

import contextlib
import functools
import heapq
import itertools
import math
import threading
import weakref
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton import knobs
from triton._C.libtriton import ir
from triton.backends.nvidia import driver as nvidia_driver
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language import _core as gl_core
from triton.experimental.gluon.language.nvidia.hopper import mbarrier
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.runtime import driver

from ..spec import AttentionSpec
from . import shares_sms
from .common import cdiv, diagonal_offset, key_range, sequence_bounds

GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float32: gl.float32}

# Tools and tests switch this off to time or check the tile kernels on the same calls.
# Gluon's API moves between Triton releases: off on any but the 3.6 line this was built on.
enabled = triton.__version__.startswith("3.6.")


def tma_readable(t: torch.Tensor) -> bool:
    """Unit last stride, 16-byte aligned base and strides: what a TMA descriptor needs
    (2-byte elements: the outer strides' gcd a multiple of 8, a zero stride too)."""
    *outer, last = t.stride()
    return last == 1 and t.data_ptr() % 16 == 0 and math.gcd(*outer) % 8 == 0


def _bias_4d(bias: torch.Tensor) -> tuple[list[int], list[int]]:
    """A bias's shape and strides padded on the left to (B', H', Sq, Sk)."""
    pad = 4 - bias.dim()
    return [1] * pad + list(bias.shape), [0] * pad + list(bias.stride())


# Elements of 2 bytes a bias's rows are aligned to for TMA: rows of whole 16 bytes.
TMA_BIAS_ALIGNMENT = 8


def bias_readable(spec: AttentionSpec, bias: torch.Tensor) -> bool:
    """A bias the Gluon kernels read by TMA tiles, over rows aligned to
    TMA_BIAS_ALIGNMENT (common.rows_aligned; dispatch copies one whose rows are not): q's
    dtype, every query and key (broadcast over batch or heads at most)."""
    shape, _ = _bias_4d(bias)
    return bias.dtype == spec.dtype and shape[2:] == [spec.seqlen_q, spec.seqlen_k]


def bias_row(spec: AttentionSpec, bias: torch.Tensor | None) -> bool:
    """A bias constant along queries, (B or 1, H or 1, 1, Sk): key padding, per-key
    offsets (False without a bias). The Gluon kernels read it as one row of keys per key
    tile, no bias tiles (the forward by TMA from bias_row_scores's fp32 copy, the backward
    by pointer: any floating dtype and strides), and reduce its gradient, dS summed over
    queries, in registers."""
    if bias is None:
        return False
    shape, _ = _bias_4d(bias)
    return shape[2] == 1 and shape[3] == spec.seqlen_k


def bias_dims(bias: torch.Tensor) -> tuple[int, int]:
    """A bias's (batch, head) sizes, 1 where it broadcasts: the kernels index batch b
    and head h at (b % batches, h % heads)."""
    return tuple(_bias_4d(bias)[0][:2])


def shared_over_batch(spec: AttentionSpec, dims: tuple[int, int]) -> bool:
    """Whether a bias of these (batch, head) sizes (bias_dims) is a plane per head that
    the call's batches share: the kernels then read it batch after batch within a head,
    so that the batch's programs meet on its tiles in L2 (forward_sm90.BIAS_BATCH_INNER,
    backward_sm90.narrow.BIAS_TILES_BATCH_INNER)."""
    return spec.batch > 1 and dims[0] == 1 and dims[1] > 1


def bias_row_strides(bias: torch.Tensor | None) -> tuple[int, int, int]:
    """(batch, head, key) strides of a bias `bias_row` accepted; a broadcast
    dimension's is 0 (the kernels index it at 0 anyway). (0, 0, 0) without one."""
    if bias is None:
        return (0, 0, 0)
    shape, strides = _bias_4d(bias)
    return tuple(0 if n == 1 else s for n, s in zip(shape[:2], strides[:2])) + (strides[3],)


def bias_full(spec: AttentionSpec, bias: torch.Tensor) -> bool:
    """Whether a bias has one element per (batch, head, query, key): its gradient is
    then dS itself, with no sum over broadcast dimensions."""
    return _bias_4d(bias)[0] == list(spec.bias_shape)


def bias_descriptor(t: torch.Tensor, rows: int, cols: int) -> TensorDescriptor:
    """4-D (batch, head, query, key) descriptor over a bias (or its gradient) that
    `bias_readable` accepted, over aligned rows; one copy moves a rows x cols tile. A broadcast
    dimension's size is 1 and the kernels index it at 0; its stride, unused, is given a
    TMA-valid value."""
    shape, strides = _bias_4d(t)
    for d in (2, 1, 0):
        if shape[d] == 1:
            strides[d] = cdiv(strides[d + 1] * shape[d + 1], 8) * 8
    block = (1, 1, rows, cols)
    return make_descriptor(t, shape, strides, block, shared_layout(block, t.dtype))


def keys_per_query(spec: AttentionSpec) -> int:
    """Keys a query sees, roughly: all of Sk, the window's width when both sides are
    bounded, half of Sk plus the bounded side when one is (a causal mask)."""
    left, right = spec.window_left, spec.window_right
    if left >= 0 and right >= 0:
        return min(spec.seqlen_k, left + right + 1)
    if left >= 0 or right >= 0:
        return min(spec.seqlen_k, spec.seqlen_k // 2 + max(left, right))
    return spec.seqlen_k


@functools.cache
def shared_layout(block: tuple[int, ...], dtype: torch.dtype,
                  swizzle: int | None = None) -> gl.NVMMASharedLayout:
    """The NVMMA shared layout of a TMA block: Gluon's default, or a narrower swizzle
    (a tile sliced by columns needs one no wider than a slice). Cached: working it out
    costs ~12 µs of host time per tensor and call."""
    default = gl.NVMMASharedLayout.get_default_for(list(block), GL_DTYPES[dtype])
    if swizzle is None or swizzle >= default.swizzle_byte_width:
        return default
    return gl.NVMMASharedLayout(swizzle, default.element_bitwidth, rank=len(block))


def descriptor(t: torch.Tensor, rows: int, cols: int | None = None,
               swizzle: int | None = None) -> TensorDescriptor:
    """4-D (batch, head, token, dim) view of a (B, S, H, D) tensor; one copy moves one
    head's ``rows`` tokens by ``cols`` (default: all D) columns. TMA zero-fills loads
    past S and clips stores there."""
    batch, seqlen, heads, dim = t.shape
    sb, ss, sh, sd = t.stride()
    block = (1, 1, rows, cols or dim)
    return make_descriptor(t, [batch, heads, seqlen, dim], [sb, sh, ss, sd], block,
                           shared_layout(block, t.dtype, swizzle))  # fmt: skip


def qk_split(head_dim_qk: int) -> int:
    """Q's and K's columns past the largest power of 2 (Gluon's shapes are powers of
    2): 192 -> 64, in buffers of their own; 0 at 64, 128, 256."""
    return head_dim_qk - (1 << (head_dim_qk.bit_length() - 1))


def make_descriptor(t, shape, strides, block, layout) -> TensorDescriptor:
    """A TensorDescriptor without its constructor's checks: on the device's host CPU
    they cost ~10 µs per descriptor and call, a tenth of a small backward's host time,
    and dispatch has checked what they check (alignment, unit last stride)."""
    desc = object.__new__(TensorDescriptor)
    desc.__dict__.update(base=t, shape=shape, strides=strides, block_shape=list(block),
                         layout=layout, padding="zero")
    return desc


@functools.cache
def sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@dataclass(frozen=True, eq=False)
class Plan:
    """One kernel's launch for the calls of one spec on one device, worked out once by
    the kernel's module (host time on every call otherwise, all of it before the
    launch): its programs, the block counts it takes as arguments, its constexprs and
    launch options. Hashed by identity, one per spec and device (`plan_cache`): the
    cheap head of a launch's variant (Launcher)."""

    programs: int
    counts: tuple[int, ...]
    constexprs: dict
    schedule: tuple[int, ...] | None = None  # each program's blocks, dealt by the host


# Each plan's schedule on its device (schedule_on_device), while the plan lives.
_SCHEDULES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def schedule_on_device(plan: Plan, device_index: int) -> torch.Tensor | None:
    """The plan's schedule as an int32 tensor on its device (a plan is made for one),
    copied there on the first call; None while a CUDA graph captures before then: a
    copy from the host cannot be captured."""
    table = _SCHEDULES.get(plan)
    if table is None:
        if torch.cuda.is_current_stream_capturing():
            return None
        device = torch.device("cuda", device_index)
        table = _SCHEDULES[plan] = torch.tensor(plan.schedule, dtype=torch.int32, device=device)
    return table


def plan_with_schedule(make_plan, args: tuple, device_index: int, stand_in: torch.Tensor):
    """(plan, schedule): make_plan(*args) and its schedule on the device, or stand_in
    (never read) for a plan without one; while a CUDA graph captures before the table
    is on the device, the plan made without a table (make_plan(*args, tabled=False))."""
    how = make_plan(*args)
    if how.schedule:
        schedule = schedule_on_device(how, device_index)
        if schedule is not None:
            return how, schedule
        how = make_plan(*args, tabled=False)  # a copy from the host cannot be captured
    return how, stand_in


_PLAN_CACHES = []


def plan_cache(make_plan):
    """Caches a module's plan maker (by its arguments: spec, device, flags, and whether
    the call runs inside `sharing_sms`, which plans read); every cache is emptied by
    `forget_plans`."""
    cached = functools.lru_cache(maxsize=256)(
        lambda sharing, *args, **kwargs: make_plan(*args, **kwargs))
    _PLAN_CACHES.append(cached)

    @functools.wraps(make_plan)
    def plan(*args, **kwargs):
        return cached(shares_sms(), *args, **kwargs)

    return plan


def forget_plans() -> None:
    """Plans are made from the modules' knobs and `sm_count`: a tool or test that sets
    those calls this before its calls (and after, to leave no plan of its own). The
    launches recorded from them (`Replays`) go too."""
    for cached in _PLAN_CACHES:
        cached.cache_clear()
    _SCHEDULES.clear()
    for replays in _ALL_REPLAYS:
        replays.launches.clear()


def rank_order(spec, blocks: int, group_blocks: int, min_blocks: int) -> int:
    """BY_RANK of a dense grid of query blocks (the forward's, the wide dQ kernel's):
    ``group_blocks`` (rank_major_item's groups of heads of at least that many blocks)
    under a right bound alone, where a block's work falls with its rank, for heads of
    ``min_blocks`` blocks or more; 0 (the grid's own order) otherwise."""
    takes = (spec.window_right >= 0 and spec.window_left < 0 and not spec.varlen
             and blocks >= min_blocks)  # fmt: skip
    return group_blocks if takes else 0


def right_bound_tiles(spec, blocks: int, block_m: int, block_n: int) -> list[int]:
    """Key tiles of a head's query blocks under a right bound alone, by rank (rank 0 the
    last block): common.key_range's hi (keys up to the block's last query's bound)."""
    off = spec.seqlen_k - spec.seqlen_q if spec.bottom_right else 0
    ends = ((blocks - rank) * block_m for rank in range(blocks))  # last row + 1
    return [cdiv(max(0, min(spec.seqlen_k, end + off + spec.window_right)), block_n)
            for end in ends]  # fmt: skip


def list_schedule(items, costs, programs: int) -> list[int]:
    """Persistent programs' blocks dealt by the host: ``items`` in their order, each to
    the program whose items so far end first by ``costs`` (one per item), ties to the
    lower program, as if each took the next item as it freed, without tickets or a
    hand-off between partitions. Each program's items keep the list's order. Flat, for
    one int32 tensor: programs + 1 offsets into it, then each program's items in its
    order (the forward's TABLE, the D 64/128 backward's DEALT programs)."""
    ends = [(0, p) for p in range(programs)]  # a heap of (cost so far, program)
    dealt = [[] for _ in range(programs)]
    for item, cost in zip(items, costs, strict=True):
        end, p = heapq.heappop(ends)
        dealt[p].append(item)
        heapq.heappush(ends, (end + cost, p))
    offsets = itertools.accumulate(map(len, dealt), initial=programs + 1)
    return [*offsets, *itertools.chain.from_iterable(dealt)]


def rank_table(tiles: list[int], heads: int, group_blocks: int, programs: int) -> list[int]:
    """The blocks persistent programs walk (the forward's TABLE): rank_major_item's order
    (heads in groups of at least ``group_blocks`` blocks, each group's rank by rank)
    dealt as a list schedule by key tiles (``tiles[rank]``)."""
    blocks = len(tiles)
    total = heads * blocks
    together = cdiv(group_blocks, blocks)
    items = [rank_major_item.fn(pid, total, blocks, together) for pid in range(total)]
    return list_schedule(items, [tiles[item % blocks] for item in items], programs)


def programs(items: int, fold: bool, persistent: bool, device_index: int) -> int:
    """Programs to launch for ``items`` blocks (`work_item` walks them): one per pair
    of blocks folded, one per block otherwise; persistent, one per SM at most."""
    wanted = (items + 1) // 2 if fold else items
    return min(wanted, sm_count(device_index)) if persistent else wanted


@gluon.jit
def work_item(pid, j, programs, blocks, FOLD: gl.constexpr):
    """Program pid's j-th block of a grid of heads x ``blocks`` blocks each: (head
    index, rank), rank 0 the block with the most work under a top-left causal mask (the
    forward's last query block, the backward's first key block). Items are walked in
    strides of ``programs``; heads one after another, each's blocks by rank. Folded,
    a head's blocks are listed as ranks 0, n-1, 1, n-2, ... and a program takes them in
    consecutive pairs, whose work under a causal mask adds up to the same for every
    pair (to within a block where an odd n puts a pair across two heads): static
    strides then give every program the same work."""
    if FOLD:
        g = 2 * (pid + (j // 2) * programs) + j % 2
        t = g % blocks
        rank = t // 2 + (t % 2) * (blocks - 1 - 2 * (t // 2))
    else:
        g = pid + j * programs
        rank = g % blocks
    return g // blocks, rank


@gluon.jit
def packed_sequence(g, H, CuSeq, num_seqs, BLOCK: gl.constexpr):
    """The packed sequence that holds item g of packed_rank's grid: sequence b's items
    start at H * (cu_seqlens[b] // BLOCK + b), so b is the count of sequences starting
    at or before g, less one. One vector load of cu_seqlens per 128 sequences a warp:
    no host sync, no buffer."""
    W: gl.constexpr = gl.num_warps()
    CHUNK: gl.constexpr = 128 * W
    layout: gl.constexpr = gl.BlockedLayout([4], [32], [W], [0])
    count = gl.to_tensor(0)
    for first in range(0, num_seqs, CHUNK):
        seq = first + gl.arange(0, CHUNK, layout=layout)
        inside = seq < num_seqs
        starts = H * (gl.load(CuSeq + seq, mask=inside, other=0) // BLOCK + seq)
        count += gl.sum(((starts <= g) & inside).to(gl.int32), axis=0)
    return count - 1


@gluon.jit
def packed_rank(g, H, b, first_token, BLOCK: gl.constexpr):
    """Item g's (head, rank) in packed sequence b, whose tokens start at first_token.
    A sequence of n tokens has H * ((first_token + n) // BLOCK - first_token // BLOCK +
    1) items, at least one a head more than its ceil(n / BLOCK) blocks: rank after rank
    (rank 0 its last block), each across the H heads; ranks past its blocks are empty.
    Plain integer arithmetic, so that tests can run it in Python."""
    local = g - H * (first_token // BLOCK + b)
    return local % H, local // H


@gluon.jit
def packed_head_rank(g, H, b, first_token, tokens, BLOCK: gl.constexpr):
    """Item g's (head, rank) in packed sequence b (first_token, tokens long) of the
    same grid, heads one after another instead: each head's ranks back to back (rank 0
    the sequence's first block), as many a head as packed_rank gives a sequence, so at
    most one a head past its blocks. The backward's order (key blocks of one head
    side by side read the same Q and dO tiles from L2), and the forward's without a
    mask (packed_block). Where the packed tensor holds tokens past cu_seqlens's last
    (unchecked where its values go unread: spec._seqlens), the last sequence has items
    past its heads' ranks: they fall on its last head, past its blocks. Plain integer
    arithmetic."""
    ranks = (first_token + tokens) // BLOCK - first_token // BLOCK + 1
    local = g - H * (first_token // BLOCK + b)
    h = local // ranks
    if h >= H:
        h = H - 1
    return h, local - h * ranks


@gluon.jit
def rank_major_item(pid, programs, blocks, together):
    """The item (head * blocks + rank) program pid of a grid of ``programs`` (heads x
    ``blocks`` blocks each) stands for when the heads go ``together`` at a time, each
    group's blocks rank by rank (rank 0 of each of its heads, then rank 1, ...; the last
    group may hold fewer heads). Under a mask whose work falls with the rank (the
    backward's key blocks under a causal mask or a window) the hardware then hands the
    heaviest blocks out first within each group, so that the grid's tail is short
    blocks, and the group's heads share what they read in L2. Plain integer
    arithmetic, so that tests can run it in Python."""
    group_size = together * blocks
    first = pid // group_size * together
    heads = programs // blocks - first
    if heads > together:
        heads = together
    rank = pid % group_size
    return (first + rank % heads) * blocks + rank // heads


@gluon.jit
def work_items(pid, programs, total, FOLD: gl.constexpr):
    """How many blocks `work_item` gives program pid, of ``total`` (pid < the count of
    pairs folded, of blocks otherwise).
    Folded: pairs q = pid, pid + programs, ... give block 2q while 2q < total and block
    2q + 1 while 2q + 1 < total. Plain integer arithmetic, so that tests can run it in
    Python."""
    if FOLD:
        firsts = ((total + 1) // 2 - pid + programs - 1) // programs
        seconds = (total // 2 - pid + programs - 1) // programs
        return firsts + seconds
    else:
        return (total - pid + programs - 1) // programs


@gluon.jit
def query_block(
    pid, j, programs, H, GROUP, num_m_blocks, seqlen_q, seqlen_k, window_left, window_right,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, FOLD: gl.constexpr,
    BOTTOM_RIGHT: gl.constexpr, BOUNDED_LEFT: gl.constexpr, BOUNDED_RIGHT: gl.constexpr,
    BATCH_INNER: gl.constexpr = False, batches=1, Schedule=0, TABLE: gl.constexpr = False,
):  # fmt: skip
    """The j-th query block of program pid (work_item's order: each head's last block
    first, folded or not) of a dense grid over query blocks (the forward's, the D=256
    backward's dQ kernel): (b, h, kv head, first row, the sequence's first query and
    key token and lengths, the diagonal's offset, key range as common.key_range gives
    it, count of key tiles). The (batch, head)s go head after head within a batch, or
    with BATCH_INNER (of ``batches``) batch after batch within a head: programs side
    by side then read a bias plane shared over the batch together, from L2. With TABLE
    the blocks are the host's (rank_table), pid the program's first entry in
    ``Schedule``: one load a block, from L1 after the first."""
    if TABLE:
        item = gl.load(Schedule + pid + j)
        bh = item // num_m_blocks
        rank = item % num_m_blocks
    else:
        bh, rank = work_item(pid, j, programs, num_m_blocks, FOLD)
    if BATCH_INNER:
        b = bh % batches
        h = bh // batches
    else:
        b = bh // H
        h = bh % H
    start_m = (num_m_blocks - 1 - rank) * BLOCK_M
    off, lo, full_lo, full_hi, n_tiles = block_keys(
        start_m, seqlen_q, seqlen_k, window_left, window_right, BLOCK_M, BLOCK_N, False,
        BOTTOM_RIGHT, BOUNDED_LEFT, BOUNDED_RIGHT)  # fmt: skip
    return (b, h, h // GROUP, start_m, 0, 0, seqlen_q, seqlen_k, off, lo, full_lo, full_hi,
            n_tiles)


@gluon.jit
def packed_block(
    g, H, GROUP, num_seqs, CuSeqQ, CuSeqK, window_left, window_right,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BOTTOM_RIGHT: gl.constexpr,
    BOUNDED_LEFT: gl.constexpr, BOUNDED_RIGHT: gl.constexpr,
):  # fmt: skip
    """Item g of packed sequences' grid (cu_seqlens), as query_block gives a block:
    sequence after sequence, each's blocks last first, so that programs side by side
    share a sequence's K and V tiles in L2 (walked rank by rank across all sequences, 8
    documents of 2048 tokens ran at 0.55x the dense batch's speed, H100: each block read
    its K and V from memory). Without a mask each head's blocks go back to back
    (packed_head_rank): programs side by side then read a few heads' K and V, and each
    tile once from memory (the bench's documents, H100: 411 -> 206 MB read, as much as
    Q, K and V; 527 -> 550 TFLOP/s). Under a mask each block goes across the heads
    (packed_rank), so that every head's heaviest blocks come first and the dynamic
    schedule ends on light ones (head after head: causal documents 478 -> 469, with
    277 -> 238 MB read). An item past its sequence's blocks starts at the sequence's
    end and has no key tile."""
    b = packed_sequence(g, H, CuSeqQ, num_seqs, BLOCK_M)
    q_start, k_start, seqlen_q, seqlen_k = sequence_bounds(CuSeqQ, CuSeqK, b, 0, 0, True)
    if BOUNDED_LEFT or BOUNDED_RIGHT:
        h, rank = packed_rank(g, H, b, q_start, BLOCK_M)
    else:
        h, rank = packed_head_rank(g, H, b, q_start, seqlen_q, BLOCK_M)
    start_m = (gl.cdiv(seqlen_q, BLOCK_M) - 1 - rank) * BLOCK_M
    if start_m < 0:  # past the sequence's blocks (rank >= 0 always)
        start_m = seqlen_q
    off, lo, full_lo, full_hi, n_tiles = block_keys(
        start_m, seqlen_q, seqlen_k, window_left, window_right, BLOCK_M, BLOCK_N, True,
        BOTTOM_RIGHT, BOUNDED_LEFT, BOUNDED_RIGHT)  # fmt: skip
    return (b, h, h // GROUP, start_m, q_start, k_start, seqlen_q, seqlen_k, off, lo, full_lo,
            full_hi, n_tiles)


POSITION_SEQS = gl.constexpr(128)  # packed_position's sequences at most (a vector of them)


@gluon.jit
def _add(a, b):
    return a + b


@gluon.jit
def packed_position(g, H, num_seqs, CuSeq, BLOCK: gl.constexpr, HEADS: gl.constexpr):
    """Item g of packed sequences' grid by position: (sequence, head, position of its
    block in the sequence, past the grid's end). The heads go in groups of HEADS; within
    a group the blocks by position, last first, each position's sequences (those with a
    block there) in turn, each across the group's heads. Items from H times the
    sequences' blocks on are past the end (sequence 0, head 0). At most POSITION_SEQS
    sequences, read once per item from cu_seqlens."""
    SEQS: gl.constexpr = POSITION_SEQS
    layout: gl.constexpr = gl.BlockedLayout([SEQS // (32 * gl.num_warps())], [32],
                                            [gl.num_warps()], [0])
    seq = gl.arange(0, SEQS, layout=layout)
    inside = seq < num_seqs
    first = gl.load(CuSeq + seq, mask=inside, other=0)
    tokens = gl.load(CuSeq + seq + 1, mask=inside, other=0) - first
    blocks = (tokens + BLOCK - 1) // BLOCK  # 0 past num_seqs
    total = gl.sum(blocks, axis=0)  # every sequence's blocks, a head
    past = g >= H * total
    local = gl.where(past, 0, g)
    group = local // (HEADS * gl.maximum(total, 1))
    local -= group * HEADS * total
    heads = gl.minimum(H - group * HEADS, HEADS)  # the last group's may be fewer
    slot = local // heads  # the (position, sequence) of the item, positions last first
    h = group * HEADS + local % heads
    # The position: the smallest p whose later positions hold no more than `slot`
    # slots, sum over sequences of max(blocks - 1 - p, 0) (it falls as p grows).
    position = gl.to_tensor(0)
    beyond = gl.max(blocks, axis=0)
    while position < beyond:
        mid = (position + beyond) // 2
        fits = gl.sum(gl.maximum(blocks - 1 - mid, 0), axis=0) <= slot
        beyond = gl.where(fits, mid, beyond)
        position = gl.where(fits, position, mid + 1)
    # The rank-th sequence with a block there: as many sequences come before it.
    rank = slot - gl.sum(gl.maximum(blocks - 1 - position, 0), axis=0)
    counted = gl.associative_scan((blocks > position).to(gl.int32), 0, _add)
    b = gl.where(past, 0, gl.sum((counted <= rank).to(gl.int32), axis=0))
    return b, h, position, past


@gluon.jit
def packed_position_block(
    g, H, GROUP, num_seqs, CuSeqQ, CuSeqK, window_left, window_right,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BOTTOM_RIGHT: gl.constexpr,
    BOUNDED_LEFT: gl.constexpr, BOUNDED_RIGHT: gl.constexpr, HEADS: gl.constexpr,
):  # fmt: skip
    """Item g of packed sequences' grid by position (packed_position over the query
    blocks), as packed_block gives one, for sequences that share a bias plane (indexed
    by positions inside each): programs side by side then read the same bias tiles (a
    position's, whichever the sequence) from L2, and a few heads' K and V stay there
    from one position to the next. Past the grid's end: start_m = seqlen_q, no key
    tile."""
    b, h, position, past = packed_position(g, H, num_seqs, CuSeqQ, BLOCK_M, HEADS)
    q_start, k_start, seqlen_q, seqlen_k = sequence_bounds(CuSeqQ, CuSeqK, b, 0, 0, True)
    start_m = gl.where(past, seqlen_q, position * BLOCK_M)
    off, lo, full_lo, full_hi, n_tiles = block_keys(
        start_m, seqlen_q, seqlen_k, window_left, window_right, BLOCK_M, BLOCK_N, True,
        BOTTOM_RIGHT, BOUNDED_LEFT, BOUNDED_RIGHT)  # fmt: skip
    return (b, h, h // GROUP, start_m, q_start, k_start, seqlen_q, seqlen_k, off, lo, full_lo,
            full_hi, n_tiles)


@gluon.jit
def block_keys(
    start_m, seqlen_q, seqlen_k, window_left, window_right, BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr, IS_VARLEN: gl.constexpr, BOTTOM_RIGHT: gl.constexpr,
    BOUNDED_LEFT: gl.constexpr, BOUNDED_RIGHT: gl.constexpr,
):  # fmt: skip
    """A query block's keys: the diagonal's offset, the key range common.key_range gives
    and its count of key tiles (none for a packed block past its sequence's end)."""
    off = diagonal_offset(seqlen_q, seqlen_k, BOTTOM_RIGHT)
    lo, full_lo, full_hi, hi = key_range(
        start_m, seqlen_k, off, window_left, window_right,
        BLOCK_M, BLOCK_N, BOUNDED_LEFT, BOUNDED_RIGHT)  # fmt: skip
    n_tiles = gl.cdiv(hi - lo, BLOCK_N)
    if IS_VARLEN:
        if start_m >= seqlen_q:
            n_tiles = 0
    return off, lo, full_lo, full_hi, n_tiles


@gluon.jit
def take_ticket(counter):
    """The int32 counter's value before adding 1 (lane 0's atom.add, shuffled to the
    warp): one warp's next item of a dynamic schedule. Inline, as a scalar atomic whose
    result is used goes through scratch that sat where warp_specialize passes captured
    values (PERFORMANCE.md, pitfalls)."""
    return gl.inline_asm_elementwise(
        "{ .reg .pred p; .reg .b32 l, v; mov.u32 l, %laneid; setp.eq.u32 p, l, 0; "
        "mov.b32 v, 0; @p atom.relaxed.gpu.global.add.s32 v, [$1], 1; "
        "shfl.sync.idx.b32 $0, v, 0, 31, -1; }",
        "=r,l", [counter], dtype=gl.int32, is_pure=False, pack=1)


# Rings of shared-memory slots between a kernel's TMA load warp and its consumers. Item
# i goes to slot i % STAGES; the slot's ready barrier completes when the item's bytes
# have landed, its empty barrier when every consumer has released it.


@gluon.jit
def ring(STAGES: gl.constexpr, CONSUMERS: gl.constexpr, PRODUCERS: gl.constexpr = 1):
    """Allocates and initialises a ring's (ready, empty) barriers, [STAGES, 1] each: a
    slot is ready once PRODUCERS have arrived (one for TMA loads, which arm it with
    their bytes), empty once CONSUMERS have."""
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=PRODUCERS)
        mbarrier.init(empty.index(i), count=CONSUMERS)
    return ready, empty


@gluon.jit
def claim(ready, empty, i, nbytes: gl.constexpr, STAGES: gl.constexpr):
    """Loader side: waits until item i's slot is free (its (i // STAGES)-th reuse waits
    for the consumers to release item i - STAGES), arms its ready barrier for nbytes
    and returns the slot."""
    slot = i % STAGES
    mbarrier.wait(empty.index(slot), ((i // STAGES) & 1) ^ 1, pred=i >= STAGES)
    mbarrier.expect(ready.index(slot), nbytes)
    return slot


@gluon.jit
def arrived(ready, i, STAGES: gl.constexpr):
    """Consumer side: waits until item i sits in its slot; returns the slot."""
    slot = i % STAGES
    mbarrier.wait(ready.index(slot), (i // STAGES) & 1)
    return slot


@gluon.jit
def _mul_wide(a, b):
    """(high, low) words of the 64-bit product of uint32 a and b: one IMAD.WIDE, where
    umulhi and a multiply make two half-rate IMADs."""
    return gl.inline_asm_elementwise(
        "{ .reg .b64 t; mul.wide.u32 t, $2, $3; mov.b64 {$1, $0}, t; }", "=r,=r,r,r",
        [a, b], dtype=(gl.uint32, gl.uint32), is_pure=True, pack=1)


@gluon.jit
def _philox(seed, c0, c1, c2, c3):
    """Philox-4x32-10 as tl.philox computes it (the 64-bit seed the key), word for word,
    with each round's two products from one wide multiply."""
    k0 = (seed & 0xFFFFFFFF).to(gl.uint32)
    k1 = ((seed >> 32) & 0xFFFFFFFF).to(gl.uint32)
    round_a = gl.full_like(c0, 0xD2511F53)
    round_b = gl.full_like(c0, 0xCD9E8D57)
    for _ in gl.static_range(10):
        hi_b, lo_b = _mul_wide(c2, round_b)
        hi_a, lo_a = _mul_wide(c0, round_a)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0 += 0x9E3779B9
        k1 += 0xBB67AE85
    return c0, c1, c2, c3


@gluon.jit
def dropout_keep(seed, rng_offset, bh, start_m, start_n, M: gl.constexpr, N: gl.constexpr,
                 TRANSPOSED: gl.constexpr, scratch=None):
    """common.dropout_keep's mask, bit for bit, for queries [start_m, + M) and keys
    [start_n, + N) (start_n % 8 == 0), for a warpgroup's wgmma accumulator layout of
    (M, N), or of (N, M) if TRANSPOSED: its 16-bit uniforms two to a word, each word
    the pair of adjacent columns (keys, or if TRANSPOSED queries) that one thread of
    that layout holds, and in that thread (`dropped` applies them). ``scratch``:
    keep_scratch's view of free shared memory that the exchange goes through in place
    of the compiler's own scratch (where shared memory has no room for both); the
    caller's warps meet before the call (nothing reads the buffer any more) and after it
    (before the buffer is written). stage_keep and staged_keep do the same in two steps."""
    if scratch is None:
        R: gl.constexpr = N if TRANSPOSED else M
        C: gl.constexpr = M if TRANSPOSED else N
        words = _keep_words(seed, rng_offset, bh, start_m, start_n, M, N, TRANSPOSED)
        return gl.convert_layout(words, _pairs_layout(R, C))
    else:
        stage_keep(seed, rng_offset, bh, start_m, start_n, M, N, TRANSPOSED, scratch)
        gl.thread_barrier()
        return staged_keep(scratch)


@gluon.jit
def stage_keep(seed, rng_offset, bh, start_m, start_n, M: gl.constexpr, N: gl.constexpr,
               TRANSPOSED: gl.constexpr, scratch):
    """dropout_keep's words into ``scratch`` (keep_scratch's view), for staged_keep to
    read once the caller's warps have met: the words wait there, not in registers."""
    scratch.store(_keep_words(seed, rng_offset, bh, start_m, start_n, M, N, TRANSPOSED))


@gluon.jit
def staged_keep(scratch):
    """The mask stage_keep put in ``scratch``, as dropout_keep returns it."""
    return scratch.load(_pairs_layout(scratch.shape[0], scratch.shape[1] * 2))


@gluon.jit
def _keep_words(seed, rng_offset, bh, start_m, start_n, M: gl.constexpr, N: gl.constexpr,
                TRANSPOSED: gl.constexpr):
    """dropout_keep's words as drawn: each thread draws the Philox words of distinct
    (query, 8 keys) pairs, in the warp that holds those queries (or keys) in the
    accumulator layout, so the exchange stays inside each warp.

    Word 2a + b of the draw for keys 8g.. holds keys 8g + 4b + 2a + (0, 1) in its low and
    high halves (common.dropout_keep's join order): queries along rows it is already a
    key pair; along columns (TRANSPOSED) each thread draws two adjacent queries, whose
    uniforms of one key it joins into a word."""
    G: gl.constexpr = N // 8
    if TRANSPOSED:  # warp w draws key groups 2w, 2w+1 (keys 16w..16w+15 of the tile)
        draw: gl.constexpr = gl.BlockedLayout([2, G // 4], [32, 1], [1, 4], [0, 1])
    else:  # warp w draws queries 16w..16w+15
        draw: gl.constexpr = gl.BlockedLayout([M // 32, 1], [8, 4], [4, 1], [1, 0])
    zero = gl.zeros([M, G], gl.int32, draw)
    rows = start_m + gl.arange(0, M, layout=gl.SliceLayout(1, draw))
    groups = start_n // 8 + gl.arange(0, G, layout=gl.SliceLayout(0, draw))
    r0, r1, r2, r3 = _philox(seed, (groups[None, :] + zero).to(gl.uint32),
                             (rows[:, None] + zero).to(gl.uint32),
                             (zero + bh).to(gl.uint32), (zero + rng_offset).to(gl.uint32))
    words = gl.reshape(gl.join(gl.join(r0, r1), gl.join(r2, r3)), [M, N // 2])  # key pairs
    if TRANSPOSED:  # (N, M / 2) query pairs: queries 2j and 2j + 1 of each key
        uniforms = gl.permute(gl.reshape(gl.join(words & 0xFFFF, words >> 16), [M, N]), [1, 0])
        even, odd = gl.split(gl.reshape(uniforms, [N, M // 2, 2]))
        words = even | (odd << 16)
    return words


@gluon.jit
def dropped(x, keep, dropout_p, WHOLE_WORD: gl.constexpr = False):
    """x, an (R, C) tile in the wgmma accumulator layout dropout_keep's mask ``keep`` is
    for, with the entries it drops zeroed: each thread compares the two halves of its
    word for a pair of columns where it zeroes them, against round(p * 2**16) as
    common.dropout_keep does. WHOLE_WORD: the high half's compare as the whole word's
    against round(p * 2**16) * 2**16, the same but for a threshold of 2**16 (every key
    dropped: a predicate of the call says so), with no shift a pair (the forward's step
    at D=128: 1081 -> 1051 instructions; H200 B4 S4096 H16 D128 p=0.1 forward 355 ->
    369 TFLOP/s); the backward's dP and P keep the shift (its dropout variant spills 48
    -> 124 bytes with the predicate)."""
    R: gl.constexpr = x.shape[0]
    C: gl.constexpr = x.shape[1]
    even, odd = gl.split(gl.reshape(x, [R, C // 2, 2]))  # columns 2j and 2j + 1
    words = gl.convert_layout(keep, even.type.layout)
    threshold = (dropout_p * 65536.0 + 0.5).to(gl.uint32)
    # In assembly: as gl.where, LLVM moves the select past P's conversion to bf16,
    # where each half is taken out of its pair, selected and put back; and a boolean
    # tile is packed into bytes while it is held.
    if WHOLE_WORD:
        even, odd = gl.inline_asm_elementwise(
            """{ .reg .pred k0, k1, some; .reg .b32 w0;
            and.b32 w0, $2, 65535; setp.ge.u32 k0, w0, $3;
            setp.lt.u32 some, $3, 65536; setp.ge.and.u32 k1, $2, $4, some;
            selp.f32 $0, $5, 0f00000000, k0; selp.f32 $1, $6, 0f00000000, k1; }""",
            "=r,=r,r,r,r,r,r", [words, gl.full_like(words, threshold),
                                gl.full_like(words, threshold << 16), even, odd],
            dtype=(gl.float32, gl.float32), is_pure=True, pack=1)
    else:
        even, odd = gl.inline_asm_elementwise(
            """{ .reg .pred k0, k1; .reg .b32 w0, w1;
            and.b32 w0, $2, 65535; shr.u32 w1, $2, 16;
            setp.ge.u32 k0, w0, $3; setp.ge.u32 k1, w1, $3;
            selp.f32 $0, $4, 0f00000000, k0; selp.f32 $1, $5, 0f00000000, k1; }""",
            "=r,=r,r,r,r,r", [words, gl.full_like(words, threshold), even, odd],
            dtype=(gl.float32, gl.float32), is_pure=True, pack=1)
    return gl.convert_layout(gl.reshape(gl.join(even, odd), [R, C]), x.type.layout)


@gluon.jit
def keep_scratch(buf, part, M: gl.constexpr, N: gl.constexpr, TRANSPOSED: gl.constexpr):
    """dropout_keep's scratch for an (M, N) tile in the free shared buffer ``buf``: its
    M N / 2 words (2 M N bytes), (M, N / 2) key pairs' in part ``part`` (0 or 1) of buf
    (4 M N bytes), or TRANSPOSED (N, M / 2) query pairs' in the whole of it (2 M N
    bytes). 16-byte chunks of a row XOR its index mod 8, so that neither a warp's stores
    (along rows) nor its loads (a pair a lane, 8 rows) meet a bank twice."""
    layout: gl.constexpr = gl.SwizzledSharedLayout(4, 1, 8, [1, 0])
    if TRANSPOSED:
        return buf._reinterpret(gl.uint32, [N, M // 2], layout)
    else:
        return buf._reinterpret(gl.uint32, [2, M, N // 2], layout).index(part)


@gluon.constexpr_function
def _pairs_layout(M, N):
    """(M, N / 2) pairs of adjacent columns (keys, or queries in a transposed tile)
    placed where a 4-warp wgmma accumulator layout of (M, N) holds them: lanes 4r + c
    hold rows r (+ 8), pairs c + 4j (columns 8j + 2c, + 1); warps 16 rows each."""
    regs = [[8, 0]] + [[0, 4 << i] for i in range((N // 8).bit_length() - 1)]
    lanes = [[0, 1], [0, 2], [1, 0], [2, 0], [4, 0]]
    warps = [[16, 0], [32, 0]][: (M // 16).bit_length() - 1]
    return gl.DistributedLinearLayout(reg_bases=regs, lane_bases=lanes, warp_bases=warps,
                                      block_bases=[], shape=[M, N // 2])


@gluon.constexpr_function
def accumulator_order(M, N):
    """A shared layout for an (M, N) fp32 wgmma accumulator of one 4-warp warpgroup
    (NVMMADistributedLayout v3, instr [16, N, 16]; M = 64 or 128) in its registers'
    order, so that a warp stores 512 contiguous bytes (st.shared.v4, no bank conflicts;
    the NVMMA 128-byte swizzle took two wavefronts per half-warp's st.shared.v2, and the
    dQ tiles' stores were 9 % of the backward's shared-memory wavefronts, half of them
    conflicts). A thread's registers hold (r, c), (r, c + 1), (r + 8, c), (r + 8, c + 1),
    then columns c + 8, 16, ... and rows r + 64; lanes 4r + c / 2; warps 16 rows each.
    The offset's bits, lowest first: the first two registers', the lanes', the other
    registers', the warps' (offset_bases: each bit's (row, column)). What TMA copies is
    the tile in that order; accumulator_tile reads it back."""
    regs_hi = [[0, 8 << i] for i in range((N // 8).bit_length() - 1)]
    regs_hi += [[64 << i, 0] for i in range((M // 64).bit_length() - 1)]
    lanes = [[0, 2], [0, 4], [1, 0], [2, 0], [4, 0]]
    return gl.SharedLinearLayout(
        offset_bases=[[0, 1], [8, 0]] + lanes + regs_hi + [[16, 0], [32, 0]])


@triton.jit
def accumulator_tile(first, M: tl.constexpr, N: tl.constexpr):
    """The (M, N) tile that accumulator_order laid out from pointer ``first``, in rows and
    columns: read in its stored order (contiguous, so every load is 16 bytes wide; read
    element by element through its offsets they were 4), then its offset's bits
    (accumulator_order's, lowest first: column 0, row 3, columns 1-2, rows 0-2, columns
    3.., rows 6.., rows 4-5) put back in row and column order."""
    x = tl.load(first + tl.arange(0, M * N))
    x = tl.reshape(x, [4, M // 64, N // 8, 8, 4, 2, 2])
    return tl.reshape(tl.permute(x, [1, 0, 5, 3, 2, 4, 6]), [M, N])


@gl_core.builtin
def tma_reduce_add(tensor_desc, coord, src, _semantic=None):
    """global[coord : coord + block] += src (cp.reduce.async.bulk.tensor, an L2-side
    atomic of a whole tile); tma.store_wait covers it as it does a TMA store. Triton
    3.6 builds the op, but its Gluon Hopper module has no wrapper for it yet."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD,
                                              tensor_desc.handle, coord, src.handle)


@gluon.constexpr_function
def _bar_asm(op, bar_id, threads):
    return f"{op} {bar_id}, {threads}; mov.b32 $0, 0;"


@gluon.jit
def named_barrier(bar_id: gl.constexpr, threads: gl.constexpr, ARRIVE: gl.constexpr):
    """bar.sync (or, ARRIVE, bar.arrive) on hardware barrier bar_id for ``threads``
    threads: warpgroups handing each other turns (Gluon's partitions use the low ids)."""
    asm: gl.constexpr = _bar_asm("bar.arrive" if ARRIVE else "bar.sync", bar_id, threads)
    gl.inline_asm_elementwise(asm, "=r", [], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def launch_dependents():
    """griddepcontrol.launch_dependents: the next kernel in the stream, launched as this
    one's programmatic dependent (launch_pdl), may start once every program here has
    passed this or ended; its programs then take the SMs this grid's last wave leaves."""
    gl.inline_asm_elementwise("griddepcontrol.launch_dependents; mov.b32 $0, 0;", "=r", [],
                              dtype=gl.int32, is_pure=False, pack=1)  # fmt: skip


@gluon.jit
def wait_for_primary():
    """griddepcontrol.wait: until the kernel this one depends on programmatically has
    completed and its writes are visible (at once without such a kernel)."""
    gl.inline_asm_elementwise("griddepcontrol.wait; mov.b32 $0, 0;", "=r", [],
                              dtype=gl.int32, is_pure=False, pack=1)  # fmt: skip


@gluon.jit
def wait_turn(lock, turn):
    """Spins until the int32 counter at ``lock`` reads ``turn`` (ld.acquire.gpu, every
    lane): adds from different programs in a fixed order (backward_sm90.narrow.ORDERED_DQ)."""
    gl.inline_asm_elementwise(
        "{ .reg .pred p; .reg .b32 v; WAIT_TURN: ld.global.acquire.gpu.b32 v, [$1]; "
        "setp.ne.s32 p, v, $2; @p bra WAIT_TURN; mov.b32 $0, v; }",
        "=r,l,r", [lock, turn], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def end_turn(lock):
    """Counts a turn done at ``lock``, from one warp, once the warp's bulk copies have
    completed: cp.async.bulk.wait_group 0 (tma.store_wait's .read variant only waits
    for their sources to be read, not for their writes), the warp's lanes together,
    fence.acq_rel.gpu, then lane 0's red.add; the next wait_turn then sees the writes
    (and those of warpgroups that handed the turn to this warp: hand_over_turn)."""
    gl.inline_asm_elementwise(
        "{ .reg .pred p; .reg .b32 l; cp.async.bulk.wait_group 0; bar.warp.sync -1; "
        "mov.u32 l, %laneid; setp.eq.u32 p, l, 0; fence.acq_rel.gpu; "
        "@p red.relaxed.gpu.global.add.s32 [$1], 1; mov.b32 $0, 0; }",
        "=r,l", [lock], dtype=gl.int32, is_pure=False, pack=1)


@gluon.constexpr_function
def _wait_group_asm(pending):
    return f"cp.async.bulk.wait_group {pending}; mov.b32 $0, 0;"


@gluon.jit
def hand_over_turn(landed, counted, i, KIND: gl.constexpr, RING: gl.constexpr,
                   PENDING: gl.constexpr):  # fmt: skip
    """A warpgroup that issues its own bulk copies hands its i-th turn of a kind (KIND) to
    the warp that counts them (backward_sm90.narrow's "ordered" bias gradients), once all
    its copies but the last PENDING have completed: cp.async.bulk.wait_group PENDING in
    every thread (whichever issued them), the warpgroup's barrier, an arrive on the turn's
    slot of ``landed`` ([KIND * RING + i % RING]), which the counting warp gives back on
    ``counted`` (the slot's last use waited for first). The counting warp's end_turn
    then makes the writes visible at gpu scope: a release's fence in the warpgroup itself
    held up its steps (H200: 1HQK's row 213 -> 241 TFLOP/s where its adds were relaxed)."""
    slot = KIND * RING + i % RING
    mbarrier.wait(counted.index(slot), ((i // RING) & 1) ^ 1, pred=i >= RING)
    asm: gl.constexpr = _wait_group_asm(PENDING)
    gl.inline_asm_elementwise(asm, "=r", [], dtype=gl.int32, is_pure=False, pack=1)
    gl.thread_barrier()
    mbarrier.arrive(landed.index(slot))


@gluon.jit
def load_acquire(ptr):
    """The int32 at ``ptr`` (ld.acquire.gpu): a turn's counter read ahead of wait_turn,
    whose spin a caller then skips where it already reads the turn."""
    return gl.inline_asm_elementwise("ld.global.acquire.gpu.b32 $0, [$1];", "=r,l", [ptr],
                                     dtype=gl.int32, is_pure=False, pack=1)


# Arguments a launch key holds by value: Triton specialises an int on its value (is it
# 1, divisible by 16, its width), a float or a bool on its type. Keying on the value
# (the types sit beside it in the key) costs a tenth of working those out on each call,
# and only makes more keys: a new value first launches through JITFunction.run.
_BY_VALUE = frozenset({int, float, bool, type(None)})


def _specialisation(arg):
    """What a launch key holds for one argument: a scalar's value, a tensor's dtype and
    16-byte alignment, a descriptor's dtype, block and layout (what JITFunction.run
    specialises a kernel on, or finer)."""
    if type(arg) in _BY_VALUE:
        return arg
    if type(arg) is TensorDescriptor:
        return (arg.base.dtype, *arg.block_shape, arg.layout)
    if isinstance(arg, torch.Tensor):
        return (arg.dtype, arg.data_ptr() % 16 == 0)
    return type(arg)


# Tests set this: every launch given a `variant` then also works out the full key and
# checks that the variant's first launch had the same (Launcher).
CHECK_VARIANTS = False


def aligned(t: torch.Tensor | None) -> bool:
    """Whether a pointer argument is 16-byte aligned (None is): what Triton specialises
    a tensor on beside its dtype, for a caller's `variant`."""
    return t is None or t.data_ptr() % 16 == 0


def tensor_key(t: torch.Tensor | None) -> tuple | None:
    """A tensor's address, dtype, shape and strides (None for None): what a launch's
    arguments take from it, for a `Launcher.launch_prepared` key."""
    return None if t is None else (t.data_ptr(), t.dtype, t.shape, t.stride())


class _Recording(threading.local):
    """The launches a `Replays.recording` on this thread records (None: none records)."""

    launches: list | None = None


_RECORDING = _Recording()
_ALL_REPLAYS: list[Replays] = []


def _allocations() -> int | None:
    """How many allocations PyTorch's CUDA allocator has made on the current device (None
    without CUDA): a recorded path must make none (Replays, under CHECK_VARIANTS)."""
    if not torch.cuda.is_available():
        return None
    return torch.cuda.memory_stats().get("allocation.all.allocated", 0)


class Replays:
    """A host path's launches, recorded per call and launched again as they were: a
    later call of the same key skips all the path's work between and before its
    launches (a small backward's checks, plans, keys and arguments: PERFORMANCE.md, "The
    host path"). The key holds all the launches are made of but the device and
    `sharing_sms`, which are added here: every tensor's address, dtype, shape and
    strides (`tensor_key`), the fresh buffers' addresses, and the spec. Only Launcher
    launches are recorded: a path recorded may do nothing else on the stream, nor
    allocate (a buffer's address its key does not hold). A recording where a launch
    went through Triton (a compile, a launch hook, scratch memory) is not kept; with
    CHECK_VARIANTS (tests) nothing is launched from a recording, each one made again is
    compared with the one kept, and one that allocated raises."""

    def __init__(self):
        self.launches = {}  # (device, sharing_sms, key) -> ((C launcher, programs, tail), ...)
        _ALL_REPLAYS.append(self)

    def launch(self, key) -> bool:
        """Launches what the call of ``key`` launched when recorded, on the current
        stream, and returns True; False where nothing is kept for it (the caller then
        takes its path, recording it)."""
        if CHECK_VARIANTS:
            return False
        device = driver.active.get_current_device()
        found = self.launches.get((device, shares_sms(), key))
        if found is None or _hooked(knobs.runtime.launch_enter_hook) \
                or _hooked(knobs.runtime.launch_exit_hook):  # fmt: skip
            return False
        stream = driver.active.get_current_stream(device)
        for raw, programs, tail in found:
            raw(programs, 1, 1, stream, *tail)
        return True

    @contextlib.contextmanager
    def recording(self, key):
        """Records the Launcher launches made inside, kept for ``key`` (None: nothing is
        recorded) once the block ends without an exception."""
        if key is None:
            yield
            return
        allocations = _allocations() if CHECK_VARIANTS else None
        launches = _RECORDING.launches = []
        try:
            yield
        finally:
            _RECORDING.launches = None
        if not launches or None in launches:  # none, or one through Triton
            return
        if allocations is not None and _allocations() != allocations:
            raise AssertionError(f"a recorded call allocated memory, whose address its key "
                                 f"does not hold: {key!r}")
        full_key = (driver.active.get_current_device(), shares_sms(), key)
        if len(self.launches) >= 4096:  # many distinct calls: start over
            self.launches.clear()
        kept = self.launches.setdefault(full_key, tuple(launches))
        if CHECK_VARIANTS and kept != tuple(launches):
            raise AssertionError(f"a recorded call's launches differ from those its key "
                                 f"was first recorded with: {key!r}")


class Launcher:
    """Launches a kernel straight through its compiled launcher after the first call
    of each variant. JITFunction.run binds and specialises every argument in Python on
    every call: ~25-40 us of the device host's time per launch (PERFORMANCE.md),
    as long as a whole small kernel. The variant's key is either the constexprs, launch
    options, arguments' types and `_specialisation`s (as fine as run()'s specialisation
    or finer), or, cheaper (~3 µs per launch on a workstation, several times that on
    the device's host), a ``variant`` from the caller: a hashable that fixes all of
    those (the call's spec or a plan made from it, the ints they do not fix, the
    pointers' alignment). A new key goes through run(), which compiles (where its own
    cache has not) and launches it. Call as launcher(grid, *args, variant=..., **kw)
    with the constexprs and options as keywords; grid is one-dimensional, (programs,):
    later launches pass the C launcher grid[0] alone."""

    def __init__(self, fn):
        self.fn = fn
        self.kernels = {}  # key -> _Compiled
        self.prepared = {}  # (device, call) -> (C launcher, its arguments after the stream)

    def launch_prepared(self, programs: int, call) -> bool:
        """Launches the arguments an earlier launch given ``prepare=call`` left, and
        returns True; False where there are none (the caller then makes its arguments
        and launches). ``call`` is a hashable of everything those arguments are made
        of (the plan, the tensors' addresses and strides): a small call then skips
        making descriptors and looking up their maps, ~30 % of a forward's host time
        before its launch (PERFORMANCE.md). Tests (CHECK_VARIANTS) always make the
        arguments and check that they equal the prepared ones."""
        if CHECK_VARIANTS:
            return False
        device = driver.active.get_current_device()
        found = self.prepared.get((device, call))
        if found is None or _hooked(knobs.runtime.launch_enter_hook) \
                or _hooked(knobs.runtime.launch_exit_hook):  # fmt: skip
            return False
        raw, tail = found
        raw(programs, 1, 1, driver.active.get_current_stream(device), *tail)
        if _RECORDING.launches is not None:
            _RECORDING.launches.append((raw, programs, tail))
        return True

    def __call__(self, grid, *args, variant=None, prepare=None, **kwargs):
        device = driver.active.get_current_device()
        full = None
        if variant is None or CHECK_VARIANTS:
            full = (device, *kwargs.items(), *map(type, args), *map(_specialisation, args))
        key = full if variant is None else (device, variant)
        found = self.kernels.get(key)
        if found is None:
            if len(grid) != 1:
                raise ValueError(f"Launcher takes a 1-D grid, got {grid}")
            kernel = self.fn[grid](*args, **kwargs)
            constexprs = [kwargs[name] for name in self.fn.arg_names[len(args):]]
            if len(self.kernels) >= 4096:  # many distinct shapes: start over
                self.kernels.clear()
                self.prepared.clear()  # their arguments name the dropped kernels
            self.kernels[key] = _Compiled(kernel, constexprs, args, full)
            if _RECORDING.launches is not None:
                _RECORDING.launches.append(None)  # through Triton: not replayed
            return
        if CHECK_VARIANTS and found.full_key != full:
            name = getattr(self.fn, "__name__", self.fn)
            raise AssertionError(f"{name}: variant {variant!r} launched with arguments of "
                                 "another specialisation than its first launch")
        stream = driver.active.get_current_stream(device)
        tail = found.arguments(stream, args)
        if tail is None:  # a hook or scratch memory: Triton's own launch
            found.launch_by_triton(grid[0], stream, args)
            if _RECORDING.launches is not None:
                _RECORDING.launches.append(None)
            return
        recording = _RECORDING.launches
        if prepare is not None or recording is not None:
            # Addresses, not tensors: the C launcher takes either, and the caches must
            # not keep a call's outputs alive.
            tail = tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in tail)
        if recording is not None:
            recording.append((found.raw, grid[0], tail))
        if prepare is not None:
            prepared = self.prepared.setdefault((device, prepare), (found.raw, tail))
            if CHECK_VARIANTS and prepared != (found.raw, tail):
                name = getattr(self.fn, "__name__", self.fn)
                raise AssertionError(f"{name}: a prepared call's arguments differ from "
                                     "those its key was first made for")
            if len(self.prepared) >= 4096:  # many distinct tensors: start over
                self.prepared.clear()
        found.raw(grid[0], 1, 1, stream, *tail)


class _Compiled:
    """A compiled variant and how to launch it. Where it can, a launch goes to the C
    launcher Triton built for the kernel, with the descriptors' CUtensorMaps from a
    cache (`_tensor_map_args`): Triton's Python wrapper around that launcher walks every
    argument and encodes every descriptor anew on each call, ~40 us of the device
    host's time for a forward (PERFORMANCE.md). A launch hook (a profiler such as
    proton), scratch memory or a launcher of another shape take Triton's own path."""

    def __init__(self, kernel, constexprs, args, full_key):
        self.kernel = kernel
        self.constexprs = constexprs
        self.full_key = full_key  # Launcher's key from the arguments, where worked out
        metas = iter(getattr(kernel.metadata, "tensordesc_meta", None) or ())
        # Each descriptor's position and metadata (None: no map, the tensor passes): a
        # launch splices their maps between slices of the other arguments instead of
        # walking all thirty (~10 us of the device's host).
        self.descriptors = tuple((i, next(metas, None)) for i, a in enumerate(args)
                                 if isinstance(a, TensorDescriptor))  # fmt: skip
        run = kernel.run  # Triton's CudaLauncher
        scratch = run.global_scratch_size or run.profile_scratch_size
        self.raw = None if scratch else _c_launcher(run.launch)
        self.flags = (run.launch_cooperative_grid, run.launch_pdl)

    def arguments(self, stream: int, args: tuple) -> tuple | None:
        """The C launcher's arguments after (programs, 1, 1, stream); None where the
        launch must go through Triton (`launch_by_triton`): a launch hook is set or the
        kernel needs scratch memory."""
        enter, leave = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
        if self.raw is None or _hooked(enter) or _hooked(leave):
            return None
        final, start = [], 0
        for i, meta in self.descriptors:
            final += args[start:i]
            final += _tensor_map_args(args[i], meta)
            start = i + 1
        final += args[start:]
        kernel = self.kernel
        return (kernel.function, *self.flags, None, None, kernel.packed_metadata, None, None,
                None, *final, *self.constexprs)  # fmt: skip

    def launch_by_triton(self, programs: int, stream: int, args: tuple):
        kernel = self.kernel
        enter, leave = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
        meta = kernel.launch_metadata((programs,), stream, *args, *self.constexprs)
        kernel.run(programs, 1, 1, stream, kernel.function, kernel.packed_metadata, meta,
                   enter, leave, *args, *self.constexprs)


def _hooked(hook) -> bool:
    """Whether a launch hook is set: Triton 3.6 keeps an empty HookChain by default
    (one Python call and a launch-metadata dict per launch when passed on), or a user
    may set a function."""
    return bool(getattr(hook, "calls", hook))


def _c_launcher(launch):
    """The C launcher under Triton 3.6's descriptor wrapper (`wrap_handle_tensordesc`
    closes over it as ``launcher``), or the launcher itself where nothing wraps it;
    None for anything else."""
    code = getattr(launch, "__code__", None)
    if code is None:
        return launch
    cells = dict(zip(code.co_freevars, launch.__closure__ or ()))
    return cells["launcher"].cell_contents if "launcher" in cells else None


_TENSOR_MAPS: dict[tuple, list] = {}


def _tensor_map_args(desc: TensorDescriptor, meta) -> list:
    """What Triton's launcher takes for a descriptor (its CUtensorMap, shape and
    strides), cached on all the map encodes: the base address, shape, strides, block and
    padding, and the kernel's metadata for it (swizzle, element type; it lives as long
    as the kernel, so its id is stable)."""
    if meta is None:  # no map: Triton passes the tensor itself, which is not ours to keep
        return nvidia_driver.make_tensordesc_arg(desc, meta)
    key = (desc.base.data_ptr(), *desc.shape, *desc.strides, *desc.block_shape,
           desc.padding, id(meta))  # fmt: skip
    found = _TENSOR_MAPS.get(key)
    if found is None:
        if len(_TENSOR_MAPS) >= 4096:  # many distinct tensors: start over
            _TENSOR_MAPS.clear()
        found = _TENSOR_MAPS[key] = nvidia_driver.make_tensordesc_arg(desc, meta)
    return found


# The least a key row's value may be in Q K^T's units (bias_row_scores): finite biases
# below it (eager masks' finfo.min, divided by a scale < 1) would overflow to -inf and
# turn a row the reference averages into an empty one.
BIAS_ROW_FLOOR = tl.constexpr(3.0e38)


@triton.jit
def _bias_row_scores_kernel(Bias, Out, stride_b, stride_h, stride_n, heads, seqlen_k,
                            out_row, blocks, inv_scale, BLOCK: tl.constexpr):  # fmt: skip
    bh = tl.program_id(0) // blocks  # a 1-D grid, as Launcher launches
    offs = (tl.program_id(0) % blocks) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < seqlen_k
    x = tl.load(Bias + (bh // heads).to(tl.int64) * stride_b + (bh % heads).to(tl.int64)
                * stride_h + offs.to(tl.int64) * stride_n, mask=ok, other=0.0).to(tl.float32)
    row = tl.where(x == float("-inf"), x, tl.maximum(x * inv_scale, -BIAS_ROW_FLOOR))
    tl.store(Out + bh.to(tl.int64) * out_row + offs, row, mask=ok)


_launch_bias_row_scores = Launcher(_bias_row_scores_kernel)


def bias_row_scores(bias: torch.Tensor, scale: float) -> torch.Tensor:
    """A bias `bias_row` accepted, in Q K^T's units: fp32 (B', H', Sk), bias / scale
    (a scale > 0: dispatch sends 0 to the tile forward), -inf kept, finite values at
    least -BIAS_ROW_FLOOR. The Gluon forward's S wgmma starts from it, so the softmax
    adds nothing (an FMA a score was a fifth of its arithmetic); worked out once per
    call here. Rows padded to 16 bytes: the forward loads them by TMA."""
    shape, _ = _bias_4d(bias)
    batches, heads, _, seqlen_k = shape
    padded = cdiv(seqlen_k, 4) * 4
    out = torch.empty(batches, heads, padded, dtype=torch.float32, device=bias.device)
    out = out[..., :seqlen_k]
    block = 1024
    blocks = cdiv(seqlen_k, block)
    _launch_bias_row_scores((blocks * batches * heads,), bias, out, *bias_row_strides(bias),
                            heads, seqlen_k, padded, blocks, 1.0 / scale,
                            BLOCK=block)  # fmt: skip
    return out
