"""What the Hopper backward's kernels share (narrow.py, split.py, wide.py): the load
warp's Q and dO tiles, the grid of key blocks and packed sequences' items on it, dQ's
fp32 tiles and the row statistics' buffer, and which kernel takes a call's head dims
and how it makes a bias's gradient (is_wide, fuses_split_dq, dbias_kind_of)."""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ...spec import AttentionSpec
from .. import hopper
from ..common import (
    cdiv,
    diagonal_offset,
    dq_tile,
    packed_items,
    query_range,
    sequence_bounds,
    visible,
)

BLOCK_M = 64  # query rows a step (registers: dK and dV take 2 * D / 2 a thread)
STAGES = 2  # Q and dO rings
# The preprocess, the main kernel (narrow's, split's) and dQ's conversion launch as
# programmatic dependents, each while the one before it ends (FA4's chain): the
# preprocess lets the main kernel launch at its start, whose load warp sends a block's
# K and V before it waits for the preprocess's writes (its statistics, dQ's zeroed
# buffer); the main kernel lets the conversion launch at its start, which waits for its
# end. The profiler showed the three launches one after the other leaving ~7 us of idle
# GPU a call (FA4's ~1.4), partly its own cost a launch: A/Bs read +1-4 % on one H200
# (the causal documents, D 64/128 at S1024), nothing on another (PERFORMANCE.md).
# The wide kernels' dQ kernel, the dK/dV kernel's own dependent, reads the statistics
# unwaited, so the dK/dV kernel launches once the preprocess has ended.
DEPENDENT_LAUNCHES = True


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
def _bwd_load_partition(
    q_desc, do_desc, k_desc, v_desc, stats_desc, bias_desc, q_smem, do_smem, k_smem, v_smem,
    lse_smem, delta_smem, bias_smem, kv_bar, q_ready, do_ready, q_empty, do_empty, b_tma,
    hk, q_start, k_start, stats_start, GROUP, bias_b, bias_heads, start_n, lo, n_tiles,
    q2_desc, k2_desc, q2_smem, k2_smem, BLOCK_M: gl.constexpr, STAGES: gl.constexpr,
    HAS_BIAS: gl.constexpr, QK_SPLIT: gl.constexpr, rot=0, ROTATE: gl.constexpr = False,
    step=0, first=0, WAIT_PRIMARY: gl.constexpr = False,
):  # fmt: skip
    """One warp: K and V once, then Q (with its rows' lse and the bias tile) and dO
    (with delta) tiles of every query head of the group. b_tma: the batch's index to
    TMA, 0 for packed sequences (one batch of all tokens), whose tiles start at their
    sequence's first token (q_start, k_start; 0 dense) and their row statistics at
    stats_start (common.packed_stats_start; 0 dense). With QK_SPLIT, Q's and K's last
    QK_SPLIT columns go to buffers of their own (q2, k2) on the same barriers. step: the
    rings' count of tiles before this block's (a persistent program's earlier blocks);
    first: the block's tiles loaded before (_bwd_blocks_load_partition). WAIT_PRIMARY
    (DEPENDENT_LAUNCHES): K and V go out before the wait for the preprocess's writes,
    which the query tiles' row statistics are."""
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
    if WAIT_PRIMARY:
        hopper.wait_for_primary()
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
def _packed_key_item(pid, HKV, CuSeqK, num_seqs, num_n_blocks, BLOCK_N: gl.constexpr,
                     DESCENDING: gl.constexpr = False):  # fmt: skip
    """The item of _key_block's grid (packed sequences' key blocks counted to the
    longest) that program pid of the packed grid stands for, -1 past its sequence's
    blocks. The packed grid (common.packed_items over the keys, in packed_head_rank's
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
    DESCENDING: gl.constexpr = False, batches=1,
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
    vary fastest instead (SUMMED_BIAS_INNER), of ``batches`` (sequences). DESCENDING
    (ORDERED_DQ under a right bound): each head's key blocks last first, so that a
    program's dQ adds wait only on programs started before it (dq_add_turn), the inner
    dims' too."""
    if BATCH_INNER or HEAD_INNER:
        rest = item
        if BATCH_INNER:
            b = rest % batches
            rest = rest // batches
        if HEAD_INNER:
            hk = rest % HKV
            rest = rest // HKV
        start_n = (rest % num_n_blocks) * BLOCK_N
        if DESCENDING and not IS_VARLEN:
            start_n = (num_n_blocks - 1 - rest % num_n_blocks) * BLOCK_N
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
            if start_n + BLOCK_N <= seqlen_k:  # from their statistics (common.row_stats_buffer)
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
# 192/128 on split.py's kernel (fuses_split_dq); False: on the wide kernels (tools A/B
# it, then call hopper.forget_plans()).
FUSED_SPLIT = True


def is_wide(spec: AttentionSpec) -> bool:
    """Whether the call runs the wide kernels (_bwd_wide_kernel, _bwd_dq_wide_kernel):
    head dims past 128, q·k's or V's (but fuses_split_dq's)."""
    return max(spec.head_dim_qk, spec.head_dim_v) > 128 and not fuses_split_dq(spec)


def takes_head_dims(spec: AttentionSpec) -> bool:
    """Whether these kernels take the call's head dims (HEAD_DIM_PAIRS and
    SPLIT_HEAD_DIM_PAIRS)."""
    dims = (spec.head_dim_qk, spec.head_dim_v)
    return dims in HEAD_DIM_PAIRS or dims in SPLIT_HEAD_DIM_PAIRS


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


def dbias_kind_of(spec: AttentionSpec, bias: torch.Tensor) -> str:
    """How the D 64/128 kernel makes a bias's gradient: "row" for one constant along
    queries (hopper.bias_row: dS summed over each head's queries in registers), "full"
    for one with an element per (b, h, i, j) (dS is the gradient: each tile stored as it
    is), "added" for a plane per head that up to PACKED_BIAS_ADDS packed sequences share
    (each tile added into the gradient by TMA reduce-add; not past 128 columns), "summed"
    for any other broadcast over batch or heads (dS added into an fp32 buffer by TMA
    reduce-adds, as dQ is; past 128 columns by atomics: _bwd_wide_kernel), but for
    deterministic dense calls "ordered": the same buffer, each tile's adds (and dQ's)
    in turns (turns.bias_sum_turn), with no expanded (B, H, Sq, Sk) buffer."""
    if hopper.bias_row(spec, bias):
        return "row"
    if hopper.bias_full(spec, bias):
        return "full"
    if (spec.varlen and spec.batch <= PACKED_BIAS_ADDS and not is_wide(spec)
            and hopper.bias_dims(bias) == (1, spec.heads)):
        return "added"
    if spec.deterministic and not spec.varlen and dq_in_fp32(spec):
        return "ordered"
    return "summed"


# dbias_kind_of's kinds whose tiles leave the compute warpgroups by TMA (stored or
# added), where the dQ writer warp has no room
TILE_GRADIENTS = ("full", "added", "summed", "ordered")
# dbias_kind_of's kinds added into an fp32 buffer in the bias's shape, converted after
SUMMED_GRADIENTS = ("summed", "ordered")


# dQ's conversion (the D 64/128 kernel's fp32 tiles to dQ) by (sequence, kv head): the
# main kernel counts each key block once its dQ adds have landed (hopper.end_turn), and
# the conversion's programs, persistent and launched as its dependents, take its tiles
# in the main grid's order from a queue, each once its head's blocks are counted, in the
# SMs the main grid's last wave frees, instead of all after the main kernel's end. Where
# that grid has a tail: packed calls, and masked dense ones by Dqk (MASKED_BY_HEAD).
DQ_CONVERTED_BY_HEAD = True
DQ_CONVERSION_PROGRAMS_PER_SM = 8
# Not for masked dense calls at Dqk=128: a program there takes one key block (the narrow
# kernel's MASKED_BY_RANK_BLOCKS), and its wait for the block's adds to land before it
# counts the block holds back the next program on its SM more than the early conversion
# saves. H200, tools/ab.py --pass bwd --rounds 5, by head -> after the grid: D128 causal
# S4096 494 -> 505 TFLOP/s, S16384 564 -> 572, S2048 428 -> 424, window 1024 399 -> 393
# (their rounds overlapping); the main kernel at S512 causal 279 -> 266 us, S4096 causal
# 1251 -> 1196. D=64 (folded strides) keeps it: S4096 causal 441 against 438.
MASKED_BY_HEAD = {64: True, 128: False}
# ... but causal dense calls at Dqk=128 of at most this many keys (8 of the narrow
# kernel's key blocks) run as D=64's masked calls do: folded persistent strides (each
# block's start under the last one's end; the narrow kernel's _plan), their dQ converted
# by head. Short heads' programs are short, and their starts and ends weigh most. H200,
# B x S = 16384, H16, out.backward timed as the bench does (do_bench, 4 rounds each),
# rank by rank -> folded -> folded and by head: S512 386.0 -> 374.3 -> 373.9 us, S1024
# 505.8 -> 503.7 -> 499.3; S4096 1385 -> 1405 -> 1386, S2048 folded 804 -> 806.
SHORT_CAUSAL_KEYS = 1024


def folds_short_causal(spec: AttentionSpec) -> bool:
    """Whether a call runs as SHORT_CAUSAL_KEYS says: causal, dense, not deterministic
    (ORDERED_DQ's plans), at Dqk=128."""
    return (spec.head_dim_qk == 128 and not spec.varlen and not spec.deterministic
            and spec.window_left < 0 and spec.window_right >= 0
            and spec.seqlen_k <= SHORT_CAUSAL_KEYS)


def converts_dq_by_head(spec: AttentionSpec) -> bool:
    """Whether dQ's conversion goes by (sequence, kv head) (DQ_CONVERTED_BY_HEAD) for a
    call whose dQ the D 64/128 kernel adds in fp32."""
    masked = spec.window_left >= 0 or spec.window_right >= 0
    return (DQ_CONVERTED_BY_HEAD and DEPENDENT_LAUNCHES and dq_in_fp32(spec)
            and not fuses_split_dq(spec)
            and (spec.varlen or (masked and (MASKED_BY_HEAD[spec.head_dim_qk]
                                             or folds_short_causal(spec)))))


def _row_stats_descriptor(stats: torch.Tensor, rows: int,
                          block_m: int = BLOCK_M) -> TensorDescriptor:  # fmt: skip
    """One descriptor over common.row_stats_buffer's tensor: [0, b, h, rows] is lse2,
    [1, b, h, rows] delta, block_m rows a box. rows: Sq, or the packed buffer's whole
    length."""
    block = (1, 1, 1, block_m)
    return hopper.make_descriptor(stats, [*stats.shape[:3], rows], list(stats.stride()),
                                  block, hopper.shared_layout(block, torch.float32))


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


def _key_block_items(spec: AttentionSpec, num_n: int, block_n: int,
                     packed_tokens_k: int | None = None) -> int:  # fmt: skip
    """The programs of a backward grid of key blocks: num_n a (batch, kv head), or
    on the packed grid (_packed_key_item's; packed_tokens_k: the packed sequences' keys
    in all) common.packed_items over them."""
    if packed_tokens_k is not None:
        return packed_items(spec.batch, packed_tokens_k, spec.kv_heads, block_n)
    return num_n * spec.batch * spec.kv_heads


def _split_descriptors(t: torch.Tensor, rows: int, width: int, split: int) -> tuple:
    """With a split (Dqk=192: hopper.qk_split's 64), descriptors of Q's, K's or dQ's
    first columns and of the last ``split`` of the kernel's ``width``; without, the second
    is a stand-in, never read."""
    first = hopper.descriptor(t, rows, width - split)
    return first, hopper.descriptor(t, rows, split) if split else first
