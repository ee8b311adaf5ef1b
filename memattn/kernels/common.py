"""Jit helpers that the forward and backward kernels share, so the two passes can never
disagree about which keys are visible, how a score is modified, or which elements
dropout keeps.

Scores travel in the log2 domain inside the kernels: ``s2 = s * log2(e)``, so that the
softmax uses exp2. Feature switches are ``tl.constexpr`` and named the same everywhere.
"""

import os

import torch
import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)
# Rows past a sequence's end that the backward's query tiles (up to 128 rows, both
# families) read: their statistics give P = 0 (row_stats_buffer).
STATS_SLACK = tl.constexpr(128)


# Read once: an environment lookup per output was host time before every launch.
POISON_OUTPUTS = os.environ.get("MEMATTN_POISON_OUTPUTS") == "1"


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for the host: triton.cdiv, which also serves inside kernels, costs
    ~1.5 µs a call on a workstation's CPU (several times that on the device's host),
    each of them host time before a launch."""
    return -(-a // b)


def new_output(shape, dtype: torch.dtype, device, row_alignment: int = 1) -> torch.Tensor:
    """An uninitialised output buffer (over rows padded to a multiple of
    ``row_alignment`` elements: padded_rows). With MEMATTN_POISON_OUTPUTS=1 in the
    environment when memattn loads (the test suites set it) it is filled with NaN, so an
    element a kernel fails to write fails a test."""
    if row_alignment > 1:
        out = padded_rows(shape, dtype, device, row_alignment)
    else:
        out = torch.empty(shape, dtype=dtype, device=device)
    return out.fill_(float("nan")) if POISON_OUTPUTS else out


def sum_to_bias(grad: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """A bias's gradient from a 4-D one whose dimensions are (B, H, Sq, Sk) or 1: summed
    over the dimensions the bias broadcasts over, in its shape and dtype."""
    shape = (1,) * (4 - bias.dim()) + tuple(bias.shape)
    summed = [d for d in range(4) if shape[d] == 1 and grad.shape[d] != 1]
    if summed:  # (a sum over dim=[] would sum over every dimension)
        grad = grad.sum(dim=summed, keepdim=True)
    return grad.reshape(bias.shape).to(bias.dtype)


# Elements the tile kernels want a bias's rows aligned to (dispatch says why), a
# multiple of TMA's (hopper.TMA_BIAS_ALIGNMENT): rows so aligned every family reads as
# they are.
TILE_BIAS_ALIGNMENT = 16


def new_bias(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """A zero bias that every kernel family reads without a copy of its own
    (aligned_bias): over rows padded to TILE_BIAS_ALIGNMENT elements, for a bias made
    from something else (a boolean mask)."""
    return padded_rows(shape, dtype, device, TILE_BIAS_ALIGNMENT).zero_()


def rows_aligned(bias: torch.Tensor, elements: int) -> bool:
    """Whether a bias's rows are aligned to ``elements``: a key stride of 1, a 16-byte
    aligned base, and batch, head and query strides that ``elements`` divides (where
    that dimension is not 1)."""
    strides = zip(bias.shape[:-1], bias.stride()[:-1])
    return (bias.stride(-1) == 1 and bias.data_ptr() % 16 == 0
            and all(s % elements == 0 for n, s in strides if n > 1))


def aligned_bias(bias: torch.Tensor | None, elements: int) -> torch.Tensor | None:
    """The bias itself where its rows are aligned to ``elements`` (rows_aligned), else
    a copy of it over rows padded to a multiple of ``elements``: the same shape and
    values, the padding never read (as PyTorch pads its memory-efficient kernel's
    bias). dispatch says why each kernel family wants which."""
    if bias is None or bias.dim() == 0 or rows_aligned(bias, elements):
        return bias
    return copy_rows(bias, padded_rows(bias.shape, bias.dtype, bias.device, elements))


def padded_rows(shape, dtype: torch.dtype, device, elements: int) -> torch.Tensor:
    """An uninitialised tensor of ``shape`` over rows padded to a multiple of ``elements``
    (the padding is never read): a bias, or its gradient, that kernels read or write by
    rows of whole 16 bytes."""
    *lead, keys = shape
    return torch.empty(*lead, cdiv(keys, elements) * elements, dtype=dtype,
                       device=device)[..., :keys]  # fmt: skip


COPY_BLOCK_KEYS = 1024  # copy_rows' most keys a block (a power of 2)


@triton.jit
def _copy_rows_kernel(Src, Dst, heads, queries, keys, rows, stride_b, stride_h, stride_q,
                      stride_k, dst_row, FLAT: tl.constexpr, BLOCK_R: tl.constexpr,
                      BLOCK_C: tl.constexpr):  # fmt: skip
    """A (B', H', Sq, Sk) tensor into rows of dst_row elements, one after the other. FLAT
    (a contiguous Src, rows of BLOCK_C keys or more): BLOCK_C of its elements in order,
    over two rows at most, so that loads go 16 bytes at a time whatever Sk; else BLOCK_R
    rows of BLOCK_C keys, in any strides."""
    if FLAT:
        start = tl.program_id(0).to(tl.int64) * BLOCK_C
        e = start + tl.arange(0, BLOCK_C)
        total = rows.to(tl.int64) * keys
        if start + BLOCK_C <= total:  # no mask: a mask not aligned splits the loads
            x = tl.load(Src + e)
        else:
            x = tl.load(Src + e, mask=e < total)
        r = start // keys
        c = e - r * keys
        past = c >= keys  # the next row's
        r = tl.where(past, r + 1, r)
        c = tl.where(past, c - keys, c)
        tl.store(Dst + r * dst_row + c, x, mask=r < rows)
    else:
        r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)[:, None]
        c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)[None, :]
        r64 = r.to(tl.int64)
        row = ((r64 // (heads * queries)) * stride_b + (r64 // queries % heads) * stride_h
               + (r64 % queries) * stride_q)  # fmt: skip
        inside = (r < rows) & (c < keys)
        x = tl.load(Src + row + c * stride_k, mask=inside)
        tl.store(Dst + r64 * dst_row + c, x, mask=inside)


def copy_rows(src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    """dst, src's copy, for a dst contiguous but for its rows' length (padded_rows):
    torch's copy_ between rows of different lengths goes element by element. H200, a
    (4, 16, 4095, 4095) bf16 bias, µs into rows of 4096 / back: torch 2390 / 2377; here
    by rows 3380 (loads by element from rows not whole 16 bytes) / 1370, in order
    (FLAT) 1685 / -. Returns dst."""
    if src.numel() == 0:
        return dst
    shape = [1] * (4 - src.dim()) + list(src.shape)
    strides = [0] * (4 - src.dim()) + list(src.stride())
    rows, keys = shape[0] * shape[1] * shape[2], shape[3]
    dst_row = dst.stride(-2) if dst.dim() > 1 else keys
    flat = src.is_contiguous() and keys >= COPY_BLOCK_KEYS
    block_c = min(COPY_BLOCK_KEYS, triton.next_power_of_2(keys))
    block_r = 1 if flat else 4096 // block_c
    grid = (cdiv(rows * keys, block_c),) if flat else (cdiv(rows, block_r), cdiv(keys, block_c))
    _copy_rows_kernel[grid](src, dst, shape[1], shape[2], keys, rows, *strides, dst_row,
                            FLAT=flat, BLOCK_R=block_r, BLOCK_C=block_c, num_warps=4)
    return dst


def alibi_strides(alibi: torch.Tensor | None) -> tuple[int, int]:
    """(batch, head) strides of ALiBi's slopes, (H,) or (B, H); (0, 0) without."""
    if alibi is None:
        return (0, 0)
    if alibi.dim() == 1:
        return (0, alibi.stride(0))
    return (alibi.stride(0), alibi.stride(1))


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
def row_block(num_m_blocks, H, DESCENDING: tl.constexpr, pid=None):
    """(b, h, b * H + h, query block) of this program (or item pid) on a 1-D grid of
    (batch * head) x num_m_blocks (no 65,535 limit on batch * heads): a head's blocks
    back to back, DESCENDING last first."""
    if pid is None:
        pid = tl.program_id(0)
    bh = pid // num_m_blocks
    m_block = pid % num_m_blocks
    if DESCENDING:
        m_block = num_m_blocks - 1 - m_block
    return bh // H, bh % H, bh, m_block


def packed_items(seqs: int, tokens: int, heads: int, block: int) -> int:
    """The items of a packed grid over ``seqs`` sequences of ``tokens`` in all
    (packed_row_block's, hopper.packed_rank's): sequence b's from heads *
    (cu_seqlens[b] // block + b) on, at least one a head more than its blocks, so that
    the grid grows with the tokens, not with the sequences times the longest."""
    return heads * (tokens // block + seqs)


@triton.jit
def packed_row_block(H, CuSeq, num_seqs, BLOCK: tl.constexpr, DESCENDING: tl.constexpr = False,
                     g=None):  # fmt: skip
    """(b, h, block) of this program (or item g) on packed_items' grid over num_seqs
    packed sequences of BLOCK-row blocks: each sequence's blocks first first
    (DESCENDING: last first), each across the H heads; a program past its sequence's
    blocks gets a block past its end (the caller's bounds skip it). b by binary search
    of cu_seqlens (the last sequence whose items start at or before the program's): no
    host sync, log2(num_seqs) loads."""
    if g is None:
        g = tl.program_id(0)
    lo = 0
    hi = num_seqs
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if H * (tl.load(CuSeq + mid) // BLOCK + mid) <= g:
            lo = mid
        else:
            hi = mid
    first = tl.load(CuSeq + lo)
    local = g - H * (first // BLOCK + lo)
    block = local // H
    if DESCENDING:
        blocks = tl.cdiv(tl.load(CuSeq + lo + 1) - first, BLOCK)
        if block < blocks:
            block = blocks - 1 - block
    return lo, local % H, block


@triton.jit
def dq_tile(start_m, q_start, b, BLOCK_M: tl.constexpr, IS_VARLEN: tl.constexpr):
    """The index, among its head's, of the BLOCK_M-row dQ tile from query row start_m
    on (backward_sm90.shared.dq_tiles): a packed sequence b's tiles from q_start // BLOCK_M + b
    on, so that no two sequences share one."""
    tile = start_m // BLOCK_M
    if IS_VARLEN:
        tile += q_start // BLOCK_M + b
    return tile


@triton.jit
def philox_key(Rng, HAS_DROPOUT: tl.constexpr):
    """Dropout's Philox (seed, offset), Rng's two int64s; (0, 0), never read, without
    dropout."""
    seed = 0
    rng_offset = 0
    if HAS_DROPOUT:
        seed = tl.load(Rng)
        rng_offset = tl.load(Rng + 1)
    return seed, rng_offset


@triton.jit
def packed_stats_start(q_start, b):
    """Where packed sequence b's row statistics start in the backward's stats buffer
    (row_stats_buffer): its first token rounded up to a multiple of 4 (16 bytes of fp32,
    where a TMA box must start) after STATS_SLACK + 4 tokens for each earlier sequence,
    so that each sequence's rows and the STATS_SLACK rows past its end (+inf lse: a
    tile's rows past the sequence get P = 0) overlap no other's."""
    return (q_start + (STATS_SLACK + 4) * b + 3) // 4 * 4


def row_stats_buffer(lse: torch.Tensor, varlen: bool, batch: int) -> torch.Tensor:
    """The backward's row statistics, which the preprocess (backward._delta_kernel)
    fills for both kernel families: one float32 tensor, [0] lse * log2(e) (+inf where
    lse is -inf: P = 0, not NaN) and [1] delta, (2, B, H, Sq') for lse (B, H, Sq), each
    row from 0; packed sequences (lse (H, Tq), ``batch`` of them) one batch, (2, 1, H,
    Tq'), each sequence's rows from packed_stats_start on. Every sequence's rows are
    followed by STATS_SLACK rows of +inf and 0, so that a query tile's rows past its
    end get P = 0 and dS = 0: no kernel masks its loads of the statistics, and rows of
    a multiple of 16 floats (a stride Triton's specialisation sees) keep them 16 bytes
    wide. (Masked by Sq, the tile kernels' went one element at a time wherever 16 did
    not divide Sq, and the dK/dV kernel spilled 392 bytes: H200 B4 H16 D128 S4095, its
    time 3009 -> 1905 us, 2080 -> 1953 at S4096.) Nothing reads the rest of a row."""
    slack = STATS_SLACK.value
    if varlen:
        heads, tokens = lse.shape
        padded = cdiv(tokens + (slack + 4) * batch + slack, 16) * 16  # packed_stats_start's
        return torch.empty(2, 1, heads, padded, dtype=torch.float32, device=lse.device)
    batches, heads, seqlen = lse.shape
    padded = cdiv(seqlen, 16) * 16 + slack
    return torch.empty(2, batches, heads, padded, dtype=torch.float32, device=lse.device)


def stats_planes(stats: torch.Tensor, varlen: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """row_stats_buffer's (lse2, delta) planes, laid out as lse: (B, H, Sq') each, or
    packed sequences' (H, Tq')."""
    return (stats[0, 0], stats[1, 0]) if varlen else (stats[0], stats[1])


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
    [full_hi, hi), unmasked ones [full_lo, full_hi); tiles outside [lo, hi) are
    skipped entirely. Each of the three spans that holds a tile starts on a multiple of
    BLOCK_N (only an empty one may start at hi): the kernels' loops tell Triton so
    (tile_start), which it cannot prove where 16 does not divide Sk.
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
def query_range(
    start_n, seqlen_q, seqlen_k, off, window_left, window_right,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BOUNDED_LEFT: tl.constexpr, BOUNDED_RIGHT: tl.constexpr,
):  # fmt: skip
    """Queries that may see keys [start_n, start_n + BLOCK_N): key_range seen from the
    keys' side. Returns (lo, full_lo, full_hi, hi) as key_range does, for query tiles."""
    last_n = start_n + BLOCK_N - 1
    lo = 0
    hi = seqlen_q
    full_lo = 0
    full_hi = seqlen_q
    if BOUNDED_RIGHT:  # j <= i + off + right  <=>  i >= j - off - right
        lo = (tl.maximum(start_n - off - window_right, 0) // BLOCK_M) * BLOCK_M
        full_lo = tl.maximum(last_n - off - window_right, 0)
        full_lo = ((full_lo + BLOCK_M - 1) // BLOCK_M) * BLOCK_M
    if BOUNDED_LEFT:  # j >= i + off - left  <=>  i <= j - off + left
        hi = tl.minimum(hi, last_n - off + window_left + 1)
        full_hi = tl.minimum(full_hi, start_n - off + window_left + 1)
    # Keys past Sk make every query tile of this block a masked one.
    full_hi = tl.where(last_n < seqlen_k, full_hi, 0)
    hi = tl.maximum(hi, lo)
    full_lo = tl.minimum(tl.maximum(full_lo, lo), hi)
    full_hi = (tl.maximum(full_hi, 0) // BLOCK_M) * BLOCK_M
    full_hi = tl.minimum(tl.maximum(full_hi, full_lo), hi)
    return lo, full_lo, full_hi, hi


@triton.jit
def tile_start(start, BLOCK: tl.constexpr):
    """A tile loop's first element as a 64-bit offset, with what key_range,
    query_range and the split-KV forward's splits guarantee told to Triton: a multiple
    of BLOCK (tests: test_tile_spans_start_on_tiles). Its loads of a bias row
    (contiguous along the loop) are then 16 bytes wide where 16 does not divide Sk;
    proved from Sk alone they were one element each (H200, tile forward over a (1, H,
    4095, 4095) bias, B4 D128: 3468 µs, now 1667, against 1679 at 4096). The hint goes
    on this value: one on the loop's bounds (a helper's arguments) or its counter is
    dropped."""
    return tl.multiple_of(tl.cast(start, tl.int64), BLOCK)


@triton.jit
def tile_span(SPAN: tl.constexpr, lo, full_lo, full_hi, hi):
    """The tiles of pass SPAN over a (lo, full_lo, full_hi, hi) range: 0 the masked
    tiles at the left edge, 1 the unmasked interior, 2 the masked right edge. Kernels
    walk ``tl.static_range(3)`` with MASKED = SPAN != 1, one compiled loop per pass."""
    if SPAN == 0:
        return lo, full_lo
    elif SPAN == 1:
        return full_lo, full_hi
    else:
        return full_hi, hi


@triton.jit
def visible(
    rows, cols, seqlen_k, off, window_left, window_right,
    BOUNDED_LEFT: tl.constexpr, BOUNDED_RIGHT: tl.constexpr,
):  # fmt: skip
    """Bool tile: key ``cols`` exists and is visible from query ``rows``.

    rows and cols are query and key positions shaped to broadcast against each other,
    (M, 1) and (1, N) for a (queries, keys) tile or (1, M) and (N, 1) for the
    transposed tile the dK/dV loop works on; the same holds for the helpers below.
    """
    mask = cols < seqlen_k
    diag = rows + off
    if BOUNDED_RIGHT:
        mask = mask & (cols <= diag + window_right)
    if BOUNDED_LEFT:
        mask = mask & (cols >= diag - window_left)
    return mask


# Triton's interpreter runs no inline PTX (read once, as Triton reads it).
INTERPRETING = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")


@triton.jit
def tanh(x, FAST: tl.constexpr):
    """softcap's tanh. FAST (16-bit inputs): the GPU's tanh.approx.f32, one MUFU
    operation, relative error below 2^-10.9 (a bf16 score's rounding is 2^-9); else,
    and under the interpreter, 1 - 2 / (2^(2x log2 e) + 1), an exp2 and a division (two
    MUFU operations and the division's refinement), saturating to +-1 without overflow
    trouble. Every kernel of a call decides alike (by the inputs' dtype), so that a
    backward recomputes the forward's P."""
    if FAST and not INTERPRETING:
        return tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [x],
                                         dtype=tl.float32, is_pure=True, pack=1)
    else:
        return 1.0 - 2.0 / (tl.exp2(x * (2.0 * LOG2E)) + 1.0)


@triton.jit
def capped_score_log2(qk, scale, softcap, HAS_SOFTCAP: tl.constexpr, FAST: tl.constexpr):
    """The scaled (and softcapped) score times log2(e), from the raw q.k tile (fp32).
    The backward recovers softcap's tanh from it: t = s2 / (softcap * log2(e)). FAST:
    tanh's."""
    if HAS_SOFTCAP:
        return tanh(qk * (scale / softcap), FAST) * (softcap * LOG2E)
    else:
        return qk * (scale * LOG2E)


@triton.jit
def add_bias_alibi_log2(
    s, rows, cols, off, slope, bias, HAS_BIAS: tl.constexpr, HAS_ALIBI: tl.constexpr,
):  # fmt: skip
    """Adds the bias tile (fp32, natural units) and ALiBi's -slope * |i + off - j| to a
    log2-domain score: the score before masking."""
    if HAS_BIAS:
        # A finite bias below -FLT_MAX / log2(e) (eager-style masks use finfo.min) would
        # overflow to -inf and turn a row the reference averages into an empty row:
        # clamp finite values, keep -inf as -inf.
        scaled = tl.maximum(bias, -2.0e38) * LOG2E
        s += tl.where(bias == float("-inf"), float("-inf"), scaled)
    if HAS_ALIBI:
        s = tl.fma(alibi_distance(rows, cols, off), -(slope * LOG2E), s)
    return s


@triton.jit
def alibi_distance(rows, cols, off):
    """ALiBi's |i + off - j| between query rows and key columns, fp32 (its slope's
    factor; off: diagonal_offset's). The rows' and the columns' positions go to fp32
    once each, not once a score (an integer conversion, an absolute value and an add a
    score were a third of the ALiBi forward's instructions); exact while i + off and j
    stay below 2**24, and past that within fp32's own rounding of the product."""
    return tl.abs((rows + off).to(tl.float32) - cols.to(tl.float32))


@triton.jit
def dropout_keep(seed, rng_offset, bh, offs_m, start_n, dropout_p, BLOCK_N: tl.constexpr):
    """(M, BLOCK_N) bool keep tile for head bh = b * H + h, query positions offs_m and
    the keys start_n + [0, BLOCK_N) (positions inside the sequence; start_n % 8 == 0).

    Counter-based Philox-4x32-10: the counter is (key // 8, query, b*H + h, offset), the
    key the 64-bit seed. One call gives four 32-bit words, eight 16-bit uniforms: key
    8g + 4i + 2j + h takes half h (0: the low half) of word 2j + i, the order the nested
    tl.join lays them out in. A key is kept when its uniform is >= round(p * 2**16), so
    the drop probability is p rounded to a multiple of 2**-16 (1.5e-5). The backward
    regenerates the forward's mask bit for bit, in any tiling. Eight keys per call (one,
    then four, before): the integer work of Philox weighed on the dropout kernels.
    """
    groups = start_n // 8 + tl.arange(0, BLOCK_N // 8)
    c0 = (groups[None, :] + tl.zeros_like(offs_m)[:, None]).to(tl.uint32)
    c1 = (offs_m[:, None] + tl.zeros_like(groups)[None, :]).to(tl.uint32)
    c2 = (tl.zeros_like(c1) + bh).to(tl.uint32)
    c3 = (tl.zeros_like(c1) + rng_offset).to(tl.uint32)  # offset < 2**31 by design
    r0, r1, r2, r3 = tl.philox(seed, c0, c1, c2, c3)
    threshold = tl.cast(dropout_p * 65536.0 + 0.5, tl.uint32)
    low = tl.join(tl.join(r0 & 0xFFFF, r1 & 0xFFFF), tl.join(r2 & 0xFFFF, r3 & 0xFFFF))
    high = tl.join(tl.join(r0 >> 16, r1 >> 16), tl.join(r2 >> 16, r3 >> 16))
    keep = tl.join(low, high) >= threshold  # (M, N/8, 2, 2, 2)
    return tl.reshape(keep, (offs_m.shape[0], BLOCK_N))
