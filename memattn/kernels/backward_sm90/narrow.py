"""The Hopper backward at Dqk and Dv up to 128 (64/64, 128/128, 128/64, 64/128), in
Gluon, warp-specialised (FlashAttention-3's structure).

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
Deterministic calls add into each fp32 tile in a fixed order, in turns (turns.py):
dQ's tiles through the dQ writer warp (ORDERED_DQ); with a bias gradient summed over
batch or heads (dbias_kind_of's "ordered") the compute warpgroups add both kinds of
tile themselves and hand each turn to one of two counting warps
(_bwd_turn_counter_partition), whose release makes the adds visible to the programs
waiting for them. The turns follow the order in which the programs reach a tile: where
they would reach it together, their walks are spread (the kv heads') or their starts
staggered (the batches' under a causal mask: _staggered_item), a step or two apart, no
more: a tile's adds must meet in L2. Where every wait is on a block that a program
reaches earlier in the grid's order, the programs are persistent: on the blocks the
host dealt them in that order (ORDERED_DEALT) or, for a summed bias gradient under a
causal mask, on folded strides (ORDERED_SUM_FOLD); a summed bias gradient's other
calls on strides of whole groups of the blocks that must run at once
(ORDERED_SUM_PERSISTENT).
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from ...spec import AttentionSpec
from .. import hopper, shares_sms
from ..common import (
    LOG2E,
    add_bias_alibi_log2,
    alibi_strides,
    cdiv,
    packed_stats_start,
    philox_key,
    tanh,
)
from ..forward import dense_strides
from . import shared
from .shared import (
    BLOCK_M,
    STAGES,
    SUMMED_GRADIENTS,
    TILE_GRADIENTS,
    _bwd_load_partition,
    _dq_tile_row,
    _dq_tiles_descriptor,
    _key_block,
    _key_block_items,
    _kv_views,
    _operand_buffers,
    _packed_key_item,
    _query_tile,
    _query_tile_loads,
    _row_stats_descriptor,
    _runtime_zero,
    _store_rows,
    _store_transposed,
    _visible_t,
    dbias_kind_of,
    dq_in_fp32,
    dq_split,
    keeps_bits_in_shared,
)
from .turns import (
    ROTATE_BY_BLOCK,
    ROTATE_NONE,
    SPREAD_OVER_KV_HEADS,
    dq_add_turn,
    dq_tile_lock,
    spread_span,
    step_turns,
    wait_bias_sum_turn,
    walk_start,
)

BLOCK_N = 128  # keys a program: two warpgroups x 64
# Query rows a step at D=64 (a knob tools/ab.py sets): dK and dV take 64 registers a
# thread there, S and dP 64 each at 128 rows (FA4's D=64 step).
BLOCK_M_D64 = 128
# How the programs take their key blocks (the PERSISTENT constexpr): a program per
# block, or one per SM at most walking hopper.work_item's strides (PERSISTENT_BLOCKS)
# or the blocks the host dealt it (ORDERED_DEALT).
PER_BLOCK = gl.constexpr(0)
STRIDES = gl.constexpr(1)
DEALT = gl.constexpr(2)


@gluon.constexpr_function
def overlaps_block_ends(persistent, fold, block_m):
    """Whether a program's key blocks overlap one's end with the next one's start: folded
    or dealt (ORDERED_DEALT) D=64 blocks (128-row steps under a mask: few steps a
    block). The load warp sends the next block's first Q and dO tiles before it waits
    for K and V to free; the compute warpgroups free K and V once the last step's dQ
    wgmma is done, and let dK and dV leave through the writer warp's buffer that the
    next block's first dQ tile takes (its last reduce-add read a step earlier than the
    last tile's), which that tile's write then waits for. Elsewhere the checks in the
    step loop cost more than they save (PERFORMANCE.md, "Levers that did not pay")."""
    return (fold or persistent == DEALT.value) and block_m == 128


@gluon.jit
def _bwd_blocks_load_partition(
    loads, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
    HAS_BIAS: gl.constexpr, IS_VARLEN: gl.constexpr, BOTTOM_RIGHT: gl.constexpr,
    BOUNDED_LEFT: gl.constexpr, BOUNDED_RIGHT: gl.constexpr, BATCH_INNER: gl.constexpr,
    HEAD_INNER: gl.constexpr, ORDERED: gl.constexpr, ROTATE: gl.constexpr,
    PERSISTENT: gl.constexpr, FOLD: gl.constexpr, PDL: gl.constexpr,
):  # fmt: skip
    """_bwd_sm90_kernel's load warp: _bwd_load_partition's loads for each of the
    program's key blocks (_program_block), each block's K and V once the compute
    warpgroups are done with the last block's (kv_empty), while they store its dK and
    dV; the Q and dO rings run on from block to block. ``loads``: its runtime
    arguments (``blocks``: _program_block's). PDL (shared.DEPENDENT_LAUNCHES): the first
    reads of the preprocess's writes wait for its end; the other warps' first reads and
    writes of them (dQ's buffer, its counters) follow from those."""
    # The overlapped ends send a block's first query tile before its K and V.
    WAIT_AFTER_KV: gl.constexpr = PDL and not overlaps_block_ends(PERSISTENT, FOLD, BLOCK_M)
    if PDL and not WAIT_AFTER_KV:
        hopper.wait_for_primary()
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
        rot = walk_start(hk, start_n, n_tiles, seqlen_k, blocks, BLOCK_N, ROTATE)
        first = 0
        if overlaps_block_ends(PERSISTENT, FOLD, BLOCK_M):  # the block's first Q and dO
            # tiles, whose slots free before the last block's K and V do
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
            HAS_BIAS, 0, rot, ROTATE, step, first, WAIT_AFTER_KV)  # fmt: skip
        step += GROUP * n_tiles


@gluon.jit
def _staggered_item(pid, ranks, batches, stagger):
    """A batch-inner grid's item (_key_block's: batch inner, then rank, then kv head)
    for program pid, each kv head's ranks x batches blocks in the order of rank +
    stagger * batch, then the batch (ORDERED_BATCH_STAGGER): each batch's blocks in rank
    order, and a batch's block of a rank stagger ranks' programs after the batch
    before's."""
    group = ranks * batches
    p = pid % group
    key = p * 0
    seen = p * 0
    lo = p * 0
    count = gl.minimum(batches - 1, key // stagger) - lo + 1
    while seen + count <= p:
        seen += count
        key += 1
        lo = (gl.maximum(key - ranks + 1, 0) + stagger - 1) // stagger
        count = gl.minimum(batches - 1, key // stagger) - lo + 1
    b = lo + p - seen
    return (pid // group * ranks + key - stagger * b) * batches + b


@gluon.jit
def _program_block(
    j, blocks, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, IS_VARLEN: gl.constexpr,
    BOTTOM_RIGHT: gl.constexpr, BOUNDED_LEFT: gl.constexpr, BOUNDED_RIGHT: gl.constexpr,
    BATCH_INNER: gl.constexpr, HEAD_INNER: gl.constexpr, DESCENDING: gl.constexpr,
    PERSISTENT: gl.constexpr, FOLD: gl.constexpr,
):  # fmt: skip
    """_key_block's tuple for this program's j-th key block: the grid item of its own;
    PERSISTENT == STRIDES, the j-th of hopper.work_item's strides over (batch, kv head) x
    key blocks (rank 0 a head's first block, the most work under a causal mask; FOLD: in
    pairs of equal work); DEALT, the j-th the host dealt it (the grid's items, pid its
    first entry in Schedule). ``blocks``: (pid, programs, HKV, CuSeqQ, CuSeqK, seqlen_q,
    seqlen_k, num_n_blocks, window_left, window_right, spread steps, Schedule, batches).
    Every partition walks the same blocks."""
    (pid, programs, HKV, CuSeqQ, CuSeqK, seqlen_q, seqlen_k, num_n_blocks, window_left,
     window_right, _, Schedule, batches) = blocks
    item = pid
    if PERSISTENT == DEALT:
        item = gl.load(Schedule + pid + j)
    elif PERSISTENT == STRIDES:
        head, rank = hopper.work_item(pid, j, programs, num_n_blocks, FOLD)
        item = head * num_n_blocks + rank
    return _key_block(item, HKV, CuSeqQ, CuSeqK, seqlen_q, seqlen_k, num_n_blocks, window_left,
                      window_right, BLOCK_M, BLOCK_N, IS_VARLEN, BOTTOM_RIGHT, BOUNDED_LEFT,
                      BOUNDED_RIGHT, BATCH_INNER, HEAD_INNER, DESCENDING and BOUNDED_RIGHT,
                      batches)


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
    KV_VIEWS_PER_STEP: gl.constexpr, IDLE_KEYS: gl.constexpr, TURN_LAG: gl.constexpr,
    COUNT_HEADS: gl.constexpr,
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
     softcap, DqLocks, SumLocks, landed, counted, HeadsDone) = shared
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
    OVERLAP_ENDS: gl.constexpr = overlaps_block_ends(PERSISTENT, FOLD, BLOCK_M)
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
    # Deterministic with a bias gradient summed over batch or heads ("ordered"):
    # this warpgroup adds dS's fp32 tiles and dQ's itself, each in its turn, and hands a
    # step's turns to the counting warps TURN_LAG steps later (ORDERED_SUM_TURN_LAG; the
    # copies alternate, two a step, so that wait_group leaves the later ones in flight),
    # so that it does not wait for its adds to land as it makes them.
    ORDERED_SUM: gl.constexpr = ORDERED and DBIAS_SUM
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
        rot = walk_start(hk, start_n, n_tiles, seqlen_k, blocks, BLOCK_N, ROTATE)
        mbarrier.wait(kv_bar, blk & 1)
        if ORDERED_SUM:  # step_turns' arguments beside the step
            turns_of = (b, hk, GROUP, lo, n_tiles, rot, start_n, seqlen_q, seqlen_k, off,
                        window_left, window_right, heads, bias_batches, bias_heads,
                        spread_span(n_tiles, blocks))  # fmt: skip

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
            if ORDERED_SUM:  # while S and dP run: the summed tile of TURN_LAG steps ago
                # has landed, its turn goes to be counted (the adds since, two a step, run
                # on); this step's counters are read ahead, spun on below only if not at
                # their turns
                if t >= TURN_LAG:
                    hopper.hand_over_turn(landed, counted, i - TURN_LAG, 0, TURN_RING,
                                          2 * TURN_LAG - 1)  # fmt: skip
                sum_lock, sum_count, dq_lock, dq_count = step_turns(
                    t, turns_of, BLOCK_M, BLOCK_N, BOUNDED_LEFT, BOUNDED_RIGHT, ROTATE)
                sum_ready = hopper.load_acquire(SumLocks + sum_lock) == sum_count
                dq_ready = hopper.load_acquire(DqLocks + dq_lock) == dq_count
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
                    if ORDERED_SUM:
                        wait_bias_sum_turn(sum_ready, SumLocks, t, turns_of, BLOCK_M, BLOCK_N,
                                           BOUNDED_LEFT, BOUNDED_RIGHT, ROTATE)  # fmt: skip
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
                if ORDERED_SUM:
                    wait_bias_sum_turn(sum_ready, SumLocks, t, turns_of, BLOCK_M, BLOCK_N,
                                       BOUNDED_LEFT, BOUNDED_RIGHT, ROTATE)  # fmt: skip
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

            if ORDERED_SUM:  # likewise dQ's tile of TURN_LAG steps ago; this one's turn
                if t >= TURN_LAG:
                    hopper.hand_over_turn(landed, counted, i - TURN_LAG, 1, TURN_RING,
                                          2 * TURN_LAG - 1)  # fmt: skip
                if not dq_ready:
                    _, _, dq_lock, dq_count = step_turns(
                        t, turns_of, BLOCK_M, BLOCK_N, BOUNDED_LEFT, BOUNDED_RIGHT, ROTATE)
                    hopper.wait_turn(DqLocks + dq_lock, dq_count)
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
        if ORDERED_SUM:  # the last TURN_LAG steps' turns, once all has landed
            for lag in gl.static_range(TURN_LAG):
                if busy_steps - TURN_LAG + lag >= 0:
                    last = step + busy_steps - TURN_LAG + lag
                    hopper.hand_over_turn(landed, counted, last, 0, TURN_RING, 0)
                    hopper.hand_over_turn(landed, counted, last, 1, TURN_RING, 0)
        step += GROUP * n_tiles
        if not OVERLAP_ENDS or n_tiles == 0:  # done with K and V: the next block's
            mbarrier.arrive(kv_empty)  # may load
        if DQ_BUFS == 0 and COUNT_HEADS:  # its dQ adds landed: a warp's count of the
            hopper.end_turn(HeadsDone + b * blocks[2] + hk)  # block's
        tma.store_wait(0)  # the last dQ (and bias gradient) copies have read their buffers

        _store_block_grads(
            dk, dv, dk_desc, dv_desc, DK, DV, stride_kb, stride_kn, stride_kh, stride_vb,
            stride_vn, stride_vh, dq_smem, dq_empty, b, b_tma, hk, k_start, row0, seqlen_k, step,
            scale, dropout_p, HALF, HALF_N, HEAD_DIM_QK, HEAD_DIM_V, DQ_BUFS, HAS_DROPOUT,
            IS_VARLEN, OVERLAP_ENDS, TOGETHER, DV_STAGED, dk_layout, dv_layout)  # fmt: skip
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
def _store_block_grads(
    dk, dv, dk_desc, dv_desc, DK, DV, stride_kb, stride_kn, stride_kh, stride_vb, stride_vn,
    stride_vh, dq_smem, dq_empty, b, b_tma, hk, k_start, row0, seqlen_k, step, scale,
    dropout_p, HALF: gl.constexpr, HALF_N: gl.constexpr, HEAD_DIM_QK: gl.constexpr,
    HEAD_DIM_V: gl.constexpr, DQ_BUFS: gl.constexpr, HAS_DROPOUT: gl.constexpr,
    IS_VARLEN: gl.constexpr, OVERLAP_ENDS: gl.constexpr, TOGETHER: gl.constexpr,
    DV_STAGED: gl.constexpr, dk_layout: gl.constexpr, dv_layout: gl.constexpr,
):  # fmt: skip
    """A block's dK and dV (keys [row0, + HALF_N), fp32 registers) out, scaled: by TMA
    store through this warpgroup's dQ buffer (both at once where TOGETHER, dV by plain
    stores where its tile does not fit: not DV_STAGED), or by plain stores where a
    packed sequence's keys end inside the block (a TMA store clips at the packed
    tensor's end, not the sequence's). ``step``: the rings' count after the block (the
    writer warp's last dQ tile read from the buffer first, DQ_BUFS > 0)."""
    dtype: gl.constexpr = dk_desc.dtype
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


@gluon.jit
def _bwd_dq_writer_partition(
    dq_desc, dq_smem, dq_full, dq_empty, blocks, n_items, GROUP, DqLocks, heads, HeadsDone,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, DQ_BUFS: gl.constexpr,
    IS_VARLEN: gl.constexpr, BOTTOM_RIGHT: gl.constexpr, BOUNDED_LEFT: gl.constexpr,
    BOUNDED_RIGHT: gl.constexpr, BATCH_INNER: gl.constexpr, HEAD_INNER: gl.constexpr,
    ORDERED: gl.constexpr, ROTATE: gl.constexpr, PERSISTENT: gl.constexpr,
    FOLD: gl.constexpr, PDL: gl.constexpr, COUNT_HEADS: gl.constexpr,
):  # fmt: skip
    """One warp (DQ_WRITER, ORDERED_DQ): for each of its program's key blocks
    (_program_block), each step's two dQ halves, left in dq_smem by the compute
    warpgroups, added into the fp32 buffer by TMA reduce-add; their buffers released
    once read. The compute warpgroups then neither issue nor wait for these copies
    (FA4's dQ warp). ORDERED: each tile's adds wait for their turn (dq_add_turn) on the
    tile's counter in DqLocks, and count it on once they are done. ``blocks``: as
    _program_block takes them. PDL: the counters, zeroed by the kernel before this one,
    are read once it has ended (shared.DEPENDENT_LAUNCHES)."""
    if PDL:
        hopper.wait_for_primary()
    TILE_ROWS: gl.constexpr = dq_desc.block_type.shape[2]
    window_left, window_right = blocks[8], blocks[9]
    step = gl.to_tensor(0)  # the rings' count of tiles before this block's
    for blk in range(n_items):
        b, hk, start_n, q_start, _, seqlen_q, seqlen_k, off, lo, _, _, n_tiles = _program_block(
            blk, blocks, BLOCK_M, BLOCK_N, IS_VARLEN, BOTTOM_RIGHT, BOUNDED_LEFT,
            BOUNDED_RIGHT, BATCH_INNER, HEAD_INNER, ORDERED, PERSISTENT, FOLD)  # fmt: skip
        b_tma = 0 if IS_VARLEN else b
        num_n = gl.cdiv(seqlen_k, BLOCK_N)  # the sequence's key blocks
        rot = walk_start(hk, start_n, n_tiles, seqlen_k, blocks, BLOCK_N, ROTATE)
        for t in range(GROUP * n_tiles):
            i = step + t
            h, start_m = _query_tile(t, hk, GROUP, lo, n_tiles, BLOCK_M, rot, ROTATE)
            if ORDERED:
                lock = DqLocks + dq_tile_lock(b, h, start_m, q_start, seqlen_q, heads, BLOCK_M,
                                              IS_VARLEN)
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
        if COUNT_HEADS:  # the block's dQ adds landed: its count
            hopper.end_turn(HeadsDone + b * blocks[2] + hk)
        step += GROUP * n_tiles


@gluon.jit
def _bwd_turn_counter_partition(
    landed, counted, Locks, blocks, n_items, GROUP, heads, bias_batches, bias_heads,
    KIND: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    BOTTOM_RIGHT: gl.constexpr, BOUNDED_LEFT: gl.constexpr, BOUNDED_RIGHT: gl.constexpr,
    BATCH_INNER: gl.constexpr, HEAD_INNER: gl.constexpr, ROTATE: gl.constexpr,
    PERSISTENT: gl.constexpr, FOLD: gl.constexpr,
):  # fmt: skip
    """One warp of an "ordered" bias gradient's two: counts one kind of the compute
    warpgroups' turns (KIND 0: the summed tiles', SumLocks; 1: dQ's, DqLocks) in their
    steps' order. Once both warpgroups have handed a step's turn over
    (hopper.hand_over_turn), its adds have landed: a release add of one on the tile's
    counter (hopper.end_turn), then the slot back. A release's fence waits for the
    memory system, here beside the steps instead of in them. ``blocks``: as
    _program_block takes them (a dense batch)."""
    window_left, window_right = blocks[8], blocks[9]
    step = gl.to_tensor(0)  # the steps before this block's
    for blk in range(n_items):
        b, hk, start_n, _, _, seqlen_q, seqlen_k, off, lo, _, _, n_tiles = _program_block(
            blk, blocks, BLOCK_M, BLOCK_N, False, BOTTOM_RIGHT, BOUNDED_LEFT, BOUNDED_RIGHT,
            BATCH_INNER, HEAD_INNER, True, PERSISTENT, FOLD)  # fmt: skip
        rot = walk_start(hk, start_n, n_tiles, seqlen_k, blocks, BLOCK_N, ROTATE)
        turns_of = (b, hk, GROUP, lo, n_tiles, rot, start_n, seqlen_q, seqlen_k, off,
                    window_left, window_right, heads, bias_batches, bias_heads,
                    spread_span(n_tiles, blocks))
        for t in range(GROUP * n_tiles):
            i = step + t
            slot = KIND * TURN_RING + i % TURN_RING
            mbarrier.wait(landed.index(slot), (i // TURN_RING) & 1)
            sum_lock, _, dq_lock, _ = step_turns(t, turns_of, BLOCK_M, BLOCK_N, BOUNDED_LEFT,
                                                 BOUNDED_RIGHT, ROTATE)  # fmt: skip
            hopper.end_turn(Locks + (sum_lock if KIND == 0 else dq_lock))
            mbarrier.arrive(counted.index(slot))
        step += GROUP * n_tiles


@gluon.jit
def _bwd_sm90_kernel(
    q_desc, k_desc, v_desc, do_desc, dq_desc, stats_desc, bias_desc, dbias_desc, dk_desc,
    dv_desc, DK, DV, Rng, Alibi, CuSeqQ, CuSeqK, DqLocks, SumLocks, Schedule, HeadsDone,
    BiasRow, DBiasRow, stride_kb, stride_kn, stride_kh, stride_vb, stride_vn, stride_vh,
    stride_ab, stride_ah, stride_rb, stride_rh, stride_rn, stride_pb, stride_ph, HKV, GROUP,
    bias_batches, bias_heads, seqlen_q, seqlen_k, num_seqs, num_n_blocks, num_items,
    spread_steps, scale, window_left, window_right, dropout_p, softcap,
    HEAD_DIM_QK: gl.constexpr,
    HEAD_DIM_V: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr, HAS_BIAS: gl.constexpr, DBIAS_TILES: gl.constexpr,
    DBIAS_SUM: gl.constexpr, BIAS_ROW: gl.constexpr, DBIAS_ROW: gl.constexpr,
    HAS_ALIBI: gl.constexpr, HAS_DROPOUT: gl.constexpr, IS_VARLEN: gl.constexpr,
    BOTTOM_RIGHT: gl.constexpr, BOUNDED_LEFT: gl.constexpr, BOUNDED_RIGHT: gl.constexpr,
    BATCH_INNER: gl.constexpr, HEAD_INNER: gl.constexpr, SKIP_PAST_END: gl.constexpr,
    DQ_BUFS: gl.constexpr, ORDERED: gl.constexpr,
    ROTATE: gl.constexpr, PERSISTENT: gl.constexpr, FOLD: gl.constexpr,
    BY_RANK: gl.constexpr, HAS_DQ: gl.constexpr, HAS_SOFTCAP: gl.constexpr,
    KV_VIEWS_PER_STEP: gl.constexpr, IDLE_KEYS: gl.constexpr, PDL: gl.constexpr,
    TURN_LAG: gl.constexpr, BATCH_STAGGER: gl.constexpr, COUNT_HEADS: gl.constexpr,
):  # fmt: skip
    if PDL:  # dQ's conversion may launch (shared.DEPENDENT_LAUNCHES); it waits for our end
        hopper.launch_dependents()
    # A program per key block, or PERSISTENT one per SM at most, walking num_items
    # blocks in hopper.work_item's strides (PERSISTENT_BLOCKS) or those the host dealt
    # it (ORDERED_DEALT), pid its first entry in Schedule (_program_block). Packed
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
    elif BATCH_STAGGER > 0:
        pid = _staggered_item(pid, num_n_blocks, gl.num_programs(0) // (num_n_blocks * HKV),
                              BATCH_STAGGER)
    programs = gl.num_programs(0)
    n_items = gl.to_tensor(1)
    if PERSISTENT == DEALT:
        first = gl.load(Schedule + pid)
        n_items = gl.load(Schedule + pid + 1) - first
        pid = first
    elif PERSISTENT == STRIDES:
        n_items = hopper.work_items(pid, programs, num_items, FOLD)
    blocks = (pid, programs, HKV, CuSeqQ, CuSeqK, seqlen_q, seqlen_k, num_n_blocks, window_left,
              window_right, spread_steps, Schedule, num_seqs)
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
    if ORDERED and DBIAS_SUM:  # turns handed from both compute warpgroups to the
        # counting warps: [kind * TURN_RING + step % TURN_RING]
        landed, counted = hopper.ring(2 * TURN_RING, 1, 2)
    else:  # stand-ins, never touched
        landed = ds_bar
        counted = ds_bar

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
              bias_heads, DBiasRow, stride_pb, stride_ph, softcap, DqLocks, SumLocks, landed,
              counted, HeadsDone)
    loads = (q_desc, do_desc, k_desc, v_desc, stats_desc, bias_desc, q_smem, do_smem, k_smem,
             v_smem, lse_smem, delta_smem, bias_smem, kv_bar, kv_empty, q_ready, do_ready,
             q_empty, do_empty, GROUP, bias_batches, bias_heads, blocks, n_items)
    # The partitions: both compute warpgroups and the load warp, then the dQ writer warp
    # (DQ_BUFS; ORDERED: dQ's counters in DqLocks) or, for an "ordered" bias gradient,
    # the two warps counting its turns. (Written out in each call: a constexpr held in a
    # tuple variable turns into a tensor.)
    if DQ_BUFS > 0:
        gl.warp_specialize(
            [(_bwd_compute_partition, (shared, 0, HEAD_DIM_QK, HEAD_DIM_V, BLOCK_M, BLOCK_N,
                                       STAGES, HAS_BIAS, DBIAS_TILES, DBIAS_SUM, BIAS_ROW,
                                       DBIAS_ROW, HAS_ALIBI, HAS_DROPOUT, BOUNDED_LEFT,
                                       BOUNDED_RIGHT, DQ_BUFS, ROTATE, IS_VARLEN, BOTTOM_RIGHT,
                                       BATCH_INNER, HEAD_INNER, ORDERED, PERSISTENT, FOLD,
                                       HAS_DQ, HAS_SOFTCAP, KV_VIEWS_PER_STEP,
                                       IDLE_KEYS, TURN_LAG, COUNT_HEADS)),
             (_bwd_compute_partition, (shared, 1, HEAD_DIM_QK, HEAD_DIM_V, BLOCK_M, BLOCK_N,
                                       STAGES, HAS_BIAS, DBIAS_TILES, DBIAS_SUM, BIAS_ROW,
                                       DBIAS_ROW, HAS_ALIBI, HAS_DROPOUT, BOUNDED_LEFT,
                                       BOUNDED_RIGHT, DQ_BUFS, ROTATE, IS_VARLEN, BOTTOM_RIGHT,
                                       BATCH_INNER, HEAD_INNER, ORDERED, PERSISTENT, FOLD,
                                       HAS_DQ, HAS_SOFTCAP, KV_VIEWS_PER_STEP,
                                       IDLE_KEYS, TURN_LAG, COUNT_HEADS)),
             (_bwd_blocks_load_partition, (loads, BLOCK_M, BLOCK_N, STAGES, HAS_BIAS, IS_VARLEN,
                                           BOTTOM_RIGHT, BOUNDED_LEFT, BOUNDED_RIGHT,
                                           BATCH_INNER, HEAD_INNER, ORDERED, ROTATE,
                                           PERSISTENT, FOLD, PDL)),
             (_bwd_dq_writer_partition, (dq_desc, dq_smem, dq_full, dq_empty, blocks,
                                         n_items, GROUP, DqLocks, heads, HeadsDone,
                                         BLOCK_M, BLOCK_N,
                                         DQ_BUFS, IS_VARLEN, BOTTOM_RIGHT, BOUNDED_LEFT,
                                         BOUNDED_RIGHT, BATCH_INNER, HEAD_INNER, ORDERED,
                                         ROTATE, PERSISTENT, FOLD, PDL, COUNT_HEADS))],
            worker_num_warps=[4, 1, 1], worker_num_regs=[240, 24, 24])  # fmt: skip
    elif ORDERED and DBIAS_SUM:
        gl.warp_specialize(
            [(_bwd_compute_partition, (shared, 0, HEAD_DIM_QK, HEAD_DIM_V, BLOCK_M, BLOCK_N,
                                       STAGES, HAS_BIAS, DBIAS_TILES, DBIAS_SUM, BIAS_ROW,
                                       DBIAS_ROW, HAS_ALIBI, HAS_DROPOUT, BOUNDED_LEFT,
                                       BOUNDED_RIGHT, DQ_BUFS, ROTATE, IS_VARLEN, BOTTOM_RIGHT,
                                       BATCH_INNER, HEAD_INNER, ORDERED, PERSISTENT, FOLD,
                                       HAS_DQ, HAS_SOFTCAP, KV_VIEWS_PER_STEP,
                                       IDLE_KEYS, TURN_LAG, COUNT_HEADS)),
             (_bwd_compute_partition, (shared, 1, HEAD_DIM_QK, HEAD_DIM_V, BLOCK_M, BLOCK_N,
                                       STAGES, HAS_BIAS, DBIAS_TILES, DBIAS_SUM, BIAS_ROW,
                                       DBIAS_ROW, HAS_ALIBI, HAS_DROPOUT, BOUNDED_LEFT,
                                       BOUNDED_RIGHT, DQ_BUFS, ROTATE, IS_VARLEN, BOTTOM_RIGHT,
                                       BATCH_INNER, HEAD_INNER, ORDERED, PERSISTENT, FOLD,
                                       HAS_DQ, HAS_SOFTCAP, KV_VIEWS_PER_STEP,
                                       IDLE_KEYS, TURN_LAG, COUNT_HEADS)),
             (_bwd_blocks_load_partition, (loads, BLOCK_M, BLOCK_N, STAGES, HAS_BIAS, IS_VARLEN,
                                           BOTTOM_RIGHT, BOUNDED_LEFT, BOUNDED_RIGHT,
                                           BATCH_INNER, HEAD_INNER, ORDERED, ROTATE,
                                           PERSISTENT, FOLD, PDL)),
             (_bwd_turn_counter_partition, (landed, counted, SumLocks, blocks, n_items, GROUP,
                                            heads, bias_batches, bias_heads, 0, BLOCK_M,
                                            BLOCK_N, BOTTOM_RIGHT, BOUNDED_LEFT, BOUNDED_RIGHT,
                                            BATCH_INNER, HEAD_INNER, ROTATE, PERSISTENT,
                                            FOLD)),
             (_bwd_turn_counter_partition, (landed, counted, DqLocks, blocks, n_items, GROUP,
                                            heads, bias_batches, bias_heads, 1, BLOCK_M,
                                            BLOCK_N, BOTTOM_RIGHT, BOUNDED_LEFT, BOUNDED_RIGHT,
                                            BATCH_INNER, HEAD_INNER, ROTATE, PERSISTENT,
                                            FOLD))],
            worker_num_warps=[4, 1, 1, 1], worker_num_regs=[240, 24, 24, 24])  # fmt: skip
    else:
        gl.warp_specialize(
            [(_bwd_compute_partition, (shared, 0, HEAD_DIM_QK, HEAD_DIM_V, BLOCK_M, BLOCK_N,
                                       STAGES, HAS_BIAS, DBIAS_TILES, DBIAS_SUM, BIAS_ROW,
                                       DBIAS_ROW, HAS_ALIBI, HAS_DROPOUT, BOUNDED_LEFT,
                                       BOUNDED_RIGHT, DQ_BUFS, ROTATE, IS_VARLEN, BOTTOM_RIGHT,
                                       BATCH_INNER, HEAD_INNER, ORDERED, PERSISTENT, FOLD,
                                       HAS_DQ, HAS_SOFTCAP, KV_VIEWS_PER_STEP,
                                       IDLE_KEYS, TURN_LAG, COUNT_HEADS)),
             (_bwd_compute_partition, (shared, 1, HEAD_DIM_QK, HEAD_DIM_V, BLOCK_M, BLOCK_N,
                                       STAGES, HAS_BIAS, DBIAS_TILES, DBIAS_SUM, BIAS_ROW,
                                       DBIAS_ROW, HAS_ALIBI, HAS_DROPOUT, BOUNDED_LEFT,
                                       BOUNDED_RIGHT, DQ_BUFS, ROTATE, IS_VARLEN, BOTTOM_RIGHT,
                                       BATCH_INNER, HEAD_INNER, ORDERED, PERSISTENT, FOLD,
                                       HAS_DQ, HAS_SOFTCAP, KV_VIEWS_PER_STEP,
                                       IDLE_KEYS, TURN_LAG, COUNT_HEADS)),
             (_bwd_blocks_load_partition, (loads, BLOCK_M, BLOCK_N, STAGES, HAS_BIAS, IS_VARLEN,
                                           BOTTOM_RIGHT, BOUNDED_LEFT, BOUNDED_RIGHT,
                                           BATCH_INNER, HEAD_INNER, ORDERED, ROTATE,
                                           PERSISTENT, FOLD, PDL))],
            worker_num_warps=[4, 1], worker_num_regs=[240, 24])  # fmt: skip


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
# ... their walks rotated where rotates_dq allows. H200, tools/ab.py --rounds 2, B4
# S4096 without a mask, rotated (a program per block) -> first block first (dealt:
# ORDERED_DEALT): D128 507 -> 482 TFLOP/s, with a (1, 1, S, S) bias's gradient 310 ->
# 253, D64 with it 198 -> 138. Tools set it to A/B, then call hopper.forget_plans().
ORDERED_ROTATE = True
# An "ordered" bias gradient (dbias_kind_of's: deterministic, summed over batch or
# heads): each compute warpgroup adds its summed tiles and dQ's in turns
# (bias_sum_turn, dq_add_turn) and hands a step's two turns to the counting warps this
# many steps later, once those adds have landed (hopper.hand_over_turn's wait_group),
# while the next step's S and dP run; the programs after it in a tile's turns wait as
# long. H200, tools/ab.py --rounds 2, B4 S4096 H16 D128 1HQK, causal / not, TFLOP/s,
# counted by the warpgroups themselves then: 1 step 212 / 244, 2 steps 205 / 224, 3
# steps 176 / 191 (the default, not deterministic: 310 / 340). Tools set it to A/B,
# then call hopper.forget_plans().
ORDERED_SUM_TURN_LAG = 1
# An "ordered" bias gradient shared over heads: the kv heads' walks spread where it has
# no bounds (walk_rotation). Tools set it to A/B, then call hopper.forget_plans().
SPREAD_SUMS = True
# ... the kv heads' walks this many steps apart (0: over all the block's tiles)
SPREAD_STEPS = 2
# An "ordered" bias gradient shared over the batch (batch inner), under a right bound:
# each batch's blocks of a rank start this many ranks' programs after the batch
# before's (_staggered_item), so that they reach each summed tile a step or so after
# it instead of at once, and seldom wait for its turn. H200, tools/ab.py --rounds 3, B4
# S4096 H16 1HQK causal, side by side -> 1, 2 ranks: D128 242 -> 259, 255 TFLOP/s (3
# ranks 240 at --rounds 2; the default, not deterministic: 309), D64 158 -> 163, 164
# (197). 0: side by side. Tools set it to A/B, then call hopper.forget_plans().
ORDERED_BATCH_STAGGER = 1
# The turns a kind handed to its counting warp and not yet counted, at most (the
# compute warpgroups wait for a slot past that: the warp counts a turn in about a
# step's time or less)
TURN_RING = gl.constexpr(4)
# Packed sequences in SUMMED_BIAS_INNER's orders (a program per key block of the
# longest sequence): programs past their sequence's blocks return before loading K and
# V (SKIP_PAST_END). H100, the bench's docs row on that grid (4480 of 6656 programs past
# their end), backward 358 -> 381 TFLOP/s. The packed grid (common.packed_items: at most
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
# dropout 309 -> 306. Packed sequences at D=128 too: H200, --rounds 7, once a program
# -> each step: the bench's causal documents 414 -> 422, without a mask 488 -> 494,
# 4096-token ones 532 -> 539, deterministic 393 -> 396 (128/64's 353 -> 350 keep
# theirs). "features": those calls; True / False: every call, none (tools A/B them).
KV_VIEWS_PER_STEP = "features"
# Packed sequences: a last key block whose second half lies past its sequence has its
# second warpgroup make only its part of dQ, from the first half's dS (_idle_steps).
# H100, tools/ab.py --variants default,no_idle --rounds 3: 900-token documents (a few
# keys in each last block) 348 -> 359 TFLOP/s, the bench's documents 481 -> 477 (within
# their spread, 473-495). Dense lengths that end so: B4 S4000 D=128 528 -> 523, D=64
# 458 -> 456, not taken. Tools set it to A/B, then call hopper.forget_plans().
IDLE_HALVES = True
# Programs persistent (one per SM at most, the forward's strides: hopper.work_item,
# blocks of equal work paired under a right bound), so that a block's K and V, and its
# first Q and dO tiles, load while the last block's dK and dV leave, and no program
# starts per block: what a program's start and end cost weighs most where it has few
# query tiles (short and causal rows, D=64's 128-row steps). Not where the order of the
# blocks is not free (_plan).
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
# "Levers that did not pay"). 0: folded. Causal heads of few blocks fold at D=128 too
# (shared.SHORT_CAUSAL_KEYS: with dQ converted by head, H200 S512 386 -> 374 us).
MASKED_BY_RANK_BLOCKS = {64: 0, 128: 256}
# Masked calls whose heads have more key blocks than this run a program per block
# (heaviest first) where they would run folded strides (D=64). H100, tools/ab.py,
# folded -> a program per block, four calls (medians of 2-6 rounds): D64 S16384 causal
# 487 -> 523, 485 -> 516, 503 -> 512, 504 -> 464 TFLOP/s (rounds spread +-8 %); at
# S8192 (64 blocks) 476 -> 468, S4096 419 -> 426. Tools set it to A/B, then call
# hopper.forget_plans().
MASKED_PERSISTENT_MAX_BLOCKS = 64
# ORDERED_DQ's calls of a dense batch whose turns wait only on blocks earlier in the
# grid's order (no rotated walks, no inner dims) in persistent programs, each dealt
# the grid's blocks in that order by the host (hopper.list_schedule, a block's cost its
# steps and one for its start and end): a program's adds then wait only on blocks
# dealt before, to programs running beside it (all are: one per SM at most), and at
# D=64 the blocks' ends overlap the next ones' starts as the default's folded ones do
# (overlaps_block_ends). Up to DEALT_ITEMS blocks (the host deals them once a plan);
# where a CUDA graph captures a call before its table is on the device
# (hopper.schedule_on_device), a program per block. H200, tools/ab.py --rounds 2,
# deterministic causal, 16k tokens, a program per block -> dealt: D64 S1024 268 -> 293
# TFLOP/s (274 -> 307 on another machine), S4096 419 -> 417 (424 -> 427), S16384 483
# -> 480 (491 -> 492), D128 S4096 457 -> 463 (its 64-row steps keep their ends apart),
# D64 with a (1, 1, S, S) bias's gradient 155 -> 154. Tools set it to A/B, then call
# hopper.forget_plans().
ORDERED_DEALT = True
DEALT_ITEMS = 1 << 16
# ... but an "ordered" bias gradient's under a causal mask (an even count of blocks a
# head, a head's pairs no more than the SMs) in the folded strides (hopper.work_item),
# each program a head's lighter block of a pair first (_key_block's DESCENDING lists
# the last block first), so that twice as many heads run at once (a head's blocks over
# half as many programs). A light block's adds wait on lighter ones and on the heads
# before; a heavy one's on the light ones and on heavier ones, whose programs are past
# their light ones: with every pair of a head on a program of its own, each wait is on
# a program that gets there (test_dispatch simulates the turns over the strides).
# H200, tools/ab.py --rounds 2, B4 S4096 causal, a (1, 1, S, S) bias with its
# gradient, a program per block -> dealt -> folded: D64 (H32) 156 -> 157 -> 169
# TFLOP/s (dealt -> folded 155 -> 167 on another machine; the default's, not
# deterministic, 240: folded too), D128 (H16) dealt -> folded 241 -> 277. Without a
# summed bias folding lost (D64): S4096 417 -> 387, S16384 480 -> 429, S1024 293 ->
# 287. Tools set it to A/B, then call hopper.forget_plans().
ORDERED_SUM_FOLD = True
# ... and an "ordered" bias gradient's other calls (not dealt, not folded, no staggered
# batches) in persistent programs too, walking the grid's blocks in strides of whole
# groups of the blocks that must run at once: a head's rotated blocks (rotates_dq, among
# the inner dims' ones: rotated_together), a block's kv heads whose walks spread
# (SPREAD_OVER_KV_HEADS), else one (every wait on a block earlier in the grid). As many
# programs as the SMs hold whole groups, so that each round of strides is whole groups
# and no turn waits on a later round; a block's K and V load under the last one's dK
# and dV stores, as in the default's strides. By Dqk. H200, tools/ab.py, B4 S4096
# deterministic, a program per block -> these strides: 11QK's gradient (--rounds 3,
# then 4 on another H200) D=128 305 -> 317 and 301 -> 315 TFLOP/s, S8192 279 -> 298,
# S2048 309 -> 317, D=64 198 -> 191 and 200 -> 195; B1QK's D=128 300 -> 326, causal 226
# -> 226, D=64 217 -> 218; 1HQK's D=128 286 -> 287, D=64 177 -> 178 (--rounds 3).
# Without a bias gradient (not taken: rotated, 128 programs of 132 SMs) D=128 517 ->
# 504, S8192 542 -> 524, S1024 402 -> 412. Tools set it to A/B, then call
# hopper.forget_plans().
ORDERED_SUM_PERSISTENT = {64: False, 128: True}


def kv_views_per_step(spec: AttentionSpec, bias_row: bool) -> bool:
    """Whether the D 64/128 kernel makes K's and V's views in each step (KV_VIEWS_PER_STEP)."""
    if KV_VIEWS_PER_STEP != "features":
        return bool(KV_VIEWS_PER_STEP)
    feature = spec.dropout_p > 0 or spec.softcap > 0 or spec.has_alibi or spec.has_bias
    packed = spec.varlen and spec.head_dim_qk == spec.head_dim_v == 128
    return bias_row or packed or (feature and 128 in (spec.head_dim_qk, spec.head_dim_v))


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
    compute warpgroups (dQ's writer warp has no room beside it) but an "ordered" one's,
    beside which they add dQ themselves, in turns too. dq_add_turn's orders wait only on
    programs started before, or (rotates_dq) running beside."""
    return (ORDERED_DQ and spec.deterministic and dq_in_fp32(spec)
            and (dbias_kind not in TILE_GRADIENTS or dbias_kind == "ordered"))


def rotates_dq(spec: AttentionSpec, inner: tuple[bool, bool] = (False, False)) -> bool:
    """Whether ORDERED_DQ's walks rotate (walk_start): without bounds, where every
    key block of a head (packed sequences: of the longest) runs at once, at most half
    the SMs, to leave room for other streams' work; then no add waits in the steady
    state. With inner dims (inner_dims: an "ordered" bias gradient's) a head's blocks
    lie among the other batches' or heads' ones, all of which must run at once. Elsewhere
    without a right bound the blocks add first first, each one step behind the block
    before it (dq_add_turn)."""
    unbounded = spec.window_left < 0 and spec.window_right < 0
    return (ORDERED_ROTATE and unbounded
            and rotated_together(spec, inner) <= hopper.sm_count(spec.device.index) // 2)


def rotated_together(spec: AttentionSpec, inner: tuple[bool, bool]) -> int:
    """The key blocks that must run at once where ORDERED_DQ's walks rotate: a head's,
    and where they lie among other batches' or kv heads' (inner dims), those too."""
    return (cdiv(spec.seqlen_k, BLOCK_N) * (spec.batch if inner[0] else 1)
            * (spec.kv_heads if inner[1] else 1))


def walk_rotation(spec: AttentionSpec, dbias_kind: str | None, inner: tuple[bool, bool]) -> int:
    """An ORDERED_DQ call's ROTATE (walk_start): ROTATE_BY_BLOCK where rotates_dq;
    SPREAD_OVER_KV_HEADS for an "ordered" bias gradient shared over heads (kv heads
    inner) without bounds (SPREAD_SUMS), where all of a key block's kv heads fit on half
    the SMs (one may wait on a later one); ROTATE_NONE otherwise. Spread over the batch
    (a bias shared over batches) did not pay (PERFORMANCE.md)."""
    if rotates_dq(spec, inner):
        return int(ROTATE_BY_BLOCK)
    unbounded = spec.window_left < 0 and spec.window_right < 0
    if (SPREAD_SUMS and dbias_kind == "ordered" and unbounded and inner[1]
            and spec.kv_heads <= hopper.sm_count(spec.device.index) // 2):
        return int(SPREAD_OVER_KV_HEADS)
    return int(ROTATE_NONE)


def batch_stagger(spec: AttentionSpec, ordered: bool, inner: tuple[bool, bool]) -> int:
    """The kernel's BATCH_STAGGER (ORDERED_BATCH_STAGGER): ORDERED_DQ's calls of a dense
    batch under a right bound whose "ordered" bias gradient has the batch alone inner
    (inner_dims); 0 otherwise."""
    if ordered and inner == (True, False) and spec.window_right >= 0 and not spec.varlen:
        return ORDERED_BATCH_STAGGER
    return 0


def dq_from_full_bias(spec: AttentionSpec, dbias_kind: str | None) -> bool:
    """Whether a deterministic call takes dQ = scale · dS K from the (B, H, Sq, Sk) dS
    the kernel stores (backward.dq_from_ds: one batched matmul, in a fixed order): the
    tiles leave no room for ORDERED_DQ's writer, so the kernel's own dQ adds would land
    in any order; it makes none. Dense batches with a full bias gradient, where dQ goes
    through the fp32 buffer (D 64/128)."""
    return (spec.deterministic and dbias_kind == "full" and not spec.varlen
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
    if dbias_kind not in ("added", *SUMMED_GRADIENTS) or not SUMMED_BIAS_INNER:
        return (False, False)
    batches, heads = hopper.bias_dims(bias)
    inner = (batches == 1 and spec.batch > 1, heads == 1 and spec.kv_heads > 1)
    return (False, False) if all(inner) else inner


_launch_backward = hopper.Launcher(_bwd_sm90_kernel)


def backward(spec: AttentionSpec, q, k, v, grad_out, bias, alibi_slopes, rng_state,
             cu_seqlens_q, cu_seqlens_k, stats, dq, dk, dv, dbias, heads_done=None) -> int:
    """The package's `backward` at Dqk and Dv up to 128: _bwd_sm90_kernel, dQ added
    into dq (dq_tiles' fp32 buffer) but for dq_from_full_bias's calls. heads_done: the
    counters each key block is counted in once its dQ adds landed, for dQ's conversion
    (shared.converts_dq_by_head); returns the counts a block (0 without them)."""
    bias_row = hopper.bias_row(spec, bias)
    dbias_kind = None if dbias is None else dbias_kind_of(spec, bias)
    how, schedule = hopper.plan_with_schedule(
        _plan, (spec, bias_row, dbias_kind, inner_dims(spec, bias, dbias_kind),
                k.shape[0] if spec.varlen else 0, q.device.index), q.device.index, dk)
    dq_locks = sum_locks = dk  # stand-ins, never read
    if how.constexprs["ORDERED"]:  # a counter per dQ tile (packed: common.dq_tile's), and
        # an "ordered" bias gradient's per tile (bias_sum_turn), 16-byte aligned
        rows = how.constexprs["BLOCK_M"]
        tiles = (q.shape[0] // rows + spec.batch if spec.varlen
                 else spec.batch * cdiv(spec.seqlen_q, rows))
        dq_count = cdiv(tiles * spec.heads, 4) * 4
        sum_count = 0
        if how.constexprs["DBIAS_SUM"]:
            batches, heads = hopper.bias_dims(bias)
            sum_count = (batches * heads * cdiv(spec.seqlen_q, rows)
                         * cdiv(spec.seqlen_k, BLOCK_N))
        dq_locks = torch.zeros(dq_count + sum_count, dtype=torch.int32, device=q.device)
        sum_locks = dq_locks[dq_count:]
    # What the arguments are made of beside the plan, shapes included (the spec does not
    # fix packed sequences' token counts): hopper.Launcher.launch_prepared.
    # counts a block: the dQ writer warp's one, or each compute warp's (eight)
    count_heads = 0 if heads_done is None else 1 if how.constexprs["DQ_BUFS"] else 8
    call = (how, count_heads, *map(hopper.tensor_key, (
        q, k, v, grad_out, stats, dq, dk, dv, bias, dbias, alibi_slopes, rng_state,
        cu_seqlens_q, cu_seqlens_k, dq_locks, sum_locks, schedule, heads_done)))
    if _launch_backward.launch_prepared(how.programs, call):
        return count_heads
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
    variant = (how, count_heads, bias_batches, bias_heads, alibi_batch_stride, alibi_head_stride,
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
        cu_seqlens_q, cu_seqlens_k, dq_locks, sum_locks, schedule,
        dk if heads_done is None else heads_done, bias if bias_row else dk,
        dbias if dbias_kind == "row" else dk,
        *k_strides, *v_strides,
        alibi_batch_stride, alibi_head_stride, *row_strides, *partial_strides,
        spec.kv_heads, spec.group, bias_batches, bias_heads, spec.seqlen_q, spec.seqlen_k,
        spec.batch, *how.counts, spec.scale, spec.window_left, spec.window_right, spec.dropout_p,
        spec.softcap, variant=variant, prepare=call,
        # A constexpr: as a runtime flag, never set where nothing counts, it still cost
        # the unmasked D 64/128 backward 3-5 % (H200; ptxas scheduled the kernel otherwise)
        COUNT_HEADS=count_heads > 0, **how.constexprs,
    )  # fmt: skip
    return count_heads


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


@hopper.plan_cache
def _plan(spec: AttentionSpec, bias_row: bool, dbias_kind: str | None,
          inner: tuple[bool, bool], tokens_k: int, device_index: int,
          tabled: bool = True) -> hopper.Plan:  # fmt: skip
    """The D 64/128 kernel's launch (hopper.Plan): key blocks of each (batch, kv head)
    (packed sequences: common.packed_items over the keys, blocks of the longest with
    inner dims), persistent programs walking them where PERSISTENT_BLOCKS allows, else a
    program per block. bias_row: the bias is one row of keys (hopper.bias_row), read by
    pointer. dbias_kind: dbias_kind_of's, None without a bias gradient. inner: batch and
    kv head innermost in the programs' order (SUMMED_BIAS_INNER). tokens_k: packed
    sequences' key tokens in all (0 for dense batches). tabled: a host-dealt schedule
    may be used (ORDERED_DEALT). Counts: key blocks per head, in all, and SPREAD_STEPS."""
    num_n = cdiv(spec.seqlen_k, BLOCK_N)
    bias_tiles = spec.has_bias and not bias_row
    ordered = orders_dq(spec, dbias_kind)
    dq_bufs = dq_buffers(spec, bias_tiles, dbias_kind)
    packed_grid = spec.varlen and not any(inner)
    items = _key_block_items(spec, num_n, BLOCK_N, tokens_k if packed_grid else None)
    # Persistent where the order of the blocks is free: not packed sequences (blocks
    # past a sequence's end), nor a summed bias gradient's or ORDERED_DQ's order, nor
    # under a mask where MASKED_BY_RANK_BLOCKS takes a program per block rank by rank
    # (not short causal heads: shared.SHORT_CAUSAL_KEYS), or a head has more than
    # MASKED_PERSISTENT_MAX_BLOCKS blocks.
    free_order = not spec.varlen and not ordered and not any(inner)
    masked = free_order and spec.window_right >= 0
    by_rank = 0 if shared.folds_short_causal(spec) else (
        MASKED_BY_RANK_BLOCKS[spec.head_dim_qk] if masked else 0)
    # Inside sharing_sms a program per block (as the forward's plan).
    persistent = (PERSISTENT_BLOCKS and not shares_sms() and free_order and not by_rank
                  and not (masked and num_n > MASKED_PERSISTENT_MAX_BLOCKS))
    fold = persistent and spec.window_right >= 0
    rows = block_m(spec, bias_row)
    rotate = walk_rotation(spec, dbias_kind, inner) if ordered else int(ROTATE_NONE)
    # ORDERED_DQ's calls whose turns wait only on blocks a program reaches earlier (no
    # rotated walks, no inner dims): persistent too, dealt (ORDERED_DEALT) or, an
    # "ordered" bias gradient's under a causal mask, folded (ORDERED_SUM_FOLD); its other
    # calls in strides of whole groups (ORDERED_SUM_PERSISTENT).
    in_order = (PERSISTENT_BLOCKS and ordered and not spec.varlen and not any(inner)
                and rotate == int(ROTATE_NONE))
    sum_fold = (in_order and ORDERED_SUM_FOLD and dbias_kind == "ordered"
                and spec.window_right >= 0 and spec.window_left < 0 and num_n % 2 == 0
                and num_n // 2 <= hopper.sm_count(device_index))
    dealt = in_order and not sum_fold and ORDERED_DEALT and tabled and items <= DEALT_ITEMS
    stagger = batch_stagger(spec, ordered, inner)
    summed = (PERSISTENT_BLOCKS and ORDERED_SUM_PERSISTENT[spec.head_dim_qk]
              and dbias_kind == "ordered" and not spec.varlen and not in_order and not stagger)
    persistent, fold = persistent or sum_fold or summed, fold or sum_fold
    programs = hopper.programs(items, fold, persistent or dealt, device_index)
    if summed:  # rounds of strides of whole groups of blocks that run together
        together = {int(ROTATE_BY_BLOCK): rotated_together(spec, inner),
                    int(SPREAD_OVER_KV_HEADS): spec.kv_heads}
        group = together.get(rotate, 1)
        programs = min(items, hopper.sm_count(device_index) // group * group)
    schedule = None
    if dealt:  # the grid's blocks in its order, each costing its steps and one more
        steps = _block_steps(spec, num_n, rows)
        if spec.window_right >= 0:  # _key_block's DESCENDING: each head's last block first
            steps.reverse()
        schedule = tuple(hopper.list_schedule(range(items), [steps[item % num_n] + 1
                                                             for item in range(items)],
                                              programs))  # fmt: skip
    constexprs = dict(
        HEAD_DIM_QK=spec.head_dim_qk, HEAD_DIM_V=spec.head_dim_v,
        BLOCK_M=rows, BLOCK_N=BLOCK_N, STAGES=STAGES,
        HAS_BIAS=bias_tiles,
        DBIAS_TILES={"full": 1, "added": 2}.get(dbias_kind, 0),
        DBIAS_SUM=dbias_kind in SUMMED_GRADIENTS,
        BIAS_ROW=bias_row, DBIAS_ROW=dbias_kind == "row", HAS_ALIBI=spec.has_alibi,
        HAS_DROPOUT=spec.dropout_p > 0, IS_VARLEN=spec.varlen,
        BOTTOM_RIGHT=spec.bottom_right, BOUNDED_LEFT=spec.window_left >= 0,
        BOUNDED_RIGHT=spec.window_right >= 0, BATCH_INNER=inner[0], HEAD_INNER=inner[1],
        SKIP_PAST_END=spec.varlen and SKIP_EMPTY_KEY_BLOCKS and not packed_grid,
        DQ_BUFS=dq_bufs, ORDERED=ordered,
        ROTATE=rotate, PERSISTENT=int(DEALT if dealt else STRIDES if persistent else PER_BLOCK),
        FOLD=fold, BY_RANK=by_rank,
        HAS_DQ=not dq_from_full_bias(spec, dbias_kind), HAS_SOFTCAP=spec.softcap > 0,
        KV_VIEWS_PER_STEP=kv_views_per_step(spec, bias_row),
        IDLE_KEYS=IDLE_HALVES and spec.varlen, PDL=shared.DEPENDENT_LAUNCHES,
        TURN_LAG=ORDERED_SUM_TURN_LAG, BATCH_STAGGER=stagger,
        num_warps=4, launch_pdl=shared.DEPENDENT_LAUNCHES,
    )  # fmt: skip
    return hopper.Plan(programs, (num_n, items, SPREAD_STEPS), constexprs, schedule)


def _block_steps(spec: AttentionSpec, num_n: int, rows: int) -> list[int]:
    """The steps of a dense batch's key blocks (n = 0, 1, ...): GROUP x their query
    tiles of ``rows`` (common.query_range's lo and hi)."""
    off = spec.seqlen_k - spec.seqlen_q if spec.bottom_right else 0
    steps = []
    for n in range(num_n):
        lo, hi = 0, spec.seqlen_q
        if spec.window_right >= 0:
            lo = max(n * BLOCK_N - off - spec.window_right, 0) // rows * rows
        if spec.window_left >= 0:
            hi = min(hi, (n + 1) * BLOCK_N - off + spec.window_left)  # last key + left + 1
        steps.append(spec.group * cdiv(max(hi, lo) - lo, rows))
    return steps
