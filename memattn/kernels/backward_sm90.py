"""Hopper backward kernel in Gluon, warp-specialised (FlashAttention-3's structure).

backward.py's tile kernels compute dQ in a second kernel that recomputes S and dP:
7 matmuls per (query tile, key tile) pair where the gradient needs 5. Here a program
takes a block of 128 keys of one (batch, kv head) at a time (persistent: one program
per SM at most walks many, PERSISTENT_BLOCKS), keeps dK and dV in registers, walks
every query tile of its GQA group once, and adds each tile's dQ into an fp32 buffer by
TMA reduce-add (an L2-side atomic of a whole tile). Three partitions:
- a load warp: a block's K and V (once the last block's are released), then Q and dO
  tiles by TMA into two-stage rings, each slot refilled as soon as both consumers
  release it (mbarriers);
- two compute warpgroups, 64 keys each. Per query tile (64 rows, 128 at D=64) each
  computes, in the transposed (keys, queries) orientation, S^T = K Q^T and
  dP^T = V dO^T (asynchronous wgmmas), P^T and dS^T from them, dV += P^T dO with the
  probabilities straight from registers, and writes dS^T to shared memory. Once both
  halves are there (an mbarrier between the two), each computes half of dQ's columns,
  dQ[:, half] = dS K[:, half], then dK += dS^T Q, and sends dQ to the fp32 buffer
  while dK's wgmma runs.
dS stays unscaled in shared memory, as (queries, keys) tiles of rows x 64: it is the
gradient of a bias, and for a full bias each warpgroup's tile leaves by TMA store as
it is; for one broadcast over batch or heads each tile is added, in fp32, into the
gradient by TMA reduce-add as dQ is (a plane per head shared by packed sequences: into
the gradient itself, in its dtype, PACKED_BIAS_ADDS). dK takes the softmax scale in
fp32 at a block's end, dQ where its fp32 buffer is converted (_dq_from_tiles_kernel).
A bias tile loads beside each Q tile; a bias constant along queries (key padding) is
read by pointer, 64 keys a warpgroup, and its gradient is dS summed over
each query head's tiles in registers, stored once per (b, h, keys) into an fp32 buffer
that run() sums over the dimensions the bias broadcasts over: no atomics, no expanded
buffer, the same bits every run.
Dropout's keep bits come from hopper.dropout_keep in the transposed layout (two
queries' 16-bit uniforms a word, compared where P and dP are zeroed). Packed
sequences (varlen): one batch of all tokens to TMA, tiles from each sequence's first
token, dK and dV stored from its first key;
their lse and delta from common.packed_stats_start on, a multiple of 4 tokens (a TMA
box along the tokens must start 16-byte aligned, and a sequence may start anywhere),
with +inf lse past its end, so that a tile whose rows run past the end (the next
sequence's) needs no mask for them.
At D 64 and 128 the fp32 dQ buffer (dq_tiles) holds each tile in its registers' order
(hopper.accumulator_order: its stores to shared memory without bank conflicts);
backward.py's preprocess zeroes it and _dq_from_tiles_kernel converts it to the output.

At Dqk=192 / Dv=128 (SPLIT_HEAD_DIM_PAIRS) _bwd_split_kernel runs, the same dQ
buffer and reduce-adds in FlashAttention-4's orientation for these head dims (see
FUSED_SPLIT). At D=256 (and the other pairs past 128 columns), and for 192/128's
deterministic calls and those with a bias, ALiBi, dropout or softcap, two other
kernels run: _bwd_wide_kernel splits dK and dV's work the other way round (64 keys a
program, each warpgroup part of the head dims, see BLOCK_N_WIDE), and
_bwd_dq_wide_kernel computes dQ apart, a program per block of queries (see
DQ_BLOCK_N), writing it in the output dtype: no fp32 buffer, and no atomics.

Covers what forward_sm90 covers (bf16/fp16, head dims 64, 128 and 256, GQA, causal
masks either way, sliding windows, a bias, ALiBi, softcap, dropout, dense and packed
batches) minus a bias gradient summed over keys, minus softcap beside a bias gradient,
minus deterministic calls at D 64 and 128 other than orders_dq's (TMA reduce-adds land
in any order; ORDERED_DQ puts them in one) and dq_from_full_bias's (dS stored whole, dQ
from it), and past 128 columns minus deterministic calls with the gradient of a bias
broadcast over batch or heads with queries (the wide kernels read a bias and apply
ALiBi, softcap and dropout as the D 64/128 kernel does, _wide_probs; a full bias's
gradient they store from registers, a summed one's they add by atomics, a key row's
they sum in registers). Every other call runs backward.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ..spec import AttentionSpec
from . import backward as tiles
from . import hopper
from .common import (
    LOG2E,
    STATS_SLACK,
    add_bias_alibi_log2,
    alibi_strides,
    cdiv,
    diagonal_offset,
    dq_tile,
    new_output,
    packed_stats_start,
    philox_key,
    query_range,
    row_block,
    sequence_bounds,
    tanh,
    visible,
)
from .forward import dense_strides
from .hopper import accumulator_offset

ROWS = gl.constexpr(64)  # query rows per warpgroup in the wide dQ kernel
BLOCK_N = 128  # keys per program: two warpgroups x 64
BLOCK_M = 64  # query rows per step (registers: dK and dV take 2 * D / 2 per thread)
# Query rows a step at D=64 (a knob tools/ab.py sets): dK and dV take 64 registers a
# thread there, S and dP 64 each at 128 rows (FA4's D=64 step).
BLOCK_M_D64 = 128
STAGES = 2  # Q and dO rings


@gluon.jit
def _query_tile(i, hk, GROUP, lo, n_tiles, BLOCK_M: gl.constexpr, rot=0,
                ROTATE: gl.constexpr = False):  # fmt: skip
    """(query head, first row) of a program's i-th query tile: the heads of the GQA
    group in turn, each's n_tiles tiles from lo on (ROTATE: from tile rot on, wrapping
    round; see ORDERED_DQ). The load warp, the compute warpgroups and the dQ writer walk
    the same sequence."""
    h = hk * GROUP + i // n_tiles
    t = i % n_tiles
    if ROTATE:
        t = (t + rot) % n_tiles
    return h, lo + t * BLOCK_M


@gluon.jit
def _walk_rotation(start_n, n_tiles, seqlen_k, BLOCK_N: gl.constexpr, ROTATE: gl.constexpr):
    """ROTATE: the query tile key block start_n's walk starts at, n * n_tiles // num_n
    for block n of the num_n of its (sequence's) keys (ORDERED_DQ, dq_add_turn); 0
    otherwise. The three partitions take it from here, so that they walk alike."""
    rot = 0
    if ROTATE:
        rot = (start_n // BLOCK_N) * n_tiles // gl.cdiv(seqlen_k, BLOCK_N)
    return rot


@gluon.jit
def dq_add_turn(n, start_m, num_n, n_tiles, off, window_left, window_right,
                BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BOUNDED_LEFT: gl.constexpr,
                BOUNDED_RIGHT: gl.constexpr, ROTATE: gl.constexpr):  # fmt: skip
    """ORDERED_DQ: key block n's place among the key blocks that add into the dQ tile of
    rows [start_m, + BLOCK_M) of one head, the order in which they reach it. With a
    right bound (causal, windows) each program starts at its first query tile, later
    the further right its keys, so the blocks add last first: the tile's last block
    (the last whose keys a row of the tile sees) first. Without one, ROTATE: every
    block sees every tile, and each program starts its walk at tile n * n_tiles //
    num_n (_query_tile's rot): tile m's adds come from the block that started there, or
    last before it, then the ones before that, wrapping round. Otherwise every block
    walks from the first tile, and they add first first (the tile's first block: the
    first whose keys a row of it sees under a left bound), in the order the programs
    start. Plain integer arithmetic, so that tests can run it in Python."""
    if BOUNDED_RIGHT:
        last = (start_m + BLOCK_M + off + window_right - 1) // BLOCK_N
        if last > num_n - 1:
            last = num_n - 1
        turn = last - n
    elif not ROTATE:
        first = 0
        if BOUNDED_LEFT:
            first = start_m + off - window_left
            if first < 0:
                first = 0
            first = first // BLOCK_N
        turn = n - first
    else:
        # the last block whose walk starts at this tile or before it
        starter = ((start_m // BLOCK_M + 1) * num_n - 1) // n_tiles
        if starter > num_n - 1:
            starter = num_n - 1
        turn = (starter - n + num_n) % num_n
    return turn


@gluon.constexpr_function
def overlaps_block_ends(fold, block_m):
    """Whether a program's key blocks overlap one's end with the next one's start: folded
    D=64 blocks (128-row steps under a mask: few steps a block). The load warp sends the
    next block's first Q and dO tiles before it waits for K and V to free; the compute
    warpgroups free K and V once the last step's dQ wgmma is done, and let dK and dV
    leave through the writer warp's buffer that the next block's first dQ tile takes
    (its last reduce-add read a step earlier than the last tile's), which that tile's
    write then waits for. Elsewhere the checks in the step loop cost more than they save
    (PERFORMANCE.md, "Levers that did not pay")."""
    return fold and block_m == 128


@gluon.constexpr_function
def keeps_bits_in_shared(dropout, bias_tiles, head_dim_qk, head_dim_v):
    """Whether dropout's keep bits go through a buffer of the step's own
    (hopper.keep_scratch: dS's at D 64/128, P's in the wide kernels) rather than the
    compiler's scratch. At 128/128 always: staged there (hopper.stage_keep) and read
    back where they are used, so that they are not held in registers across the
    softmax (the D=128 step's spills 452 -> 304 bytes, causal 396 -> 180; H100, B4
    S4096 dropout 0.1: 361 -> 405-410 TFLOP/s); and beside bias tiles at 256/256, where
    shared memory has no room for both (sm_90 compile, of the 232,448 bytes a block
    may take: D=256's dK/dV kernel 230,992-231,008 so, 238,704 with the compiler's
    scratch). Elsewhere the compiler's exchange is the faster (H100, tools/ab.py, D=64
    with a 1HQK bias and dropout 0.1, B4 S4096: causal 153 -> 146 TFLOP/s through dS,
    without a mask 232 -> 229)."""
    return dropout and head_dim_qk == head_dim_v and (
        head_dim_v == 128 or (bias_tiles and head_dim_v == 256))


@gluon.constexpr_function
def dq_split(head_dim_qk, rows):
    """(rows, columns) of a part of a ``rows``-row dQ tile, the unit a compute warpgroup
    makes and adds: half the columns, or at 128 rows half the rows (a wgmma 32 columns
    wide reads as much of dS from shared memory as one 64 wide, and shared memory bounds
    the kernel); at Dqk=192 a third, 64 columns (_bwd_split_kernel)."""
    if rows == 128:
        return (rows // 2, head_dim_qk)
    return (rows, 64) if head_dim_qk == 192 else (rows, head_dim_qk // 2)


@gluon.jit
def _dq_tile_row(b, q_start, start_m, part, BLOCK_M: gl.constexpr, TILE_ROWS: gl.constexpr,
                 PARTS: gl.constexpr, IS_VARLEN: gl.constexpr):  # fmt: skip
    """Where part ``part`` of the dQ tile of rows [start_m, + BLOCK_M) starts in its head's
    fp32 buffer (dq_tiles: each tile's PARTS parts, dq_split's, TILE_ROWS rows of 256
    each, in their registers' order; common.dq_tile numbers the tiles)."""
    return (PARTS * dq_tile(start_m, q_start, b, BLOCK_M, IS_VARLEN) + part) * TILE_ROWS


@gluon.jit
def _store_rows(x, X, b, h, stride_b, stride_n, stride_h, seqlen, rows, cols, width):
    """x (dK, dV or the wide kernels' dQ, in the output dtype) of tokens ``rows`` and
    columns ``cols`` of (b, head h), by plain stores: a packed sequence's block that ends
    past its tokens (elsewhere TMA stores, which clip at the packed tensor's end, not the
    sequence's); tokens past the sequence's ``seqlen``, and columns from ``width`` on (the
    tensor's own, where the kernel's head dims span more: dispatch.kernel_spec), are not
    written."""
    ok = (rows < seqlen)[:, None] & (cols < width)[None, :]
    rows64 = rows.to(gl.int64)[:, None]
    ptrs = (X + b.to(gl.int64) * stride_b + h.to(gl.int64) * stride_h + rows64 * stride_n
            + cols[None, :])
    gl.store(ptrs, x, mask=ok)


@gluon.jit
def _bwd_load_partition(
    q_desc, do_desc, k_desc, v_desc, stats_desc, bias_desc, q_smem, do_smem, k_smem, v_smem,
    lse_smem, delta_smem, bias_smem, kv_bar, q_ready, do_ready, q_empty, do_empty, b_tma,
    hk, q_start, k_start, stats_start, GROUP, bias_b, bias_heads, start_n, lo, n_tiles,
    q2_desc, k2_desc, q2_smem, k2_smem, BLOCK_M: gl.constexpr, STAGES: gl.constexpr,
    HAS_BIAS: gl.constexpr, QK_SPLIT: gl.constexpr, rot=0, ROTATE: gl.constexpr = False,
    step=0, first=0,
):  # fmt: skip
    """One warp: K and V once, then Q (with its rows' lse and the bias tile) and dO
    (with delta) tiles of every query head of the group. b_tma: the batch's index to
    TMA, 0 for packed sequences (one batch of all tokens), whose tiles start at their
    sequence's first token (q_start, k_start; 0 dense) and their row statistics at
    stats_start (common.packed_stats_start; 0 dense). With QK_SPLIT, Q's and K's last
    QK_SPLIT columns go to buffers of their own (q2, k2) on the same barriers. step: the
    rings' count of tiles before this block's (a persistent program's earlier blocks);
    first: the block's tiles loaded before (_bwd_blocks_load_partition)."""
    split_col: gl.constexpr = q_desc.block_type.shape[3]  # where Q's and K's split starts
    kv_bytes: gl.constexpr = k_desc.block_type.nbytes + v_desc.block_type.nbytes + (
        k2_desc.block_type.nbytes if QK_SPLIT > 0 else 0)
    mbarrier.expect(kv_bar, kv_bytes)
    tma.async_copy_global_to_shared(k_desc, [b_tma, hk, k_start + start_n, 0], kv_bar,
                                    k_smem.index(0))
    if QK_SPLIT > 0:
        tma.async_copy_global_to_shared(k2_desc, [b_tma, hk, k_start + start_n, split_col],
                                        kv_bar, k2_smem)
    tma.async_copy_global_to_shared(v_desc, [b_tma, hk, k_start + start_n, 0], kv_bar,
                                    v_smem.index(0))
    _query_tile_loads(
        q_desc, do_desc, stats_desc, bias_desc, q_smem, do_smem, lse_smem, delta_smem,
        bias_smem, q_ready, do_ready, q_empty, do_empty, b_tma, hk, q_start, stats_start,
        GROUP, bias_b, bias_heads, start_n, lo, n_tiles, q2_desc, q2_smem, BLOCK_M, STAGES,
        HAS_BIAS, QK_SPLIT, rot, ROTATE, step, first)  # fmt: skip


@gluon.jit
def _query_tile_loads(
    q_desc, do_desc, stats_desc, bias_desc, q_smem, do_smem, lse_smem, delta_smem, bias_smem,
    q_ready, do_ready, q_empty, do_empty, b_tma, hk, q_start, stats_start, GROUP, bias_b,
    bias_heads, start_n, lo, n_tiles, q2_desc, q2_smem, BLOCK_M: gl.constexpr,
    STAGES: gl.constexpr, HAS_BIAS: gl.constexpr, QK_SPLIT: gl.constexpr, rot=0,
    ROTATE: gl.constexpr = False, step=0, first=0, end=-1,
):  # fmt: skip
    """The load warp's Q (with its rows' lse, the bias tile and Q's last QK_SPLIT
    columns) and dO (with delta) tiles for one key block, every query head of the group,
    into their rings (_bwd_load_partition's arguments): tiles [first, end), end -1 the
    block's last."""
    split_col: gl.constexpr = q_desc.block_type.shape[3]
    if end < 0:
        end = GROUP * n_tiles
    for t in range(first, end):
        h, start_m = _query_tile(t, hk, GROUP, lo, n_tiles, BLOCK_M, rot, ROTATE)
        i = step + t
        row = q_start + start_m
        # Q's and dO's tiles differ where Dqk != Dv: each barrier expects its own bytes.
        q_bytes: gl.constexpr = q_desc.block_type.nbytes + stats_desc.block_type.nbytes + (
            bias_desc.block_type.nbytes if HAS_BIAS else 0) + (
            q2_desc.block_type.nbytes if QK_SPLIT > 0 else 0)
        do_bytes: gl.constexpr = do_desc.block_type.nbytes + stats_desc.block_type.nbytes
        slot = hopper.claim(q_ready, q_empty, i, q_bytes, STAGES)
        tma.async_copy_global_to_shared(q_desc, [b_tma, h, row, 0], q_ready.index(slot),
                                        q_smem.index(slot))
        if QK_SPLIT > 0:
            tma.async_copy_global_to_shared(q2_desc, [b_tma, h, row, split_col],
                                            q_ready.index(slot), q2_smem.index(slot))
        tma.async_copy_global_to_shared(stats_desc, [0, b_tma, h, stats_start + start_m],
                                        q_ready.index(slot), lse_smem.index(slot))
        if HAS_BIAS:  # indexed by positions inside the sequence
            tma.async_copy_global_to_shared(bias_desc, [bias_b, h % bias_heads, start_m, start_n],
                                            q_ready.index(slot), bias_smem.index(slot))
        slot = hopper.claim(do_ready, do_empty, i, do_bytes, STAGES)
        tma.async_copy_global_to_shared(do_desc, [b_tma, h, row, 0], do_ready.index(slot),
                                        do_smem.index(slot))
        tma.async_copy_global_to_shared(stats_desc, [1, b_tma, h, stats_start + start_m],
                                        do_ready.index(slot), delta_smem.index(slot))


@gluon.jit
def _bwd_blocks_load_partition(
    loads, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
    HAS_BIAS: gl.constexpr, IS_VARLEN: gl.constexpr, BOTTOM_RIGHT: gl.constexpr,
    BOUNDED_LEFT: gl.constexpr, BOUNDED_RIGHT: gl.constexpr, BATCH_INNER: gl.constexpr,
    HEAD_INNER: gl.constexpr, ORDERED: gl.constexpr, ROTATE: gl.constexpr,
    PERSISTENT: gl.constexpr, FOLD: gl.constexpr,
):  # fmt: skip
    """_bwd_sm90_kernel's load warp: _bwd_load_partition's loads for each of the
    program's key blocks (_program_block), each block's K and V once the compute
    warpgroups are done with the last block's (kv_empty), while they store its dK and
    dV; the Q and dO rings run on from block to block. ``loads``: its runtime
    arguments (``blocks``: _program_block's)."""
    (q_desc, do_desc, k_desc, v_desc, stats_desc, bias_desc, q_smem, do_smem, k_smem, v_smem,
     lse_smem, delta_smem, bias_smem, kv_bar, kv_empty, q_ready, do_ready, q_empty, do_empty,
     GROUP, bias_batches, bias_heads, blocks, n_items) = loads
    step = gl.to_tensor(0)
    for j in range(n_items):
        b, hk, start_n, q_start, k_start, _, seqlen_k, _, lo, _, _, n_tiles = _program_block(
            j, blocks, BLOCK_M, BLOCK_N, IS_VARLEN, BOTTOM_RIGHT, BOUNDED_LEFT, BOUNDED_RIGHT,
            BATCH_INNER, HEAD_INNER, ORDERED, PERSISTENT, FOLD)  # fmt: skip
        b_tma = b
        stats_start = 0
        if IS_VARLEN:  # one batch of all tokens; row statistics from packed_stats_start
            b_tma = 0
            stats_start = packed_stats_start(q_start, b)
        rot = _walk_rotation(start_n, n_tiles, seqlen_k, BLOCK_N, ROTATE)
        first = 0
        if overlaps_block_ends(FOLD, BLOCK_M):  # the block's first Q and dO tiles, whose
            # slots free before the last block's K and V do
            first = gl.minimum(GROUP * n_tiles, 1)
            _query_tile_loads(
                q_desc, do_desc, stats_desc, bias_desc, q_smem, do_smem, lse_smem, delta_smem,
                bias_smem, q_ready, do_ready, q_empty, do_empty, b_tma, hk, q_start,
                stats_start, GROUP, b % bias_batches, bias_heads, start_n, lo, n_tiles,
                q_desc, q_smem, BLOCK_M, STAGES, HAS_BIAS, 0, rot, ROTATE, step, 0,
                first)  # fmt: skip
        mbarrier.wait(kv_empty, (j & 1) ^ 1, pred=j > 0)
        _bwd_load_partition(
            q_desc, do_desc, k_desc, v_desc, stats_desc, bias_desc, q_smem, do_smem, k_smem,
            v_smem, lse_smem, delta_smem, bias_smem, kv_bar, q_ready, do_ready, q_empty,
            do_empty, b_tma, hk, q_start, k_start, stats_start, GROUP, b % bias_batches,
            bias_heads, start_n, lo, n_tiles, q_desc, k_desc, q_smem, k_smem, BLOCK_M, STAGES,
            HAS_BIAS, 0, rot, ROTATE, step, first)  # fmt: skip
        step += GROUP * n_tiles


@gluon.jit
def _program_block(
    j, blocks, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, IS_VARLEN: gl.constexpr,
    BOTTOM_RIGHT: gl.constexpr, BOUNDED_LEFT: gl.constexpr, BOUNDED_RIGHT: gl.constexpr,
    BATCH_INNER: gl.constexpr, HEAD_INNER: gl.constexpr, DESCENDING: gl.constexpr,
    PERSISTENT: gl.constexpr, FOLD: gl.constexpr,
):  # fmt: skip
    """_key_block's tuple for this program's j-th key block: the grid item of its own,
    or PERSISTENT, the j-th of hopper.work_item's strides over (batch, kv head) x key
    blocks (rank 0 a head's first block, the most work under a causal mask; FOLD: in
    pairs of equal work). ``blocks``: (pid, programs, HKV, CuSeqQ, CuSeqK, seqlen_q,
    seqlen_k, num_n_blocks, window_left, window_right). Every partition walks the same
    blocks."""
    (pid, programs, HKV, CuSeqQ, CuSeqK, seqlen_q, seqlen_k, num_n_blocks, window_left,
     window_right) = blocks
    item = pid
    if PERSISTENT:
        head, rank = hopper.work_item(pid, j, programs, num_n_blocks, FOLD)
        item = head * num_n_blocks + rank
    return _key_block(item, HKV, CuSeqQ, CuSeqK, seqlen_q, seqlen_k, num_n_blocks, window_left,
                      window_right, BLOCK_M, BLOCK_N, IS_VARLEN, BOTTOM_RIGHT, BOUNDED_LEFT,
                      BOUNDED_RIGHT, BATCH_INNER, HEAD_INNER, DESCENDING and BOUNDED_RIGHT)


@gluon.jit
def _visible_t(keys, start_m, seqlen_q, seqlen_k, off, window_left, window_right,
               BLOCK_M: gl.constexpr, BOUNDED_LEFT: gl.constexpr, BOUNDED_RIGHT: gl.constexpr,
               layout: gl.constexpr):  # fmt: skip
    """common.visible for a (keys, queries) tile of queries [start_m, + BLOCK_M), the
    query existing too. At 64 rows a step each key's range of visible query columns
    comes first, so that a score is two compares of its column, a constant, against
    its row's bounds: common.visible holds each column's bounds per thread and ptxas
    keeps a select per condition (the masked tile's code at D=128: 181 -> 136
    instructions causal, 261 -> 168 in a window; H100 window1024 causal backward 354 ->
    364). At 128 rows (D=64) the per-key bounds spill more (causal 104 -> 128 bytes) and
    did not pay (D64 S4096 causal 427 -> 422), so common.visible stays there."""
    if BLOCK_M == 128:
        queries = start_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, layout))
        mask = visible(queries[None, :], keys[:, None], seqlen_k, off, window_left,
                       window_right, BOUNDED_LEFT, BOUNDED_RIGHT)
        return mask & (queries < seqlen_q)[None, :]
    cols = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, layout))
    diag = keys - off - start_m  # query column of the key's diagonal
    first = gl.zeros_like(keys)
    if BOUNDED_RIGHT:  # j <= i + off + right  <=>  i >= j - off - right
        first = diag - window_right
    last = gl.zeros_like(keys) + (seqlen_q - 1 - start_m)
    if BOUNDED_LEFT:  # j >= i + off - left  <=>  i <= j - off + left
        last = gl.minimum(last, diag + window_left)
    last = gl.where(keys < seqlen_k, last, -1)
    return (cols[None, :] >= first[:, None]) & (cols[None, :] <= last[:, None])


@gluon.jit
def _runtime_zero(seqlen_k):
    """0 at run time (no length is negative), which neither LLVM nor ptxas can fold: a
    view of shared memory indexed by it times the step count is made anew in each step
    (_kv_views)."""
    return (seqlen_k < 0).to(gl.int32)


@gluon.jit
def _kv_views(k_smem, v_smem, index, HALF: gl.constexpr, HALF_N: gl.constexpr,
              DQ_COLS: gl.constexpr):
    """This warpgroup's keys of K (Sᵀ's operand) and of V (dPᵀ's), and K's columns of
    dQ's part, from the block's K and V buffers viewed at ``index`` (their only slot).
    Made in each step with an index the compilers cannot fold (0 at run time:
    KV_VIEWS_PER_STEP), the views' wgmma descriptors are worked out there in the
    uniform datapath; made once a program, ptxas hoists them (twenty at D=128) out of
    the step loop and keeps them in vector registers (moved to uniform ones before each
    wgmma), which spill where the step holds more."""
    block_n: gl.constexpr = k_smem.shape[3]  # buffers of (1, 1, 1, BLOCK_N, D)
    k_all = k_smem.index(index).reshape([block_n, k_smem.shape[4]])
    k_half = k_all.slice(HALF * HALF_N, HALF_N, dim=0)
    v_half = v_smem.index(index).reshape([block_n, v_smem.shape[4]]).slice(HALF * HALF_N,
                                                                           HALF_N, dim=0)
    k_cols = k_all.slice(HALF * DQ_COLS % k_smem.shape[4], DQ_COLS, dim=1)  # dQ's columns
    return k_half, v_half, k_cols


@gluon.jit
def _bwd_compute_partition(
    shared, HALF: gl.constexpr, HEAD_DIM_QK: gl.constexpr, HEAD_DIM_V: gl.constexpr,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, HAS_BIAS: gl.constexpr,
    DBIAS_TILES: gl.constexpr, DBIAS_SUM: gl.constexpr, BIAS_ROW: gl.constexpr,
    DBIAS_ROW: gl.constexpr, HAS_ALIBI: gl.constexpr, HAS_DROPOUT: gl.constexpr,
    BOUNDED_LEFT: gl.constexpr, BOUNDED_RIGHT: gl.constexpr, DQ_BUFS: gl.constexpr,
    ROTATE: gl.constexpr, IS_VARLEN: gl.constexpr, BOTTOM_RIGHT: gl.constexpr,
    BATCH_INNER: gl.constexpr, HEAD_INNER: gl.constexpr, ORDERED: gl.constexpr,
    PERSISTENT: gl.constexpr, FOLD: gl.constexpr, HAS_DQ: gl.constexpr,
    HAS_SOFTCAP: gl.constexpr,
    KV_VIEWS_PER_STEP: gl.constexpr, IDLE_KEYS: gl.constexpr,
):  # fmt: skip
    """One warpgroup, for each of its program's key blocks (_program_block): keys
    [start_n + HALF * 64, + 64) against every query tile. ``shared``: the runtime
    arguments both take (_bwd_sm90_kernel builds the tuple). DQ_BUFS: 0, this warpgroup
    sends its dQ tiles itself; else it leaves them in that many buffers for the dQ
    writer warp. HAS_DQ off (dq_from_full_bias): no dQ here, the two warpgroups never
    meet. ROTATE: _query_tile's. Once a block's last tile is done, K and V go
    back to the load warp (the next block's load while this one's dK and dV leave), and
    dK and dV leave by TMA store through this warpgroup's dQ buffer; a packed
    sequence's block that ends past the sequence's keys by plain stores (a TMA store
    clips at the packed tensor's end, not the sequence's). HAS_SOFTCAP: the scores
    capped first (common.capped_score_log2), dK and dQ through tanh's derivative; a bias
    gradient leaves before it (by tiles through this warpgroup's dQ buffer, where dS's
    holds dK's and dQ's)."""
    (dq_desc, dbias_desc, dk_desc, dv_desc, DK, DV, stride_kb, stride_kn, stride_kh, stride_vb,
     stride_vn, stride_vh, q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem, bias_smem,
     ds_smem, dq_smem, dsum_smem, dq_full, dq_empty, kv_bar, kv_empty, q_ready, do_ready,
     q_empty, do_empty, ds_bar, blocks, n_items, GROUP, scale, window_left, window_right,
     seed, rng_offset, heads, dropout_p, Alibi, stride_ab, stride_ah, BiasRow, stride_rb,
     stride_rh, stride_rn, bias_batches, bias_heads, DBiasRow, stride_pb, stride_ph,
     softcap) = shared
    dtype: gl.constexpr = k_smem.dtype
    HALF_N: gl.constexpr = BLOCK_N // 2
    DQ_ROWS: gl.constexpr = dq_split(HEAD_DIM_QK, BLOCK_M)[0]  # dQ's part made here
    DQ_COLS: gl.constexpr = dq_split(HEAD_DIM_QK, BLOCK_M)[1]
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_M, 16])
    dk_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM_QK, 16])
    dv_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM_V, 16])
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, DQ_COLS, 16])
    ds_op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=dk_layout,
                                                     k_width=2)
    p_op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=dv_layout,
                                                    k_width=2)
    cols_layout: gl.constexpr = gl.SliceLayout(0, s_layout)

    k_half, v_half, k_cols = _kv_views(k_smem, v_smem, 0, HALF, HALF_N, DQ_COLS)
    scale_log2 = scale * LOG2E
    # Bulk copies (TMA) a step may leave in flight when dQ's tile is written: the bias
    # gradient's store or reduce-add from dS's tile (DBIAS_TILES: 1 stored, 2 added), or
    # the fp32 reduce-add from a buffer of its own.
    # (With softcap, a bias gradient by tiles leaves from dQ's buffer: RAW_DS_IN_DQ.)
    RAW_DS_IN_DQ: gl.constexpr = HAS_SOFTCAP and DBIAS_TILES > 0
    OTHER_BULK: gl.constexpr = 1 if ((DBIAS_TILES > 0 and not RAW_DS_IN_DQ)
                                     or (DBIAS_SUM and HEAD_DIM_QK != BLOCK_N)) else 0
    # dK and dV leave through one of this warpgroup's dQ buffers: both at once where they
    # fit (D=64 at 128 rows), else one after the other.
    TOGETHER: gl.constexpr = (HEAD_DIM_QK == HEAD_DIM_V and 2 * dk_desc.block_type.nbytes
                              <= dq_desc.block_type.nbytes)  # fmt: skip
    # dV's tile where it fits the buffer, else (V wider than q·k: 64/128) by plain stores
    DV_STAGED: gl.constexpr = dv_desc.block_type.nbytes <= DQ_ROWS * DQ_COLS * 4
    OVERLAP_ENDS: gl.constexpr = overlaps_block_ends(FOLD, BLOCK_M)
    KEEP_IN_DS: gl.constexpr = keeps_bits_in_shared(HAS_DROPOUT, HAS_BIAS, HEAD_DIM_QK,
                                                    HEAD_DIM_V)
    # A dense gradient stored whole under a mask: the tiles no query of a block sees get
    # their zeros here, not from a pass over the gradient (bias_grad_tiles' ZERO_UNSEEN).
    ZERO_UNSEEN_TILES: gl.constexpr = (DBIAS_TILES == 1 and not IS_VARLEN
                                       and (BOUNDED_LEFT or BOUNDED_RIGHT))
    # A last block whose second half of keys lies past the sequence (IDLE_KEYS): the
    # second warpgroup does no more than the first one's dQ needs (_idle_steps), so
    # that the first one's wgmmas have the tensor cores to themselves.
    IDLE_HALF: gl.constexpr = (IDLE_KEYS and HALF == 1 and HAS_DQ and DBIAS_TILES == 0
                               and not DBIAS_SUM and not DBIAS_ROW and not OVERLAP_ENDS)
    # The rings' tiles before this block's (dS's and dQ's buffers go by them too)
    step = gl.to_tensor(0)

    for blk in range(n_items):
        (b, hk, start_n, q_start, k_start, seqlen_q, seqlen_k, off, lo, full_lo, full_hi,
         n_tiles) = _program_block(
            blk, blocks, BLOCK_M, BLOCK_N, IS_VARLEN, BOTTOM_RIGHT, BOUNDED_LEFT, BOUNDED_RIGHT,
            BATCH_INNER, HEAD_INNER, ORDERED, PERSISTENT, FOLD)  # fmt: skip
        b_tma = b
        if IS_VARLEN:  # packed sequences: one batch of all tokens to TMA
            b_tma = 0
        row0 = start_n + HALF * HALF_N
        offs_n = row0 + gl.arange(0, HALF_N, layout=gl.SliceLayout(1, s_layout))
        dk = gl.zeros([HALF_N, HEAD_DIM_QK], gl.float32, layout=dk_layout)
        dv = gl.zeros([HALF_N, HEAD_DIM_V], gl.float32, layout=dv_layout)
        if DBIAS_ROW:  # this query head's dS summed over its query tiles so far
            db_row = gl.zeros([HALF_N], gl.float32, layout=gl.SliceLayout(1, s_layout))
        bias_b = (b % bias_batches).to(gl.int64)  # 0 where the bias broadcasts over batches
        rot = _walk_rotation(start_n, n_tiles, seqlen_k, BLOCK_N, ROTATE)
        mbarrier.wait(kv_bar, blk & 1)

        zero = _runtime_zero(seqlen_k)
        busy_steps = GROUP * n_tiles
        if IDLE_HALF:
            if row0 >= seqlen_k:
                busy_steps = 0
        for t in range(busy_steps):
            i = step + t  # the rings' count
            if KV_VIEWS_PER_STEP:
                k_half, v_half, k_cols = _kv_views(k_smem, v_smem, zero * t, HALF, HALF_N,
                                                   DQ_COLS)
            h, start_m = _query_tile(t, hk, GROUP, lo, n_tiles, BLOCK_M, rot, ROTATE)
            offs_m = start_m + gl.arange(0, BLOCK_M, layout=cols_layout)
            slot = hopper.arrived(q_ready, i, STAGES)
            q = q_smem.index(slot).reshape([BLOCK_M, HEAD_DIM_QK])
            # Zero accumulators made here, not held across the loop: registers are short.
            s_init = gl.zeros([HALF_N, BLOCK_M], gl.float32, layout=s_layout)
            s = warpgroup_mma(k_half, q.permute((1, 0)), s_init, use_acc=False, is_async=True)
            hopper.arrived(do_ready, i, STAGES)
            do = do_smem.index(slot).reshape([BLOCK_M, HEAD_DIM_V])
            dp = warpgroup_mma(v_half, do.permute((1, 0)), s_init, use_acc=False, is_async=True)
            if KEEP_IN_DS:  # the keep bits through this step's dS buffer (two steps
                # ago's, read), before dS: its bias gradient copy then (or the unseen
                # tiles' zeros) has read it
                if DBIAS_TILES > 0 and not HAS_DQ:
                    tma.store_wait(1)
                gl.thread_barrier()
                scratch = hopper.keep_scratch(ds_smem.index((i % 2) * 2 + HALF), 0,
                                              BLOCK_M, HALF_N, True)
                hopper.stage_keep(seed, rng_offset, b * heads + h, start_m, row0, BLOCK_M,
                                  HALF_N, True, scratch)
                gl.thread_barrier()  # read back where used: not held in registers
            elif HAS_DROPOUT:  # Philox's integer work runs while the tensor cores do S and dP
                keep = hopper.dropout_keep(seed, rng_offset, b * heads + h, start_m, row0,
                                           BLOCK_M, HALF_N, True)
            if BIAS_ROW:  # this half's keys of a bias constant along queries, this head's
                row_ptrs = (BiasRow + bias_b * stride_rb + (h % bias_heads).to(gl.int64) * stride_rh
                            + offs_n.to(gl.int64) * stride_rn)
                bias_row = gl.load(row_ptrs, mask=offs_n < seqlen_k, other=0.0)
            s = warpgroup_mma_wait(1, deps=(s,))

            p_scale = scale_log2
            if HAS_SOFTCAP:  # log2 units from here, as the forwards' scores; tanh's
                # derivative kept in dS's dtype until dS (its 32 fp32 registers a thread
                # across dP's wait spilled 340-510 bytes at D=128), where dS is rounded so
                t_cap = tanh(s * (scale / softcap), True)  # 16-bit inputs
                s = t_cap * (softcap * LOG2E)
                cap_slope = (1.0 - t_cap * t_cap).to(dtype)
                p_scale = 1.0
            if HAS_BIAS or BIAS_ROW or HAS_ALIBI:  # the scale goes in first, as in the forward
                bias = 0.0
                if HAS_BIAS:  # this half's keys of the (queries, keys) tile, transposed
                    bias = (bias_smem.index(slot).reshape([BLOCK_M, BLOCK_N])
                            .slice(HALF * HALF_N, HALF_N, dim=1).permute((1, 0)).load(s_layout))
                    bias = bias.to(gl.float32)
                if BIAS_ROW:
                    bias = bias_row.to(gl.float32)[:, None]
                slope = 0.0
                if HAS_ALIBI:  # this query head's
                    slope = gl.load(Alibi + b.to(gl.int64) * stride_ab + h.to(gl.int64) * stride_ah)
                s = add_bias_alibi_log2(s * p_scale, offs_m[None, :], offs_n[:, None], off,
                                        slope, bias, HAS_BIAS or BIAS_ROW, HAS_ALIBI)
                p_scale = 1.0
            lse2 = lse_smem.index(slot).reshape([BLOCK_M]).load(cols_layout)
            if (start_m < full_lo) | (start_m >= full_hi):
                # Rows past Sq: zeros by TMA in a dense batch, the next sequence's in a
                # packed one; either way no query.
                mask = _visible_t(offs_n, start_m, seqlen_q, seqlen_k, off, window_left,
                                  window_right, BLOCK_M, BOUNDED_LEFT, BOUNDED_RIGHT,
                                  s_layout)  # fmt: skip
                s = gl.where(mask, s, float("-inf"))
            p = gl.exp2(s * p_scale - lse2[None, :])
            dp = warpgroup_mma_wait(0, deps=(dp,))
            delta = delta_smem.index(slot).reshape([BLOCK_M]).load(cols_layout)
            p_kept = p
            if HAS_DROPOUT:  # dP Z / (1 - p) (the scale in dS's FFMA); dV takes its
                # 1 / (1 - p) at the end
                if KEEP_IN_DS:
                    keep = hopper.staged_keep(scratch)
                    gl.thread_barrier()  # every warp has its words before dS is stored
                dp = hopper.dropped(dp, keep, dropout_p) * (1.0 / (1.0 - dropout_p))
                p_kept = hopper.dropped(p, keep, dropout_p)
            ds = p * (dp - delta[None, :])  # the bias gradient; dK, dQ take the scale later
            if HAS_SOFTCAP:  # the bias gradient out before tanh's derivative, which dK's
                # and dQ's dS carry: d(softcap * tanh(x / softcap)) / dx
                if DBIAS_SUM:
                    _store_transposed(ds, dsum_smem.index(HALF), dbias_desc,
                                      [b % bias_batches, h % bias_heads, start_m, row0], True)
                if RAW_DS_IN_DQ:  # its tile through this warpgroup's dQ buffer (free once
                    # its last reduce-add has read it; dQ's write waits for this copy)
                    _store_transposed(ds, dq_smem.index(HALF), dbias_desc,
                                      [b if DBIAS_TILES == 1 else 0, h, start_m, row0],
                                      DBIAS_TILES == 2)  # fmt: skip
            if DBIAS_ROW:  # summed over queries; stored once per query head, its last tile
                db_row += gl.sum(ds, 1)
                head_done = t % n_tiles == n_tiles - 1
                if head_done:
                    gl.store(DBiasRow + b.to(gl.int64) * stride_pb + h.to(gl.int64) * stride_ph
                             + offs_n, db_row, mask=offs_n < seqlen_k)
                db_row = gl.where(head_done, 0.0, db_row)
            if HAS_SOFTCAP:
                ds = ds * cap_slope.to(gl.float32)

            p_op = gl.convert_layout(p_kept.to(dtype), p_op_layout)
            dv = warpgroup_mma(p_op, do, dv, is_async=True)
            ds_lo = ds.to(dtype)
            if DBIAS_SUM and not HAS_SOFTCAP:  # a bias broadcast over batch or heads: dS
                # added into its fp32 gradient by TMA reduce-add, as dQ is (several (b, h)
                # add to each tile)
                _store_transposed(ds, dsum_smem.index(HALF), dbias_desc,
                                  [b % bias_batches, h % bias_heads, start_m, row0], True)
            ds_op = gl.convert_layout(ds_lo, ds_op_layout)

            # dS to shared memory as (queries, keys), each warpgroup its half of the keys;
            # once both halves are there, dQ's columns of this half: dS K summed over halves.
            ds_pair = (i % 2) * 2
            ds_own = ds_smem.index(ds_pair + HALF)
            if not HAS_DQ and not KEEP_IN_DS:  # the bias gradient's store two steps ago
                tma.store_wait(1)  # has read this buffer (where dQ's are, its write waits
                # so: OTHER_BULK; KEEP_IN_DS waited before the keep bits)
                gl.thread_barrier()
            ds_own.reshape([BLOCK_M, HALF_N]).permute((1, 0)).store(ds_lo)
            fence_async_shared()
            if DBIAS_TILES == 1 and not HAS_SOFTCAP:  # the bias gradient is dS: this half's
                # tile goes straight out
                tma.async_copy_shared_to_global(dbias_desc, [b, h, start_m, row0], ds_own)
            if DBIAS_TILES == 2 and not HAS_SOFTCAP:  # a bias the packed sequences share:
                # added in, as it is
                hopper.tma_reduce_add(dbias_desc, [0, h, start_m, row0], ds_own)
            if HAS_DQ:
                mbarrier.arrive(ds_bar)
                mbarrier.wait(ds_bar, i & 1)
                dq = gl.zeros([DQ_ROWS, DQ_COLS], gl.float32, layout=dq_layout)
                for j in gl.static_range(2):
                    ds_rows = ds_smem.index(ds_pair + j).reshape([BLOCK_M, HALF_N]).slice(
                        HALF * DQ_ROWS % BLOCK_M, DQ_ROWS, dim=0)
                    dq = warpgroup_mma(ds_rows, k_cols.slice(j * HALF_N, HALF_N, dim=0), dq,
                                       use_acc=j > 0, is_async=True)
            # dK's wgmma last: it runs while dQ goes to shared memory and out (FA4's order)
            dk = warpgroup_mma(ds_op, q, dk, is_async=True)
            if HAS_DQ:
                dv, dq, p_op = warpgroup_mma_wait(1, deps=(dv, dq, p_op))
            else:
                dv, p_op = warpgroup_mma_wait(1, deps=(dv, p_op))
            mbarrier.arrive(do_empty.index(slot))
            if OVERLAP_ENDS and t == GROUP * n_tiles - 1:
                mbarrier.arrive(kv_empty)  # dQ's was the last wgmma to read K or V

            if HAS_DQ:
                _send_dq(dq, dq_smem, dq_full, dq_empty, dq_desc, i, t, b, b_tma, h, q_start,
                         start_m, HALF, BLOCK_M, DQ_BUFS, OTHER_BULK, OVERLAP_ENDS,
                         IS_VARLEN)  # fmt: skip
            dk, ds_op = warpgroup_mma_wait(0, deps=(dk, ds_op))
            mbarrier.arrive(q_empty.index(slot))

        if IDLE_HALF:
            if busy_steps == 0:
                _idle_steps(dq_desc, q_ready, do_ready, q_empty, do_empty, ds_smem, ds_bar,
                            dq_smem, dq_full, dq_empty, k_cols, step, GROUP, n_tiles, b, b_tma,
                            hk, q_start, lo, rot, HEAD_DIM_QK, BLOCK_M, BLOCK_N, STAGES,
                            DQ_BUFS, OTHER_BULK, ROTATE, IS_VARLEN)  # fmt: skip
        if ZERO_UNSEEN_TILES:  # through this warpgroup's dS buffer of the other pair
            free = ds_smem.index((step + GROUP * n_tiles) % 2 * 2 + HALF)
            _zero_unseen_ds_tiles(dbias_desc, free, b, hk, GROUP, row0, seqlen_q, lo, n_tiles,
                                  BLOCK_M, HALF_N)  # fmt: skip
        step += GROUP * n_tiles
        if not OVERLAP_ENDS or n_tiles == 0:  # done with K and V: the next block's
            mbarrier.arrive(kv_empty)  # may load
        tma.store_wait(0)  # the last dQ (and bias gradient) copies have read their buffers

        if HAS_DROPOUT:
            dv = dv * (1.0 / (1.0 - dropout_p))
        dk_out = (dk * scale).to(dtype)
        dv_out = dv.to(dtype)
        if IS_VARLEN and row0 + HALF_N > seqlen_k:
            _store_rows(dk_out, DK + k_start.to(gl.int64) * stride_kn, b, hk, stride_kb,
                        stride_kn, stride_kh, seqlen_k,
                        row0 + gl.arange(0, HALF_N, layout=gl.SliceLayout(1, dk_layout)),
                        gl.arange(0, HEAD_DIM_QK, layout=gl.SliceLayout(0, dk_layout)),
                        dk_desc.shape[3])  # fmt: skip
            _store_rows(dv_out, DV + k_start.to(gl.int64) * stride_vn, b, hk, stride_vb,
                        stride_vn, stride_vh, seqlen_k,
                        row0 + gl.arange(0, HALF_N, layout=gl.SliceLayout(1, dv_layout)),
                        gl.arange(0, HEAD_DIM_V, layout=gl.SliceLayout(0, dv_layout)),
                        dv_desc.shape[3])  # fmt: skip
        else:  # the TMA store clips a dense batch's keys past Sk
            if DQ_BUFS > 0:  # the writer warp has read the buffer's last dQ tile
                if OVERLAP_ENDS:  # the buffer of the next block's first dQ tile
                    last = step - DQ_BUFS
                    stage_slot = HALF * DQ_BUFS + step % DQ_BUFS
                else:  # the first, once the block's last tile has been read
                    last = step - 1
                    stage_slot = HALF * DQ_BUFS
                mbarrier.wait(dq_empty.index(HALF * DQ_BUFS + last % DQ_BUFS),
                              (last // DQ_BUFS) & 1, pred=last >= 0)
                stage = dq_smem.index(stage_slot)
            else:
                stage = dq_smem.index(HALF)
            rows = [b_tma, hk, k_start + row0, 0]
            if TOGETHER:
                pair = stage._reinterpret(dtype, [2] + dk_desc.block_type.shape, dk_desc.layout)
                _store_by_tma(dk_out, pair.index(0), dk_desc, rows)
                _store_by_tma(dv_out, pair.index(1), dv_desc, rows)
            else:
                _store_by_tma(dk_out, stage._reinterpret(dtype, dk_desc.block_type.shape,
                                                         dk_desc.layout), dk_desc, rows)
                if DV_STAGED:
                    tma.store_wait(0)
                    gl.thread_barrier()
                    _store_by_tma(dv_out, stage._reinterpret(dtype, dv_desc.block_type.shape,
                                                             dv_desc.layout), dv_desc, rows)
                else:
                    _store_rows(
                        dv_out, DV + k_start.to(gl.int64) * stride_vn, b, hk, stride_vb,
                        stride_vn, stride_vh, seqlen_k,
                        row0 + gl.arange(0, HALF_N, layout=gl.SliceLayout(1, dv_layout)),
                        gl.arange(0, HEAD_DIM_V, layout=gl.SliceLayout(0, dv_layout)),
                        dv_desc.shape[3])  # fmt: skip
            if DQ_BUFS == 0 or not OVERLAP_ENDS:
                tma.store_wait(0)  # before the buffer's next dQ tile
    if OVERLAP_ENDS:  # the last block's stores have read shared memory
        tma.store_wait(0)


@gluon.jit
def _idle_steps(
    dq_desc, q_ready, do_ready, q_empty, do_empty, ds_smem, ds_bar, dq_smem, dq_full,
    dq_empty, k_cols, step, GROUP, n_tiles, b, b_tma, hk, q_start, lo, rot,
    HEAD_DIM_QK: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr, DQ_BUFS: gl.constexpr, OTHER_BULK: gl.constexpr,
    ROTATE: gl.constexpr, IS_VARLEN: gl.constexpr,
):  # fmt: skip
    """The second compute warpgroup's steps (GROUP * n_tiles, the rings' count at
    ``step``) of a block whose second half of keys lies past its sequence (every P there
    is 0): its half of dS as zeros for the other warpgroup's dQ, its own part of dQ from
    the first half's dS alone, and the rings' slots released, with no S, dP, dV or dK
    (dK and dV stay zero; their rows are past the sequence, where stores skip or clip
    them). The buffers and barriers: _bwd_compute_partition's."""
    HALF: gl.constexpr = 1
    HALF_N: gl.constexpr = BLOCK_N // 2
    DQ_ROWS: gl.constexpr = dq_split(HEAD_DIM_QK, BLOCK_M)[0]
    DQ_COLS: gl.constexpr = dq_split(HEAD_DIM_QK, BLOCK_M)[1]
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_M, 16])
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, DQ_COLS, 16])
    for t in range(GROUP * n_tiles):
        i = step + t
        h, start_m = _query_tile(t, hk, GROUP, lo, n_tiles, BLOCK_M, rot, ROTATE)
        slot = hopper.arrived(q_ready, i, STAGES)
        hopper.arrived(do_ready, i, STAGES)
        ds_pair = (i % 2) * 2
        ds_smem.index(ds_pair + HALF).reshape([BLOCK_M, HALF_N]).permute((1, 0)).store(
            gl.zeros([HALF_N, BLOCK_M], ds_smem.dtype, layout=s_layout))
        fence_async_shared()
        mbarrier.arrive(ds_bar)
        mbarrier.wait(ds_bar, i & 1)
        ds_rows = ds_smem.index(ds_pair).reshape([BLOCK_M, HALF_N]).slice(
            HALF * DQ_ROWS % BLOCK_M, DQ_ROWS, dim=0)
        dq = warpgroup_mma(ds_rows, k_cols.slice(0, HALF_N, dim=0),
                           gl.zeros([DQ_ROWS, DQ_COLS], gl.float32, layout=dq_layout),
                           use_acc=False, is_async=True)
        dq = warpgroup_mma_wait(0, deps=(dq,))
        mbarrier.arrive(do_empty.index(slot))
        _send_dq(dq, dq_smem, dq_full, dq_empty, dq_desc, i, t, b, b_tma, h, q_start, start_m,
                 HALF, BLOCK_M, DQ_BUFS, OTHER_BULK, False, IS_VARLEN)  # fmt: skip
        mbarrier.arrive(q_empty.index(slot))


@gluon.jit
def _send_dq(dq, dq_smem, dq_full, dq_empty, dq_desc, i, t, b, b_tma, h, q_start, start_m,
             HALF: gl.constexpr, BLOCK_M: gl.constexpr, DQ_BUFS: gl.constexpr,
             OTHER_BULK: gl.constexpr, OVERLAP_ENDS: gl.constexpr,
             IS_VARLEN: gl.constexpr):  # fmt: skip
    """A compute warpgroup's part of step i's dQ tile (the block's step t) out: into a
    buffer the writer warp has read, for it to send (DQ_BUFS), else by this warpgroup's
    own reduce-add into the fp32 buffer. OTHER_BULK: copies the step may leave in flight
    (_bwd_compute_partition's)."""
    DQ_ROWS: gl.constexpr = dq.shape[0]
    DQ_COLS: gl.constexpr = dq.shape[1]
    # dQ's tile goes to shared memory, and out, in its registers' order (dq_tiles)
    dq_order: gl.constexpr = hopper.accumulator_order(DQ_ROWS, DQ_COLS)
    if DQ_BUFS > 0:
        dq_slot = HALF * DQ_BUFS + i % DQ_BUFS
        mbarrier.wait(dq_empty.index(dq_slot), ((i // DQ_BUFS) & 1) ^ 1, pred=i >= DQ_BUFS)
        if OVERLAP_ENDS:
            if t == 0:  # the last block's dK and dV stores have read this buffer
                tma.store_wait(0)
                gl.thread_barrier()
        dq_smem.index(dq_slot)._reinterpret(gl.float32, [DQ_ROWS, DQ_COLS],
                                            dq_order).store(dq)
        fence_async_shared()
        mbarrier.arrive(dq_full.index(dq_slot))
    else:
        # The last dQ reduce has read dq_smem (one thread issued it; this step's bias
        # gradient copy, issued after it, may still run where it reads another buffer).
        tma.store_wait(OTHER_BULK)
        gl.thread_barrier()
        dq_buf = dq_smem.index(HALF)
        dq_buf._reinterpret(gl.float32, [DQ_ROWS, DQ_COLS], dq_order).store(dq)
        fence_async_shared()
        dq_row = _dq_tile_row(b, q_start, start_m, HALF, BLOCK_M, dq_desc.block_type.shape[2],
                              2, IS_VARLEN)  # fmt: skip
        hopper.tma_reduce_add(dq_desc, [b_tma, h, dq_row, 0], dq_buf)


@gluon.jit
def _zero_unseen_ds_tiles(dbias_desc, buf, b, hk, GROUP, row0, seqlen_q, lo, n_tiles,
                          BLOCK_M: gl.constexpr, HALF_N: gl.constexpr):  # fmt: skip
    """Zeros, by TMA stores from ``buf`` (one of this warpgroup's dS buffers, free: its
    pair's last step was two steps ago), into the dense bias gradient's tiles of keys
    [row0, + HALF_N) that the block's walk over query tiles [lo, + n_tiles) skipped,
    for each query head of kv head hk: no query there sees these keys (their dS is 0).
    Waits for the stores to have read the buffer."""
    tma.store_wait(0)  # dS's last stores from this warpgroup's buffers have read them
    zero_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    rows = buf.reshape([BLOCK_M, HALF_N])
    for r in gl.static_range(0, BLOCK_M, 16):  # 8 registers a thread at a time
        rows.slice(r, 16, dim=0).store(gl.zeros([16, HALF_N], buf.dtype, zero_layout))
    fence_async_shared()
    before = lo // BLOCK_M
    skipped = gl.cdiv(seqlen_q, BLOCK_M) - n_tiles  # a head's
    for z in range(GROUP * skipped):
        k = z % skipped
        m = gl.where(k < before, k, k + n_tiles) * BLOCK_M
        tma.async_copy_shared_to_global(dbias_desc, [b, hk * GROUP + z // skipped, m, row0],
                                        buf)
    tma.store_wait(0)


@gluon.jit
def _store_by_tma(x, buf, desc, coords):
    """x (2-D, registers) into the shared buffer buf (desc's block), then out by TMA store
    at coords; the store is left in flight."""
    buf.reshape([x.shape[0], x.shape[1]]).store(x)
    fence_async_shared()
    tma.async_copy_shared_to_global(desc, coords, buf)


@gluon.jit
def _bwd_dq_writer_partition(
    dq_desc, dq_smem, dq_full, dq_empty, blocks, n_items, GROUP, DqLocks, heads,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, DQ_BUFS: gl.constexpr,
    IS_VARLEN: gl.constexpr, BOTTOM_RIGHT: gl.constexpr, BOUNDED_LEFT: gl.constexpr,
    BOUNDED_RIGHT: gl.constexpr, BATCH_INNER: gl.constexpr, HEAD_INNER: gl.constexpr,
    ORDERED: gl.constexpr, ROTATE: gl.constexpr, PERSISTENT: gl.constexpr,
    FOLD: gl.constexpr,
):  # fmt: skip
    """One warp (DQ_WRITER, ORDERED_DQ): for each of its program's key blocks
    (_program_block), each step's two dQ halves, left in dq_smem by the compute
    warpgroups, added into the fp32 buffer by TMA reduce-add; their buffers released
    once read. The compute warpgroups then neither issue nor wait for these copies
    (FA4's dQ warp). ORDERED: each tile's adds wait for their turn (dq_add_turn) on the
    tile's counter in DqLocks, and count it on once they are done. ``blocks``: as
    _program_block takes them."""
    TILE_ROWS: gl.constexpr = dq_desc.block_type.shape[2]
    window_left, window_right = blocks[8], blocks[9]
    step = gl.to_tensor(0)  # the rings' count of tiles before this block's
    for blk in range(n_items):
        b, hk, start_n, q_start, _, seqlen_q, seqlen_k, off, lo, _, _, n_tiles = _program_block(
            blk, blocks, BLOCK_M, BLOCK_N, IS_VARLEN, BOTTOM_RIGHT, BOUNDED_LEFT,
            BOUNDED_RIGHT, BATCH_INNER, HEAD_INNER, ORDERED, PERSISTENT, FOLD)  # fmt: skip
        b_tma = 0 if IS_VARLEN else b
        num_n = gl.cdiv(seqlen_k, BLOCK_N)  # the sequence's key blocks
        rot = _walk_rotation(start_n, n_tiles, seqlen_k, BLOCK_N, ROTATE)
        for t in range(GROUP * n_tiles):
            i = step + t
            h, start_m = _query_tile(t, hk, GROUP, lo, n_tiles, BLOCK_M, rot, ROTATE)
            if ORDERED:
                tile = dq_tile(start_m, q_start, b, BLOCK_M, IS_VARLEN)
                if IS_VARLEN:  # packed sequences' tiles (common.dq_tile), heads inner
                    lock = DqLocks + tile * heads + h
                else:
                    lock = DqLocks + (b * heads + h) * gl.cdiv(seqlen_q, BLOCK_M) + tile
                turn = dq_add_turn(start_n // BLOCK_N, start_m, num_n, n_tiles, off,
                                   window_left, window_right, BLOCK_M, BLOCK_N,
                                   BOUNDED_LEFT, BOUNDED_RIGHT, ROTATE)  # fmt: skip
                hopper.wait_turn(lock, turn)
            for half in gl.static_range(2):
                slot = half * DQ_BUFS + i % DQ_BUFS
                mbarrier.wait(dq_full.index(slot), (i // DQ_BUFS) & 1)
                dq_row = _dq_tile_row(b, q_start, start_m, half, BLOCK_M, TILE_ROWS, 2,
                                      IS_VARLEN)
                hopper.tma_reduce_add(dq_desc, [b_tma, h, dq_row, 0], dq_smem.index(slot))
            tma.store_wait(0)
            if ORDERED:
                hopper.end_turn(lock)
            for half in gl.static_range(2):
                mbarrier.arrive(dq_empty.index(half * DQ_BUFS + i % DQ_BUFS))
        step += GROUP * n_tiles


@gluon.jit
def _packed_key_item(pid, HKV, CuSeqK, num_seqs, num_n_blocks, BLOCK_N: gl.constexpr,
                     DESCENDING: gl.constexpr = False):  # fmt: skip
    """The item of _key_block's grid (packed sequences' key blocks counted to the
    longest) that program pid of the packed grid stands for, -1 past its sequence's
    blocks. The packed grid (hopper.packed_items over the keys, in packed_head_rank's
    order, which is _key_block's: sequence after sequence, each kv head's blocks back to
    back) holds at most one item a (sequence, head) past its blocks: 13 documents in
    16k tokens, H16, 208 of 2256 programs against 4480 of 6656. Worked out once, before
    the partitions, which take the item for their program's (searched in each, the
    compute loop spilled)."""
    b = hopper.packed_sequence(pid, HKV, CuSeqK, num_seqs, BLOCK_N)
    first = gl.load(CuSeqK + b)
    tokens = gl.load(CuSeqK + b + 1) - first
    hk, rank = hopper.packed_head_rank(pid, HKV, b, first, tokens, BLOCK_N)
    item = (b * HKV + hk) * num_n_blocks + rank
    if DESCENDING:  # ORDERED_DQ under a right bound: each (sequence, head)'s blocks last first
        item = (b * HKV + hk) * num_n_blocks + gl.cdiv(tokens, BLOCK_N) - 1 - rank
    if rank * BLOCK_N >= tokens:
        item = -1
    return item


@gluon.jit
def _key_block(
    item, HKV, CuSeqQ, CuSeqK, seqlen_q, seqlen_k, num_n_blocks, window_left, window_right,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, IS_VARLEN: gl.constexpr,
    BOTTOM_RIGHT: gl.constexpr, BOUNDED_LEFT: gl.constexpr, BOUNDED_RIGHT: gl.constexpr,
    BATCH_INNER: gl.constexpr = False, HEAD_INNER: gl.constexpr = False,
    DESCENDING: gl.constexpr = False,
):  # fmt: skip
    """Grid item ``item``'s keys: (b, kv head, first key, the sequence's first query and
    key token and lengths, the diagonal's offset, the query range common.query_range
    gives, its count of query tiles). Key blocks of one head run back to back, first first:
    with a causal mask (top-left) they see the most queries, so the longest programs
    start earliest; and they read the same Q and dO tiles, which stay in L2 (taking
    each (sequence, head)'s first block first instead, for packed sequences, halved the
    backward's speed: 427 -> 231 TFLOP/s on 13 documents, H100). Varlen (packed
    sequences, cu_seqlens): blocks count to the longest sequence, and a block past its
    own sequence's end has no query tile (the programs' grid holds few of them:
    _packed_key_item). BATCH_INNER, HEAD_INNER: the batch (sequence), then the kv head,
    vary fastest instead (SUMMED_BIAS_INNER; a program per item, so the grid's size
    counts the batches). DESCENDING (ORDERED_DQ under a right bound): each head's key
    blocks last first, so that a program's dQ adds wait only on programs started before
    it (dq_add_turn)."""
    if BATCH_INNER or HEAD_INNER:
        rest = item
        if BATCH_INNER:
            batches = gl.num_programs(0) // (num_n_blocks * HKV)
            b = rest % batches
            rest = rest // batches
        if HEAD_INNER:
            hk = rest % HKV
            rest = rest // HKV
        start_n = (rest % num_n_blocks) * BLOCK_N
        rest = rest // num_n_blocks
        if not HEAD_INNER:
            hk = rest % HKV
            rest = rest // HKV
        if not BATCH_INNER:
            b = rest
    else:
        bhk = item // num_n_blocks
        start_n = (item % num_n_blocks) * BLOCK_N
        if DESCENDING and not IS_VARLEN:  # packed grids: _packed_key_item's order
            start_n = (num_n_blocks - 1 - item % num_n_blocks) * BLOCK_N
        b = bhk // HKV
        hk = bhk % HKV
    q_start, k_start, seqlen_q, seqlen_k = sequence_bounds(CuSeqQ, CuSeqK, b, seqlen_q,
                                                           seqlen_k, IS_VARLEN)
    off = diagonal_offset(seqlen_q, seqlen_k, BOTTOM_RIGHT)
    lo, full_lo, full_hi, hi = query_range(
        start_n, seqlen_q, seqlen_k, off, window_left, window_right,
        BLOCK_M, BLOCK_N, BOUNDED_LEFT, BOUNDED_RIGHT)  # fmt: skip
    n_tiles = gl.cdiv(hi - lo, BLOCK_M)
    if IS_VARLEN:
        if start_n >= seqlen_k:
            n_tiles = 0
        if not BOUNDED_LEFT:  # the last query tile's rows past the sequence get P = 0
            if start_n + BLOCK_N <= seqlen_k:  # from their statistics (row_stats_buffer)
                full_hi = hi
    return (b, hk, start_n, q_start, k_start, seqlen_q, seqlen_k, off, lo, full_lo, full_hi,
            n_tiles)


@gluon.jit
def _operand_buffers(q_desc, do_desc, k_desc, v_desc, stats_desc, STAGES: gl.constexpr):
    """What both backward kernels keep in shared memory: K and V, the Q and dO rings
    with their rows' lse and delta, K and V's barrier (kv_bar), the barrier where the
    two compute warpgroups meet each step (ds_bar: both halves of dS stored), and the
    rings' barriers, each slot released by both compute warpgroups."""
    dtype: gl.constexpr = q_desc.dtype
    q_smem = gl.allocate_shared_memory(dtype, [STAGES] + q_desc.block_type.shape, q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES] + do_desc.block_type.shape,
                                        do_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [1] + k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [1] + v_desc.block_type.shape, v_desc.layout)
    lse_smem = gl.allocate_shared_memory(gl.float32, [STAGES] + stats_desc.block_type.shape,
                                         stats_desc.layout)
    delta_smem = gl.allocate_shared_memory(gl.float32, [STAGES] + stats_desc.block_type.shape,
                                           stats_desc.layout)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ds_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    mbarrier.init(ds_bar, count=2)
    q_ready, q_empty = hopper.ring(STAGES, 2)
    do_ready, do_empty = hopper.ring(STAGES, 2)
    return (q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem, kv_bar, ds_bar, q_ready,
            q_empty, do_ready, do_empty)


@gluon.jit
def _bwd_sm90_kernel(
    q_desc, k_desc, v_desc, do_desc, dq_desc, stats_desc, bias_desc, dbias_desc, dk_desc,
    dv_desc, DK, DV, Rng, Alibi, CuSeqQ, CuSeqK, DqLocks, BiasRow, DBiasRow, stride_kb,
    stride_kn, stride_kh, stride_vb, stride_vn, stride_vh, stride_ab, stride_ah, stride_rb,
    stride_rh, stride_rn, stride_pb, stride_ph, HKV, GROUP, bias_batches, bias_heads, seqlen_q,
    seqlen_k, num_seqs, num_n_blocks, num_items, scale, window_left, window_right, dropout_p,
    softcap, HEAD_DIM_QK: gl.constexpr, HEAD_DIM_V: gl.constexpr, BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr, HAS_BIAS: gl.constexpr, DBIAS_TILES: gl.constexpr,
    DBIAS_SUM: gl.constexpr, BIAS_ROW: gl.constexpr, DBIAS_ROW: gl.constexpr,
    HAS_ALIBI: gl.constexpr, HAS_DROPOUT: gl.constexpr, IS_VARLEN: gl.constexpr,
    BOTTOM_RIGHT: gl.constexpr, BOUNDED_LEFT: gl.constexpr, BOUNDED_RIGHT: gl.constexpr,
    BATCH_INNER: gl.constexpr, HEAD_INNER: gl.constexpr, SKIP_PAST_END: gl.constexpr,
    DQ_BUFS: gl.constexpr, ORDERED: gl.constexpr,
    ROTATE: gl.constexpr, PERSISTENT: gl.constexpr, FOLD: gl.constexpr,
    BY_RANK: gl.constexpr, HAS_DQ: gl.constexpr, HAS_SOFTCAP: gl.constexpr,
    KV_VIEWS_PER_STEP: gl.constexpr, IDLE_KEYS: gl.constexpr,
):  # fmt: skip
    # A program per key block, or PERSISTENT (PERSISTENT_BLOCKS) one per SM at most,
    # walking num_items blocks in hopper.work_item's strides (_program_block). Packed
    # sequences in the default order: a program per item of the packed grid, which
    # stands for an item of _key_block's (_packed_key_item). BY_RANK
    # (MASKED_BY_RANK_BLOCKS): a program per block, heads in groups of at least this
    # many blocks, each group's blocks rank by rank.
    pid = gl.program_id(0)
    if IS_VARLEN and not (BATCH_INNER or HEAD_INNER):
        pid = _packed_key_item(pid, HKV, CuSeqK, num_seqs, num_n_blocks, BLOCK_N,
                               ORDERED and BOUNDED_RIGHT)
        if pid < 0:
            return
    elif BY_RANK > 0:
        pid = hopper.rank_major_item(pid, gl.num_programs(0), num_n_blocks,
                                     gl.cdiv(BY_RANK, num_n_blocks))
    programs = gl.num_programs(0)
    n_items = gl.to_tensor(1)
    if PERSISTENT:
        n_items = hopper.work_items(pid, programs, num_items, FOLD)
    blocks = (pid, programs, HKV, CuSeqQ, CuSeqK, seqlen_q, seqlen_k, num_n_blocks, window_left,
              window_right)
    if SKIP_PAST_END:  # a key block past its packed sequence's end: nothing to do
        _, _, start_n, _, _, _, seqlen_k_b, _, _, _, _, _ = _program_block(
            0, blocks, BLOCK_M, BLOCK_N, IS_VARLEN, BOTTOM_RIGHT, BOUNDED_LEFT, BOUNDED_RIGHT,
            BATCH_INNER, HEAD_INNER, ORDERED, PERSISTENT, FOLD)  # fmt: skip
        if start_n >= seqlen_k_b:
            return

    dtype: gl.constexpr = q_desc.dtype
    (q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem, kv_bar, ds_bar, q_ready, q_empty,
     do_ready, do_empty) = _operand_buffers(q_desc, do_desc, k_desc, v_desc, stats_desc, STAGES)
    # dS as (queries, keys) in two buffers of two halves of the keys, each half a TMA
    # block of the bias gradient: [2 * buffer + half].
    ds_block: gl.constexpr = [1, 1, BLOCK_M, BLOCK_N // 2]
    ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for(ds_block, dtype)
    ds_smem = gl.allocate_shared_memory(dtype, [4] + ds_block, ds_layout)
    # dQ's halves: one buffer each, or DQ_BUFS each for the writer warp ([half, buffer])
    # (allocated in a swizzled layout for its 1024-byte alignment: the buffers take dK and
    # dV's swizzled tiles at the end of each block)
    DQ_SLOTS: gl.constexpr = 2 * DQ_BUFS if DQ_BUFS > 0 else 2
    dq_shape: gl.constexpr = [DQ_SLOTS] + dq_desc.block_type.shape
    dq_smem = gl.allocate_shared_memory(
        gl.float32, dq_shape, gl.NVMMASharedLayout(128, 32, rank=4))._reinterpret(
            gl.float32, dq_shape, dq_desc.layout)  # fmt: skip
    kv_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_empty, count=2)  # both compute warpgroups done with a block's K, V
    if DQ_BUFS > 0:
        dq_full, dq_empty = hopper.ring(2 * DQ_BUFS, 1)
    else:  # stand-ins, never touched
        dq_full = ds_bar
        dq_empty = ds_bar
    if HAS_BIAS:  # a (queries, keys) tile beside each Q tile
        bias_smem = gl.allocate_shared_memory(dtype, [STAGES] + bias_desc.block_type.shape,
                                              bias_desc.layout)
    else:  # a stand-in, never touched
        bias_smem = q_smem
    # dS in fp32 for a summed bias gradient's reduce-adds: where dQ's halves have dS's
    # tile shape (Dqk = 128) their buffers, which hold nothing else at that point in a step
    if DBIAS_SUM and HEAD_DIM_QK != BLOCK_N:
        dsum_smem = gl.allocate_shared_memory(gl.float32, [2] + dbias_desc.block_type.shape,
                                              dbias_desc.layout)
    else:
        dsum_smem = dq_smem

    seed, rng_offset = philox_key(Rng, HAS_DROPOUT)
    heads = HKV * GROUP
    # Runtime values only: a constexpr stored in a variable would turn into a tensor, so
    # the constexprs go into each partition's arguments inline.
    shared = (dq_desc, dbias_desc, dk_desc, dv_desc, DK, DV, stride_kb, stride_kn, stride_kh,
              stride_vb, stride_vn, stride_vh, q_smem, do_smem, k_smem, v_smem, lse_smem,
              delta_smem, bias_smem, ds_smem, dq_smem, dsum_smem, dq_full, dq_empty, kv_bar,
              kv_empty, q_ready, do_ready, q_empty, do_empty, ds_bar, blocks, n_items, GROUP,
              scale, window_left, window_right, seed, rng_offset, heads, dropout_p, Alibi,
              stride_ab, stride_ah, BiasRow, stride_rb, stride_rh, stride_rn, bias_batches,
              bias_heads, DBiasRow, stride_pb, stride_ph, softcap)
    loads = (q_desc, do_desc, k_desc, v_desc, stats_desc, bias_desc, q_smem, do_smem, k_smem,
             v_smem, lse_smem, delta_smem, bias_smem, kv_bar, kv_empty, q_ready, do_ready,
             q_empty, do_empty, GROUP, bias_batches, bias_heads, blocks, n_items)
    if DQ_BUFS > 0:  # a fourth partition, the dQ writer warp (ORDERED: dQ's counters in
        # DqLocks)
        gl.warp_specialize(
            [(_bwd_compute_partition, (shared, 0, HEAD_DIM_QK, HEAD_DIM_V, BLOCK_M, BLOCK_N,
                                       STAGES, HAS_BIAS, DBIAS_TILES, DBIAS_SUM, BIAS_ROW,
                                       DBIAS_ROW, HAS_ALIBI, HAS_DROPOUT, BOUNDED_LEFT,
                                       BOUNDED_RIGHT, DQ_BUFS, ROTATE, IS_VARLEN, BOTTOM_RIGHT,
                                       BATCH_INNER, HEAD_INNER, ORDERED, PERSISTENT, FOLD,
                                       HAS_DQ, HAS_SOFTCAP, KV_VIEWS_PER_STEP,
                                       IDLE_KEYS)),
             (_bwd_compute_partition, (shared, 1, HEAD_DIM_QK, HEAD_DIM_V, BLOCK_M, BLOCK_N,
                                       STAGES, HAS_BIAS, DBIAS_TILES, DBIAS_SUM, BIAS_ROW,
                                       DBIAS_ROW, HAS_ALIBI, HAS_DROPOUT, BOUNDED_LEFT,
                                       BOUNDED_RIGHT, DQ_BUFS, ROTATE, IS_VARLEN, BOTTOM_RIGHT,
                                       BATCH_INNER, HEAD_INNER, ORDERED, PERSISTENT, FOLD,
                                       HAS_DQ, HAS_SOFTCAP, KV_VIEWS_PER_STEP,
                                       IDLE_KEYS)),
             (_bwd_blocks_load_partition, (loads, BLOCK_M, BLOCK_N, STAGES, HAS_BIAS, IS_VARLEN,
                                           BOTTOM_RIGHT, BOUNDED_LEFT, BOUNDED_RIGHT,
                                           BATCH_INNER, HEAD_INNER, ORDERED, ROTATE,
                                           PERSISTENT, FOLD)),
             (_bwd_dq_writer_partition, (dq_desc, dq_smem, dq_full, dq_empty, blocks,
                                         n_items, GROUP, DqLocks, heads, BLOCK_M, BLOCK_N,
                                         DQ_BUFS, IS_VARLEN, BOTTOM_RIGHT, BOUNDED_LEFT,
                                         BOUNDED_RIGHT, BATCH_INNER, HEAD_INNER, ORDERED,
                                         ROTATE, PERSISTENT, FOLD))],
            worker_num_warps=[4, 1, 1], worker_num_regs=[240, 24, 24])  # fmt: skip
    else:
        gl.warp_specialize(
            [(_bwd_compute_partition, (shared, 0, HEAD_DIM_QK, HEAD_DIM_V, BLOCK_M, BLOCK_N,
                                       STAGES, HAS_BIAS, DBIAS_TILES, DBIAS_SUM, BIAS_ROW,
                                       DBIAS_ROW, HAS_ALIBI, HAS_DROPOUT, BOUNDED_LEFT,
                                       BOUNDED_RIGHT, DQ_BUFS, ROTATE, IS_VARLEN, BOTTOM_RIGHT,
                                       BATCH_INNER, HEAD_INNER, ORDERED, PERSISTENT, FOLD,
                                       HAS_DQ, HAS_SOFTCAP, KV_VIEWS_PER_STEP,
                                       IDLE_KEYS)),
             (_bwd_compute_partition, (shared, 1, HEAD_DIM_QK, HEAD_DIM_V, BLOCK_M, BLOCK_N,
                                       STAGES, HAS_BIAS, DBIAS_TILES, DBIAS_SUM, BIAS_ROW,
                                       DBIAS_ROW, HAS_ALIBI, HAS_DROPOUT, BOUNDED_LEFT,
                                       BOUNDED_RIGHT, DQ_BUFS, ROTATE, IS_VARLEN, BOTTOM_RIGHT,
                                       BATCH_INNER, HEAD_INNER, ORDERED, PERSISTENT, FOLD,
                                       HAS_DQ, HAS_SOFTCAP, KV_VIEWS_PER_STEP,
                                       IDLE_KEYS)),
             (_bwd_blocks_load_partition, (loads, BLOCK_M, BLOCK_N, STAGES, HAS_BIAS, IS_VARLEN,
                                           BOTTOM_RIGHT, BOUNDED_LEFT, BOUNDED_RIGHT,
                                           BATCH_INNER, HEAD_INNER, ORDERED, ROTATE,
                                           PERSISTENT, FOLD))],
            worker_num_warps=[4, 1], worker_num_regs=[240, 24])  # fmt: skip


# Head dim 256: a warpgroup's dK and dV over 64 keys would take 256 registers a thread.
# So a program owns 64 keys and each warpgroup half of the head dims (FlashAttention-3's
# split): dK[:, half] and dV[:, half] in 128 registers. S and dP are split by keys (each
# warpgroup 64 queries x 32 keys), and P and dS go to shared memory as (keys, queries)
# tiles that both read. Shared memory: K, V 32 KiB each, Q and dO rings 2 x 32 KiB
# each, P and dS 8 KiB each (one buffer: a barrier keeps the next step's stores behind
# both warpgroups' reads): 208 KiB. dQ has a kernel of its own (_bwd_dq_wide_kernel):
# here its fp32 reduce-adds, 64 KiB per 64 x 64 step, bounded the kernel, and
# the zeroed buffer and conversion they need cost 164 us at 16k tokens (H100).
# The same two kernels ("wide": head dims past 128) take Dqk=192 / Dv=128 (MLA's;
# SPLIT_HEAD_DIM_PAIRS): Q, K and dQ in two buffers, 128 + 64 columns (Gluon's shapes
# are powers of 2, as in the forward), the first warpgroup making dK's first 128
# columns, the second dK's last 64, and each half of dV: 192 against 128 columns of dK
# and dV a warpgroup (FA3/FA4 split 96 keys instead, a shape Gluon has no tile for).
# Shared memory at 192/128: 141 KiB (dK/dV), 145 KiB (dQ). They take V of 256 columns
# beside a narrower q·k too (64/256, 128/256, 192/256: is_wide), each warpgroup half of
# dV's columns as at D=256; at Dqk=64 a warpgroup's dK columns (32) span half of Q's
# 128-byte swizzle, so Q's tiles there take a 64-byte one.
BLOCK_N_WIDE = 64


@gluon.jit
def _wide_probs(
    s, lse2, masked, offs_m, offs_n, bias, features, b, h, seqlen_k, off, scale, window_left,
    window_right, BOUNDED_LEFT: gl.constexpr, BOUNDED_RIGHT: gl.constexpr,
    HAS_BIAS: gl.constexpr, HAS_ALIBI: gl.constexpr, HAS_SOFTCAP: gl.constexpr,
):  # fmt: skip
    """P of a wide kernel's (queries, keys) tile from S (raw q·k, fp32) as the D 64/128
    kernel makes it: softcap's cap, then the bias (HAS_BIAS: ``bias``, fp32, the tile's
    or a row of keys) and ALiBi, then the mask (``masked``: the tile crosses the mask's
    edge); and tanh's derivative for dS (1.0 without softcap). features: the kernels'
    options (dropout's seed, offset, heads and rate, ALiBi's slopes and their strides,
    softcap, a key row bias's pointer, strides and (batch, head) sizes) for query head h
    of batch b."""
    _, _, _, _, Alibi, stride_ab, stride_ah, softcap = features[:8]
    p_scale = scale * LOG2E
    cap_slope = 1.0
    if HAS_SOFTCAP:  # log2 units from here, as the forwards' scores
        t_cap = tanh(s * (scale / softcap), True)  # 16-bit inputs
        s = t_cap * (softcap * LOG2E)
        cap_slope = 1.0 - t_cap * t_cap
        p_scale = 1.0
    if HAS_BIAS or HAS_ALIBI:  # the scale goes in first, as in the forward
        slope = 0.0
        if HAS_ALIBI:
            slope = gl.load(Alibi + b.to(gl.int64) * stride_ab + h.to(gl.int64) * stride_ah)
        s = add_bias_alibi_log2(s * p_scale, offs_m[:, None], offs_n[None, :], off, slope, bias,
                                HAS_BIAS, HAS_ALIBI)  # fmt: skip
        p_scale = 1.0
    if masked:
        mask = visible(offs_m[:, None], offs_n[None, :], seqlen_k, off, window_left,
                       window_right, BOUNDED_LEFT, BOUNDED_RIGHT)
        s = gl.where(mask, s, float("-inf"))
    return gl.exp2(s * p_scale - lse2[:, None]), cap_slope


@gluon.jit
def _wide_bias_row(features, b, h, offs_n, seqlen_k):
    """Keys offs_n of a bias constant along queries (hopper.bias_row), query head h of
    batch b, in fp32 as a (1, keys) row; 0 past Sk."""
    BiasRow, stride_rb, stride_rh, stride_rn, bias_batches, bias_heads = features[8:]
    ptrs = (BiasRow + (b % bias_batches).to(gl.int64) * stride_rb
            + (h % bias_heads).to(gl.int64) * stride_rh + offs_n.to(gl.int64) * stride_rn)
    return gl.load(ptrs, mask=offs_n < seqlen_k, other=0.0).to(gl.float32)[None, :]


@gluon.jit
def _wide_grad_scores(p, dp, delta, keep, cap_slope, dropout_p, HAS_DROPOUT: gl.constexpr,
                      HAS_SOFTCAP: gl.constexpr):  # fmt: skip
    """P as dV takes it (dropout's zeros; its 1 / (1 - p) at the block's end) and dS
    (unscaled: the softmax scale goes in once, at the end) from a wide kernel's P, dP,
    the rows' delta, dropout's keep tile and _wide_probs' cap slope."""
    p_kept = p
    if HAS_DROPOUT:  # dP Z / (1 - p)
        dp = hopper.dropped(dp, keep, dropout_p) * (1.0 / (1.0 - dropout_p))
        p_kept = hopper.dropped(p, keep, dropout_p)
    ds = p * (dp - delta[:, None])
    if HAS_SOFTCAP:  # d(softcap * tanh(x / softcap)) / dx
        ds = ds * cap_slope
    return p_kept, ds


@gluon.jit
def _store_wide_bias_grad(ds, dbias_out, b, h, start_m, key0, offs_m, offs_n, seqlen_q,
                          seqlen_k, BLOCK_M: gl.constexpr, KEYS: gl.constexpr,
                          ADD: gl.constexpr):  # fmt: skip
    """A bias's gradient from dS's (queries, keys) tile of query head h, batch b, rows
    [start_m, + BLOCK_M) and keys [key0, + KEYS) (offs_m, offs_n in dS's layout), by
    pointer: a full bias's stored in its dtype; with ADD, one broadcast over batch or
    heads, added into its fp32 buffer (at the bias's own batch and head, b and h taken
    modulo its sizes by the caller) by atomics. Rows and keys past the sequence's left
    out. Offsets within the tile in 32 bits (registers), its corner in 64."""
    DBias, stride_gb, stride_gh, stride_gm = dbias_out
    corner = (DBias + b.to(gl.int64) * stride_gb + h.to(gl.int64) * stride_gh
              + start_m.to(gl.int64) * stride_gm + key0)
    within = (offs_m - start_m)[:, None] * stride_gm + (offs_n - key0)[None, :]
    keep = (offs_m < seqlen_q)[:, None] & (offs_n < seqlen_k)[None, :]
    if ADD:
        gl.atomic_add(corner + within, ds, mask=keep, sem="relaxed")
    else:
        gl.store(corner + within, ds.to(DBias.dtype.element_ty), mask=keep)


@gluon.jit
def _bwd_wide_compute_partition(
    shared, HALF: gl.constexpr, HEAD_DIM_QK: gl.constexpr, HEAD_DIM_V: gl.constexpr,
    QK_SPLIT: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr, BOUNDED_LEFT: gl.constexpr, BOUNDED_RIGHT: gl.constexpr,
    HAS_BIAS: gl.constexpr, BIAS_ROW: gl.constexpr, DBIAS_FULL: gl.constexpr,
    DBIAS_SUM: gl.constexpr, DBIAS_ROW: gl.constexpr, HAS_ALIBI: gl.constexpr,
    HAS_DROPOUT: gl.constexpr, HAS_SOFTCAP: gl.constexpr, IS_VARLEN: gl.constexpr,
):  # fmt: skip
    """One warpgroup at D=256 (or 192/128): S and dP of keys [start_n + HALF * 32, + 32),
    then dK and dV of this warpgroup's head-dim columns over all 64 keys: half of each at
    D=256; with QK_SPLIT, dK's first (HALF 0) or split columns and half of dV's. P and
    dS as the D 64/128 kernel makes them (_wide_probs). A bias gradient (not beside
    softcap, whose dS for dK is not the bias's): DBIAS_FULL, dS is it, each tile stored
    from registers by pointer (no shared memory for a copy beside D=256's tiles);
    DBIAS_SUM, one broadcast over batch or heads, dS added into its fp32 buffer by
    atomics from registers; DBIAS_ROW, a key row's, dS summed over each query head's
    queries in registers and stored once per head into a (B, H, Sk) fp32 buffer (as the
    D 64/128 kernel)."""
    (dk_desc, dk2_desc, dv_desc, q_smem, do_smem, k_smem, v_smem, q2_smem, k2_smem,
     lse_smem, delta_smem, pt_smem, dst_smem, bias_smem,
     kv_bar, q_ready, do_ready, q_empty, do_empty, ds_bar, pds_free, b, hk, GROUP, start_n,
     lo, full_lo, full_hi, n_tiles, seqlen_q, seqlen_k, off, scale, window_left,
     window_right, features, k_start, DK, DV, key_strides, dbias_out) = shared
    gl.static_assert(not HAS_SOFTCAP or not (DBIAS_FULL or DBIAS_SUM or DBIAS_ROW),
                     "softcap's dS for dK is not the bias gradient's")
    seed, rng_offset, heads, dropout_p = features[:4]  # dropout's (_wide_probs' docstring)
    dtype: gl.constexpr = k_smem.dtype
    HALF_N: gl.constexpr = BLOCK_N // 2
    QK_MAIN: gl.constexpr = HEAD_DIM_QK - QK_SPLIT  # Q's and K's columns in q_smem, k_smem
    DV_COLS: gl.constexpr = HEAD_DIM_V // 2  # dV's columns this warpgroup makes
    # dK's: half at D=256; with a split, all of Q's first buffer or all of its second
    DK_COLS: gl.constexpr = (HEAD_DIM_QK // 2 if QK_SPLIT == 0
                             else (QK_MAIN if HALF == 0 else QK_SPLIT))
    DK_COL0: gl.constexpr = HALF * DK_COLS if QK_SPLIT == 0 else HALF * QK_MAIN
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HALF_N, 16])
    dk_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, DK_COLS, 16])
    dv_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, DV_COLS, 16])
    rows_layout: gl.constexpr = gl.SliceLayout(1, s_layout)

    offs_n = start_n + HALF * HALF_N + gl.arange(0, HALF_N, layout=gl.SliceLayout(0, s_layout))
    k_keys = k_smem.index(0).reshape([BLOCK_N, QK_MAIN]).slice(HALF * HALF_N, HALF_N,
                                                       dim=0).permute((1, 0))  # as Kᵀ
    k2_keys = k_keys  # a stand-in without a split
    if QK_SPLIT > 0:
        k2_keys = k2_smem.reshape([BLOCK_N, QK_SPLIT]).slice(HALF * HALF_N, HALF_N,
                                                              dim=0).permute((1, 0))
    v_keys = v_smem.index(0).reshape([BLOCK_N, HEAD_DIM_V]).slice(HALF * HALF_N, HALF_N,
                                                          dim=0).permute((1, 0))
    pt_all = pt_smem.reshape([BLOCK_N, BLOCK_M])
    dst_all = dst_smem.reshape([BLOCK_N, BLOCK_M])
    pt_own = pt_all.slice(HALF * HALF_N, HALF_N, dim=0).permute((1, 0))  # (queries, keys)
    dst_own = dst_all.slice(HALF * HALF_N, HALF_N, dim=0).permute((1, 0))
    # dropout's keep bits through this warpgroup's keys' rows of P's tile, where
    # keeps_bits_in_shared says
    KEEP_IN_PT: gl.constexpr = keeps_bits_in_shared(HAS_DROPOUT, HAS_BIAS, HEAD_DIM_QK,
                                                    HEAD_DIM_V)
    dk = gl.zeros([BLOCK_N, DK_COLS], gl.float32, layout=dk_layout)
    dv = gl.zeros([BLOCK_N, DV_COLS], gl.float32, layout=dv_layout)
    s_init = gl.zeros([BLOCK_M, HALF_N], gl.float32, layout=s_layout)
    if DBIAS_ROW:  # this query head's dS summed over its query tiles so far
        db_row = gl.zeros([HALF_N], gl.float32, layout=gl.SliceLayout(0, s_layout))
    mbarrier.wait(kv_bar, 0)

    for i in range(GROUP * n_tiles):
        h, start_m = _query_tile(i, hk, GROUP, lo, n_tiles, BLOCK_M)
        offs_m = start_m + gl.arange(0, BLOCK_M, layout=rows_layout)
        slot = hopper.arrived(q_ready, i, STAGES)
        q = q_smem.index(slot).reshape([BLOCK_M, QK_MAIN])
        s = warpgroup_mma(q, k_keys, s_init, use_acc=False, is_async=True)
        q2 = q  # a stand-in without a split
        if QK_SPLIT > 0:
            q2 = q2_smem.index(slot).reshape([BLOCK_M, QK_SPLIT])
            s = warpgroup_mma(q2, k2_keys, s, is_async=True)
        hopper.arrived(do_ready, i, STAGES)
        do = do_smem.index(slot).reshape([BLOCK_M, HEAD_DIM_V])
        dp = warpgroup_mma(do, v_keys, s_init, use_acc=False, is_async=True)
        keep = 0
        if KEEP_IN_PT:  # the keep bits through this warpgroup's rows of P's tile (both
            # warpgroups' matmuls on the last step's are done: pds_free)
            keep = hopper.dropout_keep(seed, rng_offset, b * heads + h, start_m,
                                       start_n + HALF * HALF_N, BLOCK_M, HALF_N, False,
                                       hopper.keep_scratch(pt_smem, HALF, BLOCK_M, HALF_N,
                                                           False))  # fmt: skip
            gl.thread_barrier()  # every warp has its words before P is stored there
        elif HAS_DROPOUT:  # Philox's integer work runs while the tensor cores do S and dP
            keep = hopper.dropout_keep(seed, rng_offset, b * heads + h, start_m,
                                       start_n + HALF * HALF_N, BLOCK_M, HALF_N, False)
        bias = 0.0
        if HAS_BIAS:  # this warpgroup's keys of the (queries, keys) tile beside Q's
            bias = (bias_smem.index(slot).reshape([BLOCK_M, BLOCK_N])
                    .slice(HALF * HALF_N, HALF_N, dim=1).load(s_layout).to(gl.float32))
        if BIAS_ROW:
            bias = _wide_bias_row(features, b, h, offs_n, seqlen_k)
        s = warpgroup_mma_wait(1, deps=(s,))
        lse2 = lse_smem.index(slot).reshape([BLOCK_M]).load(rows_layout)
        p, cap_slope = _wide_probs(s, lse2, (start_m < full_lo) | (start_m >= full_hi),
                                   offs_m, offs_n, bias, features, b, h, seqlen_k, off, scale,
                                   window_left, window_right, BOUNDED_LEFT, BOUNDED_RIGHT,
                                   HAS_BIAS or BIAS_ROW, HAS_ALIBI, HAS_SOFTCAP)  # fmt: skip
        dp = warpgroup_mma_wait(0, deps=(dp,))
        delta = delta_smem.index(slot).reshape([BLOCK_M]).load(rows_layout)
        p_kept, ds = _wide_grad_scores(p, dp, delta, keep, cap_slope, dropout_p, HAS_DROPOUT,
                                       HAS_SOFTCAP)
        if DBIAS_FULL or DBIAS_SUM:
            gb, gh = b, h
            if DBIAS_SUM:  # the bias's own batch and head
                bias_batches, bias_heads = features[12:]
                gb, gh = b % bias_batches, h % bias_heads
            _store_wide_bias_grad(ds, dbias_out, gb, gh, start_m, start_n + HALF * HALF_N,
                                  offs_m, offs_n, seqlen_q, seqlen_k, BLOCK_M, HALF_N,
                                  DBIAS_SUM)
        if DBIAS_ROW:  # summed over queries; stored once per query head, its last tile
            db_row += gl.sum(ds, 0)
            head_done = i % n_tiles == n_tiles - 1
            if head_done:
                DBias, stride_gb, stride_gh, _ = dbias_out
                gl.store(DBias + b.to(gl.int64) * stride_gb + h.to(gl.int64) * stride_gh
                         + offs_n, db_row, mask=offs_n < seqlen_k)
            db_row = gl.where(head_done, 0.0, db_row)

        # This warpgroup's keys of P and dS into the shared (keys, queries) tiles (both
        # warpgroups' reads of the previous step's are done: pds_free), then wait for
        # the other warpgroup's keys.
        pt_own.store(p_kept.to(dtype))
        dst_own.store(ds.to(dtype))
        fence_async_shared()
        mbarrier.arrive(ds_bar)
        mbarrier.wait(ds_bar, i & 1)

        dv = warpgroup_mma(pt_all, do.slice(HALF * DV_COLS, DV_COLS, dim=1), dv,
                           is_async=True)
        if QK_SPLIT == 0:
            dk = warpgroup_mma(dst_all, q.slice(DK_COL0, DK_COLS, dim=1), dk, is_async=True)
        elif HALF == 0:
            dk = warpgroup_mma(dst_all, q, dk, is_async=True)
        else:
            dk = warpgroup_mma(dst_all, q2, dk, is_async=True)
        dv, dk = warpgroup_mma_wait(0, deps=(dv, dk))
        # This step's Q and dO are read; once both warpgroups are here, so are P and dS.
        mbarrier.arrive(q_empty.index(slot))
        mbarrier.arrive(do_empty.index(slot))
        mbarrier.arrive(pds_free)
        mbarrier.wait(pds_free, i & 1)

    # Both warpgroups are past the last step's pds_free: the Q and dO rings are free,
    # and slot HALF of each takes this warpgroup's dK and dV for their TMA stores (which
    # clip a dense batch's keys past Sk); a packed sequence's block that ends past its
    # keys by plain stores (a TMA store clips at the packed tensor's end).
    out_desc = dk2_desc if QK_SPLIT > 0 and HALF == 1 else dk_desc
    if HAS_DROPOUT:  # P's kept entries were stored unscaled
        dv = dv * (1.0 / (1.0 - dropout_p))
    dk_out = (dk * scale).to(dtype)
    dv_out = dv.to(dtype)
    if IS_VARLEN and start_n + BLOCK_N > seqlen_k:
        stride_kb, stride_kn, stride_kh, stride_vb, stride_vn, stride_vh = key_strides
        _store_rows(dk_out, DK + k_start.to(gl.int64) * stride_kn + DK_COL0, b, hk,
                    stride_kb, stride_kn, stride_kh, seqlen_k,
                    start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, dk_layout)),
                    gl.arange(0, DK_COLS, layout=gl.SliceLayout(0, dk_layout)),
                    out_desc.shape[3] - DK_COL0)  # fmt: skip
        _store_rows(dv_out, DV + k_start.to(gl.int64) * stride_vn + HALF * DV_COLS, b, hk,
                    stride_vb, stride_vn, stride_vh, seqlen_k,
                    start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, dv_layout)),
                    gl.arange(0, DV_COLS, layout=gl.SliceLayout(0, dv_layout)),
                    dv_desc.shape[3] - HALF * DV_COLS)  # fmt: skip
    else:
        b_tma = b
        if IS_VARLEN:  # one batch of all tokens
            b_tma = 0
        dk_buf = q_smem.index(HALF)._reinterpret(dtype, out_desc.block_type.shape,
                                                 out_desc.layout)
        dv_buf = do_smem.index(HALF)._reinterpret(dtype, dv_desc.block_type.shape,
                                                  dv_desc.layout)
        dk_buf.reshape([BLOCK_N, DK_COLS]).store(dk_out)
        dv_buf.reshape([BLOCK_N, DV_COLS]).store(dv_out)
        fence_async_shared()
        krow = k_start + start_n
        tma.async_copy_shared_to_global(out_desc, [b_tma, hk, krow, DK_COL0], dk_buf)
        tma.async_copy_shared_to_global(dv_desc, [b_tma, hk, krow, HALF * DV_COLS], dv_buf)
        tma.store_wait(0)


@gluon.jit
def _bwd_wide_kernel(
    q_desc, k_desc, v_desc, do_desc, stats_desc, q2_desc, k2_desc, dk_desc, dk2_desc,
    dv_desc, bias_desc, DK, DV, Rng, Alibi, BiasRow, DBias, CuSeqQ, CuSeqK, stride_kb,
    stride_kn, stride_kh, stride_vb, stride_vn, stride_vh, stride_ab, stride_ah, stride_rb,
    stride_rh, stride_rn, stride_gb, stride_gh, stride_gm, bias_batches, bias_heads, HKV,
    GROUP, seqlen_q, seqlen_k, num_seqs, num_n_blocks, scale, window_left, window_right,
    dropout_p, softcap,
    HEAD_DIM_QK: gl.constexpr, HEAD_DIM_V: gl.constexpr, QK_SPLIT: gl.constexpr,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
    BOTTOM_RIGHT: gl.constexpr, BOUNDED_LEFT: gl.constexpr, BOUNDED_RIGHT: gl.constexpr,
    HAS_BIAS: gl.constexpr, BIAS_ROW: gl.constexpr, DBIAS_FULL: gl.constexpr,
    DBIAS_SUM: gl.constexpr, DBIAS_ROW: gl.constexpr, HAS_ALIBI: gl.constexpr,
    HAS_DROPOUT: gl.constexpr, HAS_SOFTCAP: gl.constexpr, IS_VARLEN: gl.constexpr,
):  # fmt: skip
    # A program per key block; packed sequences (IS_VARLEN) on _bwd_sm90_kernel's packed
    # grid (an item past a sequence's blocks done at once), one batch of all tokens to
    # TMA, the row statistics from common.packed_stats_start on.
    item = gl.program_id(0)
    if IS_VARLEN:
        item = _packed_key_item(item, HKV, CuSeqK, num_seqs, num_n_blocks, BLOCK_N)
        if item < 0:
            return
    (b, hk, start_n, q_start, k_start, seqlen_q, seqlen_k, off, lo, full_lo, full_hi,
     n_tiles) = _key_block(
        item, HKV, CuSeqQ, CuSeqK, seqlen_q, seqlen_k, num_n_blocks, window_left, window_right,
        BLOCK_M, BLOCK_N, IS_VARLEN, BOTTOM_RIGHT, BOUNDED_LEFT, BOUNDED_RIGHT)  # fmt: skip
    b_tma = b
    stats_start = 0
    if IS_VARLEN:
        b_tma = 0
        stats_start = packed_stats_start(q_start, b)

    dtype: gl.constexpr = q_desc.dtype
    (q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem, kv_bar, ds_bar, q_ready, q_empty,
     do_ready, do_empty) = _operand_buffers(q_desc, do_desc, k_desc, v_desc, stats_desc, STAGES)
    if QK_SPLIT > 0:  # Q's and K's last columns
        q2_smem = gl.allocate_shared_memory(dtype, [STAGES] + q2_desc.block_type.shape,
                                            q2_desc.layout)
        k2_smem = gl.allocate_shared_memory(dtype, k2_desc.block_type.shape, k2_desc.layout)
    else:  # stand-ins, never touched
        q2_smem = q_smem
        k2_smem = k_smem
    pds_block: gl.constexpr = [BLOCK_N, BLOCK_M]
    pds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for(pds_block, dtype)
    pt_smem = gl.allocate_shared_memory(dtype, pds_block, pds_layout)
    dst_smem = gl.allocate_shared_memory(dtype, pds_block, pds_layout)
    pds_free = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(pds_free, count=2)  # both warpgroups' matmuls on P and dS done
    if HAS_BIAS:  # a (queries, keys) tile beside each Q tile
        bias_smem = gl.allocate_shared_memory(dtype, [STAGES] + bias_desc.block_type.shape,
                                              bias_desc.layout)
    else:  # a stand-in, never touched
        bias_smem = q_smem

    # The options the partitions take (_wide_probs, _wide_bias_row)
    seed, rng_offset = philox_key(Rng, HAS_DROPOUT)
    features = (seed, rng_offset, HKV * GROUP, dropout_p, Alibi, stride_ab, stride_ah, softcap,
                BiasRow, stride_rb, stride_rh, stride_rn, bias_batches, bias_heads)
    shared = (dk_desc, dk2_desc, dv_desc, q_smem, do_smem, k_smem, v_smem, q2_smem, k2_smem,
              lse_smem, delta_smem, pt_smem, dst_smem, bias_smem, kv_bar, q_ready, do_ready,
              q_empty, do_empty,
              ds_bar, pds_free, b, hk, GROUP, start_n, lo, full_lo, full_hi, n_tiles,
              seqlen_q, seqlen_k, off, scale, window_left, window_right, features, k_start,
              DK, DV, (stride_kb, stride_kn, stride_kh, stride_vb, stride_vn, stride_vh),
              (DBias, stride_gb, stride_gh, stride_gm))
    gl.warp_specialize(
        [(_bwd_wide_compute_partition, (shared, 0, HEAD_DIM_QK, HEAD_DIM_V, QK_SPLIT,
                                        BLOCK_M, BLOCK_N, STAGES, BOUNDED_LEFT,
                                        BOUNDED_RIGHT, HAS_BIAS, BIAS_ROW, DBIAS_FULL,
                                        DBIAS_SUM, DBIAS_ROW, HAS_ALIBI, HAS_DROPOUT,
                                        HAS_SOFTCAP, IS_VARLEN)),
         (_bwd_wide_compute_partition, (shared, 1, HEAD_DIM_QK, HEAD_DIM_V, QK_SPLIT,
                                        BLOCK_M, BLOCK_N, STAGES, BOUNDED_LEFT,
                                        BOUNDED_RIGHT, HAS_BIAS, BIAS_ROW, DBIAS_FULL,
                                        DBIAS_SUM, DBIAS_ROW, HAS_ALIBI, HAS_DROPOUT,
                                        HAS_SOFTCAP, IS_VARLEN)),
         (_bwd_load_partition, (
            q_desc, do_desc, k_desc, v_desc, stats_desc, bias_desc, q_smem, do_smem, k_smem,
            v_smem, lse_smem, delta_smem, bias_smem, kv_bar, q_ready, do_ready, q_empty,
            do_empty, b_tma, hk, q_start, k_start, stats_start, GROUP, b % bias_batches,
            bias_heads, start_n, lo, n_tiles, q2_desc, k2_desc, q2_smem, k2_smem, BLOCK_M,
            STAGES, HAS_BIAS, QK_SPLIT))],
        worker_num_warps=[4, 1], worker_num_regs=[240, 24])  # fmt: skip


# Head dim 256, dQ: a kernel of its own, the forward's shape. A program owns 128 query
# rows (a warpgroup 64), keeps dQ in registers (128 a thread) over every key tile, and
# writes it once, in the output dtype, by a TMA store through its Q buffer. It
# recomputes S and dP (3 matmuls a step where dQ inside the dK/dV kernel takes 1), but
# sends no fp32 traffic, needs no zeroed buffer and no conversion, and adds in a fixed
# order: deterministic. Shared memory: Q and dO 64 KiB each, K and V rings of three
# 32-key tiles, 16 KiB each: 224 KiB. 64-key tiles fit only with one V slot, and ran
# slower (S=512: 301 against 210 us a call, H100); issuing a tile's S
# and dP ahead of the previous tile's dQ changed nothing. At Dqk=192 / Dv=128, K and V
# tiles of 64 keys fit (206 KiB) and paid: 328 -> 343 TFLOP/s causal S=4096, 366 -> 388
# S=16384 (tools/ab.py, H100). Keyed by Dqk; V of 256 columns (dO's 64 KiB) takes
# D=256's 32 whatever q·k's width (dq_block_n). With dropout the K and V rings take two
# stages (dq_kv_stages): its keep bits' exchange into the wgmma layout needs shared
# memory of its own.
DQ_BLOCK_N = {256: 32, 192: 64}
DQ_STAGES = 3


def dq_block_n(spec: AttentionSpec) -> int:
    """Keys per K and V tile of _bwd_dq_wide_kernel (DQ_BLOCK_N)."""
    return DQ_BLOCK_N[256] if spec.head_dim_v > 128 else DQ_BLOCK_N[spec.head_dim_qk]


def dq_kv_stages(spec: AttentionSpec, bias_tiles: bool) -> int:
    """Stages of _bwd_dq_wide_kernel's K and V rings (DQ_STAGES; one fewer with dropout or
    bias tiles beside them)."""
    return DQ_STAGES - 1 if spec.dropout_p > 0 or bias_tiles else DQ_STAGES


# Under a mask a program takes a pair of query blocks of equal work from this many
# blocks on, as the forward's D=256 grid does (forward_sm90.MIN_BLOCKS_TO_FOLD).
DQ_MIN_BLOCKS_TO_FOLD = 5


@gluon.jit
def _dq_block(j, blocks, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, FOLD: gl.constexpr,
              BOTTOM_RIGHT: gl.constexpr, BOUNDED_LEFT: gl.constexpr,
              BOUNDED_RIGHT: gl.constexpr, IS_VARLEN: gl.constexpr):  # fmt: skip
    """_bwd_dq_wide_kernel's j-th query block of its program, as hopper.query_block gives
    one: the dense grid's, or packed sequences' (the program's one item of
    hopper.packed_block's grid, worked out before the partitions)."""
    (pid, programs, H, GROUP, num_m_blocks, seqlen_q, seqlen_k, window_left, window_right,
     packed) = blocks
    if IS_VARLEN:
        return packed
    return hopper.query_block(pid, j, programs, H, GROUP, num_m_blocks, seqlen_q, seqlen_k,
                              window_left, window_right, BLOCK_M, BLOCK_N, FOLD, BOTTOM_RIGHT,
                              BOUNDED_LEFT, BOUNDED_RIGHT)


@gluon.jit
def _dq_load_partition(
    loads, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, KV_STAGES: gl.constexpr,
    FOLD: gl.constexpr, BOTTOM_RIGHT: gl.constexpr, BOUNDED_LEFT: gl.constexpr,
    BOUNDED_RIGHT: gl.constexpr, QK_SPLIT: gl.constexpr, HAS_BIAS: gl.constexpr,
    IS_VARLEN: gl.constexpr,
):  # fmt: skip
    """One warp: each query block's Q and dO (with their rows' lse and delta), then its
    K and V tiles as their rings' slots come free; with QK_SPLIT, Q's and K's last
    columns into buffers of their own (q2, k2) on the same barriers; HAS_BIAS, the
    block's (queries, keys) bias tile beside each K tile."""
    (q_desc, do_desc, k_desc, v_desc, stats_desc, q2_desc, k2_desc, bias_desc, q_smem, do_smem,
     k_smem, v_smem, q2_smem, k2_smem, bias_smem, lse_smem, delta_smem, q_ready, q_empty,
     k_ready, k_empty, v_ready, v_empty, blocks, n_items, bias_batches, bias_heads) = loads
    PARTS: gl.constexpr = BLOCK_M // ROWS
    split_col: gl.constexpr = q_desc.block_type.shape[3]  # where Q's and K's split starts
    block_bytes: gl.constexpr = PARTS * (
        q_desc.block_type.nbytes + do_desc.block_type.nbytes + 2 * stats_desc.block_type.nbytes
        + (q2_desc.block_type.nbytes if QK_SPLIT > 0 else 0))
    k_bytes: gl.constexpr = k_desc.block_type.nbytes + (
        k2_desc.block_type.nbytes if QK_SPLIT > 0 else 0) + (
        bias_desc.block_type.nbytes if HAS_BIAS else 0)
    kv = 0
    for j in range(n_items):
        b, h, hk, start_m, q_start, k_start, _, _, off, lo, full_lo, full_hi, n_tiles = _dq_block(
            j, blocks, BLOCK_M, BLOCK_N, FOLD, BOTTOM_RIGHT, BOUNDED_LEFT, BOUNDED_RIGHT,
            IS_VARLEN)  # fmt: skip
        b_tma = b
        stats_start = 0
        if IS_VARLEN:  # one batch of all tokens; row statistics from packed_stats_start
            b_tma = 0
            stats_start = packed_stats_start(q_start, b)
        hopper.claim(q_ready, q_empty, j, block_bytes, 1)
        for i in gl.static_range(PARTS):
            row = q_start + start_m + i * ROWS
            tma.async_copy_global_to_shared(q_desc, [b_tma, h, row, 0], q_ready.index(0),
                                            q_smem.index(i))
            if QK_SPLIT > 0:
                tma.async_copy_global_to_shared(q2_desc, [b_tma, h, row, split_col],
                                                q_ready.index(0), q2_smem.index(i))
            tma.async_copy_global_to_shared(do_desc, [b_tma, h, row, 0], q_ready.index(0),
                                            do_smem.index(i))
            stats_row = stats_start + start_m + i * ROWS
            tma.async_copy_global_to_shared(stats_desc, [0, b_tma, h, stats_row],
                                            q_ready.index(0), lse_smem.index(i))
            tma.async_copy_global_to_shared(stats_desc, [1, b_tma, h, stats_row],
                                            q_ready.index(0), delta_smem.index(i))
        for t in range(n_tiles):
            start_n = lo + t * BLOCK_N
            krow = k_start + start_n
            slot = hopper.claim(k_ready, k_empty, kv + t, k_bytes, KV_STAGES)
            tma.async_copy_global_to_shared(k_desc, [b_tma, hk, krow, 0], k_ready.index(slot),
                                            k_smem.index(slot))
            if QK_SPLIT > 0:
                tma.async_copy_global_to_shared(k2_desc, [b_tma, hk, krow, split_col],
                                                k_ready.index(slot), k2_smem.index(slot))
            if HAS_BIAS:
                tma.async_copy_global_to_shared(
                    bias_desc, [b % bias_batches, h % bias_heads, start_m, start_n],
                    k_ready.index(slot), bias_smem.index(slot))
            slot = hopper.claim(v_ready, v_empty, kv + t, v_desc.block_type.nbytes,
                                KV_STAGES)
            tma.async_copy_global_to_shared(v_desc, [b_tma, hk, krow, 0], v_ready.index(slot),
                                            v_smem.index(slot))
        kv += n_tiles


@gluon.jit
def _dq_compute_partition(
    shared, PART: gl.constexpr, HEAD_DIM_QK: gl.constexpr, HEAD_DIM_V: gl.constexpr,
    QK_SPLIT: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    KV_STAGES: gl.constexpr, FOLD: gl.constexpr, BOTTOM_RIGHT: gl.constexpr,
    BOUNDED_LEFT: gl.constexpr, BOUNDED_RIGHT: gl.constexpr, HAS_BIAS: gl.constexpr,
    BIAS_ROW: gl.constexpr, HAS_ALIBI: gl.constexpr, HAS_DROPOUT: gl.constexpr,
    HAS_SOFTCAP: gl.constexpr, IS_VARLEN: gl.constexpr,
):  # fmt: skip
    """One warpgroup: dQ of query rows [start_m + PART * 64, + 64) of each of the
    program's query blocks, over every key tile: S = Q Kᵀ and dP = dO Vᵀ together,
    P and dS from them, dQ += dS K with dS straight from registers (with QK_SPLIT, dQ's
    last columns in an accumulator of their own, from K's)."""
    (dq_desc, dq2_desc, q_smem, do_smem, k_smem, v_smem, q2_smem, k2_smem, bias_smem, lse_smem,
     delta_smem, q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, blocks, n_items, scale,
     window_left, window_right, features, DQ, dq_strides) = shared
    seed, rng_offset, heads, dropout_p = features[:4]  # dropout's (_wide_probs' docstring)
    dtype: gl.constexpr = q_smem.dtype
    QK_MAIN: gl.constexpr = HEAD_DIM_QK - QK_SPLIT  # Q's and K's columns in q_smem, k_smem
    # With a split both dQ accumulators take the split's wgmma width, so that dS is one
    # operand for both.
    DQ_N: gl.constexpr = QK_MAIN if QK_SPLIT == 0 else QK_SPLIT
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16])
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, DQ_N, 16])
    ds_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=dq_layout, k_width=2)
    rows_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    q_tile = q_smem.index(PART).reshape([ROWS, QK_MAIN])
    q2_tile = q_tile  # a stand-in without a split
    if QK_SPLIT > 0:
        q2_tile = q2_smem.index(PART).reshape([ROWS, QK_SPLIT])
    do_tile = do_smem.index(PART).reshape([ROWS, HEAD_DIM_V])

    kv = 0
    for j in range(n_items):
        (b, h, hk, start_m, q_start, _, seq_q, seq_k, off, lo, full_lo, full_hi,
         n_tiles) = _dq_block(j, blocks, BLOCK_M, BLOCK_N, FOLD, BOTTOM_RIGHT, BOUNDED_LEFT,
                              BOUNDED_RIGHT, IS_VARLEN)  # fmt: skip
        row0 = start_m + PART * ROWS
        offs_m = row0 + gl.arange(0, ROWS, layout=rows_layout)
        hopper.arrived(q_ready, j, 1)
        lse2 = lse_smem.index(PART).reshape([ROWS]).load(rows_layout)
        delta = delta_smem.index(PART).reshape([ROWS]).load(rows_layout)
        dq = gl.zeros([ROWS, QK_MAIN], gl.float32, layout=dq_layout)
        if QK_SPLIT > 0:
            dq2 = gl.zeros([ROWS, QK_SPLIT], gl.float32, layout=dq_layout)
        for t in range(n_tiles):
            start_n = lo + t * BLOCK_N
            k_slot = hopper.arrived(k_ready, kv + t, KV_STAGES)
            k = k_smem.index(k_slot).reshape([BLOCK_N, QK_MAIN])
            # Zero accumulators made here, not held across the loop: registers are short.
            s_init = gl.zeros([ROWS, BLOCK_N], gl.float32, layout=s_layout)
            s = warpgroup_mma(q_tile, k.permute((1, 0)), s_init, use_acc=False, is_async=True)
            if QK_SPLIT > 0:
                k2 = k2_smem.index(k_slot).reshape([BLOCK_N, QK_SPLIT])
                s = warpgroup_mma(q2_tile, k2.permute((1, 0)), s, is_async=True)
            v_slot = hopper.arrived(v_ready, kv + t, KV_STAGES)
            v = v_smem.index(v_slot).reshape([BLOCK_N, HEAD_DIM_V])
            dp = warpgroup_mma(do_tile, v.permute((1, 0)), s_init, use_acc=False,
                               is_async=True)
            keep = 0
            if HAS_DROPOUT:  # Philox's integer work runs while the tensor cores do S and dP
                keep = hopper.dropout_keep(seed, rng_offset, b * heads + h, row0, start_n,
                                           ROWS, BLOCK_N, False)
            offs_n = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
            bias = 0.0
            if HAS_BIAS:  # this warpgroup's rows of the tile beside K's
                bias = (bias_smem.index(k_slot).reshape([BLOCK_M, BLOCK_N])
                        .slice(PART * ROWS, ROWS, dim=0).load(s_layout).to(gl.float32))
            if BIAS_ROW:
                bias = _wide_bias_row(features, b, h, offs_n, seq_k)
            s = warpgroup_mma_wait(1, deps=(s,))
            p, cap_slope = _wide_probs(s, lse2, (start_n < full_lo) | (start_n >= full_hi),
                                       offs_m, offs_n, bias, features, b, h, seq_k, off,
                                       scale, window_left, window_right, BOUNDED_LEFT,
                                       BOUNDED_RIGHT, HAS_BIAS or BIAS_ROW, HAS_ALIBI,
                                       HAS_SOFTCAP)  # fmt: skip
            dp = warpgroup_mma_wait(0, deps=(dp,))
            mbarrier.arrive(v_empty.index(v_slot))
            ds = _wide_grad_scores(p, dp, delta, keep, cap_slope, dropout_p, HAS_DROPOUT,
                                   HAS_SOFTCAP)[1]
            ds = gl.convert_layout(ds.to(dtype), ds_layout)
            dq = warpgroup_mma(ds, k, dq, is_async=True)
            if QK_SPLIT > 0:
                dq2 = warpgroup_mma(ds, k2, dq2, is_async=True)
                dq, dq2, ds = warpgroup_mma_wait(0, deps=(dq, dq2, ds))
            else:
                dq, ds = warpgroup_mma_wait(0, deps=(dq, ds))
            mbarrier.arrive(k_empty.index(k_slot))
        kv += n_tiles

        # dQ leaves through this warpgroup's Q buffer (its S are all done), refilled
        # for the next block once the store has read it. Rows with no visible key
        # get zeros; the store clips a dense batch's rows past Sq, a packed sequence's
        # last rows go by plain stores (a TMA store clips at the packed tensor's end).
        if IS_VARLEN and row0 + ROWS > seq_q:
            stride_b, stride_n, stride_h = dq_strides
            rows = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, dq_layout))
            X = DQ + q_start.to(gl.int64) * stride_n
            _store_rows((dq * scale).to(dtype), X, b, h, stride_b, stride_n, stride_h, seq_q,
                        rows, gl.arange(0, QK_MAIN, layout=gl.SliceLayout(0, dq_layout)),
                        dq_desc.shape[3])  # fmt: skip
            if QK_SPLIT > 0:
                _store_rows((dq2 * scale).to(dtype), X + QK_MAIN, b, h, stride_b, stride_n,
                            stride_h, seq_q, rows,
                            gl.arange(0, QK_SPLIT, layout=gl.SliceLayout(0, dq_layout)),
                            dq_desc.shape[3] - QK_MAIN)  # fmt: skip
        else:
            b_tma = b
            if IS_VARLEN:  # one batch of all tokens
                b_tma = 0
            q_tile.store((dq * scale).to(dtype))
            if QK_SPLIT > 0:
                q2_tile.store((dq2 * scale).to(dtype))
            fence_async_shared()
            qrow = q_start + row0
            tma.async_copy_shared_to_global(dq_desc, [b_tma, h, qrow, 0], q_smem.index(PART))
            if QK_SPLIT > 0:
                tma.async_copy_shared_to_global(dq2_desc, [b_tma, h, qrow, QK_MAIN],
                                                q2_smem.index(PART))
            tma.store_wait(0)
        gl.thread_barrier()
        mbarrier.arrive(q_empty.index(0))


@gluon.jit
def _bwd_dq_wide_kernel(
    q_desc, k_desc, v_desc, do_desc, dq_desc, stats_desc, q2_desc, k2_desc, dq2_desc,
    bias_desc, DQ, Rng, Alibi, BiasRow, CuSeqQ, CuSeqK, stride_qb, stride_qn, stride_qh,
    stride_ab, stride_ah, stride_rb, stride_rh, stride_rn, bias_batches, bias_heads, H, GROUP,
    seqlen_q, seqlen_k, num_seqs, num_m_blocks, num_items, scale, window_left, window_right,
    dropout_p, softcap, HEAD_DIM_QK: gl.constexpr, HEAD_DIM_V: gl.constexpr,
    QK_SPLIT: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    KV_STAGES: gl.constexpr, FOLD: gl.constexpr, BOTTOM_RIGHT: gl.constexpr,
    BOUNDED_LEFT: gl.constexpr, BOUNDED_RIGHT: gl.constexpr, HAS_BIAS: gl.constexpr,
    BIAS_ROW: gl.constexpr, HAS_ALIBI: gl.constexpr, HAS_DROPOUT: gl.constexpr,
    HAS_SOFTCAP: gl.constexpr, IS_VARLEN: gl.constexpr,
):  # fmt: skip
    pid = gl.program_id(0)
    programs = gl.num_programs(0)
    n_items = hopper.work_items(pid, programs, num_items, FOLD)
    packed = pid  # a stand-in for dense batches
    if IS_VARLEN:  # a program per item of the packed grid; one past its sequence's blocks
        # is done at once
        packed = hopper.packed_block(pid, H, GROUP, num_seqs, CuSeqQ, CuSeqK, window_left,
                                     window_right, BLOCK_M, BLOCK_N, BOTTOM_RIGHT, BOUNDED_LEFT,
                                     BOUNDED_RIGHT)  # fmt: skip
        if packed[3] >= packed[6]:  # start_m past seqlen_q
            return
    PARTS: gl.constexpr = BLOCK_M // ROWS
    dtype: gl.constexpr = q_desc.dtype
    q_smem = gl.allocate_shared_memory(dtype, [PARTS] + q_desc.block_type.shape, q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [PARTS] + do_desc.block_type.shape,
                                        do_desc.layout)
    lse_smem = gl.allocate_shared_memory(gl.float32, [PARTS] + stats_desc.block_type.shape,
                                         stats_desc.layout)
    delta_smem = gl.allocate_shared_memory(gl.float32, [PARTS] + stats_desc.block_type.shape,
                                           stats_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [KV_STAGES] + k_desc.block_type.shape,
                                       k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [KV_STAGES] + v_desc.block_type.shape,
                                       v_desc.layout)
    if QK_SPLIT > 0:  # Q's and K's last columns
        q2_smem = gl.allocate_shared_memory(dtype, [PARTS] + q2_desc.block_type.shape,
                                            q2_desc.layout)
        k2_smem = gl.allocate_shared_memory(dtype, [KV_STAGES] + k2_desc.block_type.shape,
                                            k2_desc.layout)
    else:  # stand-ins, never touched
        q2_smem = q_smem
        k2_smem = k_smem
    if HAS_BIAS:  # the query block's (queries, keys) tile beside each K tile
        bias_smem = gl.allocate_shared_memory(dtype, [KV_STAGES] + bias_desc.block_type.shape,
                                              bias_desc.layout)
    else:  # a stand-in, never touched
        bias_smem = k_smem
    q_ready, q_empty = hopper.ring(1, PARTS)
    k_ready, k_empty = hopper.ring(KV_STAGES, PARTS)
    v_ready, v_empty = hopper.ring(KV_STAGES, PARTS)

    # The options the partitions take (_wide_probs, _wide_bias_row)
    seed, rng_offset = philox_key(Rng, HAS_DROPOUT)
    features = (seed, rng_offset, H, dropout_p, Alibi, stride_ab, stride_ah, softcap, BiasRow,
                stride_rb, stride_rh, stride_rn, bias_batches, bias_heads)
    blocks = (pid, programs, H, GROUP, num_m_blocks, seqlen_q, seqlen_k, window_left,
              window_right, packed)  # _dq_block's
    shared = (dq_desc, dq2_desc, q_smem, do_smem, k_smem, v_smem, q2_smem, k2_smem, bias_smem,
              lse_smem, delta_smem, q_ready, q_empty, k_ready, k_empty, v_ready, v_empty,
              blocks, n_items, scale, window_left, window_right, features, DQ,
              (stride_qb, stride_qn, stride_qh))
    loads = (q_desc, do_desc, k_desc, v_desc, stats_desc, q2_desc, k2_desc, bias_desc, q_smem,
             do_smem, k_smem, v_smem, q2_smem, k2_smem, bias_smem, lse_smem, delta_smem,
             q_ready, q_empty, k_ready, k_empty, v_ready, v_empty, blocks, n_items,
             bias_batches, bias_heads)
    gl.warp_specialize(
        [(_dq_compute_partition, (shared, 0, HEAD_DIM_QK, HEAD_DIM_V, QK_SPLIT, BLOCK_M,
                                  BLOCK_N, KV_STAGES, FOLD, BOTTOM_RIGHT, BOUNDED_LEFT,
                                  BOUNDED_RIGHT, HAS_BIAS, BIAS_ROW, HAS_ALIBI, HAS_DROPOUT,
                                  HAS_SOFTCAP, IS_VARLEN)),
         (_dq_compute_partition, (shared, 1, HEAD_DIM_QK, HEAD_DIM_V, QK_SPLIT, BLOCK_M,
                                  BLOCK_N, KV_STAGES, FOLD, BOTTOM_RIGHT, BOUNDED_LEFT,
                                  BOUNDED_RIGHT, HAS_BIAS, BIAS_ROW, HAS_ALIBI, HAS_DROPOUT,
                                  HAS_SOFTCAP, IS_VARLEN)),
         (_dq_load_partition, (loads, BLOCK_M, BLOCK_N, KV_STAGES, FOLD, BOTTOM_RIGHT,
                               BOUNDED_LEFT, BOUNDED_RIGHT, QK_SPLIT, HAS_BIAS, IS_VARLEN))],
        # dQ alone takes 128 registers a thread: the second warpgroup gets the most
        # there is, and Triton gives the first (the default partition) 224 of the rest.
        worker_num_warps=[4, 1], worker_num_regs=[256, 24])  # fmt: skip


# Dqk=192 / Dv=128 (MLA's), calls that need not be deterministic: one kernel, dQ fused,
# in FlashAttention-4's orientation for these head dims (interface.py
# _tile_size_bwd_sm90): S = Q Kᵀ and dP = dO Vᵀ with the queries on the wgmma's M, dK
# and dV transposed (the head dim on M), P and dS through shared memory. In ours (keys
# on M) dK and dV over 64 keys take 160 registers a thread and leave too few for S, dP
# and their 16 query columns of lse and delta. Each compute warpgroup owns KEYS keys of
# the program's block (FA4: two of 48, a tile Gluon has none for; here two of 64):
# dKᵀ 192 x KEYS (two accumulators, 128 + 64 rows), dVᵀ 128 x KEYS, S and dP 64 x KEYS
# (dP issued after S, in its registers), lse and delta two rows a thread. dQ = dS K
# over both warpgroups' dS, in three 64-column parts (dq_split, split_parts), each
# added into dq_tiles' fp32 buffer by TMA reduce-add as at D 64/128. Shared memory: K
# 48 KiB, V 32, Q and dO rings of two 48 + 32, P and dS 16 each, a 16 KiB fp32 dQ
# buffer a warpgroup (dK and dV leave through it): 226 of the 227 KiB. Matmul work is
# 832 units per 832 useful, against the wide kernels' 1152 (dQ's kernel recomputes S
# and dP). Deterministic calls keep the wide kernels (their dQ is added in one order).
# H100, tools/ab.py, wide -> this kernel: S4096 364 -> 404, S16384 causal 366 -> 399,
# S4096 causal 344 -> 345. Three warpgroups of 32 keys (96 a block, FA4's count; dP
# beside S) had paid under a mask while the views' descriptors spilled, and lost once
# they were made each step (PERFORMANCE.md, "Levers that did not pay").
FUSED_SPLIT = True
SPLIT_WARPGROUPS = 2  # compute warpgroups a program
SPLIT_KEYS = 64  # keys a warpgroup (a TMA box of K, V, dK and dV)
# _bwd_split_kernel's shared-memory views (K, V, P and dS) made in each step, for
# _kv_views' reason: sm_90 compiles spill 0 against 264 bytes under a causal mask, 36
# against 376 without one. H100, `tools/ab.py --pass bwd`, medians, once a block -> each
# step: causal S4096 364 -> 379, S8192 374 -> 408, S16384 396 -> 423 (five rounds),
# S1024 230 -> 238, without a mask S4096 421 -> 460, the packed documents 296 -> 321.
SPLIT_VIEWS_PER_STEP = True
# The programs of this many (batch, kv head)s at a time take their key blocks by rank
# (first blocks first): under a causal mask the longest first, so that the grid's end
# waits on short blocks; a few heads' at a time, so that what they read and add stays
# in L2. H100, causal S4096, each head's blocks in turn -> 4 heads' by rank: 329 -> 345
# (8: as 4).
SPLIT_HEADS_TOGETHER = 4


@gluon.constexpr_function
def split_parts(warpgroup):
    """dQ's 64-column parts (dq_split) warpgroup ``warpgroup`` of _bwd_split_kernel makes:
    the first two (K's first buffer's columns), the second the third."""
    return (0, 1) if warpgroup == 0 else (2,)


@gluon.jit
def _own_views(k_smem, k2_smem, v_smem, p_smem, ds_smem, index):
    """A _bwd_split_kernel warpgroup's buffers at ``index`` (its own): Kᵀ in its two
    column parts, Vᵀ, P and dS (queries, keys)."""
    keys: gl.constexpr = k_smem.shape[3]
    k_own = k_smem.index(index).reshape([keys, k_smem.shape[4]]).permute((1, 0))
    k2_own = k2_smem.index(index).reshape([keys, k2_smem.shape[4]]).permute((1, 0))
    v_own = v_smem.index(index).reshape([keys, v_smem.shape[4]]).permute((1, 0))
    return k_own, k2_own, v_own, p_smem.index(index), ds_smem.index(index)


@gluon.jit
def _bwd_split_compute_partition(
    shared, WG: gl.constexpr, WARPGROUPS: gl.constexpr, HEAD_DIM_QK: gl.constexpr,
    HEAD_DIM_V: gl.constexpr, QK_SPLIT: gl.constexpr, BLOCK_M: gl.constexpr,
    KEYS: gl.constexpr, STAGES: gl.constexpr, IS_VARLEN: gl.constexpr,
    BOUNDED_LEFT: gl.constexpr, BOUNDED_RIGHT: gl.constexpr, VIEWS_PER_STEP: gl.constexpr,
):  # fmt: skip
    """Warpgroup WG of _bwd_split_kernel: keys [start_n + WG * KEYS, + KEYS) against
    every query tile. Per tile: S, P into shared memory, dP,
    dVᵀ += dOᵀ P, dS into shared memory and dKᵀ += Qᵀ dS from this warpgroup's keys
    (asynchronous wgmmas); once every warpgroup's dS is there, this warpgroup's parts
    of dQ (split_parts) over all the keys, each out by TMA reduce-add."""
    (dq_desc, dk_desc, dk2_desc, dv_desc, DK, DV, stride_kn, stride_kh, stride_vn, stride_vh,
     q_smem, do_smem, k_smem, v_smem, q2_smem, k2_smem, lse_smem, delta_smem, p_smem, ds_smem,
     dq_smem, kv_bar, q_ready, do_ready, q_empty, do_empty, ds_bar, ds_free, b, b_tma, hk,
     GROUP, start_n, q_start, k_start, lo, full_lo, full_hi, n_tiles, seqlen_q, seqlen_k, off,
     scale, window_left, window_right) = shared
    dtype: gl.constexpr = k_smem.dtype
    QK_MAIN: gl.constexpr = HEAD_DIM_QK - QK_SPLIT  # Q's and K's columns in q_smem, k_smem
    PART: gl.constexpr = dq_split(HEAD_DIM_QK, BLOCK_M)[1]  # dQ's columns a part
    PARTS: gl.constexpr = split_parts(WG)
    # S, dP, dKᵀ and dVᵀ: KEYS wide; dQ's parts: PART wide
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, KEYS, 16])
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, PART, 16])
    rows_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    dq_order: gl.constexpr = hopper.accumulator_order(BLOCK_M, PART)
    TILE_ROWS: gl.constexpr = dq_desc.block_type.shape[2]

    k_own, k2_own, v_own, p_own, ds_own = _own_views(k_smem, k2_smem, v_smem, p_smem,
                                                     ds_smem, WG)
    dq_buf = dq_smem.index(WG)
    dkt = gl.zeros([QK_MAIN, KEYS], gl.float32, layout=s_layout)
    dk2t = gl.zeros([QK_SPLIT, KEYS], gl.float32, layout=s_layout)
    dvt = gl.zeros([HEAD_DIM_V, KEYS], gl.float32, layout=s_layout)
    scale_log2 = scale * LOG2E
    mbarrier.wait(kv_bar, 0)

    zero = _runtime_zero(seqlen_k)
    for i in range(GROUP * n_tiles):
        z = 0  # added to the views' indices: made in each step with VIEWS_PER_STEP
        if VIEWS_PER_STEP:
            z = zero * i
            k_own, k2_own, v_own, p_own, ds_own = _own_views(k_smem, k2_smem, v_smem, p_smem,
                                                             ds_smem, WG + z)
        h, start_m = _query_tile(i, hk, GROUP, lo, n_tiles, BLOCK_M)
        offs_m = start_m + gl.arange(0, BLOCK_M, layout=rows_layout)
        slot = hopper.arrived(q_ready, i, STAGES)
        q = q_smem.index(slot).reshape([BLOCK_M, QK_MAIN])
        q2 = q2_smem.index(slot).reshape([BLOCK_M, QK_SPLIT])
        # Zero accumulators made here, not held across the loop: registers are short.
        s_init = gl.zeros([BLOCK_M, KEYS], gl.float32, layout=s_layout)
        s = warpgroup_mma(q, k_own, s_init, use_acc=False, is_async=True)
        s = warpgroup_mma(q2, k2_own, s, is_async=True)
        s = warpgroup_mma_wait(0, deps=(s,))
        lse2 = lse_smem.index(slot).reshape([BLOCK_M]).load(rows_layout)
        if (start_m < full_lo) | (start_m >= full_hi):
            # the keys made here, not held across the loop (KEYS / 4 registers a thread)
            offs_n = start_n + WG * KEYS + gl.arange(0, KEYS, layout=gl.SliceLayout(0, s_layout))
            mask = visible(offs_m[:, None], offs_n[None, :], seqlen_k, off, window_left,
                           window_right, BOUNDED_LEFT, BOUNDED_RIGHT)
            if IS_VARLEN:  # rows past the sequence: the next one's, no query of this one
                mask = mask & (offs_m < seqlen_q)[:, None]
            s = gl.where(mask, s, float("-inf"))
        p = gl.exp2(s * scale_log2 - lse2[:, None])
        # P to shared memory for dV (this warpgroup's last dV wgmma, its one reader, is
        # done). P is kept for dS in fp16: dP's registers are not free beside it in fp32
        # (a P rounded to 11 bits, where dS is then rounded to the inputs' 8 or 11).
        p_own.store(p.to(dtype))
        p = p.to(gl.float16)
        fence_async_shared()
        gl.thread_barrier()
        # dP only now, in S's registers
        hopper.arrived(do_ready, i, STAGES)
        do = do_smem.index(slot).reshape([BLOCK_M, HEAD_DIM_V])
        dp = warpgroup_mma(do, v_own, s_init, use_acc=False, is_async=True)
        dvt = warpgroup_mma(do.permute((1, 0)), p_own, dvt, is_async=True)
        dp = warpgroup_mma_wait(1, deps=(dp,))
        delta = delta_smem.index(slot).reshape([BLOCK_M]).load(rows_layout)
        ds = (p.to(gl.float32) * (dp - delta[:, None])).to(dtype)

        # dS to shared memory once every warpgroup's dQ wgmmas have read the last step's
        # (ds_free); dK reads this warpgroup's alone, dQ all of them (ds_bar)
        mbarrier.wait(ds_free, (i & 1) ^ 1, pred=i > 0)
        ds_own.store(ds)
        fence_async_shared()
        gl.thread_barrier()
        dkt = warpgroup_mma(q.permute((1, 0)), ds_own, dkt, is_async=True)
        dk2t = warpgroup_mma(q2.permute((1, 0)), ds_own, dk2t, is_async=True)
        mbarrier.arrive(ds_bar)
        mbarrier.wait(ds_bar, i & 1)
        for n in gl.static_range(len(PARTS)):  # one after the other: registers
            dq = gl.zeros([BLOCK_M, PART], gl.float32, layout=dq_layout)
            for j in gl.static_range(WARPGROUPS):
                if PARTS[n] < 2:
                    k_cols = k_smem.index(j + z).reshape([KEYS, QK_MAIN]).slice(
                        PARTS[n] * PART, PART, dim=1)
                else:
                    k_cols = k2_smem.index(j + z).reshape([KEYS, QK_SPLIT])
                dq = warpgroup_mma(ds_smem.index(j + z), k_cols, dq, use_acc=j > 0,
                                   is_async=True)
            if n == 0:
                dvt, dkt, dk2t, dq = warpgroup_mma_wait(0, deps=(dvt, dkt, dk2t, dq))
                mbarrier.arrive(do_empty.index(slot))  # dP and dV done with dO
            else:
                dq = warpgroup_mma_wait(0, deps=(dq,))
            if n == len(PARTS) - 1:
                mbarrier.arrive(ds_free)  # every dS read here
            row = _dq_tile_row(b, q_start, start_m, PARTS[n], BLOCK_M, TILE_ROWS, 3, IS_VARLEN)
            _dq_add(dq, dq_buf, dq_desc, [b_tma, h, row, 0], dq_order, BLOCK_M, PART)
        mbarrier.arrive(q_empty.index(slot))

    # dK and dV, transposed, leave through this warpgroup's dQ buffer one after another
    # (the TMA stores clip a dense batch's keys past Sk); a packed sequence's keys that
    # end before the warpgroup's by plain stores (TMA would clip at the packed end)
    row = start_n + WG * KEYS
    if IS_VARLEN and row + KEYS > seqlen_k:
        dk_ptr = DK + k_start.to(gl.int64) * stride_kn
        dk_width = dk_desc.shape[3]  # dK's and dV's own columns (dispatch.kernel_spec)
        _store_key_cols(dvt, DV + k_start.to(gl.int64) * stride_vn, hk, stride_vn, stride_vh,
                        seqlen_k, row, dv_desc.shape[3], HEAD_DIM_V)
        _store_key_cols(dkt * scale, dk_ptr, hk, stride_kn, stride_kh, seqlen_k, row, dk_width,
                        QK_MAIN)
        _store_key_cols(dk2t * scale, dk_ptr + QK_MAIN, hk, stride_kn, stride_kh, seqlen_k, row,
                        dk_width - QK_MAIN, QK_SPLIT)
    else:
        krow = k_start + row
        _store_transposed(dvt, dq_buf, dv_desc, [b_tma, hk, krow, 0])
        _store_transposed(dkt * scale, dq_buf, dk_desc, [b_tma, hk, krow, 0])
        _store_transposed(dk2t * scale, dq_buf, dk2_desc, [b_tma, hk, krow, QK_MAIN])
    tma.store_wait(0)  # the last copies have read the buffer


@gluon.jit
def _dq_add(dq, buf, desc, coords, order: gl.constexpr, ROWS: gl.constexpr, COLS: gl.constexpr):
    """dq (fp32, registers) added into dq_tiles by TMA reduce-add through buf, in its
    registers' order, once buf's last copy has read it."""
    tma.store_wait(0)
    gl.thread_barrier()
    buf._reinterpret(gl.float32, [ROWS, COLS], order).store(dq)
    fence_async_shared()
    hopper.tma_reduce_add(desc, coords, buf)


@gluon.jit
def _store_key_cols(xt, X, hk, stride_n, stride_h, seqlen_k, row0, width, COLS: gl.constexpr):
    """xt (fp32, registers, (COLS columns, keys from row0)) as _store_rows stores a
    tile of keys along its rows, in X's dtype: keys past seqlen_k and columns from
    ``width`` on are not written."""
    x = gl.permute(xt, (1, 0)).to(X.dtype.element_ty)
    layout: gl.constexpr = x.type.layout
    rows = row0 + gl.arange(0, x.shape[0], layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, COLS, layout=gl.SliceLayout(0, layout))
    _store_rows(x, X, gl.to_tensor(0), hk, 0, stride_n, stride_h, seqlen_k, rows, cols, width)


@gluon.jit
def _store_transposed(xt, buf, desc, coords, ADD: gl.constexpr = False):
    """xt (fp32, registers, transposed) out in desc's dtype by TMA store through buf (ADD:
    a TMA reduce-add), once buf's last copy has read it."""
    tma.store_wait(0)
    gl.thread_barrier()
    stage = buf._reinterpret(desc.dtype, desc.block_type.shape, desc.layout)
    stage.reshape([xt.shape[1], xt.shape[0]]).permute((1, 0)).store(xt.to(desc.dtype))
    fence_async_shared()
    if ADD:
        hopper.tma_reduce_add(desc, coords, stage)
    else:
        tma.async_copy_shared_to_global(desc, coords, stage)


@gluon.jit
def _bwd_split_load_partition(loads, WARPGROUPS: gl.constexpr, BLOCK_M: gl.constexpr,
                              STAGES: gl.constexpr):  # fmt: skip
    """One warp: each warpgroup's keys of K (both buffers) and V, then the Q and dO
    tiles (_query_tile_loads)."""
    (q_desc, do_desc, k_desc, k2_desc, v_desc, stats_desc, q2_desc, q_smem, do_smem, k_smem,
     k2_smem, v_smem, q2_smem, lse_smem, delta_smem, kv_bar, q_ready, do_ready, q_empty,
     do_empty, b_tma, hk, q_start, k_start, stats_start, GROUP, start_n, lo, n_tiles) = loads
    keys: gl.constexpr = k_desc.block_type.shape[2]
    split_col: gl.constexpr = q_desc.block_type.shape[3]
    kv_bytes: gl.constexpr = WARPGROUPS * (k_desc.block_type.nbytes + k2_desc.block_type.nbytes
                                           + v_desc.block_type.nbytes)
    mbarrier.expect(kv_bar, kv_bytes)
    for j in gl.static_range(WARPGROUPS):
        row = k_start + start_n + j * keys
        tma.async_copy_global_to_shared(k_desc, [b_tma, hk, row, 0], kv_bar, k_smem.index(j))
        tma.async_copy_global_to_shared(k2_desc, [b_tma, hk, row, split_col], kv_bar,
                                        k2_smem.index(j))
        tma.async_copy_global_to_shared(v_desc, [b_tma, hk, row, 0], kv_bar, v_smem.index(j))
    _query_tile_loads(
        q_desc, do_desc, stats_desc, q_desc, q_smem, do_smem, lse_smem, delta_smem, q_smem,
        q_ready, do_ready, q_empty, do_empty, b_tma, hk, q_start, stats_start, GROUP, 0, 1,
        start_n, lo, n_tiles, q2_desc, q2_smem, BLOCK_M, STAGES, False,
        q2_desc.block_type.shape[3])  # fmt: skip


@gluon.jit
def _bwd_split_kernel(
    q_desc, k_desc, v_desc, do_desc, dq_desc, stats_desc, q2_desc, k2_desc, dk_desc, dk2_desc,
    dv_desc, DK, DV, CuSeqQ, CuSeqK, stride_kn, stride_kh, stride_vn, stride_vh, HKV, GROUP,
    seqlen_q, seqlen_k, num_seqs, num_n_blocks, scale, window_left, window_right,
    HEAD_DIM_QK: gl.constexpr, HEAD_DIM_V: gl.constexpr, QK_SPLIT: gl.constexpr,
    BLOCK_M: gl.constexpr, WARPGROUPS: gl.constexpr, STAGES: gl.constexpr,
    IS_VARLEN: gl.constexpr, BOTTOM_RIGHT: gl.constexpr, BOUNDED_LEFT: gl.constexpr,
    BOUNDED_RIGHT: gl.constexpr, HEADS_TOGETHER: gl.constexpr, VIEWS_PER_STEP: gl.constexpr,
):  # fmt: skip
    # The programs of HEADS_TOGETHER (batch, kv head)s take their key blocks by rank
    # (SPLIT_HEADS_TOGETHER). Packed sequences (IS_VARLEN): one batch of all tokens to
    # TMA, and _bwd_sm90_kernel's grid (hopper.packed_items over the keys, an item past
    # a sequence's blocks done at once); DK and DV take the stores TMA would clip at the
    # packed tensor's end.
    KEYS: gl.constexpr = k_desc.block_type.shape[2]  # a warpgroup's
    pid = gl.program_id(0)
    if IS_VARLEN:  # the packed grid
        item = _packed_key_item(pid, HKV, CuSeqK, num_seqs, num_n_blocks, WARPGROUPS * KEYS)
        if item < 0:
            return
    else:
        item = hopper.rank_major_item(pid, gl.num_programs(0), num_n_blocks, HEADS_TOGETHER)
    b, hk, start_n, q_start, k_start, seqlen_q, seqlen_k, off, lo, full_lo, full_hi, n_tiles = (
        _key_block(item, HKV, CuSeqQ, CuSeqK, seqlen_q, seqlen_k, num_n_blocks, window_left,
                   window_right, BLOCK_M, WARPGROUPS * KEYS, IS_VARLEN, BOTTOM_RIGHT,
                   BOUNDED_LEFT, BOUNDED_RIGHT))  # fmt: skip

    dtype: gl.constexpr = q_desc.dtype
    q_smem = gl.allocate_shared_memory(dtype, [STAGES] + q_desc.block_type.shape, q_desc.layout)
    q2_smem = gl.allocate_shared_memory(dtype, [STAGES] + q2_desc.block_type.shape,
                                        q2_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES] + do_desc.block_type.shape,
                                        do_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [WARPGROUPS] + k_desc.block_type.shape,
                                       k_desc.layout)
    k2_smem = gl.allocate_shared_memory(dtype, [WARPGROUPS] + k2_desc.block_type.shape,
                                        k2_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [WARPGROUPS] + v_desc.block_type.shape,
                                       v_desc.layout)
    lse_smem = gl.allocate_shared_memory(gl.float32, [STAGES] + stats_desc.block_type.shape,
                                         stats_desc.layout)
    delta_smem = gl.allocate_shared_memory(gl.float32, [STAGES] + stats_desc.block_type.shape,
                                           stats_desc.layout)
    pds_block: gl.constexpr = [BLOCK_M, KEYS]  # (queries, keys), a warpgroup's
    pds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for(pds_block, dtype)
    p_smem = gl.allocate_shared_memory(dtype, [WARPGROUPS] + pds_block, pds_layout)
    ds_smem = gl.allocate_shared_memory(dtype, [WARPGROUPS] + pds_block, pds_layout)
    # A dQ buffer a warpgroup (allocated swizzled for its 1024-byte alignment: dK and
    # dV leave through it at the end)
    dq_shape: gl.constexpr = [WARPGROUPS] + dq_desc.block_type.shape
    dq_smem = gl.allocate_shared_memory(
        gl.float32, dq_shape, gl.NVMMASharedLayout(128, 32, rank=4))._reinterpret(
            gl.float32, dq_shape, dq_desc.layout)  # fmt: skip
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ds_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ds_free = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    mbarrier.init(ds_bar, count=WARPGROUPS)  # every warpgroup's dS stored
    mbarrier.init(ds_free, count=WARPGROUPS)  # every warpgroup's dQ wgmmas have read dS
    q_ready, q_empty = hopper.ring(STAGES, WARPGROUPS)
    do_ready, do_empty = hopper.ring(STAGES, WARPGROUPS)

    b_tma = b
    stats_start = 0
    if IS_VARLEN:  # one batch of all tokens; row statistics from packed_stats_start
        b_tma = 0
        stats_start = packed_stats_start(q_start, b)
    shared = (dq_desc, dk_desc, dk2_desc, dv_desc, DK, DV, stride_kn, stride_kh, stride_vn,
              stride_vh, q_smem, do_smem, k_smem, v_smem, q2_smem, k2_smem, lse_smem,
              delta_smem, p_smem, ds_smem, dq_smem, kv_bar, q_ready, do_ready, q_empty,
              do_empty, ds_bar, ds_free, b, b_tma, hk, GROUP, start_n, q_start, k_start, lo,
              full_lo, full_hi, n_tiles, seqlen_q, seqlen_k, off, scale, window_left,
              window_right)
    loads = (q_desc, do_desc, k_desc, k2_desc, v_desc, stats_desc, q2_desc, q_smem, do_smem,
             k_smem, k2_smem, v_smem, q2_smem, lse_smem, delta_smem, kv_bar, q_ready,
             do_ready, q_empty, do_empty, b_tma, hk, q_start, k_start, stats_start, GROUP,
             start_n, lo, n_tiles)
    gl.warp_specialize(
        [(_bwd_split_compute_partition, (shared, 0, WARPGROUPS, HEAD_DIM_QK, HEAD_DIM_V, QK_SPLIT,
                                         BLOCK_M, KEYS, STAGES, IS_VARLEN,
                                         BOUNDED_LEFT, BOUNDED_RIGHT, VIEWS_PER_STEP)),
         (_bwd_split_compute_partition, (shared, 1, WARPGROUPS, HEAD_DIM_QK, HEAD_DIM_V, QK_SPLIT,
                                         BLOCK_M, KEYS, STAGES, IS_VARLEN,
                                         BOUNDED_LEFT, BOUNDED_RIGHT, VIEWS_PER_STEP)),
         (_bwd_split_load_partition, (loads, WARPGROUPS, BLOCK_M, STAGES))],
        worker_num_warps=[4, 1], worker_num_regs=[240, 24])  # fmt: skip

# Below this many keys per query backward.py's kernels win: each program then has few
# query tiles to spread its start-up (K and V loads, the partitions) and its dK/dV
# stores over. H100, tools/ab.py (bench timing, host included), tile -> Gluon: D=64
# S512 causal (256 keys) 159 -> 171 TFLOP/s, S256 causal (128 keys) 99 -> 94, a window
# of 64 keys 48 -> 42; D=128 S512 causal 145 -> 173, windows of 256 and 32 keys 107 ->
# 150 and 16 -> 22; D=256 S512 causal 104 -> 144.
MIN_KEYS_PER_QUERY = {64: 256, 128: 0, 192: 0, 256: 0}
HEAD_DIMS = (64, 128, 192, 256)  # q·k
# (q·k, v) head dims these kernels take: the D 64/128 kernel sizes dK and dV apart. At
# Dqk=192 dK would take 96 registers a thread beside dV's 64, so 192/128 goes to a
# kernel of its own with Q and K split (FUSED_SPLIT), or for deterministic calls to
# the wide kernels (BLOCK_N_WIDE): SPLIT_HEAD_DIM_PAIRS. Past Dqk=128 the other pairs
# the forward takes (a narrower V) run the wide kernels, each warpgroup half of dV's
# columns and its share of dK's (at 192 the split's), as at D=256.
# V wider than q·k (64/128): the D 64/128 kernel stages dK's and dV's tiles for their
# TMA stores in one of its dQ buffers, which at Dqk=64 holds 8 KiB, where dV's tile at
# Dv=128 takes 16: dV leaves by plain stores there (DV_STAGED). V of 256 columns (dV's
# 128 registers a thread) runs the wide kernels whatever q·k's width.
HEAD_DIM_PAIRS = ((64, 64), (128, 128), (128, 64), (64, 128), (192, 64), (256, 256),
                  (256, 128), (256, 64), (64, 256), (128, 256), (192, 256))
SPLIT_HEAD_DIM_PAIRS: tuple[tuple[int, int], ...] = ((192, 128),)


def is_wide(spec: AttentionSpec) -> bool:
    """Whether the call runs the wide kernels (_bwd_wide_kernel, _bwd_dq_wide_kernel):
    head dims past 128, q·k's or V's (but fuses_split_dq's)."""
    return max(spec.head_dim_qk, spec.head_dim_v) > 128 and not fuses_split_dq(spec)


def takes_head_dims(spec: AttentionSpec) -> bool:
    """Whether these kernels take the call's head dims (HEAD_DIM_PAIRS and
    SPLIT_HEAD_DIM_PAIRS)."""
    dims = (spec.head_dim_qk, spec.head_dim_v)
    return dims in HEAD_DIM_PAIRS or dims in SPLIT_HEAD_DIM_PAIRS


# A summed bias gradient (dbias_kind_of's "summed") from key-block programs ordered with
# the dimension the bias broadcasts over innermost (the batch, or the kv head), so that
# the programs adding into a tile run together and their reduce-adds meet in L2 instead
# of reading and writing the fp32 buffer in memory. H100, B4 S4096 H16 D128, backward
# TFLOP/s, shipped order -> inner: 1HQK 190 -> 286, B1QK 289 -> 341, but 11QK 307 -> 208:
# there all B*H programs of a key block add into one tile at once, so a bias summed
# over both keeps the shipped order (key blocks of one head side by side).
SUMMED_BIAS_INNER = True
# A bias plane per head shared over the batch (1HQK) that asks no gradient is only read,
# a tile per step: the same order, batch innermost, lets the batch's programs read each
# tile from L2 together (the forward's BIAS_BATCH_INNER), at the cost of persistent
# programs. H100, tools/ab.py --rounds 9 (bench timing, medians; main kernel per call
# from torch.profiler's ten calls), shipped order -> batch inner: D128 S4096 461 -> 480
# TFLOP/s (2532 -> 2585 us), S2048 419 -> 436 (1486 -> 1344 us), D64 S4096 331 -> 346
# (3810 -> 3749 us); causal D128 S4096 422 -> 423 (1470 -> 1452 us).
BIAS_TILES_BATCH_INNER = True
# A bias the packed sequences share, a plane per head (dbias_kind_of's "added"): each
# sequence's dS tiles are added by TMA reduce-add straight into the gradient, in its
# 16-bit dtype, as they are in shared memory (zeroed beforehand), each add rounded:
# the sums autograd makes over a loop of per-sequence calls. Through the fp32 buffer
# ("summed"), each step staged its dS in fp32 for adds of twice the bytes, and the
# buffer took a zeroing pass and a conversion: H100, the bench's causal documents with
# a (1, H, 4000, 4000) bias, 172 -> 267 TFLOP/s. The sequences of a key block run side
# by side (inner_dims), so that their adds meet in L2 (sequence after sequence: 195).
# Up to PACKED_BIAS_ADDS sequences a call; past that the roundings add up, and the
# fp32 buffer takes over.
PACKED_BIAS_ADDS = 32
# dQ through a warp of its own (FA4's dQ warp), by Dqk: the compute warpgroups leave
# each step's dQ halves in shared memory (two buffers each where they fit) and go on; a
# fifth warp issues the TMA reduce-adds and releases the buffers once read. Without it
# each warpgroup waits for its previous reduce to have read its buffer, with a
# warpgroup barrier, and issues the next itself. H100, persistent programs, tools/ab.py
# --rounds 6 (medians; variants "dq_writer", "no_dq_writer"): D=64 S1024 379 -> 383,
# causal 271 -> 276, S4096 459 -> 457, causal 409 -> 417, S16384 478 -> 488, causal 471
# -> 483; D=128 S1024 425 -> 425, S4096 539 -> 534, causal 473 -> 467, S16384 causal
# 550 -> 543. Deterministic calls (ORDERED_DQ) take it at every Dqk.
DQ_WRITER = {64: True, 128: False}
# And packed sequences without a mask at D=128 (a program per block there: each ends
# without waiting for its last reduce). H100, tools/ab.py --pass bwd --rounds 3,
# without -> with: the bench's documents 470 -> 484 TFLOP/s, 1024-token documents 403
# -> 411, 2048 481 -> 490, 4096 520 -> 535; causal it did not pay (the bench's 397 ->
# 395, 1024-token 296 -> 290, 4096 462 -> 468).
DQ_WRITER_PACKED_UNMASKED = True
# Deterministic calls at D 64/128 on this kernel (FA3's scheme): a counter per dQ tile
# (b, h, query tile), zeroed per call, and the dQ writer warp adds a tile's halves only
# at its program's turn (dq_add_turn), counting the turn on once the adds completed
# (hopper.wait_turn, end_turn). The turns follow the order in which the programs reach
# a tile, so that in the steady state none waits: under a right bound (causal, windows)
# the key blocks further right start on a tile earlier and add first; without bounds
# each program starts its walk at its own query tile (rot), as FA3's shift scheduler.
# Blocks of one head have consecutive programs, which the GPU starts in order, so a
# program waits only on programs already running. H100, tools/ab.py ("d" shapes, the
# tile kernels against this; the non-deterministic default beside), D128 S4096
# backward: 385 -> 504 TFLOP/s (default 546: 1.08x its time), causal 309 -> 427 (458:
# 1.07x), D64 456 (default 443).
ORDERED_DQ = True
# Packed sequences in SUMMED_BIAS_INNER's orders (a program per key block of the
# longest sequence): programs past their sequence's blocks return before loading K and
# V (SKIP_PAST_END). H100, the bench's docs row on that grid (4480 of 6656 programs past
# their end), backward 358 -> 381 TFLOP/s. The packed grid (hopper.packed_items: at most
# one a (sequence, kv head) past its blocks) returns those by itself (_packed_key_item).
SKIP_EMPTY_KEY_BLOCKS = True
# Programs persistent (one per SM at most, the forward's strides: hopper.work_item,
# blocks of equal work paired under a right bound), so that a block's K and V, and its
# first Q and dO tiles, load while the last block's dK and dV leave, and no program
# starts per block: what a program's start and end cost weighs most where it has few
# query tiles (short and causal rows, D=64's 128-row steps). Not where the order of the
# blocks is not free (_plan).
# K's and V's views made in each step of the D 64/128 kernel (_kv_views) where their
# hoisted descriptors spill: a feature that holds registers across the step (dropout,
# softcap, ALiBi, a bias) beside a head dim of 128, or a key row at D=64. sm_90 compiles
# (bytes of spills, once a program -> each step): D=128 dropout 304 -> 48, softcap 284
# -> 72, ALiBi or biases 40-100 -> 0; 128/64 dropout 132 -> 8, 64/128 112 -> 4, a D=64
# key row 220 -> 52. H100, `tools/ab.py --pass bwd --rounds 3`, medians, once a program
# -> each step: D=128 dropout 409 -> 446, causal 378 -> 406, the packed documents' 310
# -> 336, softcap 475 -> 501, ALiBi 527 -> 552, a key-padding row with its gradient 516
# -> 536, (1, H, S, S) with its gradient 284 -> 296, (B, H, S, S) 451 -> 450; 64/128
# dropout 365 -> 420, 128/64 dropout 384 -> 386, softcap 420 -> 431; a D=64 key row
# with its gradient 439 -> 452, causal 376 -> 402. But without a feature D128 S16384
# 605 -> 576, S4096 563 -> 550 (no spills to save, the descriptors' work in the step),
# D64 S16384 529 -> 484 (causal 512 -> 507, the packed documents 403 -> 402), D64
# dropout 309 -> 306. "features": those calls; True / False: every call, none (tools
# A/B them).
KV_VIEWS_PER_STEP = "features"
# Packed sequences: a last key block whose second half lies past its sequence has its
# second warpgroup make only its part of dQ, from the first half's dS (_idle_steps).
# H100, tools/ab.py --variants default,no_idle --rounds 3: 900-token documents (a few
# keys in each last block) 348 -> 359 TFLOP/s, the bench's documents 481 -> 477 (within
# their spread, 473-495). Dense lengths that end so: B4 S4000 D=128 528 -> 523, D=64
# 458 -> 456, not taken. Tools set it to A/B, then call hopper.forget_plans().
IDLE_HALVES = True
PERSISTENT_BLOCKS = True
# Under a mask (causal, windows) at D=128, a program per key block instead, the (batch,
# kv head)s in groups of at least this many blocks, each group's blocks rank by rank
# (hopper.rank_major_item): the hardware hands the heaviest out first, so that the
# grid's tail is short blocks, where static strides end as unevenly as their pairs'
# count (a model of the bench's causal rows: ~3 % of the time idle; the window1024
# row, whose blocks' work does not pair, ~7 %). H100, tools/ab.py, folded strides ->
# 256, medians of 3-5 rounds in each of three calls: window1024 369 / 367 / 367 -> 381
# / 375 / 378 TFLOP/s, causal S4096 487 / 482 / 487 -> 496 / 491 / 499, S16384 578 /
# 578 / 581 -> 599 / 530 / 597, S2048 403 / 404 -> 409 / 413, S1024 299 / 300 -> 301
# / 301. D=64 lost (S1024 causal 275 -> 253, S4096 437 -> 417: its 128-row steps give
# blocks half the tiles, whose own start and end the persistent programs hide). The
# same order from a dynamic schedule in persistent programs lost at both (PERFORMANCE.md,
# "Levers that did not pay"). 0: folded.
MASKED_BY_RANK_BLOCKS = {64: 0, 128: 256}
# Masked calls whose heads have more key blocks than this run a program per block
# (heaviest first) where they would run folded strides (D=64). H100, tools/ab.py,
# folded -> a program per block, four calls (medians of 2-6 rounds): D64 S16384 causal
# 487 -> 523, 485 -> 516, 503 -> 512, 504 -> 464 TFLOP/s (rounds spread +-8 %); at
# S8192 (64 blocks) 476 -> 468, S4096 419 -> 426. Tools set it to A/B, then call
# hopper.forget_plans().
MASKED_PERSISTENT_MAX_BLOCKS = 64


def kv_views_per_step(spec: AttentionSpec, bias_row: bool) -> bool:
    """Whether the D 64/128 kernel makes K's and V's views in each step (KV_VIEWS_PER_STEP)."""
    if KV_VIEWS_PER_STEP != "features":
        return bool(KV_VIEWS_PER_STEP)
    feature = spec.dropout_p > 0 or spec.softcap > 0 or spec.has_alibi or spec.has_bias
    return bias_row or (feature and 128 in (spec.head_dim_qk, spec.head_dim_v))


def dq_buffers(spec: AttentionSpec, bias_tiles: bool, dbias_kind: str | None) -> int:
    """The kernel's DQ_BUFS: 0 (each compute warpgroup sends its dQ tiles), or where
    DQ_WRITER or DQ_WRITER_PACKED_UNMASKED says (and for ORDERED_DQ's calls) the dQ
    writer warp's buffers a warpgroup: two where shared memory holds them (no bias
    tiles, no dropout), else one. Not beside a bias gradient that leaves by TMA from
    the compute warpgroups (full, added, or summed through dQ's buffers)."""
    unmasked = spec.window_left < 0 and spec.window_right < 0
    writer = (DQ_WRITER[spec.head_dim_qk] or orders_dq(spec, dbias_kind)
              or (DQ_WRITER_PACKED_UNMASKED and spec.varlen and unmasked))
    if not writer or dbias_kind in TILE_GRADIENTS:
        return 0
    return 1 if bias_tiles or spec.dropout_p > 0 else 2


def orders_dq(spec: AttentionSpec, dbias_kind: str | None) -> bool:
    """Whether a deterministic call runs the D 64/128 kernel with dQ's adds in a fixed
    order (ORDERED_DQ): dense or packed batches (a packed sequence's blocks as a dense
    head's, their counters common.dq_tile's), and no bias gradient sent by TMA from the
    compute warpgroups (dQ's writer warp has no room beside it). dq_add_turn's orders
    wait only on programs started before, or (rotates_dq) running beside."""
    return (ORDERED_DQ and spec.deterministic and dq_in_fp32(spec)
            and dbias_kind not in TILE_GRADIENTS)


def rotates_dq(spec: AttentionSpec) -> bool:
    """Whether ORDERED_DQ's walks rotate (_walk_rotation): without bounds, where every
    key block of a head (packed sequences: of the longest) runs at once, at most half
    the SMs, to leave room for other streams' work; then no add waits in the steady
    state. Elsewhere without a right bound the blocks add first first, each one step
    behind the block before it (dq_add_turn)."""
    unbounded = spec.window_left < 0 and spec.window_right < 0
    return unbounded and cdiv(spec.seqlen_k, BLOCK_N) <= hopper.sm_count(spec.device.index) // 2


def dq_from_full_bias(spec: AttentionSpec, dbias_kind: str | None) -> bool:
    """Whether a deterministic call takes dQ = scale · dS K from the (B, H, Sq, Sk) dS
    the kernel stores (backward.dq_from_ds: one batched matmul, in a fixed order): the
    tiles leave no room for ORDERED_DQ's writer, so the kernel's own dQ adds would land
    in any order; it makes none. Dense batches with a full bias gradient, or one summed
    over batch or heads from dS stored expanded (dbias_kind_of's "expanded"), where dQ
    goes through the fp32 buffer (D 64/128)."""
    return (spec.deterministic and dbias_kind in ("full", "expanded") and not spec.varlen
            and dq_in_fp32(spec) and spec.softcap == 0)  # softcap: dS lacks tanh's derivative


def inner_dims(spec: AttentionSpec, bias, dbias_kind: str | None) -> tuple[bool, bool]:
    """Whether the batch or the kv head varies fastest in the programs' order: the one
    dimension a summed bias gradient broadcasts over (SUMMED_BIAS_INNER), neither when
    it broadcasts over both; the batch for bias tiles shared over the batch alone that
    ask no gradient (BIAS_TILES_BATCH_INNER; dense, not deterministic: ORDERED_DQ keeps
    its own order)."""
    if (BIAS_TILES_BATCH_INNER and dbias_kind is None and bias is not None
            and not spec.varlen and not spec.deterministic and not hopper.bias_row(spec, bias)):
        return (hopper.shared_over_batch(spec, hopper.bias_dims(bias)), False)
    if dbias_kind not in ("added", "summed") or not SUMMED_BIAS_INNER:
        return (False, False)
    batches, heads = hopper.bias_dims(bias)
    inner = (batches == 1 and spec.batch > 1, heads == 1 and spec.kv_heads > 1)
    return (False, False) if all(inner) else inner


def dbias_kind_of(spec: AttentionSpec, bias: torch.Tensor) -> str:
    """How the D 64/128 kernel makes a bias's gradient: "row" for one constant along
    queries (hopper.bias_row: dS summed over each head's queries in registers), "full"
    for one with an element per (b, h, i, j) (dS is the gradient: each tile stored as it
    is), "added" for a plane per head that up to PACKED_BIAS_ADDS packed sequences share
    (each tile added into the gradient by TMA reduce-add; not past 128 columns), "summed"
    for any other broadcast over batch or heads (dS added into an fp32 buffer by TMA
    reduce-adds, as dQ is; past 128 columns by atomics: _bwd_wide_kernel), but for
    deterministic dense calls "expanded": each (b, h)'s dS stored as a full gradient's
    is, into a (B, H, Sq, Sk) buffer that bias_grad_tiles' CONVERT then sums over the
    broadcast dimensions in a fixed order (as backward.py's deterministic calls do, in
    half its bytes: the bias's dtype, where it sums fp32), and dQ made from it
    (dq_from_full_bias)."""
    if hopper.bias_row(spec, bias):
        return "row"
    if hopper.bias_full(spec, bias):
        return "full"
    if (spec.varlen and spec.batch <= PACKED_BIAS_ADDS and not is_wide(spec)
            and hopper.bias_dims(bias) == (1, spec.heads)):
        return "added"
    if spec.deterministic and not spec.varlen and dq_in_fp32(spec):
        return "expanded"
    return "summed"


# dbias_kind_of's kinds whose tiles leave the compute warpgroups by TMA (stored or
# added), where the dQ writer warp has no room
TILE_GRADIENTS = ("full", "expanded", "added", "summed")


def row_stats_buffer(spec: AttentionSpec, lse: torch.Tensor) -> torch.Tensor:
    """One (2, B, H, Sq') float32 tensor for the row statistics the preprocess fills,
    [0] lse * log2(e) and [1] delta, rows padded to 16 bytes as TMA needs (the padding
    is never written or read: the descriptor's rows end at Sq). TMA reads past Sq give
    zeros, harmless: those rows have Q = dO = 0, so P·dO and dS vanish. Packed
    sequences (lse (H, Tq)) are one batch, (2, 1, H, Tq'), each sequence's rows from
    common.packed_stats_start on, then STATS_SLACK rows of +inf lse and zero delta (a
    query tile's rows past a sequence's end, the next one's, get P = 0 from them, so
    the tile needs no mask); nothing reads the rest."""
    if spec.varlen:
        heads, tokens = lse.shape
        slack = STATS_SLACK.value
        padded = cdiv(tokens + (slack + 4) * spec.batch + slack, 4) * 4  # packed_stats_start's
        return torch.empty(2, 1, heads, padded, dtype=torch.float32, device=lse.device)
    batch, heads, seqlen = lse.shape
    padded = cdiv(seqlen, 4) * 4
    return torch.empty(2, batch, heads, padded, dtype=torch.float32, device=lse.device)


def _row_stats_descriptor(stats: torch.Tensor, rows: int,
                          block_m: int = BLOCK_M) -> TensorDescriptor:  # fmt: skip
    """One descriptor over row_stats_buffer's tensor: [0, b, h, rows] is lse2,
    [1, b, h, rows] delta, block_m rows a box. rows: Sq, or the packed buffer's whole
    length."""
    block = (1, 1, 1, block_m)
    return hopper.make_descriptor(stats, [*stats.shape[:3], rows], list(stats.stride()),
                                  block, hopper.shared_layout(block, torch.float32))


_launch_backward = hopper.Launcher(_bwd_sm90_kernel)
_launch_backward_wide = hopper.Launcher(_bwd_wide_kernel)
_launch_dq_wide = hopper.Launcher(_bwd_dq_wide_kernel)
_launch_split = hopper.Launcher(_bwd_split_kernel)

def fuses_split_dq(spec: AttentionSpec) -> bool:
    """Whether the call runs _bwd_split_kernel (FUSED_SPLIT): Dqk=192 / Dv=128, not
    deterministic, without a bias, ALiBi, dropout or softcap (which the wide kernels
    take)."""
    return (FUSED_SPLIT and (spec.head_dim_qk, spec.head_dim_v) in SPLIT_HEAD_DIM_PAIRS
            and not spec.deterministic and not spec.has_bias and not spec.has_alibi
            and spec.dropout_p == 0 and spec.softcap == 0)


def dq_in_fp32(spec: AttentionSpec) -> bool:
    """Whether `backward` adds dQ into an fp32 buffer (zeroed beforehand, converted
    after: D 64 and 128, fuses_split_dq's) rather than writing the output itself (the
    wide kernels: is_wide)."""
    return not is_wide(spec)


def backward(spec: AttentionSpec, q, k, v, grad_out, bias, alibi_slopes, rng_state,
             cu_seqlens_q, cu_seqlens_k, stats, dq, dk, dv, dbias) -> None:
    """Fills dq, dk, dv and dbias (None: not needed; every tile a query sees is written,
    the rest left as it was) for a call dispatch.gluon_backward took; dq is an fp32 buffer,
    zeroed, that dQ is added into where `dq_in_fp32` says so, the output otherwise;
    stats as row_stats_buffer made it, filled; rng_state: dropout's [seed, offset],
    None without dropout. For a bias constant along queries (hopper.bias_row), dbias is
    a zeroed (B, H, Sk) fp32 buffer that takes dS summed over each head's queries; for
    one broadcast over batch or heads, a zeroed fp32 buffer of the bias's shape that
    takes every (b, h)'s dS added in, or for dbias_kind_of's "added" the zeroed gradient
    itself."""
    if fuses_split_dq(spec):
        return _backward_split(spec, q, k, v, grad_out, cu_seqlens_q, cu_seqlens_k, stats, dq,
                               dk, dv)
    if is_wide(spec):
        return _backward_wide(spec, q, k, v, grad_out, bias, alibi_slopes, rng_state,
                              cu_seqlens_q, cu_seqlens_k, stats, dq, dk, dv, dbias)
    bias_row = hopper.bias_row(spec, bias)
    dbias_kind = None if dbias is None else dbias_kind_of(spec, bias)
    how = _plan(spec, bias_row, dbias_kind, inner_dims(spec, bias, dbias_kind),
                k.shape[0] if spec.varlen else 0, q.device.index)
    dq_locks = dk  # a stand-in, never read
    if how.constexprs["ORDERED"]:  # a counter per dQ tile (packed: common.dq_tile's)
        rows = how.constexprs["BLOCK_M"]
        tiles = (q.shape[0] // rows + spec.batch if spec.varlen
                 else spec.batch * cdiv(spec.seqlen_q, rows))
        dq_locks = torch.zeros(tiles * spec.heads, dtype=torch.int32, device=q.device)
    # What the arguments are made of beside the plan, shapes included (the spec does not
    # fix packed sequences' token counts): hopper.Launcher.launch_prepared.
    call = (how, *map(hopper.tensor_key, (q, k, v, grad_out, stats, dq, dk, dv, bias, dbias,
                                           alibi_slopes, rng_state, cu_seqlens_q,
                                           cu_seqlens_k, dq_locks)))  # fmt: skip
    if _launch_backward.launch_prepared(how.programs, call):
        return
    half_d = spec.head_dim_qk // 2
    # K's tile is sliced by columns for dQ: its swizzle may not span more than a half.
    k_swizzle = min(128, half_d * k.element_size())
    k_strides, v_strides = dense_strides(dk, spec.varlen)[:3], dense_strides(dv, spec.varlen)[:3]
    dk_tma, dv_tma = dk, dv
    if spec.varlen:  # one batch of all tokens to TMA
        q, k, v, grad_out, dk_tma, dv_tma = (
            t.unsqueeze(0) for t in (q, k, v, grad_out, dk, dv))
    block_m = how.constexprs["BLOCK_M"]
    q_desc = hopper.descriptor(q, block_m, spec.head_dim_qk)
    bias_desc = dbias_desc = q_desc  # stand-ins, never read without a bias (gradient)
    bias_batches = bias_heads = 1
    if bias_row:
        bias_batches, bias_heads = hopper.bias_dims(bias)
    elif bias is not None:
        bias_desc = hopper.bias_descriptor(bias, block_m, BLOCK_N)
        bias_batches, bias_heads = bias_desc.shape[:2]
    if dbias_kind in TILE_GRADIENTS:  # a (queries, 64 keys) tile a warpgroup
        dbias_desc = hopper.bias_descriptor(dbias, block_m, BLOCK_N // 2)
    row_strides = hopper.bias_row_strides(bias if bias_row else None)
    partial_strides = dbias.stride()[:2] if dbias_kind == "row" else (0, 0)
    alibi_batch_stride, alibi_head_stride = alibi_strides(alibi_slopes)
    # What fixes the arguments' specialisation and the constexprs (hopper.Launcher): the
    # plan, the ints it does not fix, the pointers' alignment (dk, dv and a row bias's
    # gradient buffer are fresh, so aligned).
    variant = (how, bias_batches, bias_heads, alibi_batch_stride, alibi_head_stride,
               *row_strides, *partial_strides, hopper.aligned(rng_state),
               hopper.aligned(alibi_slopes), (bias.dtype, hopper.aligned(bias)) if bias_row
               else None, hopper.aligned(cu_seqlens_q), hopper.aligned(cu_seqlens_k))  # fmt: skip
    _launch_backward(
        (how.programs,),
        q_desc, hopper.descriptor(k, BLOCK_N, spec.head_dim_qk, k_swizzle),
        hopper.descriptor(v, BLOCK_N, spec.head_dim_v),
        hopper.descriptor(grad_out, block_m, spec.head_dim_v),
        _dq_tiles_descriptor(dq, block_m * half_d // 256),
        _row_stats_descriptor(stats, stats.shape[-1] if spec.varlen else spec.seqlen_q,
                              block_m),
        bias_desc, dbias_desc, hopper.descriptor(dk_tma, BLOCK_N // 2, spec.head_dim_qk),
        hopper.descriptor(dv_tma, BLOCK_N // 2, spec.head_dim_v), dk, dv, rng_state,
        alibi_slopes,
        cu_seqlens_q, cu_seqlens_k, dq_locks,
        bias if bias_row else dk, dbias if dbias_kind == "row" else dk,
        *k_strides, *v_strides,
        alibi_batch_stride, alibi_head_stride, *row_strides, *partial_strides,
        spec.kv_heads, spec.group, bias_batches, bias_heads, spec.seqlen_q, spec.seqlen_k,
        spec.batch, *how.counts, spec.scale, spec.window_left, spec.window_right, spec.dropout_p,
        spec.softcap, variant=variant, prepare=call, **how.constexprs,
    )  # fmt: skip


def block_m(spec: AttentionSpec, bias_row: bool) -> int:
    """Query rows a step of the D 64/128 kernel: 128 at D=64 where they fit (not at
    64/128, whose dV takes D=128's registers; not beside
    bias tiles: shared memory; nor with dropout, ALiBi or softcap: their registers,
    750-3400 bytes of spills in the sm_90 compile for the first two; softcap's tanh
    lives across dP's wait), else 64. bias_row: hopper.bias_row's."""
    bias_tiles = spec.has_bias and not bias_row
    wide = (spec.head_dim_qk == spec.head_dim_v == 64 and not bias_tiles and spec.dropout_p == 0
            and not spec.has_alibi and spec.softcap == 0)
    return BLOCK_M_D64 if wide else BLOCK_M


def dq_tiles(spec: AttentionSpec, tokens: int, rows: int, device: torch.device) -> torch.Tensor:
    """The fp32 buffer the D 64/128 kernel adds dQ into (dq_in_fp32), uninitialised (the
    preprocess zeroes it): per (batch, head), each ``rows``-row tile's (block_m's) two
    halves (dq_split: the compute warpgroups' parts), each in its registers' order
    (hopper.accumulator_order: the stores to shared memory without bank conflicts), as
    rows of 256 floats for TMA. Packed sequences (one batch): tiles for ``tokens`` //
    rows + sequences + 1 (common.dq_tile). It holds dS K without the softmax scale;
    _dq_from_tiles_kernel scales and converts it."""
    tiles = (tokens // rows + spec.batch + 1 if spec.varlen
             else cdiv(spec.seqlen_q, rows))  # fmt: skip
    per_tile = rows * spec.head_dim_qk // 256
    return torch.empty(1 if spec.varlen else spec.batch, spec.heads, tiles * per_tile, 256,
                       dtype=torch.float32, device=device)  # fmt: skip


def _dq_tiles_descriptor(dq: torch.Tensor, tile_rows: int) -> TensorDescriptor:
    """dq_tiles' TMA descriptor: half a tile a copy, unswizzled (the tile's order is its
    registers', hopper.accumulator_order)."""
    block = [1, 1, tile_rows, 256]
    return hopper.make_descriptor(dq, list(dq.shape), list(dq.stride()), block,
                                  gl.NVMMASharedLayout(0, 32, rank=4))


@triton.jit
def _dq_from_tiles_kernel(
    Tiles, DQ, CuSeqQ, stride_tb, stride_th, stride_qb, stride_qm, stride_qh, H, seqlen_q,
    num_m, scale, dq_cols, DQK: tl.constexpr, BLOCK_M: tl.constexpr, ROWS_SPLIT: tl.constexpr,
    BLOCK_D: tl.constexpr, PART_COLS: tl.constexpr, C_BITS: tl.constexpr,
    R_BITS: tl.constexpr, IS_VARLEN: tl.constexpr,
):  # fmt: skip
    """dQ in its dtype from dq_tiles' fp32 tiles, one tile (BLOCK_M rows) a program; its
    parts (dq_split) hold PART_COLS columns each, or with ROWS_SPLIT half the rows. The
    tiles hold dS K without the softmax scale: it goes in here, once a value, where the
    main kernels would pay a multiply per value and step (FA4's postprocess does the
    same). Columns from dq_cols on (past dQ's own, where DQK spans more:
    dispatch.kernel_spec) are not written."""
    b, h, _, m_block = row_block(num_m, H, False)
    start_m = m_block * BLOCK_M
    q_start, _, seqlen_q, _ = sequence_bounds(CuSeqQ, CuSeqQ, b, seqlen_q, seqlen_q, IS_VARLEN)
    if start_m < seqlen_q:
        tile = dq_tile(start_m, q_start, b, BLOCK_M, IS_VARLEN)
        rows = tl.arange(0, BLOCK_M)[:, None]
        cols = tl.arange(0, BLOCK_D)[None, :]  # DQK's next power of 2
        if ROWS_SPLIT:
            part = rows // (BLOCK_M // 2)
            at = accumulator_offset(rows % (BLOCK_M // 2), cols, C_BITS, R_BITS)
        else:
            part = cols // PART_COLS
            at = accumulator_offset(rows, cols % PART_COLS, C_BITS, R_BITS)
        parts: tl.constexpr = 2 if ROWS_SPLIT else DQK // PART_COLS
        off = ((parts * tile + part) * (BLOCK_M * DQK // parts)).to(tl.int64) + at
        b64 = b.to(tl.int64)
        h64 = h.to(tl.int64)
        x = tl.load(Tiles + b64 * stride_tb + h64 * stride_th + off, mask=cols < DQK)
        row64 = (q_start + start_m + rows).to(tl.int64)
        tl.store(DQ + b64 * stride_qb + h64 * stride_qh + row64 * stride_qm + cols,
                 (x * scale).to(DQ.dtype.element_ty),
                 mask=(rows < seqlen_q - start_m) & (cols < dq_cols))


_launch_dq_from_tiles = hopper.Launcher(_dq_from_tiles_kernel)


def dq_from_tiles_launch(spec: AttentionSpec, buffer: torch.Tensor, rows: int,
                         dq: torch.Tensor, cu_seqlens_q) -> tuple[tuple, tuple, dict]:  # fmt: skip
    """_dq_from_tiles_kernel's (grid, arguments, constexprs): dq (the output) from
    dq_tiles' ``buffer`` of ``rows``-row tiles."""
    num_m = cdiv(spec.seqlen_q, rows)
    split = dq_split(spec.head_dim_qk, rows)
    args = (buffer, dq, cu_seqlens_q, 0 if spec.varlen else buffer.stride(0), buffer.stride(1),
            *dense_strides(dq, spec.varlen)[:3], spec.heads, spec.seqlen_q, num_m, spec.scale,
            dq.shape[-1])
    constexprs = dict(DQK=spec.head_dim_qk, BLOCK_M=rows, ROWS_SPLIT=split[0] < rows,
                      BLOCK_D=triton.next_power_of_2(spec.head_dim_qk), PART_COLS=split[1],
                      C_BITS=(split[1] // 8).bit_length() - 1,
                      R_BITS=(split[0] // 64).bit_length() - 1, IS_VARLEN=spec.varlen)
    return (spec.batch * spec.heads * num_m,), args, constexprs


def _key_block_items(spec: AttentionSpec, num_n: int, block_n: int,
                     packed_tokens_k: int | None = None) -> int:  # fmt: skip
    """The programs of a backward grid of key blocks: num_n a (batch, kv head), or
    on the packed grid (_packed_key_item's; packed_tokens_k: the packed sequences' keys
    in all) hopper.packed_items over them."""
    if packed_tokens_k is not None:
        return hopper.packed_items(spec.batch, packed_tokens_k, spec.kv_heads, block_n)
    return num_n * spec.batch * spec.kv_heads


@hopper.plan_cache
def _plan(spec: AttentionSpec, bias_row: bool, dbias_kind: str | None,
          inner: tuple[bool, bool], tokens_k: int, device_index: int) -> hopper.Plan:  # fmt: skip
    """The D 64/128 kernel's launch (hopper.Plan): key blocks of each (batch, kv head)
    (packed sequences: hopper.packed_items over the keys, blocks of the longest with
    inner dims), persistent programs walking them where PERSISTENT_BLOCKS allows, else a
    program per block. bias_row: the bias is one row of keys (hopper.bias_row), read by
    pointer. dbias_kind: dbias_kind_of's, None without a bias gradient. inner: batch and
    kv head innermost in the programs' order (SUMMED_BIAS_INNER). tokens_k: packed
    sequences' key tokens in all (0 for dense batches). Counts: key blocks per head, and
    in all."""
    num_n = cdiv(spec.seqlen_k, BLOCK_N)
    bias_tiles = spec.has_bias and not bias_row
    ordered = orders_dq(spec, dbias_kind)
    dq_bufs = dq_buffers(spec, bias_tiles, dbias_kind)
    packed_grid = spec.varlen and not any(inner)
    items = _key_block_items(spec, num_n, BLOCK_N, tokens_k if packed_grid else None)
    # Persistent where the order of the blocks is free: not packed sequences (blocks
    # past a sequence's end), nor a summed bias gradient's or ORDERED_DQ's order, nor
    # under a mask where MASKED_BY_RANK_BLOCKS takes a program per block rank by rank,
    # or a head has more than MASKED_PERSISTENT_MAX_BLOCKS blocks.
    free_order = not spec.varlen and not ordered and not any(inner)
    masked = free_order and spec.window_right >= 0
    by_rank = MASKED_BY_RANK_BLOCKS[spec.head_dim_qk] if masked else 0
    persistent = (PERSISTENT_BLOCKS and free_order and not by_rank
                  and not (masked and num_n > MASKED_PERSISTENT_MAX_BLOCKS))
    fold = persistent and spec.window_right >= 0
    constexprs = dict(
        HEAD_DIM_QK=spec.head_dim_qk, HEAD_DIM_V=spec.head_dim_v,
        BLOCK_M=block_m(spec, bias_row), BLOCK_N=BLOCK_N, STAGES=STAGES,
        HAS_BIAS=bias_tiles,
        DBIAS_TILES={"full": 1, "expanded": 1, "added": 2}.get(dbias_kind, 0),
        DBIAS_SUM=dbias_kind == "summed",
        BIAS_ROW=bias_row, DBIAS_ROW=dbias_kind == "row", HAS_ALIBI=spec.has_alibi,
        HAS_DROPOUT=spec.dropout_p > 0, IS_VARLEN=spec.varlen,
        BOTTOM_RIGHT=spec.bottom_right, BOUNDED_LEFT=spec.window_left >= 0,
        BOUNDED_RIGHT=spec.window_right >= 0, BATCH_INNER=inner[0], HEAD_INNER=inner[1],
        SKIP_PAST_END=spec.varlen and SKIP_EMPTY_KEY_BLOCKS and not packed_grid,
        DQ_BUFS=dq_bufs, ORDERED=ordered, ROTATE=ordered and rotates_dq(spec),
        PERSISTENT=persistent, FOLD=fold, BY_RANK=by_rank,
        HAS_DQ=not dq_from_full_bias(spec, dbias_kind), HAS_SOFTCAP=spec.softcap > 0,
        KV_VIEWS_PER_STEP=kv_views_per_step(spec, bias_row),
        IDLE_KEYS=IDLE_HALVES and spec.varlen,
        num_warps=4,
    )  # fmt: skip
    return hopper.Plan(hopper.programs(items, fold, persistent, device_index), (num_n, items),
                       constexprs)


def _backward_wide(spec: AttentionSpec, q, k, v, grad_out, bias, alibi_slopes, rng_state,
                   cu_seqlens_q, cu_seqlens_k, stats, dq, dk, dv, dbias) -> None:  # fmt: skip
    """`backward` at head dims past 128 (is_wide): dK and dV (and a bias gradient: stored,
    added by atomics, or a key row's summed) from _bwd_wide_kernel, dQ from
    _bwd_dq_wide_kernel, dense or packed batches."""
    bias_row = hopper.bias_row(spec, bias)
    dbias_kind = None if dbias is None else dbias_kind_of(spec, bias)
    tokens = (q.shape[0], k.shape[0]) if spec.varlen else (0, 0)
    dkdv, dq_plan = _plans_wide(spec, bias_row, dbias_kind, *tokens, q.device.index)
    # What each launch's arguments are made of beside its plan:
    # hopper.Launcher.launch_prepared.
    inputs = tuple(map(hopper.tensor_key, (q, k, v, grad_out, stats, bias, alibi_slopes,
                                           rng_state, cu_seqlens_q, cu_seqlens_k)))  # fmt: skip
    dkdv_call = (dkdv, *inputs, *map(hopper.tensor_key, (dk, dv, dbias)))
    dq_call = (dq_plan, *inputs, hopper.tensor_key(dq))
    dkdv_launched = _launch_backward_wide.launch_prepared(dkdv.programs, dkdv_call)
    dq_launched = _launch_dq_wide.launch_prepared(dq_plan.programs, dq_call)
    if dkdv_launched and dq_launched:
        return
    split = hopper.qk_split(spec.head_dim_qk)
    key_strides = (*dense_strides(dk, spec.varlen)[:3], *dense_strides(dv, spec.varlen)[:3])
    dq_strides = dense_strides(dq, spec.varlen)[:3]
    stats_rows = stats.shape[-1] if spec.varlen else spec.seqlen_q
    dq_out, dk_out, dv_out = dq, dk, dv
    if spec.varlen:  # one batch of all tokens to TMA
        q, k, v, grad_out, dq, dk, dv = (t.unsqueeze(0) for t in (q, k, v, grad_out, dq, dk, dv))

    def parts(t, rows):  # Q's, K's, dK's or dQ's
        return _split_descriptors(t, rows, spec.head_dim_qk, split)

    q_desc, q2_desc = parts(q, BLOCK_M)
    do_desc = hopper.descriptor(grad_out, BLOCK_M, spec.head_dim_v)
    stats_desc = _row_stats_descriptor(stats, stats_rows)
    row_strides = hopper.bias_row_strides(bias if bias_row else None)
    bias_batches, bias_heads = hopper.bias_dims(bias) if bias is not None else (1, 1)
    alibi_batch_stride, alibi_head_stride = alibi_strides(alibi_slopes)
    options = (rng_state, alibi_slopes, bias if bias_row else dk_out, cu_seqlens_q,
               cu_seqlens_k)
    strides = (alibi_batch_stride, alibi_head_stride, *row_strides, bias_batches, bias_heads)
    # What fixes the launches' specialisation beside their plans (hopper.Launcher)
    variant = (*strides, *key_strides, *dq_strides, hopper.aligned(rng_state),
               hopper.aligned(alibi_slopes), hopper.aligned(cu_seqlens_q),
               hopper.aligned(cu_seqlens_k),
               (bias.dtype, hopper.aligned(bias)) if bias_row else None)  # fmt: skip

    def bias_tiles(rows, cols):  # a (queries, keys) tile a copy; a stand-in without
        tiles = bias is not None and not bias_row
        return hopper.bias_descriptor(bias, rows, cols) if tiles else q_desc

    if not dkdv_launched:
        dbias_strides = wide_grad_strides(spec, dbias, dbias_kind)
        # A warpgroup's dK columns are a slice of Q's tile, which its swizzle may not span
        # more than (Dqk=64: 32 columns, 64 bytes)
        q_cols = q_desc
        half_bytes = spec.head_dim_qk // 2 * q.element_size()
        if not split and half_bytes < 128:
            q_cols = hopper.descriptor(q, BLOCK_M, spec.head_dim_qk, half_bytes)
        k_desc, k2_desc = parts(k, BLOCK_N_WIDE)
        # dK's columns a warpgroup stores: half of them, or with a split each buffer's
        dk_parts = parts(dk, BLOCK_N_WIDE) if split else (
            hopper.descriptor(dk, BLOCK_N_WIDE, cols=spec.head_dim_qk // 2),) * 2
        _launch_backward_wide(
            (dkdv.programs,),
            q_cols, k_desc, hopper.descriptor(v, BLOCK_N_WIDE, spec.head_dim_v), do_desc,
            stats_desc, q2_desc,
            k2_desc, *dk_parts, hopper.descriptor(dv, BLOCK_N_WIDE, cols=spec.head_dim_v // 2),
            bias_tiles(BLOCK_M, BLOCK_N_WIDE), dk_out, dv_out, *options[:3],
            dk_out if dbias is None else dbias, *options[3:], *key_strides, *strides[:5],
            *dbias_strides, *strides[5:], spec.kv_heads, spec.group, spec.seqlen_q,
            spec.seqlen_k, spec.batch, *dkdv.counts, spec.scale, spec.window_left,
            spec.window_right, spec.dropout_p, spec.softcap,
            variant=(dkdv, *variant, *dbias_strides, None if dbias is None else dbias.dtype),
            prepare=dkdv_call, **dkdv.constexprs,
        )  # fmt: skip
    if not dq_launched:
        dq_block_n = dq_plan.constexprs["BLOCK_N"]
        k_desc, k2_desc = parts(k, dq_block_n)
        dq_desc, dq2_desc = parts(dq, ROWS.value)
        _launch_dq_wide(
            (dq_plan.programs,),
            q_desc, k_desc, hopper.descriptor(v, dq_block_n, spec.head_dim_v), do_desc, dq_desc,
            stats_desc,
            q2_desc, k2_desc, dq2_desc, bias_tiles(dq_plan.constexprs["BLOCK_M"], dq_block_n),
            dq_out, *options, *dq_strides, *strides, spec.heads, spec.group, spec.seqlen_q,
            spec.seqlen_k, spec.batch, *dq_plan.counts, spec.scale, spec.window_left,
            spec.window_right, spec.dropout_p, spec.softcap, variant=(dq_plan, *variant),
            prepare=dq_call, **dq_plan.constexprs,
        )  # fmt: skip


def wide_grad_strides(spec: AttentionSpec, dbias: torch.Tensor | None,
                      dbias_kind: str | None) -> tuple[int, int, int]:  # fmt: skip
    """The (batch, head, query) strides _bwd_wide_kernel stores a bias gradient by: a full
    one's as a (B, H, Sq, Sk) view (the bias, and so its gradient, may have fewer dims:
    (H, Sq, Sk) at B = 1), a summed one's fp32 buffer as a 4-D view of the bias's shape;
    a key row's (B, H, Sk) fp32 buffer's, no query stride; zeros without a gradient."""
    if dbias is None:
        return (0, 0, 0)
    if dbias_kind == "full":
        return tuple(dbias.view(spec.bias_shape).stride()[:3])
    if dbias_kind == "summed":  # the fp32 buffer in the bias's shape, padded to 4-D
        return tuple(dbias.view(hopper.bias_dims(dbias) + tuple(dbias.shape[-2:])).stride()[:3])
    return (*dbias.stride()[:2], 0)


def _split_descriptors(t: torch.Tensor, rows: int, width: int, split: int) -> tuple:
    """With a split (Dqk=192: hopper.qk_split's 64), descriptors of Q's, K's or dQ's
    first columns and of the last ``split`` of the kernel's ``width``; without, the second
    is a stand-in, never read."""
    first = hopper.descriptor(t, rows, width - split)
    return first, hopper.descriptor(t, rows, split) if split else first


def _backward_split(spec: AttentionSpec, q, k, v, grad_out, cu_seqlens_q, cu_seqlens_k, stats,
                    dq, dk, dv) -> None:  # fmt: skip
    """`backward` for fuses_split_dq's calls: _bwd_split_kernel, dQ added into dq
    (dq_tiles' fp32 buffer)."""
    how = _plan_split(spec, k.shape[0] if spec.varlen else 0, q.device.index)
    # What the arguments are made of beside the plan: hopper.Launcher.launch_prepared.
    call = (how, *map(hopper.tensor_key, (q, k, v, grad_out, cu_seqlens_q, cu_seqlens_k,
                                           stats, dq, dk, dv)))  # fmt: skip
    if _launch_split.launch_prepared(how.programs, call):
        return
    split = how.constexprs["QK_SPLIT"]
    rows = how.constexprs["BLOCK_M"]
    k_strides, v_strides = dense_strides(dk, spec.varlen)[1:3], dense_strides(dv, spec.varlen)[1:3]
    dk_tma, dv_tma = dk, dv
    if spec.varlen:  # one batch of all tokens to TMA
        q, k, v, grad_out, dk_tma, dv_tma = (
            t.unsqueeze(0) for t in (q, k, v, grad_out, dk, dv))
    q_desc, q2_desc = _split_descriptors(q, rows, spec.head_dim_qk, split)
    k_desc, k2_desc = _split_descriptors(k, SPLIT_KEYS, spec.head_dim_qk, split)
    part = dq_split(spec.head_dim_qk, rows)
    _launch_split(
        (how.programs,),
        q_desc, k_desc, hopper.descriptor(v, SPLIT_KEYS, spec.head_dim_v),
        hopper.descriptor(grad_out, rows, spec.head_dim_v),
        _dq_tiles_descriptor(dq, part[0] * part[1] // 256),
        _row_stats_descriptor(stats, stats.shape[-1] if spec.varlen else spec.seqlen_q),
        q2_desc, k2_desc, *_split_descriptors(dk_tma, SPLIT_KEYS, spec.head_dim_qk, split),
        hopper.descriptor(dv_tma, SPLIT_KEYS, spec.head_dim_v), dk, dv, cu_seqlens_q, cu_seqlens_k,
        *k_strides, *v_strides, spec.kv_heads, spec.group, spec.seqlen_q, spec.seqlen_k, spec.batch,
        *how.counts,
        spec.scale, spec.window_left, spec.window_right,
        variant=(how, hopper.aligned(cu_seqlens_q), hopper.aligned(cu_seqlens_k)),
        prepare=call, **how.constexprs,
    )  # fmt: skip


@hopper.plan_cache
def _plan_split(spec: AttentionSpec, tokens_k: int, device_index: int) -> hopper.Plan:
    """_bwd_split_kernel's launch (hopper.Plan): a program per key block and key head
    (packed sequences: hopper.packed_items over their tokens_k keys; counts: key blocks
    per head)."""
    block_n = SPLIT_WARPGROUPS * SPLIT_KEYS
    num_n = cdiv(spec.seqlen_k, block_n)
    return hopper.Plan(
        _key_block_items(spec, num_n, block_n, tokens_k if spec.varlen else None), (num_n,),
        dict(HEAD_DIM_QK=spec.head_dim_qk, HEAD_DIM_V=spec.head_dim_v,
             QK_SPLIT=hopper.qk_split(spec.head_dim_qk), BLOCK_M=BLOCK_M,
             WARPGROUPS=SPLIT_WARPGROUPS, STAGES=STAGES, IS_VARLEN=spec.varlen,
             BOTTOM_RIGHT=spec.bottom_right,
             BOUNDED_LEFT=spec.window_left >= 0, BOUNDED_RIGHT=spec.window_right >= 0,
             HEADS_TOGETHER=SPLIT_HEADS_TOGETHER, VIEWS_PER_STEP=SPLIT_VIEWS_PER_STEP,
             num_warps=4))  # fmt: skip


@hopper.plan_cache
def _plans_wide(spec: AttentionSpec, bias_row: bool, dbias_kind: str | None, tokens_q: int,
                tokens_k: int, device_index: int) -> tuple[hopper.Plan, hopper.Plan]:  # fmt: skip
    """The D=256 (and 192/128) launches (hopper.Plan): dK/dV, a program per key block
    and key head (counts: key blocks per head); dQ, a program per query block and head,
    or per pair of them folded under a mask (counts: query blocks per head, work items).
    Packed sequences (tokens_q, tokens_k: their tokens in all; 0 for dense batches): a
    program per item of the packed grids (hopper.packed_items over the keys, and over
    the queries as the forward's). bias_row: the bias is one row of keys
    (hopper.bias_row), read by pointer. dbias_kind: dbias_kind_of's ("full", "summed"
    or "row"), None without a bias gradient; dK/dV's kernel makes it."""
    bias_tiles = spec.has_bias and not bias_row
    bounds = dict(BOTTOM_RIGHT=spec.bottom_right, BOUNDED_LEFT=spec.window_left >= 0,
                  BOUNDED_RIGHT=spec.window_right >= 0, HEAD_DIM_QK=spec.head_dim_qk,
                  HEAD_DIM_V=spec.head_dim_v, QK_SPLIT=hopper.qk_split(spec.head_dim_qk),
                  HAS_BIAS=bias_tiles, BIAS_ROW=bias_row, HAS_ALIBI=spec.has_alibi,
                  HAS_DROPOUT=spec.dropout_p > 0, HAS_SOFTCAP=spec.softcap > 0,
                  IS_VARLEN=spec.varlen)
    num_n = cdiv(spec.seqlen_k, BLOCK_N_WIDE)
    dkdv = hopper.Plan(
        _key_block_items(spec, num_n, BLOCK_N_WIDE, tokens_k if spec.varlen else None), (num_n,),
        dict(BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N_WIDE, STAGES=STAGES, **bounds,
             DBIAS_FULL=dbias_kind == "full", DBIAS_SUM=dbias_kind == "summed",
             DBIAS_ROW=dbias_kind == "row", num_warps=4))
    block_m = 2 * ROWS.value
    num_m = cdiv(spec.seqlen_q, block_m)
    num_items = num_m * spec.batch * spec.heads
    if spec.varlen:
        num_items = hopper.packed_items(spec.batch, tokens_q, spec.heads, block_m)
    masked = spec.window_left >= 0 or spec.window_right >= 0
    fold = masked and num_m >= DQ_MIN_BLOCKS_TO_FOLD and not spec.varlen
    dq = hopper.Plan(hopper.programs(num_items, fold, False, device_index), (num_m, num_items),
                     dict(BLOCK_M=block_m, BLOCK_N=dq_block_n(spec),
                          KV_STAGES=dq_kv_stages(spec, bias_tiles), FOLD=fold, **bounds,
                          num_warps=4))  # fmt: skip
    return dkdv, dq


# The preprocess (backward.py's delta kernel, FOR_SM90), launched past JITFunction.run
# (hopper.Launcher): on the device's host that run() cost ~80 us a call, more than the
# kernel at 16k tokens.
_launch_delta = hopper.Launcher(tiles._delta_kernel)


@triton.jit
def _bias_grad_tiles_kernel(
    Buf, Out, CuSeqQ, CuSeqK, batches, heads, seqlen_q, seqlen_k, tiles_k, window_left,
    window_right, sum_batches, sum_heads, buf_heads, MODE: tl.constexpr,
    IS_VARLEN: tl.constexpr, BOTTOM_RIGHT: tl.constexpr, BAND: tl.constexpr,
    BOUNDED_LEFT: tl.constexpr, BOUNDED_RIGHT: tl.constexpr, BLOCK_Q: tl.constexpr,
    BLOCK_K: tl.constexpr,
):  # fmt: skip
    """One (query, key) tile of one (batch, head) plane of a contiguous bias gradient
    (B', H', Sq, Sk). Seen: the (query, key) pairs some call's batch that the plane
    serves sees (the causal or window band, BAND; with packed sequences and a bias plane
    a sequence, that sequence's own lengths). MODE 0 zeroes the fp32 buffer Buf where a
    tile holds a seen pair, 1 sums those tiles of Buf's planes into Out (sum_batches x
    sum_heads planes of Buf, buf_heads heads a batch: the summed buffer's one, or an
    expanded gradient's planes that a broadcast plane gathers) and writes zeros in the
    others, 2 writes zeros in Out wherever a pair is not seen."""
    pid = tl.program_id(0)
    tiles = pid // tiles_k
    tiles_q = tl.cdiv(seqlen_q, BLOCK_Q)
    bh = tiles // tiles_q
    r0 = (tiles % tiles_q) * BLOCK_Q
    c0 = (pid % tiles_k) * BLOCK_K
    n_q, n_k = seqlen_q, seqlen_k
    if IS_VARLEN:
        if batches > 1:  # plane b serves sequence b alone
            _, _, n_q, n_k = sequence_bounds(CuSeqQ, CuSeqK, bh // heads, seqlen_q, seqlen_k,
                                             True)  # fmt: skip
    off = diagonal_offset(n_q, n_k, BOTTOM_RIGHT)
    # The tile's pairs inside the plane, and those inside the plane's sequence; with
    # their key - query differences' range, whether some pair is seen and all are.
    end_q, end_k = tl.minimum(r0 + BLOCK_Q, seqlen_q), tl.minimum(c0 + BLOCK_K, seqlen_k)
    seq_q, seq_k = tl.minimum(end_q, n_q), tl.minimum(end_k, n_k)
    some = (r0 < seq_q) & (c0 < seq_k)
    every = (seq_q == end_q) & (seq_k == end_k)
    if BAND and BOUNDED_RIGHT:
        some = some & (c0 - (seq_q - 1) <= off + window_right)
        every = every & (end_k - 1 - r0 <= off + window_right)
    if BAND and BOUNDED_LEFT:
        some = some & (seq_k - 1 - r0 >= off - window_left)
        every = every & (c0 - (end_q - 1) >= off - window_left)
    rows = tl.arange(0, BLOCK_Q)[:, None]
    cols = tl.arange(0, BLOCK_K)[None, :]
    inside = (r0 + rows < seqlen_q) & (c0 + cols < seqlen_k)
    start = (bh.to(tl.int64) * seqlen_q + r0) * seqlen_k + c0
    offs = rows * seqlen_k + cols
    if MODE == 0:
        if some:
            tl.store(Buf + start + offs, tl.zeros([BLOCK_Q, BLOCK_K], tl.float32), mask=inside)
    elif MODE == 1:
        x = tl.zeros([BLOCK_Q, BLOCK_K], tl.float32)
        if some:  # Buf's planes (b + i, h + j): Out's (b, h) where it does not broadcast
            for i in range(sum_batches):
                for j in range(sum_heads):
                    plane = (bh // heads + i) * buf_heads + bh % heads + j
                    x += tl.load(Buf + (plane.to(tl.int64) * seqlen_q + r0) * seqlen_k + c0
                                 + offs, mask=inside, other=0.0).to(tl.float32)
        tl.store(Out + start + offs, x.to(Out.dtype.element_ty), mask=inside)
    else:
        zeros = tl.zeros([BLOCK_Q, BLOCK_K], Out.dtype.element_ty)
        if not some:  # stores masked by `inside` alone are vectorised (Sk % 16 == 0)
            tl.store(Out + start + offs, zeros, mask=inside)
        elif not every:  # a tile the band's edge or a sequence's end crosses
            seen = (r0 + rows < n_q) & visible(r0 + rows, c0 + cols, n_k, off, window_left,
                                                window_right, BOUNDED_LEFT and BAND,
                                                BOUNDED_RIGHT and BAND)  # fmt: skip
            tl.store(Out + start + offs, zeros, mask=inside & ~seen)


_launch_bias_grad_tiles = hopper.Launcher(_bias_grad_tiles_kernel)
ZERO_SEEN, CONVERT, ZERO_UNSEEN = 0, 1, 2  # _bias_grad_tiles_kernel's modes


def bias_grad_tiles(mode: int, spec: AttentionSpec, buf, out, cu_seqlens_q,
                    cu_seqlens_k) -> None:  # fmt: skip
    """_bias_grad_tiles_kernel over a bias gradient in the bias's shape (buf: the fp32
    buffer a summed gradient is added into, or the (B, H, Sq, Sk) one of an expanded
    gradient, to sum; out: the gradient; None where the mode takes none), so that the
    pairs no query sees are neither zeroed, read nor written twice."""
    t = buf if out is None else out
    shape = [1] * (4 - t.dim()) + list(t.shape)
    planes = shape if buf is None else [1] * (4 - buf.dim()) + list(buf.shape)
    # Buf's planes a plane of Out sums (more than one for an expanded gradient): batches,
    # heads; Buf's heads
    sums = (planes[0] // shape[0], planes[1] // shape[1], planes[1])
    block_q, block_k = 32, 128
    tiles_k = cdiv(shape[3], block_k)
    # Packed sequences sharing a plane: bottom-right diagonals differ by each's lengths,
    # unless their queries and keys are one count (one cu_seqlens): all pairs count.
    shared = spec.varlen and shape[0] == 1
    band = not (shared and spec.bottom_right and (
        cu_seqlens_q.data_ptr() != cu_seqlens_k.data_ptr()
        or cu_seqlens_q.shape != cu_seqlens_k.shape))
    constexprs = dict(MODE=mode, IS_VARLEN=spec.varlen, BOTTOM_RIGHT=spec.bottom_right,
                      BAND=band, BOUNDED_LEFT=spec.window_left >= 0,
                      BOUNDED_RIGHT=spec.window_right >= 0, BLOCK_Q=block_q,
                      BLOCK_K=block_k)  # fmt: skip
    ints = (*shape, tiles_k, spec.window_left, spec.window_right, *sums)
    _launch_bias_grad_tiles(
        (shape[0] * shape[1] * cdiv(shape[2], block_q) * tiles_k,), t if buf is None else buf,
        t, cu_seqlens_q, cu_seqlens_k, *ints,
        variant=(tuple(constexprs.items()), ints, None if buf is None else buf.dtype, t.dtype,
                 hopper.aligned(cu_seqlens_q), hopper.aligned(cu_seqlens_k)),
        num_warps=4, **constexprs)  # fmt: skip


def run(spec: AttentionSpec, grad_out, grad_lse, q, k, v, out, lse, bias, alibi_slopes,
        cu_seqlens_q, cu_seqlens_k, rng_state, needs) -> tuple:  # fmt: skip
    """The backward through this module's kernels, for a call dispatch.gluon_backward
    took (spec's head dims the kernels', dispatch.kernel_spec: the tensors' may be
    narrower): the preprocess fills the row statistics, padded for TMA, and, where the
    kernel adds dQ into an fp32 buffer, zeroes it; dQ is then converted at the end (or,
    for a deterministic call with a bias gradient by tiles, made from the stored dS:
    dq_from_full_bias). Returns (dq, dk, dv, dbias), None for what ``needs`` does not
    ask. Only what this path reads is computed, and the preprocess launches first,
    before the outputs are allocated: every line here is host time on each call, and
    what comes before the first launch is what a call waits for."""
    stats = row_stats_buffer(spec, lse)
    # (B, H, Sq padded) planes, packed sequences' (H, padded): lse * log2(e), delta
    lse2, delta = stats[:, 0] if spec.varlen else stats.unbind(0)
    _, need_dk, need_dv, need_dbias = needs
    dbias_kind = dbias_kind_of(spec, bias) if need_dbias else None
    dq_by_matmul = dq_from_full_bias(spec, dbias_kind)  # the kernel adds no dQ
    dq_acc, rows = None, 0
    if dq_in_fp32(spec):  # dQ tiles in their registers' order (dq_tiles)
        rows = block_m(spec, hopper.bias_row(spec, bias))
        dq_acc = dq_tiles(spec, q.shape[0], rows, q.device)
    zeroed, zeroed_rows = (None, 0) if dq_by_matmul else (dq_acc, rows)
    grid, args, constexprs = tiles.delta_launch(
        spec, out, grad_out, lse, grad_lse, cu_seqlens_q, delta, lse2, zeroed, zeroed_rows)
    # the stats and dq_acc fresh: what the spec does not fix is here
    variant = (spec, zeroed_rows, out.shape[-1], *out.stride(), *grad_out.stride(),
               *lse.stride(), *map(hopper.aligned, (out, grad_out, lse, cu_seqlens_q)),
               None if grad_lse is None else (*grad_lse.stride(), hopper.aligned(grad_lse)))
    _launch_delta(grid, *args, variant=variant, **constexprs)
    dq = new_output(q.shape, q.dtype, q.device)
    dk = new_output(k.shape, k.dtype, k.device)
    dv = new_output(v.shape, v.dtype, v.device)
    dbias = None
    if dbias_kind == "row":  # dS summed over queries per (b, h, key), then over broadcast dims
        dbias = torch.zeros(spec.batch, spec.heads, spec.seqlen_k, dtype=torch.float32,
                            device=bias.device)
    elif dbias_kind == "summed":  # every (b, h)'s dS added in, converted at the end
        dbias = torch.empty(bias.shape, dtype=torch.float32, device=bias.device)
        bias_grad_tiles(ZERO_SEEN, spec, dbias, None, cu_seqlens_q, cu_seqlens_k)
    elif dbias_kind == "added":  # every sequence's dS added in
        dbias = torch.zeros(bias.shape, dtype=bias.dtype, device=bias.device)
    elif dbias_kind in ("full", "expanded"):  # expanded: every (b, h)'s dS
        shape = bias.shape if dbias_kind == "full" else spec.bias_shape
        dbias = new_output(shape, bias.dtype, bias.device)
        # tiles no query sees (past a sequence too) are never written; the D 64/128
        # kernel writes a dense batch's zeros itself (_zero_unseen_ds_tiles)
        masked = spec.window_left >= 0 or spec.window_right >= 0
        if spec.varlen or (masked and is_wide(spec)):
            bias_grad_tiles(ZERO_UNSEEN, spec, None, dbias, cu_seqlens_q, cu_seqlens_k)
    backward(spec, q, k, v, grad_out, bias, alibi_slopes, rng_state, cu_seqlens_q,
             cu_seqlens_k, stats, dq if dq_acc is None else dq_acc, dk, dv, dbias)
    if dq_by_matmul:  # deterministic: dQ from the stored dS
        tiles.dq_from_ds(dq, dbias, k, spec)
    elif dq_acc is not None:
        grid, args, constexprs = dq_from_tiles_launch(spec, dq_acc, rows, dq, cu_seqlens_q)
        _launch_dq_from_tiles(grid, *args, variant=(spec, rows, dq.shape[-1], *dq.stride(),
                                                    hopper.aligned(cu_seqlens_q)),
                              num_warps=4, **constexprs)  # fmt: skip
    if dbias_kind == "row":
        dbias = hopper.sum_to_bias(dbias, bias)
    elif dbias_kind == "summed":
        summed, dbias = dbias, new_output(bias.shape, bias.dtype, bias.device)
        bias_grad_tiles(CONVERT, spec, summed, dbias, cu_seqlens_q, cu_seqlens_k)
    elif dbias_kind == "expanded":  # summed in fp32, in a fixed order, seen tiles alone
        expanded, dbias = dbias, new_output(bias.shape, bias.dtype, bias.device)
        bias_grad_tiles(CONVERT, spec, expanded, dbias, cu_seqlens_q, cu_seqlens_k)
    return dq, dk if need_dk else None, dv if need_dv else None, dbias
