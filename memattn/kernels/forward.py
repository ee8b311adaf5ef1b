"""Forward kernel: online softmax over key tiles (FlashAttention-2 style), every feature
a compile-time switch, dense and varlen batches in one kernel.

Reads top to bottom: the tile loop, the kernel, the launcher. Only the launcher knows
about torch tensors and strides.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..spec import AttentionSpec
from . import tuning
from .common import (
    LN2,
    add_bias_alibi_log2,
    alibi_strides,
    capped_score_log2,
    cdiv,
    diagonal_offset,
    dropout_keep,
    key_range,
    new_output,
    packed_items,
    packed_row_block,
    philox_key,
    row_block,
    sequence_bounds,
    tile_span,
    tile_start,
    visible,
)


@triton.jit
def _fwd_tiles(
    acc, m_i, l_i, q,
    k_base, v_base, bias_rows, stride_kn, stride_kd, stride_vn, stride_vd, stride_bn,
    offs_m, offs_dqk, offs_dv, lo, hi,
    seqlen_q, seqlen_k, off, scale, softcap, slope, window_left, window_right,
    seed, rng_offset, bh, dropout_p, pos_q, pos_k,
    DQK: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    MASKED: tl.constexpr, BOUNDED_LEFT: tl.constexpr, BOUNDED_RIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, DOT_PRECISION: tl.constexpr, WITH_OUT: tl.constexpr,
):  # fmt: skip
    """Accumulates key tiles [lo, hi) into (acc, m_i, l_i) (without WITH_OUT, the row
    statistics alone: no V, acc untouched). MASKED tiles apply the
    visibility mask; the others are known to be fully visible and skip it. offs_m: each
    row's query position; bias_rows: a pointer to each row's bias row (key 0); slope and
    bh: ALiBi's slope and dropout's head, a scalar or one per row, (BLOCK_M, 1); pos_q
    and pos_k: the global positions of query and key 0, for ALiBi and dropout alone
    (AttentionSpec.position_q/k)."""
    arange_n = tl.arange(0, BLOCK_N)
    row_ok = offs_m < seqlen_q
    for start_n in tl.range(lo, hi, BLOCK_N):
        offs_n = start_n + arange_n
        col_ok = offs_n < seqlen_k
        # 64-bit: start_n * stride can pass 2**31 on long sequences; the in-tile part can't.
        start_n64 = tile_start(start_n, BLOCK_N)
        k_ptrs = (k_base + start_n64 * stride_kn
                  + arange_n[None, :] * stride_kn + offs_dqk[:, None] * stride_kd)
        if MASKED:
            k_mask = col_ok[None, :] & (offs_dqk[:, None] < DQK)
        else:
            k_mask = offs_dqk[:, None] < DQK
        k = tl.load(k_ptrs, mask=k_mask, other=0.0)
        qk = tl.dot(q, k, input_precision=DOT_PRECISION)

        bias = qk  # placeholder, unused without a bias
        if HAS_BIAS:
            b_ptrs = bias_rows[:, None] + (start_n64 + arange_n[None, :]) * stride_bn
            if MASKED:
                b_mask = row_ok[:, None] & col_ok[None, :]
            else:  # every key in range: rows alone, so aligned rows load 16 bytes at a time
                b_mask = row_ok[:, None]
            bias = tl.load(b_ptrs, mask=b_mask, other=0.0)
            bias = bias.to(tl.float32)
        s = capped_score_log2(qk, scale, softcap, HAS_SOFTCAP, k.dtype != tl.float32)
        s = add_bias_alibi_log2(s, offs_m[:, None], offs_n[None, :], off + pos_q - pos_k,
                                slope, bias, HAS_BIAS, HAS_ALIBI)
        if MASKED:
            mask = visible(offs_m[:, None], offs_n[None, :], seqlen_k, off, window_left,
                           window_right, BOUNDED_LEFT, BOUNDED_RIGHT)
            s = tl.where(mask, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row that has seen no visible key yet keeps m = -inf; subtract 0 there
        # instead, so that exp2(-inf - -inf) never makes a NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        if WITH_OUT:
            if HAS_DROPOUT:
                keep = dropout_keep(seed, rng_offset, bh, offs_m + pos_q, start_n + pos_k,
                                    dropout_p, BLOCK_N)
                p = tl.where(keep, p, 0.0)
            v_ptrs = (v_base + start_n64 * stride_vn
                      + arange_n[:, None] * stride_vn + offs_dv[None, :] * stride_vd)
            if MASKED:
                v_mask = col_ok[:, None] & (offs_dv[None, :] < DV)
            else:
                v_mask = offs_dv[None, :] < DV
            v = tl.load(v_ptrs, mask=v_mask, other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v,
                                                input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def normalised(acc, m_i, l_i, dropout_p, HAS_DROPOUT: tl.constexpr):
    """(out, lse) of _fwd_tiles' (acc, m_i, l_i): out = acc / l (and dropout's
    1 / (1 - p)), lse in natural log. Rows with no visible key (l = 0): out 0, lse -inf."""
    empty = l_i == 0.0
    inv_l = 1.0 / tl.where(empty, 1.0, l_i)
    if HAS_DROPOUT:
        inv_l = inv_l / (1.0 - dropout_p)
    out = acc * inv_l[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(tl.where(empty, 1.0, l_i))) * LN2)
    return out, lse


@triton.jit
def _fwd_kernel(
    Q, K, V, Out, Lse, Bias, Alibi, Rng, CuSeqQ, CuSeqK,
    stride_qb, stride_qm, stride_qh, stride_qd,
    stride_kb, stride_kn, stride_kh, stride_kd,
    stride_vb, stride_vn, stride_vh, stride_vd,
    stride_ob, stride_om, stride_oh, stride_od,
    stride_lb, stride_lh, stride_lm,
    stride_bb, stride_bh, stride_bm, stride_bn,
    stride_ab, stride_ah,
    H, GROUP, seqlen_q, seqlen_k, num_m_blocks, num_seqs,
    scale, softcap, window_left, window_right, dropout_p, pos_q, pos_k,
    DQK: tl.constexpr, DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    IS_VARLEN: tl.constexpr, BOTTOM_RIGHT: tl.constexpr,
    BOUNDED_LEFT: tl.constexpr, BOUNDED_RIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, DOT_PRECISION: tl.constexpr, WITH_OUT: tl.constexpr,
):  # fmt: skip
    # One program per (query block, batch * head), on a 1-D grid: no 65,535 limit on
    # batch * heads. Query blocks of one head run back to back, last block first: with
    # causal masks the last blocks are the longest. Packed sequences: common.packed_items'
    # grid over the tokens, each block across the heads.
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

    # 64-bit base offsets: batch * stride and token * stride can pass 2**31.
    b64 = tl.cast(b, tl.int64)
    h64 = tl.cast(h, tl.int64)
    hk64 = tl.cast(h // GROUP, tl.int64)
    row0 = tl.cast(q_start + start_m, tl.int64)
    q_base = Q + b64 * stride_qb + h64 * stride_qh + row0 * stride_qm
    k_base = K + b64 * stride_kb + hk64 * stride_kh + tl.cast(k_start, tl.int64) * stride_kn
    v_base = V + b64 * stride_vb + hk64 * stride_vh + tl.cast(k_start, tl.int64) * stride_vn
    o_base = Out + b64 * stride_ob + h64 * stride_oh + row0 * stride_om
    l_base = Lse + b64 * stride_lb + h64 * stride_lh + row0 * stride_lm
    bias_rows = Bias  # a stand-in, never read, without a bias
    if HAS_BIAS:  # indexed by positions inside the sequence, also in varlen mode
        bias_rows = (Bias + b64 * stride_bb + h64 * stride_bh
                     + (start_m + tl.arange(0, BLOCK_M)).to(tl.int64) * stride_bm)
    slope = 0.0
    if HAS_ALIBI:
        slope = tl.load(Alibi + b64 * stride_ab + h64 * stride_ah)
    seed, rng_offset = philox_key(Rng, HAS_DROPOUT)

    arange_m = tl.arange(0, BLOCK_M)
    offs_m = start_m + arange_m
    offs_dqk = tl.arange(0, BLOCK_DQK)
    offs_dv = tl.arange(0, BLOCK_DV)
    row_ok = offs_m < seqlen_q
    q = tl.load(q_base + arange_m[:, None] * stride_qm + offs_dqk[None, :] * stride_qd,
                mask=row_ok[:, None] & (offs_dqk[None, :] < DQK), other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)

    lo, full_lo, full_hi, hi = key_range(
        start_m, seqlen_k, off, window_left, window_right,
        BLOCK_M, BLOCK_N, BOUNDED_LEFT, BOUNDED_RIGHT)
    # Blocks past this sequence's end (varlen, padded to max_seqlen_q) do no work.
    hi = tl.where(start_m < seqlen_q, hi, lo)
    full_lo = tl.minimum(full_lo, hi)
    full_hi = tl.minimum(full_hi, hi)

    # Three passes over the keys: masked tiles on the left edge of the window, fully
    # visible tiles (no mask arithmetic), masked tiles on the right edge / past Sk.
    for span in tl.static_range(3):
        span_lo, span_hi = tile_span(span, lo, full_lo, full_hi, hi)
        acc, m_i, l_i = _fwd_tiles(
            acc, m_i, l_i, q, k_base, v_base, bias_rows,
            stride_kn, stride_kd, stride_vn, stride_vd, stride_bn,
            offs_m, offs_dqk, offs_dv, span_lo, span_hi,
            seqlen_q, seqlen_k, off, scale, softcap, slope, window_left, window_right,
            seed, rng_offset, bh, dropout_p, pos_q, pos_k,
            DQK, DV, BLOCK_M, BLOCK_N, BLOCK_DQK, BLOCK_DV, span != 1, BOUNDED_LEFT,
            BOUNDED_RIGHT, HAS_BIAS, HAS_ALIBI, HAS_SOFTCAP, HAS_DROPOUT, DOT_PRECISION,
            WITH_OUT)

    out, lse = normalised(acc, m_i, l_i, dropout_p, HAS_DROPOUT)
    if WITH_OUT:
        tl.store(o_base + arange_m[:, None] * stride_om + offs_dv[None, :] * stride_od,
                 out.to(Out.dtype.element_ty), mask=row_ok[:, None] & (offs_dv[None, :] < DV))
    tl.store(l_base + arange_m * stride_lm, lse, mask=row_ok)


# Kernels whose float32 dots stay IEEE past this padded width (dot_precision says why);
# tools/sweep.py --tf32x3 empties it to time 3xTF32 there.
IEEE_FLOAT32_PAST = {"backward": 128}


def dot_precision(spec: AttentionSpec, kernel: str = "forward") -> str:
    """How ``kernel``'s dots ("forward", "backward": the tile kernels; "decode": the
    split-KV kernel) take float32 inputs: on tensor cores as 3xTF32 (each operand split
    into a TF32 high and low part, three products summed in fp32: near float32, within
    float32's own tolerance in the GPU suite), as PyTorch's memory-efficient kernel does
    whatever allow_tf32 says. IEEE dots (FMA) ran 2-45x slower (H100; B2 S2048 H16,
    TFLOP/s fwd / bwd: D=128 11 / 6.4 against 29 / 14, D=64 10 / 7.7 against 49 / 16;
    split-KV, H32/8 D128, GB/s: Sq=1 Sk=32768 665 against 2789, Sq=16 17 against 763).
    The backward past 128 columns keeps them (IEEE_FLOAT32_PAST): at every tile
    tools/sweep.py tried there 3xTF32 ran 1 TFLOP/s against IEEE's 4 (D=256; its dK/dV
    kernel spills 42-48 KB in an sm_90 compile, IEEE's 144 bytes), and takes an lse of
    their scores (rescored_lse). Plain TF32 was 4x less accurate than torch's own TF32
    matmul (Triton truncates to TF32, which biases P downwards). Other dtypes: unused."""
    if spec.dtype != torch.float32:
        return "tf32"
    if tuning.padded_width(spec) > IEEE_FLOAT32_PAST.get(kernel, 1 << 30):
        return "ieee"
    return "tf32x3"


def feature_switches(spec: AttentionSpec, kernel: str = "forward") -> dict:
    """The compile-time switches every attention kernel takes, named alike in all;
    ``kernel`` ("forward", "backward", "decode") decides float32's dots (dot_precision)."""
    return dict(
        DQK=spec.head_dim_qk, DV=spec.head_dim_v,
        BLOCK_DQK=tuning.padded_head_dim(spec.head_dim_qk),
        BLOCK_DV=tuning.padded_head_dim(spec.head_dim_v),
        IS_VARLEN=spec.varlen, BOTTOM_RIGHT=spec.bottom_right,
        BOUNDED_LEFT=spec.window_left >= 0, BOUNDED_RIGHT=spec.window_right >= 0,
        HAS_BIAS=spec.has_bias, HAS_ALIBI=spec.has_alibi,
        HAS_SOFTCAP=spec.softcap > 0, HAS_DROPOUT=spec.dropout_p > 0,
        DOT_PRECISION=dot_precision(spec, kernel),
    )  # fmt: skip


def bias_strides(bias: torch.Tensor | None, spec: AttentionSpec) -> tuple[int, int, int, int]:
    """Strides of bias broadcast to (B, H, Sq, Sk): 0 along broadcast dimensions, so
    the kernel reads the original tensor and no expanded copy is made."""
    if bias is None:
        return (0, 0, 0, 0)
    return tuple(bias.expand(spec.bias_shape).stride())


def dense_strides(t: torch.Tensor, varlen: bool) -> tuple[int, int, int, int]:
    """(batch, token, head, dim) strides; batch stride 0 for packed (T, H, D) tensors."""
    if varlen:
        return (0, *t.stride())
    return tuple(t.stride())


def lse_strides(lse: torch.Tensor, varlen: bool) -> tuple[int, int, int]:
    """(batch, head, token) strides of lse: (B, H, Sq) dense, (H, Tq) varlen."""
    if varlen:
        return (0, *lse.stride())
    return tuple(lse.stride())


def forward(spec: AttentionSpec, q, k, v, bias, alibi_slopes, rng_state, cu_seqlens_q,
            cu_seqlens_k, out, lse) -> None:  # fmt: skip
    """Launches the forward kernel: fills out (q's layout, Dv) and lse (float32) of a
    call with queries; rng_state: dropout's [seed, offset], None without dropout."""
    _launch(spec, q, k, v, bias, alibi_slopes, rng_state, cu_seqlens_q, cu_seqlens_k, out,
            lse, tuning.forward_configs(spec), feature_switches(spec), True)


def rescored_lse(spec: AttentionSpec, q, k, v, bias, alibi_slopes, cu_seqlens_q,
                 cu_seqlens_k, lse) -> torch.Tensor | None:  # fmt: skip
    """The backward's own lse where its score dots are not the forward's (float32 past
    128 columns: IEEE against 3xTF32), made with its dots and the forward's masks and
    score terms, no P·V; None where they are the same. P = exp(S - lse) over scores of
    the backward's making and the forward's lse put every P of a row off by the lse's
    error (H200, float32 D=256/128, scale 0.241: dV 1.43x its tolerance; 0.32x so, for
    +18 % of the backward's time: tuning.RESCORE_CONFIG)."""
    precision = dot_precision(spec, "backward")
    if precision == dot_precision(spec):
        return None
    rescored = new_output(lse.shape, lse.dtype, lse.device)
    _launch(spec, q, k, v, bias, alibi_slopes, None, cu_seqlens_q, cu_seqlens_k, q, rescored,
            tuning.rescore_configs(spec),
            dict(feature_switches(spec), HAS_DROPOUT=False, DOT_PRECISION=precision), False)
    return rescored


def _launch(spec, q, k, v, bias, alibi_slopes, rng_state, cu_seqlens_q, cu_seqlens_k, out,
            lse, configs, switches, with_out):  # fmt: skip
    """_fwd_kernel over ``configs`` (the first that fits); without ``with_out`` lse alone
    (``out`` a stand-in, never written)."""

    def launch(cfg: tuning.Config):
        num_m_blocks = cdiv(spec.seqlen_q, cfg.block_m)
        programs = (packed_items(spec.batch, q.shape[0], spec.heads, cfg.block_m) if spec.varlen
                    else num_m_blocks * spec.batch * spec.heads)
        _fwd_kernel[(programs,)](
            q, k, v, out, lse, bias, alibi_slopes, rng_state, cu_seqlens_q, cu_seqlens_k,
            *dense_strides(q, spec.varlen), *dense_strides(k, spec.varlen),
            *dense_strides(v, spec.varlen), *dense_strides(out, spec.varlen),
            *lse_strides(lse, spec.varlen), *bias_strides(bias, spec),
            *alibi_strides(alibi_slopes),
            spec.heads, spec.group, spec.seqlen_q, spec.seqlen_k, num_m_blocks, spec.batch,
            spec.scale, spec.softcap, spec.window_left, spec.window_right, spec.dropout_p,
            spec.position_q, spec.position_k, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages, WITH_OUT=with_out,
            **switches,
        )  # fmt: skip

    tuning.launch_fitting("forward" if with_out else "rescore", spec, configs, launch)
