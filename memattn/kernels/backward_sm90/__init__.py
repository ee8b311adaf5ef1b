"""The Hopper backward, in Gluon: `run` is the pass. backward.py's preprocess (its delta
kernel) fills the row statistics (lse * log2(e) and delta: common.row_stats_buffer) and zeroes
dQ's fp32 buffer where the kernel adds into one (dq_tiles); one kernel, by the head
dims (`backward`); then _dq_from_tiles_kernel converts dQ (for masked and packed calls
head by head, as narrow.py's kernel counts each head's key blocks done:
shared.converts_dq_by_head), and bias_grad_tiles a summed bias gradient. The kernels,
a module each:
- narrow.py, Dqk and Dv up to 128: FlashAttention-3's kernel. A program owns 128 keys,
  keeps dK and dV in registers and walks every query tile of its GQA group once, adding
  each tile's dQ into the fp32 buffer by TMA reduce-add.
- split.py, Dqk=192 / Dv=128: one kernel in FlashAttention-4's orientation for these
  head dims (queries on the wgmma's M), the same dQ buffer and reduce-adds.
- wide.py, past 128 columns (D=256, and 192/128's deterministic calls and those with a
  bias, ALiBi, dropout or softcap): dK and dV by one kernel, each warpgroup part of the
  head dims, and dQ by another in the forward's shape, written in the output dtype.
shared.py holds what they share: the load warp's tiles, the grid of key blocks and
packed sequences' items, dQ's fp32 tiles, and which kernel takes a call (is_wide,
fuses_split_dq) and how it makes a bias's gradient (dbias_kind_of). turns.py holds
the deterministic calls' order of adds in narrow.py's kernel: each tile's counter,
each program's turn at it, and where its walk starts.

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
from triton.language.extra.cuda import gdc_wait

from ...spec import AttentionSpec
from .. import backward as tiles
from .. import hopper
from ..common import (
    TILE_BIAS_ALIGNMENT,
    cdiv,
    copy_rows,
    diagonal_offset,
    dq_tile,
    new_output,
    packed_items,
    packed_row_block,
    row_block,
    row_stats_buffer,
    sequence_bounds,
    sum_to_bias,
    visible,
)
from ..forward import dense_strides
from ..hopper import accumulator_tile
from . import narrow, shared, split, turns, wide  # noqa: F401 (turns: for tools, tests)
from .narrow import block_m, dq_from_full_bias, orders_dq
from .shared import (
    HEAD_DIMS,
    SUMMED_GRADIENTS,
    converts_dq_by_head,
    dbias_kind_of,
    dq_in_fp32,
    dq_split,
    dq_tiles,
    fuses_split_dq,
    is_wide,
    keeps_bits_in_shared,
    takes_head_dims,
)

# What dispatch.py and the CLI ask of the Hopper backward (the rest is the modules')
__all__ = ["HEAD_DIMS", "MIN_KEYS_PER_QUERY", "dbias_kind_of", "dq_from_full_bias", "dq_in_fp32",
           "is_wide", "keeps_bits_in_shared", "orders_dq", "run", "takes_head_dims"]

# Below this many keys per query backward.py's kernels win: each program then has few
# query tiles to spread its start-up (K and V loads, the partitions) and its dK/dV
# stores over. H100, tools/ab.py (bench timing, host included), tile -> Gluon: D=64
# S512 causal (256 keys) 159 -> 171 TFLOP/s, S256 causal (128 keys) 99 -> 94, a window
# of 64 keys 48 -> 42; D=128 S512 causal 145 -> 173, windows of 256 and 32 keys 107 ->
# 150 and 16 -> 22; D=256 S512 causal 104 -> 144.
MIN_KEYS_PER_QUERY = {64: 256, 128: 0, 192: 0, 256: 0}


def backward(spec: AttentionSpec, q, k, v, grad_out, bias, alibi_slopes, rng_state,
             cu_seqlens_q, cu_seqlens_k, stats, dq, dk, dv, dbias,
             heads_done=None) -> int:  # fmt: skip
    """Fills dq, dk, dv and dbias (None: not needed; every tile a query sees is written,
    the rest left as it was) for a call dispatch.gluon_backward took; dq is an fp32 buffer,
    zeroed, that dQ is added into where `dq_in_fp32` says so, the output otherwise;
    stats as row_stats_buffer made it, filled; rng_state: dropout's [seed, offset],
    None without dropout. For a bias constant along queries (hopper.bias_row), dbias is
    a zeroed (B, H, Sk) fp32 buffer that takes dS summed over each head's queries; for
    one broadcast over batch or heads, a zeroed fp32 buffer of the bias's shape that
    takes every (b, h)'s dS added in, or for dbias_kind_of's "added" the zeroed gradient
    itself. heads_done (converts_dq_by_head): zeroed counters, one a (sequence, kv head),
    that the D 64/128 kernel counts its key blocks in; returns its counts a block."""
    if fuses_split_dq(spec):
        split.backward(spec, q, k, v, grad_out, cu_seqlens_q, cu_seqlens_k, stats, dq, dk, dv)
        return 0
    if is_wide(spec):
        wide.backward(spec, q, k, v, grad_out, bias, alibi_slopes, rng_state, cu_seqlens_q,
                      cu_seqlens_k, stats, dq, dk, dv, dbias)
        return 0
    return narrow.backward(spec, q, k, v, grad_out, bias, alibi_slopes, rng_state,
                           cu_seqlens_q, cu_seqlens_k, stats, dq, dk, dv, dbias, heads_done)


@triton.jit
def _dq_tile_out(
    Tiles, DQ, CuSeqQ, CuSeqK, HeadsDone, stride_tb, stride_th, stride_qb, stride_qm,
    stride_qh, H, seqlen_q, seqlen_k, num_m, num_seqs, scale, dq_cols, group, block_counts,
    g, BLOCK_M: tl.constexpr, PART_ROWS: tl.constexpr, PART_COLS: tl.constexpr,
    PARTS: tl.constexpr, IS_VARLEN: tl.constexpr, BY_HEAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    """_dq_from_tiles_kernel's tile g. BY_HEAD: once its (sequence, kv head)'s key blocks
    are all counted in HeadsDone (block_counts each)."""
    if IS_VARLEN:  # packed_items' grid over the tokens (the delta kernel's)
        b, h, m_block = packed_row_block(H, CuSeqQ, num_seqs, BLOCK_M, False, g)
    else:
        b, h, _, m_block = row_block(num_m, H, False, g)
    start_m = m_block * BLOCK_M
    q_start, _, seqlen_q, seqlen_k = sequence_bounds(CuSeqQ, CuSeqK, b, seqlen_q, seqlen_k,
                                                     IS_VARLEN)  # fmt: skip
    if start_m < seqlen_q:
        if BY_HEAD:  # spin on plain loads, then one acquire: the tile's loads come after
            counter = HeadsDone + b * (H // group) + h // group
            target = block_counts * tl.cdiv(seqlen_k, BLOCK_N)
            while tl.load(counter, volatile=True) < target:
                pass
            tl.atomic_add(counter, 0, sem="acquire")
        tile = dq_tile(start_m, q_start, b, BLOCK_M, IS_VARLEN)
        b64 = b.to(tl.int64)
        h64 = h.to(tl.int64)
        first = (Tiles + b64 * stride_tb + h64 * stride_th
                 + tile.to(tl.int64) * (PARTS * PART_ROWS * PART_COLS))
        by_rows: tl.constexpr = PART_ROWS < BLOCK_M
        for part in tl.static_range(PARTS):
            x = accumulator_tile(first + part * PART_ROWS * PART_COLS, PART_ROWS, PART_COLS)
            if BY_HEAD:  # a sequence without keys: no count to wait for, and its tile may
                x = tl.where(seqlen_k > 0, x, 0.0)  # not be zeroed yet (the preprocess runs)
            rows = (part * PART_ROWS if by_rows else 0) + tl.arange(0, PART_ROWS)[:, None]
            cols = (0 if by_rows else part * PART_COLS) + tl.arange(0, PART_COLS)[None, :]
            row64 = (q_start + start_m + rows).to(tl.int64)
            tl.store(DQ + b64 * stride_qb + h64 * stride_qh + row64 * stride_qm + cols,
                     (x * scale).to(DQ.dtype.element_ty),
                     mask=(rows < seqlen_q - start_m) & (cols < dq_cols))


@triton.jit
def _dq_from_tiles_kernel(
    Tiles, DQ, CuSeqQ, CuSeqK, HeadsDone, stride_tb, stride_th, stride_qb, stride_qm,
    stride_qh, H, seqlen_q, seqlen_k, num_m, num_seqs, scale, dq_cols, group, block_counts,
    tiles, queue, BLOCK_M: tl.constexpr, PART_ROWS: tl.constexpr, PART_COLS: tl.constexpr,
    PARTS: tl.constexpr, IS_VARLEN: tl.constexpr, PDL: tl.constexpr, BY_HEAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    """dQ in its dtype from dq_tiles' fp32 tiles, one tile (BLOCK_M rows) a program; its
    PARTS parts (dq_split) hold PART_COLS columns each, or (PART_ROWS < BLOCK_M) half the
    rows. The tiles hold dS K without the softmax scale: it goes in here, once a value,
    where the main kernels would pay a multiply per value and step (FA4's postprocess
    does the same). Columns from dq_cols on (past dQ's own, where DQK spans more:
    dispatch.kernel_spec) are not written. PDL: launched while the main kernel runs
    (shared.DEPENDENT_LAUNCHES), it waits for its end; BY_HEAD (DQ_CONVERTED_BY_HEAD)
    its programs take the ``tiles`` tiles in the main kernel's order from a queue (the
    counter HeadsDone[queue]), each once its head's blocks are done, and wait for the
    end only at theirs (so that the stream's next kernel follows the main one too)."""
    if BY_HEAD:
        g = tl.atomic_add(HeadsDone + queue, 1)
        while g < tiles:
            _dq_tile_out(Tiles, DQ, CuSeqQ, CuSeqK, HeadsDone, stride_tb, stride_th, stride_qb,
                         stride_qm, stride_qh, H, seqlen_q, seqlen_k, num_m, num_seqs, scale,
                         dq_cols, group, block_counts, g, BLOCK_M, PART_ROWS, PART_COLS, PARTS,
                         IS_VARLEN, True, BLOCK_N)  # fmt: skip
            g = tl.atomic_add(HeadsDone + queue, 1)
        if PDL:
            gdc_wait()
    else:
        if PDL:
            gdc_wait()
        _dq_tile_out(Tiles, DQ, CuSeqQ, CuSeqK, HeadsDone, stride_tb, stride_th, stride_qb,
                     stride_qm, stride_qh, H, seqlen_q, seqlen_k, num_m, num_seqs, scale,
                     dq_cols, group, block_counts, tl.program_id(0), BLOCK_M, PART_ROWS,
                     PART_COLS, PARTS, IS_VARLEN, False, BLOCK_N)  # fmt: skip


_launch_dq_from_tiles = hopper.Launcher(_dq_from_tiles_kernel)


def dq_from_tiles_launch(
    spec: AttentionSpec, buffer: torch.Tensor, rows: int, dq: torch.Tensor, cu_seqlens_q,
    pdl: bool = False, cu_seqlens_k=None, heads_done=None, block_counts: int = 0,
) -> tuple[tuple, tuple, dict]:  # fmt: skip
    """_dq_from_tiles_kernel's (grid, arguments, constexprs): dq (the output) from
    dq_tiles' ``buffer`` of ``rows``-row tiles. pdl: the kernel waits for the one before
    it (launched with launch_pdl then). heads_done (DQ_CONVERTED_BY_HEAD, with pdl): the
    main kernel's counts, block_counts a key block, and the queue's counter after them;
    the tiles then go to persistent programs."""
    num_m = cdiv(spec.seqlen_q, rows)
    split = dq_split(spec.head_dim_qk, rows)
    tiles = (packed_items(spec.batch, dq.shape[0], spec.heads, rows) if spec.varlen
             else spec.batch * spec.heads * num_m)
    by_head = heads_done is not None
    args = (buffer, dq, cu_seqlens_q, cu_seqlens_q if cu_seqlens_k is None else cu_seqlens_k,
            heads_done if by_head else buffer, 0 if spec.varlen else buffer.stride(0),
            buffer.stride(1), *dense_strides(dq, spec.varlen)[:3], spec.heads, spec.seqlen_q,
            spec.seqlen_k, num_m, spec.batch, spec.scale, dq.shape[-1], spec.group, block_counts,
            tiles, spec.batch * spec.kv_heads)
    constexprs = dict(BLOCK_M=rows, PART_ROWS=split[0], PART_COLS=split[1],
                      PARTS=rows * spec.head_dim_qk // (split[0] * split[1]),
                      IS_VARLEN=spec.varlen, PDL=pdl, BY_HEAD=by_head, BLOCK_N=narrow.BLOCK_N)
    programs = tiles
    if by_head:
        per_sm = shared.DQ_CONVERSION_PROGRAMS_PER_SM
        programs = min(tiles, per_sm * hopper.sm_count(dq.device.index))
    return (programs,), args, constexprs


# The preprocess (backward.py's delta kernel), launched past JITFunction.run
# (hopper.Launcher): on the device's host that run() cost ~80 us a call, more than the
# kernel at 16k tokens.
_launch_delta = hopper.Launcher(tiles._delta_kernel)


@triton.jit
def _bias_grad_tiles_kernel(
    Buf, Out, CuSeqQ, CuSeqK, batches, heads, seqlen_q, seqlen_k, buf_row, out_row, tiles_k,
    window_left, window_right, MODE: tl.constexpr,
    IS_VARLEN: tl.constexpr, BOTTOM_RIGHT: tl.constexpr, BAND: tl.constexpr,
    BOUNDED_LEFT: tl.constexpr, BOUNDED_RIGHT: tl.constexpr, BLOCK_Q: tl.constexpr,
    BLOCK_K: tl.constexpr,
):  # fmt: skip
    """One (query, key) tile of one (batch, head) plane of a bias gradient (B', H', Sq,
    Sk), contiguous but for its rows' length (buf_row, out_row: Buf's and Out's). Seen:
    the (query, key) pairs some call's batch that the plane serves sees (the causal or
    window band, BAND; with packed sequences and a bias plane a sequence, that
    sequence's own lengths). MODE 0 zeroes the fp32 buffer Buf where a
    tile holds a seen pair, 1 converts those tiles of Buf into Out and writes zeros in
    the others, 2 writes zeros in Out wherever a pair is not seen."""
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
    row0 = bh.to(tl.int64) * seqlen_q + r0
    buf = Buf + row0 * buf_row + c0 + rows * buf_row + cols
    out = Out + row0 * out_row + c0 + rows * out_row + cols
    # Buf's rows with their padding (never read but here): masks Triton knows aligned
    # where Sk is not (16 divides buf_row), so 16 bytes a load or store
    inside_buf = (r0 + rows < seqlen_q) & (c0 + cols < buf_row)
    if MODE == 0:
        if some:
            tl.store(buf, tl.zeros([BLOCK_Q, BLOCK_K], tl.float32), mask=inside_buf)
    elif MODE == 1:
        x = tl.zeros([BLOCK_Q, BLOCK_K], tl.float32)
        if some:
            x = tl.load(buf, mask=inside_buf, other=0.0)
        tl.store(out, x.to(Out.dtype.element_ty), mask=inside)
    else:
        zeros = tl.zeros([BLOCK_Q, BLOCK_K], Out.dtype.element_ty)
        if not some:  # stores masked by `inside` alone are vectorised (out_row % 16 == 0)
            tl.store(out, zeros, mask=inside)
        elif not every:  # a tile the band's edge or a sequence's end crosses
            seen = (r0 + rows < n_q) & visible(r0 + rows, c0 + cols, n_k, off, window_left,
                                                window_right, BOUNDED_LEFT and BAND,
                                                BOUNDED_RIGHT and BAND)  # fmt: skip
            tl.store(out, zeros, mask=inside & ~seen)


_launch_bias_grad_tiles = hopper.Launcher(_bias_grad_tiles_kernel)
ZERO_SEEN, CONVERT, ZERO_UNSEEN = 0, 1, 2  # _bias_grad_tiles_kernel's modes


def bias_grad_tiles(mode: int, spec: AttentionSpec, buf, out, cu_seqlens_q,
                    cu_seqlens_k) -> None:  # fmt: skip
    """_bias_grad_tiles_kernel over a bias gradient in the bias's shape (buf: the fp32
    buffer a summed gradient is added into; out: the gradient; None where the mode takes
    none; either contiguous or over padded rows: padded_rows), so that the pairs no query
    sees are neither zeroed, read nor written twice."""
    t = buf if out is None else out
    shape = [1] * (4 - t.dim()) + list(t.shape)
    buf_row, out_row = ((t if x is None else x).stride(-2) for x in (buf, out))
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
    ints = (*shape, buf_row, out_row, tiles_k, spec.window_left, spec.window_right)
    _launch_bias_grad_tiles(
        (shape[0] * shape[1] * cdiv(shape[2], block_q) * tiles_k,), t if buf is None else buf,
        t, cu_seqlens_q, cu_seqlens_k, *ints,
        variant=(tuple(constexprs.items()), ints, None if buf is None else buf.dtype, t.dtype,
                 hopper.aligned(cu_seqlens_q), hopper.aligned(cu_seqlens_k)),
        num_warps=4, **constexprs)  # fmt: skip


# The calls whose launches are replayed (hopper.Replays): those without a bias gradient
# or ORDERED_DQ's counters, whose path does nothing on the stream but the buffers and
# the launches (the preprocess, the main kernel or kernels, dQ's conversion).
_REPLAYS = hopper.Replays()


def run(spec: AttentionSpec, grad_out, grad_lse, q, k, v, out, lse, bias, alibi_slopes,
        cu_seqlens_q, cu_seqlens_k, rng_state, needs) -> tuple:  # fmt: skip
    """The backward through this module's kernels, for a call dispatch.gluon_backward
    took (spec's head dims the kernels', dispatch.kernel_spec: the tensors' may be
    narrower): the preprocess fills the row statistics, padded for TMA, and, where the
    kernel adds dQ into an fp32 buffer, zeroes it; dQ is then converted at the end (or,
    for a deterministic call with a bias gradient by tiles, made from the stored dS:
    dq_from_full_bias). Returns (dq, dk, dv, dbias), None for what ``needs`` does not
    ask. Only what this path reads is computed: every line here is host time on each
    call. A call like an earlier one, its tensors and fresh buffers at the same
    addresses, launches what that one did (_REPLAYS), with none of the work between."""
    _, need_dk, need_dv, need_dbias = needs
    dbias_kind = dbias_kind_of(spec, bias) if need_dbias else None
    dq_by_matmul = dq_from_full_bias(spec, dbias_kind)  # the kernel adds no dQ
    stats = row_stats_buffer(lse, spec.varlen, spec.batch)
    dq_acc, rows = None, 0
    if dq_in_fp32(spec):  # dQ tiles in their registers' order (dq_tiles)
        rows = block_m(spec, hopper.bias_row(spec, bias))
        dq_acc = dq_tiles(spec, q.shape[0], rows, q.device)
    heads_done = None  # the main kernel's counts and the conversion's queue, zeroed first
    if dq_acc is not None and not dq_by_matmul and converts_dq_by_head(spec):
        heads_done = torch.zeros(spec.batch * spec.kv_heads + 1, dtype=torch.int32,
                                 device=q.device)
    dq = new_output(q.shape, q.dtype, q.device)
    dk = new_output(k.shape, k.dtype, k.device)
    dv = new_output(v.shape, v.dtype, v.device)
    grads = (dq, dk if need_dk else None, dv if need_dv else None)
    replay = None
    if dbias_kind is None and not orders_dq(spec, None):
        replay = (spec, *map(hopper.tensor_key, (grad_out, grad_lse, q, k, v, out, lse, bias,
                                                  alibi_slopes, cu_seqlens_q, cu_seqlens_k,
                                                  rng_state)),
                  *(t.data_ptr() for t in (stats, dq_acc, heads_done, dq, dk, dv)
                    if t is not None))  # fmt: skip
        if _REPLAYS.launch(replay):
            return (*grads, None)
    with _REPLAYS.recording(replay):
        dbias = _launch_all(spec, grad_out, grad_lse, q, k, v, out, lse, bias, alibi_slopes,
                            cu_seqlens_q, cu_seqlens_k, rng_state, dbias_kind, stats,
                            dq_acc, rows, heads_done, dq, dk, dv)  # fmt: skip
    return (*grads, dbias)


def _launch_all(spec: AttentionSpec, grad_out, grad_lse, q, k, v, out, lse, bias,
                alibi_slopes, cu_seqlens_q, cu_seqlens_k, rng_state, dbias_kind, stats,
                dq_acc, rows, heads_done, dq, dk, dv):  # fmt: skip
    """run's launches into its buffers (dq_acc: dq_tiles' fp32 buffer, None where the
    kernels write dq itself; rows its tiles'); returns the bias gradient (None without)."""
    dq_by_matmul = dq_from_full_bias(spec, dbias_kind)
    zeroed, zeroed_rows = (None, 0) if dq_by_matmul else (dq_acc, rows)
    pdl = shared.DEPENDENT_LAUNCHES
    grid, args, constexprs = tiles.delta_launch(
        spec, out, grad_out, lse, grad_lse, cu_seqlens_q, stats, zeroed, zeroed_rows, pdl)
    # the stats and dq_acc fresh: what the spec does not fix is here
    variant = (spec, zeroed_rows, pdl, out.shape[-1], *out.stride(), *grad_out.stride(),
               *lse.stride(), *map(hopper.aligned, (out, grad_out, lse, cu_seqlens_q)),
               None if grad_lse is None else (*grad_lse.stride(), hopper.aligned(grad_lse)))
    _launch_delta(grid, *args, variant=variant, **constexprs, launch_pdl=pdl)
    dbias = None
    # A gradient by TMA tiles, over rows TMA writes (padded where Sk is not a multiple of
    # 8, as the bias it reads: dispatch._gluon_bias), copied to rows of its own at the end;
    # the wide kernels' by pointer, in any rows.
    aligned = 1 if is_wide(spec) else hopper.TMA_BIAS_ALIGNMENT
    if dbias_kind == "row":  # dS summed over queries per (b, h, key), then over broadcast dims
        dbias = torch.zeros(spec.batch, spec.heads, spec.seqlen_k, dtype=torch.float32,
                            device=bias.device)
    elif dbias_kind in SUMMED_GRADIENTS:  # every (b, h)'s dS added in (in turns:
        # "ordered"), converted at the end
        dbias = new_output(bias.shape, torch.float32, bias.device,
                           TILE_BIAS_ALIGNMENT if aligned > 1 else 1)  # (bias_grad_tiles' masks)
        bias_grad_tiles(ZERO_SEEN, spec, dbias, None, cu_seqlens_q, cu_seqlens_k)
    elif dbias_kind == "added":  # every sequence's dS added in
        dbias = new_output(bias.shape, bias.dtype, bias.device, aligned).zero_()
    elif dbias_kind == "full":
        dbias = new_output(bias.shape, bias.dtype, bias.device, aligned)
        # tiles no query sees (past a sequence too) are never written; the D 64/128
        # kernel writes a dense batch's zeros itself (_zero_unseen_ds_tiles)
        masked = spec.window_left >= 0 or spec.window_right >= 0
        if spec.varlen or (masked and is_wide(spec)):
            bias_grad_tiles(ZERO_UNSEEN, spec, None, dbias, cu_seqlens_q, cu_seqlens_k)
    counts = backward(spec, q, k, v, grad_out, bias, alibi_slopes, rng_state, cu_seqlens_q,
                      cu_seqlens_k, stats, dq if dq_acc is None else dq_acc, dk, dv, dbias,
                      heads_done)  # fmt: skip
    if dq_by_matmul:  # deterministic: dQ from the stored dS
        tiles.dq_from_ds(dq, dbias, k, spec)
    elif dq_acc is not None:
        grid, args, constexprs = dq_from_tiles_launch(spec, dq_acc, rows, dq, cu_seqlens_q, pdl,
                                                      cu_seqlens_k, heads_done, counts)
        _launch_dq_from_tiles(grid, *args, variant=(spec, rows, pdl, counts, dq.shape[-1],
                                                    *dq.stride(), hopper.aligned(cu_seqlens_q),
                                                    hopper.aligned(cu_seqlens_k)),
                              num_warps=4, **constexprs, launch_pdl=pdl)  # fmt: skip
    if dbias_kind == "row":  # (B, H, Sk) fp32 sums over each head's queries
        dbias = sum_to_bias(dbias.unsqueeze(2), bias)
    elif dbias_kind in SUMMED_GRADIENTS:
        summed, dbias = dbias, new_output(bias.shape, bias.dtype, bias.device)
        bias_grad_tiles(CONVERT, spec, summed, dbias, cu_seqlens_q, cu_seqlens_k)
    elif dbias is not None and not dbias.is_contiguous():  # over padded rows: to its own
        dbias = copy_rows(dbias, torch.empty(bias.shape, dtype=bias.dtype, device=bias.device))
    return dbias
