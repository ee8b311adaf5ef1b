"""The Hopper backward at Dqk=192 / Dv=128 (MLA's head dims), for calls that need not be
deterministic and have no bias, ALiBi, dropout or softcap (shared.fuses_split_dq; the
others run wide.py's kernels): one kernel, dQ fused, in FlashAttention-4's orientation
for these head dims (interface.py _tile_size_bwd_sm90).

S = Q Kᵀ and dP = dO Vᵀ with the queries on the wgmma's M, dK and dV transposed (the
head dim on M), P and dS through shared memory. In ours (keys on M) dK and dV over 64
keys take 160 registers a thread and leave too few for S, dP and their 16 query columns
of lse and delta. Each compute warpgroup owns SPLIT_KEYS keys of the program's block
(FA4: two of 48, a tile Gluon has none for; here two of 64): dKᵀ 192 x SPLIT_KEYS (two
accumulators, 128 + 64 rows), dVᵀ 128 x SPLIT_KEYS, S and dP 64 x SPLIT_KEYS (dP issued
after S, in its registers), lse and delta two rows a thread. dQ = dS K over both
warpgroups' dS, in three 64-column parts (dq_split, split_parts), each added into
dq_tiles' fp32 buffer by TMA reduce-add as at D 64/128. Shared memory: K 48 KiB, V 32, Q
and dO rings of two 48 + 32, P and dS 16 each, a 16 KiB fp32 dQ buffer a warpgroup (dK
and dV leave through it): 226 of the 227 KiB. Matmul work is 832 units per 832 useful,
against the wide kernels' 1152 (dQ's kernel recomputes S and dP). Deterministic calls
keep the wide kernels (their dQ is added in one order). H100, tools/ab.py, wide -> this
kernel: S4096 364 -> 404, S16384 causal 366 -> 399, S4096 causal 344 -> 345. Three
warpgroups of 32 keys (96 a block, FA4's count; dP beside S) had paid under a mask while
the views' descriptors spilled, and lost once they were made each step (PERFORMANCE.md,
"Levers that did not pay").
"""

from __future__ import annotations

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
from .. import hopper
from ..common import (
    LOG2E,
    cdiv,
    packed_stats_start,
    visible,
)
from ..forward import dense_strides
from . import shared
from .shared import (
    BLOCK_M,
    STAGES,
    _dq_tile_row,
    _dq_tiles_descriptor,
    _key_block,
    _key_block_items,
    _packed_key_item,
    _query_tile,
    _query_tile_loads,
    _row_stats_descriptor,
    _runtime_zero,
    _split_descriptors,
    _store_rows,
    _store_transposed,
    dq_split,
)

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
def _bwd_split_load_partition(loads, WARPGROUPS: gl.constexpr, BLOCK_M: gl.constexpr,
                              STAGES: gl.constexpr, PDL: gl.constexpr):  # fmt: skip
    """One warp: each warpgroup's keys of K (both buffers) and V, then the Q and dO
    tiles (_query_tile_loads). PDL (shared.DEPENDENT_LAUNCHES): K and V go out before
    the wait for the preprocess's writes, as _bwd_load_partition's."""
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
    if PDL:
        hopper.wait_for_primary()
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
    PDL: gl.constexpr,
):  # fmt: skip
    if PDL:  # dQ's conversion may launch (shared.DEPENDENT_LAUNCHES); it waits for our end
        hopper.launch_dependents()
    # The programs of HEADS_TOGETHER (batch, kv head)s take their key blocks by rank
    # (SPLIT_HEADS_TOGETHER). Packed sequences (IS_VARLEN): one batch of all tokens to
    # TMA, and _bwd_sm90_kernel's grid (common.packed_items over the keys, an item past
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
         (_bwd_split_load_partition, (loads, WARPGROUPS, BLOCK_M, STAGES, PDL))],
        worker_num_warps=[4, 1], worker_num_regs=[240, 24])  # fmt: skip


_launch_split = hopper.Launcher(_bwd_split_kernel)


def backward(spec: AttentionSpec, q, k, v, grad_out, cu_seqlens_q, cu_seqlens_k, stats,
             dq, dk, dv) -> None:  # fmt: skip
    """The package's `backward` for fuses_split_dq's calls: _bwd_split_kernel, dQ added
    into dq (dq_tiles' fp32 buffer)."""
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
    (packed sequences: common.packed_items over their tokens_k keys; counts: key blocks
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
             PDL=shared.DEPENDENT_LAUNCHES, num_warps=4,
             launch_pdl=shared.DEPENDENT_LAUNCHES))  # fmt: skip
