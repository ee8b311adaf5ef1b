"""Backward kernels: the preprocess (delta = rowsum(dO * O)), dK/dV (and the bias
gradient) walking queries for a block of keys, dQ walking keys for a block of queries.

With P = exp(s - lse) the probabilities, Z the dropout keep mask over (1 - p), and s
the score before masking (natural units):
    dV = (P Z)^T dO        dP = (dO V^T) Z        dS = P (dP - delta)
    dbias = dS             dQK = dS * scale * (1 - tanh^2)  (softcap; else dS * scale)
    dQ = dQK K             dK = dQK^T Q
Each dK/dV program owns a block of keys of one (batch, kv head) and loops over every
query head of its GQA group, so dK and dV are summed in registers: no atomics, no
repeated K/V. It works on transposed (keys, queries) tiles, so that P^T and dS^T feed
the dV and dK matmuls without a transpose.

dQ has three paths (``backward`` picks): its own kernel, recomputing P (the default,
deterministic by construction); ``dq_atomic`` configurations, fp32 atomics inside the
dK/dV kernel (never in deterministic mode); and, when a full bias gradient has stored
dS anyway, one matmul dQ = scale * dS K. The other atomic path is a bias gradient
broadcast over batch, heads or keys; deterministic=True replaces it with an expanded
buffer reduced afterwards.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ..spec import AttentionSpec
from . import tuning
from .common import (
    LOG2E,
    STATS_SLACK,
    add_bias_alibi_log2,
    alibi_strides,
    capped_score_log2,
    cdiv,
    diagonal_offset,
    dq_tile,
    dropout_keep,
    key_range,
    new_output,
    packed_items,
    packed_row_block,
    packed_stats_start,
    philox_key,
    query_range,
    row_block,
    row_stats_buffer,
    sequence_bounds,
    stats_planes,
    sum_to_bias,
    tile_span,
    tile_start,
    visible,
)
from .forward import (
    bias_strides,
    dense_strides,
    feature_switches,
    lse_strides,
    rescored_lse,
)


@triton.jit
def _delta_kernel(
    Out, DOut, Delta, Lse, Lse2, DQAcc, GradLse,
    stride_ob, stride_om, stride_oh, stride_od,
    stride_gb, stride_gm, stride_gh, stride_gd,
    stride_lb, stride_lh, stride_lm,
    stride_db, stride_dh, stride_dm,
    stride_ab, stride_ah,
    stride_eb, stride_eh, stride_em,
    CuSeqQ, H, seqlen_q, num_m_blocks, num_seqs,
    DV: tl.constexpr, DQK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr,
    IS_VARLEN: tl.constexpr, ZERO_DQ: tl.constexpr,
    DQ_BLOCK_M: tl.constexpr, HAS_GRAD_LSE: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """The backward's row statistics (common.row_stats_buffer, strides stride_d*):
    delta = rowsum(dO * O), minus grad_lse where a gradient flows into lse (it adds
    P * grad_lse to dS), and lse2 = lse * log2(e) (+inf for rows that see no key, so
    their P is 0, not NaN), packed sequences' at packed_stats_start, each sequence's
    followed by STATS_SLACK rows of lse2 = +inf and delta = 0. With ZERO_DQ, zeros for
    the Gluon backward's fp32 dQ accumulator (backward_sm90.shared.dq_tiles: DQ_BLOCK_M
    rows a tile, each zeroed whole by the program at its first row). Packed sequences
    take packed_items' grid over their tokens (a grid over each sequence's blocks to
    the longest holds mostly empty programs where the lengths differ). PDL: launched as
    the stream's last kernel ends (backward_sm90.shared.DEPENDENT_LAUNCHES), it waits for
    that kernel's writes, then lets the main kernel launch, which waits for this one's."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
    if IS_VARLEN:
        b, h, m_block = packed_row_block(H, CuSeqQ, num_seqs, BLOCK_M)
    else:
        b, h, _, m_block = row_block(num_m_blocks, H, False)
    start_m = m_block * BLOCK_M
    q_start, _, seqlen_q, _ = sequence_bounds(CuSeqQ, CuSeqQ, b, seqlen_q, seqlen_q, IS_VARLEN)
    row0 = tl.cast(q_start + start_m, tl.int64)
    b64 = tl.cast(b, tl.int64)
    h64 = tl.cast(h, tl.int64)
    rows = tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_DV)
    row_ok = (start_m + rows) < seqlen_q
    mask = row_ok[:, None] & (cols < DV)[None, :]
    o = tl.load(Out + b64 * stride_ob + h64 * stride_oh + row0 * stride_om
                + rows[:, None] * stride_om + cols[None, :] * stride_od, mask=mask, other=0.0)
    do = tl.load(DOut + b64 * stride_gb + h64 * stride_gh + row0 * stride_gm
                 + rows[:, None] * stride_gm + cols[None, :] * stride_gd, mask=mask, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    if HAS_GRAD_LSE:
        delta -= tl.load(GradLse + b64 * stride_eb + h64 * stride_eh + (row0 + rows) * stride_em,
                         mask=row_ok, other=0.0)
    stats_row0 = tl.cast(start_m, tl.int64)
    if IS_VARLEN:
        stats_row0 = tl.cast(packed_stats_start(q_start, b) + start_m, tl.int64)
    d_off = b64 * stride_db + h64 * stride_dh + (stats_row0 + rows) * stride_dm
    tl.store(Delta + d_off, delta, mask=row_ok)
    lse = tl.load(Lse + b64 * stride_lb + h64 * stride_lh + (row0 + rows) * stride_lm,
                  mask=row_ok, other=0.0)
    tl.store(Lse2 + d_off, tl.where(lse == float("-inf"), float("inf"), lse * LOG2E),
             mask=row_ok)
    if (start_m < seqlen_q) & (seqlen_q <= start_m + BLOCK_M):  # the block holding the
        slack = tl.arange(0, STATS_SLACK)  # sequence's end: the slack past it
        s_off = (b64 * stride_db + h64 * stride_dh
                 + (stats_row0 + seqlen_q - start_m + slack) * stride_dm)
        tl.store(Lse2 + s_off, tl.full([STATS_SLACK], float("inf"), tl.float32))
        tl.store(Delta + s_off, tl.zeros([STATS_SLACK], tl.float32))
    if ZERO_DQ:
        if (start_m % DQ_BLOCK_M == 0) & (start_m < seqlen_q):
            tile = dq_tile(start_m, q_start, b, DQ_BLOCK_M, IS_VARLEN)
            first = h64 * stride_ah + tl.cast(tile, tl.int64) * DQ_BLOCK_M * DQK
            if not IS_VARLEN:  # packed sequences number their tiles across the batch;
                # their zero batch term would cost the offset its alignment (b comes from
                # the search's loop) and the stores their width: 4 bytes, not 16
                first += b64 * stride_ab
            # in pieces of a power of 2 (DQK's largest factor that is one: 192 -> 64)
            PIECE: tl.constexpr = DQ_BLOCK_M * (DQK & -DQK)
            for piece in tl.static_range(DQK // (DQK & -DQK)):
                tl.store(DQAcc + first + piece * PIECE + tl.arange(0, PIECE),
                         tl.zeros([PIECE], tl.float32))


_DELTA_BLOCK_M = 64


def delta_launch(spec: AttentionSpec, out, grad_out, lse, grad_lse, cu_seqlens_q, stats,
                 dq_acc=None, dq_block_m=0, pdl=False) -> tuple[tuple, tuple, dict]:  # fmt: skip
    """_delta_kernel's (grid, arguments, constexprs): the row statistics into ``stats``
    (common.row_stats_buffer's), and zeros in dq_acc where given
    (backward_sm90.shared.dq_tiles, tiles of dq_block_m rows). pdl: the kernel waits
    for the one before it, then lets the next launch (it must be launched with
    launch_pdl then). The tile backward launches it here, backward_sm90 through its
    launcher."""
    zero_dq = dq_acc is not None
    lse2, delta = stats_planes(stats, spec.varlen)
    num_m = cdiv(spec.seqlen_q, _DELTA_BLOCK_M)
    programs = (packed_items(spec.batch, out.shape[0], spec.heads, _DELTA_BLOCK_M)
                if spec.varlen else num_m * spec.batch * spec.heads)
    args = (
        out, grad_out, delta, lse, lse2, dq_acc if zero_dq else lse2,
        lse if grad_lse is None else grad_lse,
        *dense_strides(out, spec.varlen), *dense_strides(grad_out, spec.varlen),
        *lse_strides(lse, spec.varlen), *lse_strides(delta, spec.varlen),
        0 if spec.varlen or not zero_dq else dq_acc.stride(0),
        dq_acc.stride(1) if zero_dq else 0,
        *(lse_strides(grad_lse, spec.varlen) if grad_lse is not None else (0, 0, 0)),
        cu_seqlens_q, spec.heads, spec.seqlen_q, num_m, spec.batch,
    )  # fmt: skip
    # O's own columns (the Gluon backward's spec may count more: dispatch.kernel_spec);
    # dq_acc's tiles span the spec's
    constexprs = dict(
        DV=out.shape[-1], DQK=spec.head_dim_qk, BLOCK_M=_DELTA_BLOCK_M,
        BLOCK_DV=tuning.padded_head_dim(out.shape[-1]), IS_VARLEN=spec.varlen,
        ZERO_DQ=zero_dq, DQ_BLOCK_M=dq_block_m, HAS_GRAD_LSE=grad_lse is not None, PDL=pdl,
    )  # fmt: skip
    return (programs,), args, constexprs


@triton.jit
def _grad_scores(
    qk, dp, lse2, delta, rows, cols, bias, keep,
    seqlen_k, off, alibi_off, scale, softcap, slope, window_left, window_right, dropout_p,
    MASKED: tl.constexpr, BOUNDED_LEFT: tl.constexpr, BOUNDED_RIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, FAST_TANH: tl.constexpr,
):  # fmt: skip
    """The elementwise part of the backward for one tile, in either orientation:
    returns (pz, ds, dqk), the dropped probabilities P Z (for dV), dS (the bias
    gradient) and dQK = dS * dscore (for dQ and dK). keep is the dropout keep tile in
    the same orientation.

    qk (raw q.k) and dp (dO.v) are fp32 tiles; rows, cols, lse2 and delta broadcast
    against them: (M, 1) and (1, N) for a (queries, keys) tile, (1, M) and (N, 1) for
    the transposed one. lse2 = lse * log2(e) with +inf for rows that see no key, so
    that their P is 0 rather than NaN. alibi_off: ALiBi's diagonal offset, off shifted
    by the global positions (AttentionSpec.position_q - position_k).
    """
    s_cap = capped_score_log2(qk, scale, softcap, HAS_SOFTCAP, FAST_TANH)
    s = add_bias_alibi_log2(s_cap, rows, cols, alibi_off, slope, bias, HAS_BIAS, HAS_ALIBI)
    if MASKED:
        mask = visible(rows, cols, seqlen_k, off, window_left, window_right,
                       BOUNDED_LEFT, BOUNDED_RIGHT)
        s = tl.where(mask, s, float("-inf"))
    p = tl.exp2(s - lse2)
    pz = p
    if HAS_DROPOUT:
        inv_keep = 1.0 / (1.0 - dropout_p)
        pz = tl.where(keep, p * inv_keep, 0.0)
        dp = tl.where(keep, dp * inv_keep, 0.0)
    ds = p * (dp - delta)
    if HAS_SOFTCAP:
        t = s_cap * (1.0 / (softcap * LOG2E))
        dqk = ds * (scale * (1.0 - t * t))
    else:
        dqk = ds * scale
    return pz, ds, dqk


@triton.jit
def _dkdv_tiles(
    dk, dv, dbias_rows, k, v,
    q_base, do_base, lse2_base, delta_base, bias_base, dbias_base, dq_base,
    stride_qm, stride_qd, stride_gm, stride_gd, stride_lm,
    stride_bm, stride_bn, stride_dbm, stride_dbn, stride_dqm, stride_dqd,
    start_n, offs_n, offs_dqk, offs_dv, lo, hi,
    seqlen_q, seqlen_k, off, scale, softcap, slope, window_left, window_right,
    seed, rng_offset, bh, dropout_p, pos_q, pos_k,
    DQK: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr, BOUNDED_LEFT: tl.constexpr, BOUNDED_RIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, HAS_DBIAS: tl.constexpr, DBIAS_ROWS: tl.constexpr,
    DBIAS_COLS: tl.constexpr, DBIAS_ATOMIC: tl.constexpr, DQ_ATOMIC: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """Accumulates query tiles [lo, hi) into dK, dV (and the bias gradient, and with
    DQ_ATOMIC dQ) of one key block for one query head; lse2_base and delta_base: the
    head's row statistics (common.row_stats_buffer) from the sequence's first query.

    The tiles are transposed, (keys, queries), as in FlashAttention's dK/dV loop: P^T
    and dS^T come out of their matmuls in the layout the dV and dK matmuls take them
    in, where the (queries, keys) orientation would transpose both through shared
    memory on every tile.
    """
    arange_m = tl.arange(0, BLOCK_M)
    arange_n = tl.arange(0, BLOCK_N)
    col_ok = offs_n < seqlen_k
    for start_m in tl.range(lo, hi, BLOCK_M):
        offs_m = start_m + arange_m
        row_ok = offs_m < seqlen_q
        start_m64 = tile_start(start_m, BLOCK_M)
        if MASKED:
            q_mask = row_ok[:, None] & (offs_dqk[None, :] < DQK)
            do_mask = row_ok[:, None] & (offs_dv[None, :] < DV)
        else:
            q_mask = offs_dqk[None, :] < DQK
            do_mask = offs_dv[None, :] < DV
        q = tl.load(q_base + start_m64 * stride_qm + arange_m[:, None] * stride_qm
                    + offs_dqk[None, :] * stride_qd, mask=q_mask, other=0.0)
        do = tl.load(do_base + start_m64 * stride_gm + arange_m[:, None] * stride_gm
                     + offs_dv[None, :] * stride_gd, mask=do_mask, other=0.0)
        # rows past the sequence read its slack (row_stats_buffer): P = 0, dS = 0
        lse2 = tl.load(lse2_base + (start_m64 + arange_m) * stride_lm)
        delta = tl.load(delta_base + (start_m64 + arange_m) * stride_lm)
        qk_t = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION)
        dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
        bias_t = qk_t  # placeholder, unused without a bias
        if HAS_BIAS:
            b_ptrs = (bias_base + start_m64 * stride_bm + arange_m[None, :] * stride_bm
                      + arange_n[:, None] * stride_bn)
            if MASKED:
                bias_t = tl.load(b_ptrs, mask=row_ok[None, :] & col_ok[:, None], other=0.0)
            else:  # every query and key in range: aligned rows load 16 bytes at a time
                bias_t = tl.load(b_ptrs)
            bias_t = bias_t.to(tl.float32)
        keep_t = qk_t  # placeholder, unused without dropout
        if HAS_DROPOUT:  # drawn keys-last, as the forward draws it
            keep_t = tl.trans(dropout_keep(seed, rng_offset, bh, offs_m + pos_q,
                                           start_n + pos_k, dropout_p, BLOCK_N))
        pz_t, ds_t, dqk_t = _grad_scores(
            qk_t, dp_t, lse2[None, :], delta[None, :], offs_m[None, :], offs_n[:, None],
            bias_t, keep_t, seqlen_k, off, off + pos_q - pos_k, scale, softcap, slope,
            window_left, window_right, dropout_p,
            MASKED, BOUNDED_LEFT, BOUNDED_RIGHT, HAS_BIAS, HAS_ALIBI, HAS_SOFTCAP,
            HAS_DROPOUT, q.dtype != tl.float32)
        dv += tl.dot(pz_t.to(do.dtype), do, input_precision=DOT_PRECISION)
        dk += tl.dot(dqk_t.to(q.dtype), q, input_precision=DOT_PRECISION)
        if DQ_ATOMIC:  # dQ += dS K for this tile, summed over key blocks in fp32
            dq = tl.dot(tl.trans(dqk_t.to(k.dtype)), k, input_precision=DOT_PRECISION)
            tl.atomic_add(dq_base + start_m64 * stride_dqm + arange_m[:, None] * stride_dqm
                          + offs_dqk[None, :] * stride_dqd, dq,
                          mask=row_ok[:, None] & (offs_dqk[None, :] < DQK), sem="relaxed")
        if HAS_DBIAS:
            if MASKED:
                ds_t = tl.where(row_ok[None, :] & col_ok[:, None], ds_t, 0.0)
            if DBIAS_ROWS:  # bias broadcast over query rows: sum them in registers
                dbias_rows += tl.sum(ds_t, 1)
            elif DBIAS_COLS:  # broadcast over keys: sum the tile's keys, then add
                tl.atomic_add(dbias_base + start_m64 * stride_dbm + arange_m * stride_dbm,
                              tl.sum(ds_t, 0), mask=row_ok, sem="relaxed")
            else:
                db_ptrs = (dbias_base + start_m64 * stride_dbm
                           + arange_m[None, :] * stride_dbm + arange_n[:, None] * stride_dbn)
                db_mask = None  # every query and key in range: stores 16 bytes wide
                if MASKED:
                    db_mask = row_ok[None, :] & col_ok[:, None]
                if DBIAS_ATOMIC:
                    tl.atomic_add(db_ptrs, ds_t, mask=db_mask, sem="relaxed")
                else:
                    tl.store(db_ptrs, ds_t.to(dbias_base.dtype.element_ty), mask=db_mask)
    return dk, dv, dbias_rows


@triton.jit
def _dkdv_kernel(
    Q, K, V, DOut, Lse2, Delta, Bias, DBias, Alibi, Rng, CuSeqQ, CuSeqK, DK, DV_, DQAcc,
    stride_qb, stride_qm, stride_qh, stride_qd,
    stride_kb, stride_kn, stride_kh, stride_kd,
    stride_vb, stride_vn, stride_vh, stride_vd,
    stride_gb, stride_gm, stride_gh, stride_gd,
    stride_lb, stride_lh, stride_lm,
    stride_bb, stride_bh, stride_bm, stride_bn,
    stride_dbb, stride_dbh, stride_dbm, stride_dbn,
    stride_ab, stride_ah,
    stride_dkb, stride_dkn, stride_dkh, stride_dkd,
    stride_dvb, stride_dvn, stride_dvh, stride_dvd,
    stride_dqb, stride_dqm, stride_dqh, stride_dqd,
    H, HKV, GROUP, seqlen_q, seqlen_k, num_n_blocks, num_seqs,
    scale, softcap, window_left, window_right, dropout_p, pos_q, pos_k,
    DQK: tl.constexpr, DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    IS_VARLEN: tl.constexpr, BOTTOM_RIGHT: tl.constexpr,
    BOUNDED_LEFT: tl.constexpr, BOUNDED_RIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, HAS_DBIAS: tl.constexpr, DBIAS_ROWS: tl.constexpr,
    DBIAS_COLS: tl.constexpr, DBIAS_ATOMIC: tl.constexpr, DQ_ATOMIC: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    # One program per (key block, batch * kv head) on a 1-D grid, as in the forward
    # (packed sequences: common.packed_items' grid over the keys, first block first).
    if IS_VARLEN:
        b, hk, n_block = packed_row_block(HKV, CuSeqK, num_seqs, BLOCK_N)
    else:
        b, hk, _, n_block = row_block(num_n_blocks, HKV, False)
    q_start, k_start, seqlen_q, seqlen_k = sequence_bounds(
        CuSeqQ, CuSeqK, b, seqlen_q, seqlen_k, IS_VARLEN)
    start_n = n_block * BLOCK_N
    if IS_VARLEN:
        if start_n >= seqlen_k:  # an item past its sequence's blocks
            return
    off = diagonal_offset(seqlen_q, seqlen_k, BOTTOM_RIGHT)

    b64 = tl.cast(b, tl.int64)
    hk64 = tl.cast(hk, tl.int64)
    col0 = tl.cast(k_start + start_n, tl.int64)
    q_row0 = tl.cast(q_start, tl.int64)
    stats_row0 = tl.cast(0, tl.int64)  # the sequence's row statistics' first row
    if IS_VARLEN:
        stats_row0 = tl.cast(packed_stats_start(q_start, b), tl.int64)
    arange_n = tl.arange(0, BLOCK_N)
    offs_n = start_n + arange_n
    offs_dqk = tl.arange(0, BLOCK_DQK)
    offs_dv = tl.arange(0, BLOCK_DV)
    col_ok = offs_n < seqlen_k
    k = tl.load(K + b64 * stride_kb + hk64 * stride_kh + col0 * stride_kn
                + arange_n[:, None] * stride_kn + offs_dqk[None, :] * stride_kd,
                mask=col_ok[:, None] & (offs_dqk[None, :] < DQK), other=0.0)
    v = tl.load(V + b64 * stride_vb + hk64 * stride_vh + col0 * stride_vn
                + arange_n[:, None] * stride_vn + offs_dv[None, :] * stride_vd,
                mask=col_ok[:, None] & (offs_dv[None, :] < DV), other=0.0)
    seed, rng_offset = philox_key(Rng, HAS_DROPOUT)

    lo, full_lo, full_hi, hi = query_range(
        start_n, seqlen_q, seqlen_k, off, window_left, window_right,
        BLOCK_M, BLOCK_N, BOUNDED_LEFT, BOUNDED_RIGHT)
    hi = tl.where(start_n < seqlen_k, hi, lo)  # blocks past this sequence's keys
    full_lo = tl.minimum(full_lo, hi)
    full_hi = tl.minimum(full_hi, hi)

    dk = tl.zeros([BLOCK_N, BLOCK_DQK], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
    for g in range(GROUP):
        h = hk * GROUP + g
        h64 = tl.cast(h, tl.int64)
        bh = b * H + h
        q_base = Q + b64 * stride_qb + h64 * stride_qh + q_row0 * stride_qm
        do_base = DOut + b64 * stride_gb + h64 * stride_gh + q_row0 * stride_gm
        lse2_base = Lse2 + b64 * stride_lb + h64 * stride_lh + stats_row0 * stride_lm
        delta_base = Delta + b64 * stride_lb + h64 * stride_lh + stats_row0 * stride_lm
        dq_base = DQAcc
        if DQ_ATOMIC:
            dq_base = DQAcc + b64 * stride_dqb + h64 * stride_dqh + q_row0 * stride_dqm
        bias_base = Bias
        if HAS_BIAS:
            bias_base = (Bias + b64 * stride_bb + h64 * stride_bh
                         + tl.cast(start_n, tl.int64) * stride_bn)
        dbias_base = DBias
        if HAS_DBIAS:
            dbias_base = (DBias + b64 * stride_dbb + h64 * stride_dbh
                          + tl.cast(start_n, tl.int64) * stride_dbn)
        slope = 0.0
        if HAS_ALIBI:
            slope = tl.load(Alibi + b64 * stride_ab + h64 * stride_ah)
        dbias_rows = tl.zeros([BLOCK_N], dtype=tl.float32)
        for span in tl.static_range(3):
            # Masked query tiles at the window's edges, unmasked ones between them.
            span_lo, span_hi = tile_span(span, lo, full_lo, full_hi, hi)
            dk, dv, dbias_rows = _dkdv_tiles(
                dk, dv, dbias_rows, k, v, q_base, do_base, lse2_base, delta_base, bias_base,
                dbias_base, dq_base, stride_qm, stride_qd, stride_gm, stride_gd, stride_lm,
                stride_bm, stride_bn, stride_dbm, stride_dbn, stride_dqm, stride_dqd,
                start_n, offs_n, offs_dqk, offs_dv, span_lo, span_hi,
                seqlen_q, seqlen_k, off, scale, softcap, slope,
                window_left, window_right, seed, rng_offset, bh, dropout_p, pos_q, pos_k,
                DQK, DV, BLOCK_M, BLOCK_N, span != 1, BOUNDED_LEFT, BOUNDED_RIGHT,
                HAS_BIAS, HAS_ALIBI, HAS_SOFTCAP, HAS_DROPOUT, HAS_DBIAS, DBIAS_ROWS,
                DBIAS_COLS, DBIAS_ATOMIC, DQ_ATOMIC, DOT_PRECISION)
        if HAS_DBIAS:
            if DBIAS_ROWS and DBIAS_COLS:
                tl.atomic_add(dbias_base, tl.sum(dbias_rows, 0), sem="relaxed")
            elif DBIAS_ROWS:
                db_ptrs = dbias_base + arange_n * stride_dbn
                if DBIAS_ATOMIC:
                    tl.atomic_add(db_ptrs, dbias_rows, mask=col_ok, sem="relaxed")
                else:
                    tl.store(db_ptrs, dbias_rows.to(DBias.dtype.element_ty), mask=col_ok)

    dk_ptrs = (DK + b64 * stride_dkb + hk64 * stride_dkh + col0 * stride_dkn
               + arange_n[:, None] * stride_dkn + offs_dqk[None, :] * stride_dkd)
    tl.store(dk_ptrs, dk.to(DK.dtype.element_ty),
             mask=col_ok[:, None] & (offs_dqk[None, :] < DQK))
    dv_ptrs = (DV_ + b64 * stride_dvb + hk64 * stride_dvh + col0 * stride_dvn
               + arange_n[:, None] * stride_dvn + offs_dv[None, :] * stride_dvd)
    tl.store(dv_ptrs, dv.to(DV_.dtype.element_ty),
             mask=col_ok[:, None] & (offs_dv[None, :] < DV))


@triton.jit
def _dq_tiles(
    dq, q, do, lse2, delta, k_base, v_base, bias_base,
    stride_kn, stride_kd, stride_vn, stride_vd, stride_bm, stride_bn,
    offs_m, offs_dqk, offs_dv, lo, hi,
    seqlen_q, seqlen_k, off, scale, softcap, slope, window_left, window_right,
    seed, rng_offset, bh, dropout_p, pos_q, pos_k,
    DQK: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr, BOUNDED_LEFT: tl.constexpr, BOUNDED_RIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    arange_m = tl.arange(0, BLOCK_M)
    arange_n = tl.arange(0, BLOCK_N)
    row_ok = offs_m < seqlen_q
    for start_n in tl.range(lo, hi, BLOCK_N):
        offs_n = start_n + arange_n
        col_ok = offs_n < seqlen_k
        start_n64 = tile_start(start_n, BLOCK_N)
        if MASKED:
            k_mask = col_ok[:, None] & (offs_dqk[None, :] < DQK)
            v_mask = col_ok[:, None] & (offs_dv[None, :] < DV)
        else:
            k_mask = offs_dqk[None, :] < DQK
            v_mask = offs_dv[None, :] < DV
        k = tl.load(k_base + start_n64 * stride_kn + arange_n[:, None] * stride_kn
                    + offs_dqk[None, :] * stride_kd, mask=k_mask, other=0.0)
        v = tl.load(v_base + start_n64 * stride_vn + arange_n[:, None] * stride_vn
                    + offs_dv[None, :] * stride_vd, mask=v_mask, other=0.0)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
        bias = qk  # placeholder, unused without a bias
        if HAS_BIAS:
            b_ptrs = (bias_base + start_n64 * stride_bn + arange_m[:, None] * stride_bm
                      + arange_n[None, :] * stride_bn)
            if MASKED:
                b_mask = row_ok[:, None] & col_ok[None, :]
            else:  # every key in range: rows alone, so aligned rows load 16 bytes at a time
                b_mask = row_ok[:, None]
            bias = tl.load(b_ptrs, mask=b_mask, other=0.0)
            bias = bias.to(tl.float32)
        keep = qk  # placeholder, unused without dropout
        if HAS_DROPOUT:
            keep = dropout_keep(seed, rng_offset, bh, offs_m + pos_q, start_n + pos_k,
                                dropout_p, BLOCK_N)
        _, _, dqk = _grad_scores(
            qk, dp, lse2[:, None], delta[:, None], offs_m[:, None], offs_n[None, :], bias,
            keep, seqlen_k, off, off + pos_q - pos_k, scale, softcap, slope, window_left,
            window_right, dropout_p,
            MASKED, BOUNDED_LEFT, BOUNDED_RIGHT, HAS_BIAS, HAS_ALIBI, HAS_SOFTCAP,
            HAS_DROPOUT, q.dtype != tl.float32)
        dq += tl.dot(dqk.to(k.dtype), k, input_precision=DOT_PRECISION)
    return dq


@triton.jit
def _dq_kernel(
    Q, K, V, DOut, Lse2, Delta, Bias, Alibi, Rng, CuSeqQ, CuSeqK, DQ,
    stride_qb, stride_qm, stride_qh, stride_qd,
    stride_kb, stride_kn, stride_kh, stride_kd,
    stride_vb, stride_vn, stride_vh, stride_vd,
    stride_gb, stride_gm, stride_gh, stride_gd,
    stride_lb, stride_lh, stride_lm,
    stride_bb, stride_bh, stride_bm, stride_bn,
    stride_ab, stride_ah,
    stride_dqb, stride_dqm, stride_dqh, stride_dqd,
    H, GROUP, seqlen_q, seqlen_k, num_m_blocks, num_seqs,
    scale, softcap, window_left, window_right, dropout_p, pos_q, pos_k,
    DQK: tl.constexpr, DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    IS_VARLEN: tl.constexpr, BOTTOM_RIGHT: tl.constexpr,
    BOUNDED_LEFT: tl.constexpr, BOUNDED_RIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    # The forward's grid and order (_fwd_kernel)
    if IS_VARLEN:
        b, h, m_block = packed_row_block(H, CuSeqQ, num_seqs, BLOCK_M, True)
        bh = b * H + h
    else:
        b, h, bh, m_block = row_block(num_m_blocks, H, True)
    q_start, k_start, seqlen_q, seqlen_k = sequence_bounds(
        CuSeqQ, CuSeqK, b, seqlen_q, seqlen_k, IS_VARLEN)
    start_m = m_block * BLOCK_M
    if IS_VARLEN:
        if start_m >= seqlen_q:  # an item past its sequence's blocks
            return
    off = diagonal_offset(seqlen_q, seqlen_k, BOTTOM_RIGHT)

    b64 = tl.cast(b, tl.int64)
    h64 = tl.cast(h, tl.int64)
    hk64 = tl.cast(h // GROUP, tl.int64)
    row0 = tl.cast(q_start + start_m, tl.int64)
    k_base = K + b64 * stride_kb + hk64 * stride_kh + tl.cast(k_start, tl.int64) * stride_kn
    v_base = V + b64 * stride_vb + hk64 * stride_vh + tl.cast(k_start, tl.int64) * stride_vn
    bias_base = Bias
    if HAS_BIAS:
        bias_base = (Bias + b64 * stride_bb + h64 * stride_bh
                     + tl.cast(start_m, tl.int64) * stride_bm)
    slope = 0.0
    if HAS_ALIBI:
        slope = tl.load(Alibi + b64 * stride_ab + h64 * stride_ah)
    seed, rng_offset = philox_key(Rng, HAS_DROPOUT)

    arange_m = tl.arange(0, BLOCK_M)
    offs_m = start_m + arange_m
    offs_dqk = tl.arange(0, BLOCK_DQK)
    offs_dv = tl.arange(0, BLOCK_DV)
    row_ok = offs_m < seqlen_q
    q = tl.load(Q + b64 * stride_qb + h64 * stride_qh + row0 * stride_qm
                + arange_m[:, None] * stride_qm + offs_dqk[None, :] * stride_qd,
                mask=row_ok[:, None] & (offs_dqk[None, :] < DQK), other=0.0)
    do = tl.load(DOut + b64 * stride_gb + h64 * stride_gh + row0 * stride_gm
                 + arange_m[:, None] * stride_gm + offs_dv[None, :] * stride_gd,
                 mask=row_ok[:, None] & (offs_dv[None, :] < DV), other=0.0)
    # the row statistics (common.row_stats_buffer); rows past the sequence read its
    # slack: P = 0, dS = 0
    stats_row0 = start_m
    if IS_VARLEN:
        stats_row0 = packed_stats_start(q_start, b) + start_m
    l_ptrs = (b64 * stride_lb + h64 * stride_lh
              + (tl.cast(stats_row0, tl.int64) + arange_m) * stride_lm)
    lse2 = tl.load(Lse2 + l_ptrs)
    delta = tl.load(Delta + l_ptrs)

    lo, full_lo, full_hi, hi = key_range(
        start_m, seqlen_k, off, window_left, window_right,
        BLOCK_M, BLOCK_N, BOUNDED_LEFT, BOUNDED_RIGHT)
    hi = tl.where(start_m < seqlen_q, hi, lo)
    full_lo = tl.minimum(full_lo, hi)
    full_hi = tl.minimum(full_hi, hi)

    dq = tl.zeros([BLOCK_M, BLOCK_DQK], dtype=tl.float32)
    for span in tl.static_range(3):
        span_lo, span_hi = tile_span(span, lo, full_lo, full_hi, hi)
        dq = _dq_tiles(
            dq, q, do, lse2, delta, k_base, v_base, bias_base,
            stride_kn, stride_kd, stride_vn, stride_vd, stride_bm, stride_bn,
            offs_m, offs_dqk, offs_dv, span_lo, span_hi,
            seqlen_q, seqlen_k, off, scale, softcap, slope, window_left, window_right,
            seed, rng_offset, bh, dropout_p, pos_q, pos_k, DQK, DV, BLOCK_M, BLOCK_N,
            span != 1,
            BOUNDED_LEFT, BOUNDED_RIGHT, HAS_BIAS, HAS_ALIBI, HAS_SOFTCAP, HAS_DROPOUT,
            DOT_PRECISION)
    tl.store(DQ + b64 * stride_dqb + h64 * stride_dqh + row0 * stride_dqm
             + arange_m[:, None] * stride_dqm + offs_dqk[None, :] * stride_dqd,
             dq.to(DQ.dtype.element_ty), mask=row_ok[:, None] & (offs_dqk[None, :] < DQK))


def _dbias_buffer(bias: torch.Tensor, spec: AttentionSpec):
    """Where the kernel writes dS for a bias, and how to turn that into dbias.

    Returns (buffer, strides as (B, H, Sq, Sk), rows, cols, atomic). A bias broadcast
    over query rows is reduced over them in registers (rows=True: the buffer's row
    stride is unused). A bias broadcast over batch, heads or keys makes several programs
    add into one element: with atomics into a float32 buffer of the bias's shape (keys
    first summed over each tile in registers, cols=True), or, deterministic, into a
    buffer expanded over those dimensions and summed afterwards.
    """
    shape = (1,) * (4 - bias.dim()) + tuple(bias.shape)
    full = spec.bias_shape
    rows = shape[2] == 1 and full[2] != 1
    summed = [d for d in (0, 1, 3) if shape[d] == 1 and full[d] != 1]
    atomic = bool(summed) and not spec.deterministic
    buf_shape = list(shape)
    if not atomic:
        for d in summed:
            buf_shape[d] = full[d]
    dtype = torch.float32 if (atomic or summed or rows) else bias.dtype
    # Without a window or varlen bounds every tile is visited and every element of a
    # plain (non-reduced) buffer is stored: no zero fill, which for a full (B, H, S, S)
    # buffer costs as much as the stores themselves.
    every_tile = spec.window_left < 0 and spec.window_right < 0 and not spec.varlen
    if every_tile and not atomic and not rows:
        buf = new_output(buf_shape, dtype, bias.device)
    else:
        buf = torch.zeros(buf_shape, dtype=dtype, device=bias.device)
    strides = buf.expand(*full[:2], buf_shape[2], full[3]).stride()
    cols = atomic and 3 in summed
    return buf, strides, rows, cols, atomic


def _holds_full_ds(db_buf: torch.Tensor, spec: AttentionSpec) -> bool:
    """Whether the bias-gradient buffer holds dS for every (b, h, i, j), so that
    dQ = scale * dS K (dense batches, no softcap: softcap's chain rule is not in dS)."""
    return (not spec.varlen and spec.softcap == 0
            and tuple(db_buf.shape) == tuple(spec.bias_shape))


DQ_FROM_DS_ROWS = 1024  # queries a matmul of dq_from_ds under a mask's band


def _band_chunks(spec: AttentionSpec) -> list[tuple[int, int, int, int]]:
    """(first query, end, first key, end) of DQ_FROM_DS_ROWS queries at a time and the
    keys some of them see (the causal or window band; all keys without one)."""
    sq, sk = spec.seqlen_q, spec.seqlen_k
    if spec.window_left < 0 and spec.window_right < 0:
        return [(0, sq, 0, sk)]
    off = sk - sq if spec.bottom_right else 0
    chunks = []
    for r0 in range(0, sq, DQ_FROM_DS_ROWS):
        r1 = min(sq, r0 + DQ_FROM_DS_ROWS)
        lo = max(0, r0 + off - spec.window_left) if spec.window_left >= 0 else 0
        hi = min(sk, r1 + off + spec.window_right) if spec.window_right >= 0 else sk
        chunks.append((r0, r1, min(lo, sk), max(lo, hi)))
    return chunks


def dq_from_ds(dq: torch.Tensor, ds: torch.Tensor, k: torch.Tensor, spec: AttentionSpec):
    """dQ = scale * dS K as batched matmuls (cuBLAS: a fixed order): with a full bias
    gradient, dS is already in memory, and this replaces the dQ kernel's 3 recomputing
    matmuls (here; backward_sm90 for deterministic calls: its dQ adds in any order).
    dS holds zeros at the pairs no query sees; under a mask each chunk of queries
    (_band_chunks) takes only the keys in its band (causal S4096: 10 / 16 of the
    product)."""
    b, hkv, g, h = spec.batch, spec.kv_heads, spec.group, spec.heads
    sq, sk, d = spec.seqlen_q, spec.seqlen_k, k.shape[-1]
    ds3 = ds.view(b * h, sq, sk)
    k5 = k.transpose(1, 2)[:, :, None]  # (B, Hkv, 1, Sk, D)
    dq4 = dq.view(b, sq, h, d).transpose(1, 2)  # (B, H, Sq, D)
    for r0, r1, lo, hi in _band_chunks(spec):
        part = torch.empty((b * h, r1 - r0, d), dtype=dq.dtype, device=dq.device)
        if hi > lo:  # K's rows for each query head (a copy, as K's layout needs anyway)
            k3 = k5[:, :, :, lo:hi].expand(b, hkv, g, hi - lo, d).reshape(b * h, hi - lo, d)
            torch.baddbmm(part, ds3[:, r0:r1, lo:hi], k3, beta=0.0, alpha=spec.scale, out=part)
        else:  # no key seen by these queries
            part.zero_()
        dq4[:, :, r0:r1].copy_(part.view(b, h, r1 - r0, d))


def backward(
    spec: AttentionSpec,
    grad_out: torch.Tensor,
    grad_lse: torch.Tensor | None,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    bias: torch.Tensor | None,
    alibi_slopes: torch.Tensor | None,
    cu_seqlens_q: torch.Tensor | None,
    cu_seqlens_k: torch.Tensor | None,
    rng_state: torch.Tensor | None,
    needs: tuple[bool, bool, bool, bool],
):
    """Launches the tile backward kernels for the gradients in ``needs`` (dq, dk, dv,
    dbias; dbias only with a bias) of a non-empty call. Returns (dq, dk, dv, dbias) with
    None for those not needed. ``grad_lse``, a gradient flowing into lse, adds
    P * grad_lse to dS: it enters as delta - grad_lse."""
    need_dq, need_dk, need_dv, need_dbias = needs
    dq = new_output(q.shape, q.dtype, q.device) if need_dq else None
    dk = new_output(k.shape, k.dtype, k.device) if need_dk or need_dv else None
    dv = new_output(v.shape, v.dtype, v.device) if need_dk or need_dv else None
    dbias = None

    common = feature_switches(spec, "backward")
    options = (spec.scale, spec.softcap, spec.window_left, spec.window_right, spec.dropout_p,
               spec.position_q, spec.position_k)
    qkv_strides = (*dense_strides(q, spec.varlen), *dense_strides(k, spec.varlen),
                   *dense_strides(v, spec.varlen), *dense_strides(grad_out, spec.varlen))
    configs = tuning.backward_configs(spec)
    rescored = rescored_lse(spec, q, k, v, bias, alibi_slopes, cu_seqlens_q, cu_seqlens_k, lse)
    if rescored is not None:  # P over this backward's scores: the lse of its own dots
        lse = rescored
    stats = row_stats_buffer(lse, spec.varlen, spec.batch)
    grid, args, constexprs = delta_launch(spec, out, grad_out, lse, grad_lse, cu_seqlens_q,
                                          stats)  # fmt: skip
    _delta_kernel[grid](*args, **constexprs)
    lse2, delta = stats_planes(stats, spec.varlen)
    stats_strides = lse_strides(lse2, spec.varlen)

    # dQ takes one of three paths: from the dS the bias gradient already wrote (a
    # matmul), accumulated with fp32 atomics inside the dK/dV kernel (5 matmuls per
    # tile pair instead of 7, not bitwise repeatable), or its own kernel.
    run_dkdv = dk is not None or need_dbias
    db_buf, db_strides, db_rows, db_cols, db_atomic = None, (0, 0, 0, 0), False, False, False
    if need_dbias:
        db_buf, db_strides, db_rows, db_cols, db_atomic = _dbias_buffer(bias, spec)
    dq_by_matmul = (need_dq and need_dbias and _holds_full_ds(db_buf, spec)
                    and db_buf.dtype == q.dtype)
    dq_atomic = (need_dq and run_dkdv and not dq_by_matmul and configs[0].dq_atomic
                 and not spec.deterministic)
    dq_acc = torch.zeros(q.shape, dtype=torch.float32, device=q.device) if dq_atomic else None

    if run_dkdv:
        if dk is None:  # only dbias asked for: dK/dV go to scratch
            dk, dv = torch.empty_like(k), torch.empty_like(v)
            need_dk = need_dv = False

        def launch_dkdv(c: tuning.BackwardConfig):
            num_n = cdiv(spec.seqlen_k, c.block_n_dkdv)
            programs = (packed_items(spec.batch, k.shape[0], spec.kv_heads, c.block_n_dkdv)
                        if spec.varlen else num_n * spec.batch * spec.kv_heads)
            _dkdv_kernel[(programs,)](
                q, k, v, grad_out, lse2, delta, bias, db_buf, alibi_slopes, rng_state,
                cu_seqlens_q, cu_seqlens_k, dk, dv, dq_acc, *qkv_strides,
                *stats_strides, *bias_strides(bias, spec), *db_strides,
                *alibi_strides(alibi_slopes), *dense_strides(dk, spec.varlen),
                *dense_strides(dv, spec.varlen),
                *(dense_strides(dq_acc, spec.varlen) if dq_atomic else (0, 0, 0, 0)),
                spec.heads, spec.kv_heads, spec.group, spec.seqlen_q, spec.seqlen_k, num_n,
                spec.batch, *options, BLOCK_M=c.block_m_dkdv, BLOCK_N=c.block_n_dkdv,
                HAS_DBIAS=need_dbias, DBIAS_ROWS=db_rows, DBIAS_COLS=db_cols,
                DBIAS_ATOMIC=db_atomic, DQ_ATOMIC=dq_atomic,
                num_warps=c.num_warps_dkdv, num_stages=c.num_stages_dkdv, **common,
            )  # fmt: skip

        tuning.launch_fitting("dkdv", spec, configs, launch_dkdv)
        if dq_atomic:
            dq.copy_(dq_acc)
        if dq_by_matmul:
            dq_from_ds(dq, db_buf, k, spec)
        if need_dbias:
            dbias = sum_to_bias(db_buf, bias)
        if not need_dk:
            dk = None
        if not need_dv:
            dv = None

    if need_dq and not (dq_atomic or dq_by_matmul):

        def launch_dq(c: tuning.BackwardConfig):
            num_m = cdiv(spec.seqlen_q, c.block_m_dq)
            programs = (packed_items(spec.batch, q.shape[0], spec.heads, c.block_m_dq)
                        if spec.varlen else num_m * spec.batch * spec.heads)
            _dq_kernel[(programs,)](
                q, k, v, grad_out, lse2, delta, bias, alibi_slopes, rng_state, cu_seqlens_q,
                cu_seqlens_k, dq, *qkv_strides, *stats_strides,
                *bias_strides(bias, spec), *alibi_strides(alibi_slopes),
                *dense_strides(dq, spec.varlen),
                spec.heads, spec.group, spec.seqlen_q, spec.seqlen_k, num_m, spec.batch,
                *options,
                BLOCK_M=c.block_m_dq, BLOCK_N=c.block_n_dq,
                num_warps=c.num_warps_dq, num_stages=c.num_stages_dq, **common,
            )  # fmt: skip

        tuning.launch_fitting("dq", spec, configs, launch_dq)
    return dq, dk, dv, dbias
