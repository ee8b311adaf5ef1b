"""The Hopper backward past 128 columns (D=256, and the pairs with a narrower q·k or
V; Dqk=192 / Dv=128 where split.py's kernel does not take it): _bwd_wide_kernel makes dK
and dV (and a bias's gradient), each warpgroup part of the head dims (or, at 256/256
without bias tiles or dropout, one warpgroup P and dV, the other dS and dK: BY_ROLE), and
_bwd_dq_wide_kernel makes dQ apart, in the forward's shape, written in the output dtype:
no fp32 buffer and no atomics, so deterministic. See BLOCK_N_WIDE and DQ_BLOCK_N."""

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
from .. import hopper
from ..common import (
    LOG2E,
    add_bias_alibi_log2,
    alibi_strides,
    cdiv,
    packed_items,
    packed_stats_start,
    philox_key,
    tanh,
    visible,
)
from ..forward import dense_strides
from .shared import (
    BLOCK_M,
    STAGES,
    _bwd_load_partition,
    _key_block,
    _key_block_items,
    _operand_buffers,
    _packed_key_item,
    _query_tile,
    _row_stats_descriptor,
    _runtime_zero,
    _split_descriptors,
    _store_rows,
    _visible_t,
    dbias_kind_of,
    keeps_bits_in_shared,
)

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
ROWS = gl.constexpr(64)  # query rows a warpgroup in the dQ kernel


@gluon.jit
def _wide_probs(
    s, lse2, masked, offs_m, offs_n, bias, features, b, h, seqlen_k, off, scale, window_left,
    window_right, BOUNDED_LEFT: gl.constexpr, BOUNDED_RIGHT: gl.constexpr,
    HAS_BIAS: gl.constexpr, HAS_ALIBI: gl.constexpr, HAS_SOFTCAP: gl.constexpr,
):  # fmt: skip
    """P of a wide kernel's (queries, keys) tile from S (raw q·k, fp32) as the D 64/128
    kernel makes it: _wide_scores', then the mask (``masked``: the tile crosses the
    mask's edge); and tanh's derivative for dS (1.0 without softcap)."""
    s, p_scale, cap_slope = _wide_scores(s, offs_m[:, None], offs_n[None, :], bias, features,
                                         b, h, off, scale, HAS_BIAS, HAS_ALIBI, HAS_SOFTCAP)
    if masked:
        mask = visible(offs_m[:, None], offs_n[None, :], seqlen_k, off, window_left,
                       window_right, BOUNDED_LEFT, BOUNDED_RIGHT)
        s = gl.where(mask, s, float("-inf"))
    return gl.exp2(s * p_scale - lse2[:, None]), cap_slope


@gluon.jit
def _wide_scores(s, queries, keys, bias, features, b, h, off, scale, HAS_BIAS: gl.constexpr,
                 HAS_ALIBI: gl.constexpr, HAS_SOFTCAP: gl.constexpr):  # fmt: skip
    """A tile's scores from S (raw q·k, fp32; queries and keys: its positions, broadcast
    as its rows and columns lie) as the D 64/128 kernel makes them: softcap's cap, then
    the bias (HAS_BIAS: ``bias``, fp32, the tile's or a row of keys) and ALiBi; with the
    factor to log2 units still to apply (p_scale) and tanh's derivative for dS (1.0
    without softcap). features: the kernels' options (dropout's seed, offset, heads and
    rate, ALiBi's slopes and their strides, softcap, a key row bias's pointer, strides
    and (batch, head) sizes) for query head h of batch b."""
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
        s = add_bias_alibi_log2(s * p_scale, queries, keys, off, slope, bias, HAS_BIAS,
                                HAS_ALIBI)
        p_scale = 1.0
    return s, p_scale, cap_slope


@gluon.jit
def _wide_bias_row(features, b, h, offs_n, seqlen_k):
    """Keys offs_n of a bias constant along queries (hopper.bias_row), query head h of
    batch b, in fp32; 0 past Sk."""
    BiasRow, stride_rb, stride_rh, stride_rn, bias_batches, bias_heads = features[8:]
    ptrs = (BiasRow + (b % bias_batches).to(gl.int64) * stride_rb
            + (h % bias_heads).to(gl.int64) * stride_rh + offs_n.to(gl.int64) * stride_rn)
    return gl.load(ptrs, mask=offs_n < seqlen_k, other=0.0).to(gl.float32)


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
            bias = _wide_bias_row(features, b, h, offs_n, seqlen_k)[None, :]
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


# Head dims 256/256 (BY_ROLE; by_role says beside which features): the warpgroups split
# each step's matmuls by role instead of by keys and columns. The first makes Sᵀ = K Qᵀ
# over the block's 64 keys, P from it and dV += Pᵀ dO (all 256 columns, P from
# registers); the second dPᵀ = V dOᵀ, dS from P (which the first leaves in shared
# memory, fp32, in its registers' order: hopper.accumulator_order) and dK += dSᵀ Q (dS
# from registers). So S and dP are 64 wide, each operand read once a step, and dV and
# dK read only dO and Q from shared memory: 208 KB of wgmma operands a step against the
# split by keys' 288 (S and dP 32 keys wide, both warpgroups reading all of Q and dO; a
# 32-wide wgmma asks 192 bytes of shared memory a clock, which gives 128). P has two
# slots, so the first warpgroup may run a step ahead: its softmax overlaps the second's
# matmuls. Each warpgroup waits for its own matmuls within the step: with the next
# step's S or dP issued ahead, the pipelined wgmmas need more than the 240 registers a
# warpgroup has (ptxas serialised every wgmma, C7512). H200, tools/ab.py --pass bwd,
# split by keys -> by role: S16384 395 -> 448 TFLOP/s, causal 387 -> 430, S4096 384 ->
# 429, causal softcap 342 -> 367, ALiBi 382 -> 411, a key row's gradient 326 -> 390
# (the dK/dV kernel 8.5 -> 6.3 ms at S16384). Shared memory (231 KB of 232) leaves no
# room for bias tiles or dropout's exchange: those keep the split kernel.
BY_ROLE = True


@gluon.constexpr_function
def _role_layout(cols):
    """A by-role warpgroup's (64 keys, cols) accumulator layout: the (keys, queries)
    tile's, dK's or dV's."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                     instr_shape=[16, cols, 16])


@gluon.jit
def _bwd_role_probs_partition(
    roles, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr, BOUNDED_LEFT: gl.constexpr, BOUNDED_RIGHT: gl.constexpr,
    BIAS_ROW: gl.constexpr, HAS_ALIBI: gl.constexpr, HAS_SOFTCAP: gl.constexpr,
    IS_VARLEN: gl.constexpr,
):  # fmt: skip
    """BY_ROLE's first warpgroup: each step's Sᵀ (keys, queries), its scores as
    _wide_scores makes them (softcap, a key row's bias, ALiBi), P from them (masked
    where the tile crosses the mask's edge) into a p_smem slot for the second (times
    tanh's derivative with softcap: all the second needs of P is dS's factor), and
    dV += Pᵀ dO; the block's dV out at the end."""
    (q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem, p_smem, kv_bar, q_ready, do_ready,
     q_empty, do_empty, p_full, p_empty, done, b, hk, GROUP, start_n, lo, full_lo, full_hi,
     n_tiles, seqlen_q, seqlen_k, off, scale, window_left, window_right, outputs, features,
     dbias_out) = roles
    dtype: gl.constexpr = k_smem.dtype
    s_layout: gl.constexpr = _role_layout(BLOCK_M)
    dv_layout: gl.constexpr = _role_layout(HEAD_DIM // 2)
    p_op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=dv_layout,
                                                    k_width=2)
    cols_layout: gl.constexpr = gl.SliceLayout(0, s_layout)
    offs_n = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, s_layout))
    zero = _runtime_zero(seqlen_k)
    dv0 = gl.zeros([BLOCK_N, HEAD_DIM // 2], gl.float32, layout=dv_layout)
    dv1 = gl.zeros([BLOCK_N, HEAD_DIM // 2], gl.float32, layout=dv_layout)
    s_init = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=s_layout)
    mbarrier.wait(kv_bar, 0)
    for i in range(GROUP * n_tiles):
        slot = hopper.arrived(q_ready, i, STAGES)
        s = _role_transposed(k_smem, zero * i, q_smem.index(slot), s_init)
        h, start_m = _query_tile(i, hk, GROUP, lo, n_tiles, BLOCK_M)
        lse2 = lse_smem.index(slot).reshape([BLOCK_M]).load(cols_layout)
        bias = 0.0
        if BIAS_ROW:
            bias = _wide_bias_row(features, b, h, offs_n, seqlen_k)[:, None]
        queries = 0
        if HAS_ALIBI:
            queries = (start_m + gl.arange(0, BLOCK_M, layout=cols_layout))[None, :]
        s = warpgroup_mma_wait(0, deps=(s,))
        mbarrier.arrive(q_empty.index(slot))  # S was this warpgroup's read of Q
        s, p_scale, cap_slope = _wide_scores(s, queries, offs_n[:, None], bias, features, b, h,
                                             off, scale, BIAS_ROW, HAS_ALIBI, HAS_SOFTCAP)
        if (start_m < full_lo) | (start_m >= full_hi):
            mask = _visible_t(offs_n, start_m, seqlen_q, seqlen_k, off, window_left,
                              window_right, BLOCK_M, BOUNDED_LEFT, BOUNDED_RIGHT, s_layout)
            s = gl.where(mask, s, float("-inf"))
        p = gl.exp2(s * p_scale - lse2[None, :])
        p_slot = i % 2  # the second warpgroup's read of the slot's last P is done
        mbarrier.wait(p_empty.index(p_slot), ((i // 2) & 1) ^ 1, pred=i >= 2)
        if HAS_SOFTCAP:
            p_smem.index(p_slot).store(p * cap_slope)
        else:
            p_smem.index(p_slot).store(p)
        mbarrier.arrive(p_full.index(p_slot))
        p_op = gl.convert_layout(p.to(dtype), p_op_layout)
        do = do_smem.index(hopper.arrived(do_ready, i, STAGES)).reshape([BLOCK_M, HEAD_DIM])
        dv0, dv1 = _role_accumulate(p_op, do, dv0, dv1)
        mbarrier.arrive(do_empty.index(slot))
    _store_role_grad((dv0.to(dtype), dv1.to(dtype)), q_smem.index(0), done, outputs, 1, b, hk,
                     start_n, seqlen_k, dv_layout, IS_VARLEN)


@gluon.jit
def _bwd_role_grads_partition(
    roles, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr, DBIAS_ROW: gl.constexpr, IS_VARLEN: gl.constexpr,
):  # fmt: skip
    """BY_ROLE's second warpgroup: each step's dPᵀ (keys, queries), dS from it and the
    first warpgroup's P, and dK += dSᵀ Q; the block's dK out, scaled, at the end.
    DBIAS_ROW: a key row bias's gradient, dS summed over each query head's queries in
    registers and stored once per head into a (B, H, Sk) fp32 buffer (as the split
    kernel's)."""
    (q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem, p_smem, kv_bar, q_ready, do_ready,
     q_empty, do_empty, p_full, p_empty, done, b, hk, GROUP, start_n, lo, full_lo, full_hi,
     n_tiles, seqlen_q, seqlen_k, off, scale, window_left, window_right, outputs, features,
     dbias_out) = roles
    dtype: gl.constexpr = k_smem.dtype
    s_layout: gl.constexpr = _role_layout(BLOCK_M)
    dk_layout: gl.constexpr = _role_layout(HEAD_DIM // 2)
    ds_op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=dk_layout,
                                                     k_width=2)
    cols_layout: gl.constexpr = gl.SliceLayout(0, s_layout)
    zero = _runtime_zero(seqlen_k)
    dk0 = gl.zeros([BLOCK_N, HEAD_DIM // 2], gl.float32, layout=dk_layout)
    dk1 = gl.zeros([BLOCK_N, HEAD_DIM // 2], gl.float32, layout=dk_layout)
    s_init = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=s_layout)
    if DBIAS_ROW:  # this query head's dS summed over its query tiles so far
        offs_n = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, s_layout))
        db_row = gl.zeros([BLOCK_N], gl.float32, layout=gl.SliceLayout(1, s_layout))
    mbarrier.wait(kv_bar, 0)
    for i in range(GROUP * n_tiles):
        slot = hopper.arrived(do_ready, i, STAGES)
        dp = _role_transposed(v_smem, zero * i, do_smem.index(slot), s_init)
        delta = delta_smem.index(slot).reshape([BLOCK_M]).load(cols_layout)
        dp = warpgroup_mma_wait(0, deps=(dp,))
        mbarrier.arrive(do_empty.index(slot))  # dP was this warpgroup's read of dO
        p_slot = i % 2
        mbarrier.wait(p_full.index(p_slot), (i // 2) & 1)
        p = p_smem.index(p_slot).load(s_layout)
        mbarrier.arrive(p_empty.index(p_slot))
        ds = p * (dp - delta[None, :])  # dK takes the scale at the end
        if DBIAS_ROW:  # summed over queries; stored once per query head, its last tile
            db_row += gl.sum(ds, 1)
            head_done = i % n_tiles == n_tiles - 1
            if head_done:
                DBias, stride_gb, stride_gh, _ = dbias_out
                h = _query_tile(i, hk, GROUP, lo, n_tiles, BLOCK_M)[0]
                gl.store(DBias + b.to(gl.int64) * stride_gb + h.to(gl.int64) * stride_gh
                         + offs_n, db_row, mask=offs_n < seqlen_k)
            db_row = gl.where(head_done, 0.0, db_row)
        ds_op = gl.convert_layout(ds.to(dtype), ds_op_layout)
        q = q_smem.index(hopper.arrived(q_ready, i, STAGES)).reshape([BLOCK_M, HEAD_DIM])
        dk0, dk1 = _role_accumulate(ds_op, q, dk0, dk1)
        mbarrier.arrive(q_empty.index(slot))
    _store_role_grad(((dk0 * scale).to(dtype), (dk1 * scale).to(dtype)), do_smem.index(0), done,
                     outputs, 0, b, hk, start_n, seqlen_k, dk_layout, IS_VARLEN)


@gluon.jit
def _role_transposed(kv_smem, index, rows, init):
    """Issues a by-role step's Sᵀ = K Qᵀ (or dPᵀ = V dOᵀ): the block's K (V) times the
    step's Q (dO) tile ``rows`` transposed. K is viewed at ``index``: its only slot, 0,
    but a runtime 0 times the step, so that the view's 16 wgmma descriptors are made in
    each step in the uniform datapath (made once a block, ptxas keeps them in 64 vector
    registers, which the step has not to spare: _kv_views)."""
    keys = kv_smem.index(index).reshape([kv_smem.shape[3], kv_smem.shape[4]])
    rows = rows.reshape([rows.shape[2], rows.shape[3]])
    return warpgroup_mma(keys, rows.permute((1, 0)), init, use_acc=False, is_async=True)


@gluon.jit
def _role_accumulate(op, rows, acc0, acc1):
    """acc0, acc1 += op rows' two column halves (dV from P and dO, or dK from dS and Q:
    256 columns in two accumulators of 128), done."""
    half: gl.constexpr = rows.shape[1] // 2
    acc0 = warpgroup_mma(op, rows.slice(0, half, dim=1), acc0, is_async=True)
    acc1 = warpgroup_mma(op, rows.slice(half, half, dim=1), acc1, is_async=True)
    acc0, acc1, op = warpgroup_mma_wait(0, deps=(acc0, acc1, op))
    return acc0, acc1


@gluon.jit
def _store_role_grad(halves, buf, done, outputs, WHICH: gl.constexpr, b, hk, start_n, seqlen_k,
                     layout: gl.constexpr, IS_VARLEN: gl.constexpr):  # fmt: skip
    """A by-role warpgroup's dK (WHICH 0) or dV (1) of the block's keys, as two halves of
    its columns in the output dtype, out once both warpgroups' matmuls are done (done):
    by TMA store through buf (a ring slot no matmul reads then; the store clips a dense
    batch's keys past Sk), or by plain stores where a packed sequence's keys end inside
    the block."""
    descs, ptrs, key_strides, k_start = outputs
    desc = descs[WHICH]
    stride_b, stride_n, stride_h = key_strides[3 * WHICH:3 * WHICH + 3]
    block_n: gl.constexpr = halves[0].shape[0]
    half: gl.constexpr = halves[0].shape[1]
    mbarrier.arrive(done)
    mbarrier.wait(done, 0)
    if IS_VARLEN and start_n + block_n > seqlen_k:
        rows = start_n + gl.arange(0, block_n, layout=gl.SliceLayout(1, layout))
        cols = gl.arange(0, half, layout=gl.SliceLayout(0, layout))
        X = ptrs[WHICH] + k_start.to(gl.int64) * stride_n
        for j in gl.static_range(2):
            _store_rows(halves[j], X + j * half, b, hk, stride_b, stride_n, stride_h, seqlen_k,
                        rows, cols, desc.shape[3] - j * half)
    else:
        b_tma = b
        if IS_VARLEN:  # one batch of all tokens
            b_tma = 0
        stage = buf._reinterpret(desc.dtype, desc.block_type.shape, desc.layout)
        tile = stage.reshape([block_n, 2 * half])
        for j in gl.static_range(2):
            tile.slice(j * half, half, dim=1).store(halves[j])
        fence_async_shared()
        tma.async_copy_shared_to_global(desc, [b_tma, hk, k_start + start_n, 0], stage)
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
    DQ_DEPENDENT: gl.constexpr, ROLES: gl.constexpr,
):  # fmt: skip
    # A program per key block; packed sequences (IS_VARLEN) on _bwd_sm90_kernel's packed
    # grid (an item past a sequence's blocks done at once), one batch of all tokens to
    # TMA, the row statistics from common.packed_stats_start on. ROLES: the warpgroups
    # by role (BY_ROLE), dK's and dV's descriptors whole rows.
    if DQ_DEPENDENT:  # the dQ kernel (DQ_AS_DEPENDENT) may take the SMs this grid frees
        hopper.launch_dependents()
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
    # The options the partitions take (_wide_scores, _wide_bias_row)
    seed, rng_offset = philox_key(Rng, HAS_DROPOUT)
    features = (seed, rng_offset, HKV * GROUP, dropout_p, Alibi, stride_ab, stride_ah, softcap,
                BiasRow, stride_rb, stride_rh, stride_rn, bias_batches, bias_heads)
    dbias_out = (DBias, stride_gb, stride_gh, stride_gm)
    if ROLES:
        p_smem = gl.allocate_shared_memory(gl.float32, [2, BLOCK_N, BLOCK_M],
                                           hopper.accumulator_order(BLOCK_N, BLOCK_M))
        p_full, p_empty = hopper.ring(2, 1)
        done = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(done, count=2)  # both warpgroups' matmuls done: the rings are free
        roles = (q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem, p_smem, kv_bar,
                 q_ready, do_ready, q_empty, do_empty, p_full, p_empty, done, b, hk, GROUP,
                 start_n, lo, full_lo, full_hi, n_tiles, seqlen_q, seqlen_k, off, scale,
                 window_left, window_right,
                 ((dk_desc, dv_desc), (DK, DV),
                  (stride_kb, stride_kn, stride_kh, stride_vb, stride_vn, stride_vh), k_start),
                 features, dbias_out)
        gl.warp_specialize(
            [(_bwd_role_probs_partition, (roles, HEAD_DIM_QK, BLOCK_M, BLOCK_N, STAGES,
                                          BOUNDED_LEFT, BOUNDED_RIGHT, BIAS_ROW, HAS_ALIBI,
                                          HAS_SOFTCAP, IS_VARLEN)),
             (_bwd_role_grads_partition, (roles, HEAD_DIM_QK, BLOCK_M, BLOCK_N, STAGES,
                                          DBIAS_ROW, IS_VARLEN)),
             (_bwd_load_partition, (
                q_desc, do_desc, k_desc, v_desc, stats_desc, bias_desc, q_smem, do_smem,
                k_smem, v_smem, lse_smem, delta_smem, q_smem, kv_bar, q_ready, do_ready,
                q_empty, do_empty, b_tma, hk, q_start, k_start, stats_start, GROUP, 0, 1,
                start_n, lo, n_tiles, q2_desc, k2_desc, q_smem, k_smem, BLOCK_M, STAGES,
                False, 0))],
            worker_num_warps=[4, 1], worker_num_regs=[240, 24])  # fmt: skip
    else:
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

        shared = (dk_desc, dk2_desc, dv_desc, q_smem, do_smem, k_smem, v_smem, q2_smem, k2_smem,
                  lse_smem, delta_smem, pt_smem, dst_smem, bias_smem, kv_bar, q_ready, do_ready,
                  q_empty, do_empty,
                  ds_bar, pds_free, b, hk, GROUP, start_n, lo, full_lo, full_hi, n_tiles,
                  seqlen_q, seqlen_k, off, scale, window_left, window_right, features, k_start,
                  DK, DV, (stride_kb, stride_kn, stride_kh, stride_vb, stride_vn, stride_vh),
                  dbias_out)
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
# blocks on, as the forward's D=256 grid does (forward_sm90.MIN_BLOCKS_TO_FOLD); under a
# right bound alone, heads of DQ_MIN_BLOCKS_BY_RANK blocks or more take a program per
# block, groups of heads of DQ_MASKED_BY_RANK_BLOCKS blocks rank by rank, as the
# forward's (forward_sm90.MASKED_BY_RANK_BLOCKS). H200, tools/ab.py --pass bwd, medians
# of 3, pairs -> rank by rank: D256 S16384 causal 385 -> 393, S8192 375 -> 379. 0: off.
DQ_MIN_BLOCKS_TO_FOLD = 5
DQ_MASKED_BY_RANK_BLOCKS = 256
DQ_MIN_BLOCKS_BY_RANK = 40
# The dQ kernel launches as the dK/dV kernel's programmatic dependent: the two are
# independent (both read the preprocess's statistics, done before either starts), so
# dQ's programs take the SMs the dK/dV grid's last wave leaves idle (2048 programs of
# 64 keys at 16k tokens, 15.5 waves) and start without the gap between two launches;
# each waits for the dK/dV grid's end before it ends (hopper.wait_for_primary), so that
# the stream's next work sees dK and dV. H200, tools/ab.py --pass bwd, medians of 3,
# after -> dependent: S1024 338 -> 352 TFLOP/s, causal 276 -> 285; S4096 390 -> 388,
# causal 359 -> 357; S16384 403 -> 397 (both 394-404).
DQ_AS_DEPENDENT = True


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
                bias = _wide_bias_row(features, b, h, offs_n, seq_k)[None, :]
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
    KV_STAGES: gl.constexpr, FOLD: gl.constexpr, BY_RANK: gl.constexpr,
    BOTTOM_RIGHT: gl.constexpr, BOUNDED_LEFT: gl.constexpr, BOUNDED_RIGHT: gl.constexpr,
    HAS_BIAS: gl.constexpr, BIAS_ROW: gl.constexpr, HAS_ALIBI: gl.constexpr,
    HAS_DROPOUT: gl.constexpr, HAS_SOFTCAP: gl.constexpr, IS_VARLEN: gl.constexpr,
    DEPENDENT: gl.constexpr,
):  # fmt: skip
    pid = gl.program_id(0)
    programs = gl.num_programs(0)
    if BY_RANK > 0:  # a program per block (DQ_MASKED_BY_RANK_BLOCKS)
        pid = hopper.rank_major_item(pid, programs, num_m_blocks,
                                     gl.cdiv(BY_RANK, num_m_blocks))
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
    if DEPENDENT:  # launched while the dK/dV kernel ran: it has ended when this grid has,
        hopper.wait_for_primary()  # so the stream's next work sees dK and dV


_launch_backward_wide = hopper.Launcher(_bwd_wide_kernel)
_launch_dq_wide = hopper.Launcher(_bwd_dq_wide_kernel)


def backward(spec: AttentionSpec, q, k, v, grad_out, bias, alibi_slopes, rng_state,
             cu_seqlens_q, cu_seqlens_k, stats, dq, dk, dv, dbias) -> None:  # fmt: skip
    """The package's `backward` at head dims past 128 (is_wide): dK and dV (and a bias
    gradient: stored, added by atomics, or a key row's summed) from _bwd_wide_kernel, dQ
    from _bwd_dq_wide_kernel, dense or packed batches."""
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
        # dK's columns a warpgroup stores: half of them, or with a split each buffer's;
        # by role, one warpgroup stores all of dK, the other all of dV
        roles = dkdv.constexprs["ROLES"]
        # (the kernel's columns: a head dim padded to 256 (dispatch.kernel_spec) is wider
        # than the tensor's, whose store TMA clips)
        dk_parts = parts(dk, BLOCK_N_WIDE) if split else (
            hopper.descriptor(dk, BLOCK_N_WIDE, cols=spec.head_dim_qk // (1 if roles else 2)),
        ) * 2
        dv_desc = hopper.descriptor(dv, BLOCK_N_WIDE, cols=spec.head_dim_v // (1 if roles else 2))
        _launch_backward_wide(
            (dkdv.programs,),
            q_cols, k_desc, hopper.descriptor(v, BLOCK_N_WIDE, spec.head_dim_v), do_desc,
            stats_desc, q2_desc,
            k2_desc, *dk_parts, dv_desc,
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


def by_role(spec: AttentionSpec, bias_row: bool, dbias_kind: str | None) -> bool:
    """Whether _bwd_wide_kernel's warpgroups split its matmuls by role (BY_ROLE): head
    dims 256/256 without dropout, bias tiles (shared memory has no room for their slots,
    nor for dropout's exchange, beside P's) or a bias gradient other than a key row's;
    with softcap, ALiBi, a key row's bias (hopper.bias_row) and its gradient."""
    tiles = spec.has_bias and not bias_row
    return (BY_ROLE and spec.head_dim_qk == spec.head_dim_v == 256 and not tiles
            and spec.dropout_p == 0 and dbias_kind in (None, "row"))


@hopper.plan_cache
def _plans_wide(spec: AttentionSpec, bias_row: bool, dbias_kind: str | None, tokens_q: int,
                tokens_k: int, device_index: int) -> tuple[hopper.Plan, hopper.Plan]:  # fmt: skip
    """The D=256 (and 192/128) launches (hopper.Plan): dK/dV, a program per key block
    and key head (counts: key blocks per head); dQ, a program per query block and head,
    or per pair of them folded under a mask (counts: query blocks per head, work items).
    Packed sequences (tokens_q, tokens_k: their tokens in all; 0 for dense batches): a
    program per item of the packed grids (common.packed_items over the keys, and over
    the queries as the forward's). bias_row: the bias is one row of keys
    (hopper.bias_row), read by pointer. dbias_kind: dbias_kind_of's ("full", "summed"
    or "row"), None without a bias gradient; dK/dV's kernel makes it."""
    bias_tiles = spec.has_bias and not bias_row
    roles = by_role(spec, bias_row, dbias_kind)
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
             DBIAS_ROW=dbias_kind == "row", DQ_DEPENDENT=DQ_AS_DEPENDENT, ROLES=roles,
             num_warps=4))
    block_m = 2 * ROWS.value
    num_m = cdiv(spec.seqlen_q, block_m)
    num_items = num_m * spec.batch * spec.heads
    if spec.varlen:
        num_items = packed_items(spec.batch, tokens_q, spec.heads, block_m)
    masked = spec.window_left >= 0 or spec.window_right >= 0
    by_rank = hopper.rank_order(spec, num_m, DQ_MASKED_BY_RANK_BLOCKS, DQ_MIN_BLOCKS_BY_RANK)
    fold = masked and num_m >= DQ_MIN_BLOCKS_TO_FOLD and not spec.varlen and not by_rank
    dq = hopper.Plan(hopper.programs(num_items, fold, False, device_index), (num_m, num_items),
                     dict(BLOCK_M=block_m, BLOCK_N=dq_block_n(spec),
                          KV_STAGES=dq_kv_stages(spec, bias_tiles), FOLD=fold,
                          BY_RANK=by_rank, DEPENDENT=DQ_AS_DEPENDENT,
                          launch_pdl=DQ_AS_DEPENDENT, **bounds,
                          num_warps=4))  # fmt: skip
    return dkdv, dq
