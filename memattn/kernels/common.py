"""Jit helpers that the forward and backward kernels share, so the two passes can never
disagree about which keys are visible, how a score is modified, or which elements
dropout keeps.

Scores travel in the log2 domain inside the kernels: ``s2 = s * log2(e)``, so that the
softmax uses exp2. Feature switches are ``tl.constexpr`` and named the same everywhere.
"""

import triton
import triton.language as tl

LOG2E: tl.constexpr = 1.4426950408889634
LN2: tl.constexpr = 0.6931471805599453


@triton.jit
def sequence_bounds(CuSeqQ, CuSeqK, b, seqlen_q, seqlen_k, IS_VARLEN: tl.constexpr):
    """Start offset (in packed tokens) and length of batch b's query and key sequences."""
    if IS_VARLEN:
        q_start = tl.load(CuSeqQ + b)
        k_start = tl.load(CuSeqK + b)
        seqlen_q = tl.load(CuSeqQ + b + 1) - q_start
        seqlen_k = tl.load(CuSeqK + b + 1) - k_start
    else:
        q_start = 0
        k_start = 0
    return q_start, k_start, seqlen_q, seqlen_k


@triton.jit
def diagonal_offset(seqlen_q, seqlen_k, BOTTOM_RIGHT: tl.constexpr):
    """off: query i sits at key position i + off (0 top-left, Sk - Sq bottom-right)."""
    if BOTTOM_RIGHT:
        return seqlen_k - seqlen_q
    else:
        return 0


@triton.jit
def key_range(
    start_m, seqlen_k, off, window_left, window_right,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BOUNDED_LEFT: tl.constexpr, BOUNDED_RIGHT: tl.constexpr,
):  # fmt: skip
    """Keys that queries [start_m, start_m + BLOCK_M) may see, split into tiles that
    need the visibility mask and tiles that are fully visible for every row.

    Returns (lo, full_lo, full_hi, hi): masked tiles cover [lo, full_lo) and
    [full_hi, hi), unmasked ones [full_lo, full_hi). lo and full_lo are multiples of
    BLOCK_N; tiles outside [lo, hi) are skipped entirely.
    """
    # Clamp at 0 before every division: integer // truncates on the GPU but floors in
    # the interpreter, and the two differ for negative numbers.
    last_m = start_m + BLOCK_M - 1
    lo = 0
    hi = seqlen_k
    full_lo = 0
    full_hi = seqlen_k
    if BOUNDED_RIGHT:
        hi = tl.minimum(hi, last_m + off + window_right + 1)
        full_hi = tl.minimum(full_hi, start_m + off + window_right + 1)
    if BOUNDED_LEFT:
        lo = (tl.maximum(start_m + off - window_left, 0) // BLOCK_N) * BLOCK_N
        full_lo = tl.maximum(last_m + off - window_left, 0)
        full_lo = ((full_lo + BLOCK_N - 1) // BLOCK_N) * BLOCK_N
    hi = tl.maximum(hi, lo)
    full_lo = tl.minimum(tl.maximum(full_lo, lo), hi)
    full_hi = (tl.maximum(full_hi, 0) // BLOCK_N) * BLOCK_N
    full_hi = tl.minimum(tl.maximum(full_hi, full_lo), hi)
    return lo, full_lo, full_hi, hi


@triton.jit
def visible(
    offs_m, offs_n, seqlen_k, off, window_left, window_right,
    BOUNDED_LEFT: tl.constexpr, BOUNDED_RIGHT: tl.constexpr,
):  # fmt: skip
    """(BLOCK_M, BLOCK_N) bool: key offs_n exists and is visible from query offs_m."""
    mask = offs_n[None, :] < seqlen_k
    diag = offs_m[:, None] + off
    if BOUNDED_RIGHT:
        mask = mask & (offs_n[None, :] <= diag + window_right)
    if BOUNDED_LEFT:
        mask = mask & (offs_n[None, :] >= diag - window_left)
    return mask


@triton.jit
def tanh(x):
    # exp-based so that it runs on the GPU and in Triton's interpreter alike; saturates
    # to +-1 for large |x| without overflow trouble (exp2 -> inf gives 1 - 0).
    return 1.0 - 2.0 / (tl.exp2(x * (2.0 * LOG2E)) + 1.0)


@triton.jit
def scores_log2(
    qk, offs_m, offs_n, off, scale, softcap, slope, bias,
    HAS_SOFTCAP: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_ALIBI: tl.constexpr,
):  # fmt: skip
    """The score before masking, times log2(e): softcap, then bias and ALiBi.

    qk is the raw q.k tile (fp32); bias the loaded bias tile (fp32) or None.
    Also returns the softcap's tanh (needed by the backward's chain rule), else None.
    """
    t = None
    if HAS_SOFTCAP:
        t = tanh(qk * (scale / softcap))
        s = t * (softcap * LOG2E)
    else:
        s = qk * (scale * LOG2E)
    if HAS_BIAS:
        s += bias * LOG2E
    if HAS_ALIBI:
        dist = tl.abs(offs_m[:, None] + off - offs_n[None, :]).to(tl.float32)
        s -= (slope * LOG2E) * dist
    return s, t


@triton.jit
def dropout_keep(seed, rng_offset, bh, offs_m, offs_n, dropout_p):
    """(BLOCK_M, BLOCK_N) bool keep mask for head bh = b * H + h, query rows offs_m and
    key columns offs_n (positions inside the sequence).

    Counter-based Philox: the counter is (column, row, b*H + h, offset) and the key the
    64-bit seed, so every element has its own counter and the backward regenerates the
    forward's mask bit for bit, in any tiling.
    """
    shape_m = offs_m[:, None] + tl.zeros_like(offs_n)[None, :]
    shape_n = offs_n[None, :] + tl.zeros_like(offs_m)[:, None]
    c0 = shape_n.to(tl.uint32)
    c1 = shape_m.to(tl.uint32)
    c2 = (tl.zeros_like(shape_m) + bh).to(tl.uint32)
    c3 = (tl.zeros_like(shape_m) + rng_offset).to(tl.uint32)  # offset < 2**31 by design
    r, _, _, _ = tl.philox(seed, c0, c1, c2, c3)
    return tl.uint_to_uniform_float(r) >= dropout_p
