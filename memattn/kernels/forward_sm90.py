"""Hopper forward kernel in Gluon, warp-specialised (FlashAttention-3's structure).

What the tile-level kernel (forward.py) cannot express: Triton's compiler runs every
warp of a program in lockstep through load, matmul and softmax, so the tensor cores
idle during each softmax. Here one program (a 128-row query block) is three partitions:
- a load warp: Q once, then K and V tiles by TMA into a two-stage ring of shared
  memory, each slot refilled as soon as both consumers release it (mbarriers);
- two softmax warpgroups of 64 query rows each. Each keeps S(t) = Q·K(t)ᵀ and
  O += P(t-1)·V(t-1) in flight together as asynchronous wgmmas and computes the
  softmax of S(t) while P(t-1)·V(t-1) runs; the two warpgroups drift apart freely, so
  one's softmax overlaps the other's matmuls.
The output leaves by a TMA store, which clips rows past Sq; TMA loads zero-fill past S.

Covers bf16/fp16, head dims 64 and 128 (q·k and v alike), dense batches, GQA, causal
masks either way and sliding windows; `supports` says so, and every other call runs
forward.py. Softcap, ALiBi, bias and dropout stay there for now.
"""

from __future__ import annotations

import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from ..spec import AttentionSpec
from . import hopper
from .common import LN2, LOG2E, diagonal_offset, key_range, visible

BLOCK_M = 128  # two warpgroups x 64 rows
BLOCK_N = 128
STAGES = 2  # K and V each: 2 x 32 KiB at D=128, plus Q's 32 KiB


@gluon.jit
def _load_partition(
    q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_ready, v_ready, k_empty,
    v_empty, b, h, hk, start_m, lo, n_tiles,
    BLOCK_N: gl.constexpr, HALF_M: gl.constexpr, STAGES: gl.constexpr,
):  # fmt: skip
    """One warp: Q once, then K and V tiles into the ring as slots come free."""
    mbarrier.expect(q_bar, 2 * q_desc.block_type.nbytes)
    for i in gl.static_range(2):
        tma.async_copy_global_to_shared(q_desc, [b, h, start_m + i * HALF_M, 0], q_bar,
                                        q_smem.index(i))
    for t in range(n_tiles):
        slot = t % STAGES
        # A slot's (t // STAGES)-th reuse waits for both consumers to release tile t - STAGES.
        free_phase = ((t // STAGES) & 1) ^ 1
        mbarrier.wait(k_empty.index(slot), free_phase, pred=t >= STAGES)
        mbarrier.expect(k_ready.index(slot), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [b, hk, lo + t * BLOCK_N, 0],
                                        k_ready.index(slot), k_smem.index(slot))
        mbarrier.wait(v_empty.index(slot), free_phase, pred=t >= STAGES)
        mbarrier.expect(v_ready.index(slot), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [b, hk, lo + t * BLOCK_N, 0],
                                        v_ready.index(slot), v_smem.index(slot))


@gluon.jit
def _ready(bars, tile, STAGES: gl.constexpr):
    """Waits until key tile ``tile`` sits in its ring slot; returns the slot."""
    slot = tile % STAGES
    mbarrier.wait(bars.index(slot), (tile // STAGES) & 1)
    return slot


@gluon.jit
def _softmax_tile(
    s, m_i, l_i, start_n, offs_m, seqlen_k, off, window_left, window_right, needs_mask,
    scale_log2, BLOCK_N: gl.constexpr, BOUNDED_LEFT: gl.constexpr,
    BOUNDED_RIGHT: gl.constexpr,
):  # fmt: skip
    """Online-softmax step on raw scores s; m_i is kept in scaled log2 units."""
    if needs_mask:
        offs_n = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s.type.layout))
        mask = visible(offs_m[:, None], offs_n[None, :], seqlen_k, off, window_left,
                       window_right, BOUNDED_LEFT, BOUNDED_RIGHT)
        s = gl.where(mask, s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, 1) * scale_log2)
    # Rows with no visible key yet keep m = -inf: subtract 0 there (no -inf - -inf).
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
    p = gl.exp2(s * scale_log2 - m_safe[:, None])
    alpha = gl.exp2(m_i - m_safe)
    l_i = l_i * alpha + gl.sum(p, 1)
    return p, m_new, l_i, alpha


@gluon.jit
def _softmax_partition(
    o_desc, Lse, stride_lb, stride_lh, stride_lm, q_smem, k_smem, v_smem, q_bar,
    k_ready, v_ready, k_empty, v_empty, b, h, start_m, lo, full_lo, full_hi, n_tiles,
    seqlen_q, seqlen_k, off, scale_log2, window_left, window_right,
    HALF: gl.constexpr, HEAD_DIM: gl.constexpr, HALF_M: gl.constexpr,
    BLOCK_N: gl.constexpr, STAGES: gl.constexpr, BOUNDED_LEFT: gl.constexpr,
    BOUNDED_RIGHT: gl.constexpr,
):  # fmt: skip
    """One warpgroup: query rows [start_m + HALF * HALF_M, + HALF_M) over every key
    tile. S(t) and P(t-1)·V(t-1) are in flight together; the softmax of S(t) runs
    while P(t-1)·V(t-1) does."""
    dtype: gl.constexpr = o_desc.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)

    row0 = start_m + HALF * HALF_M
    offs_m = row0 + gl.arange(0, HALF_M, layout=gl.SliceLayout(1, s_layout))
    m_i = gl.full([HALF_M], float("-inf"), gl.float32, layout=gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([HALF_M], gl.float32, layout=gl.SliceLayout(1, s_layout))
    acc = gl.zeros([HALF_M, HEAD_DIM], gl.float32, layout=o_layout)
    s_init = gl.zeros([HALF_M, BLOCK_N], gl.float32, layout=s_layout)
    q_tile = q_smem.index(HALF).reshape([HALF_M, HEAD_DIM])
    mbarrier.wait(q_bar, 0)

    if n_tiles > 0:
        # Tile 0 alone: its softmax has no P·V to overlap with.
        slot = _ready(k_ready, 0, STAGES)
        k = k_smem.index(slot).reshape([BLOCK_N, HEAD_DIM]).permute((1, 0))
        s = warpgroup_mma(q_tile, k, s_init, use_acc=False, is_async=True)
        s = warpgroup_mma_wait(0, deps=(s,))
        mbarrier.arrive(k_empty.index(slot))
        needs_mask = (lo < full_lo) | (lo >= full_hi)
        p, m_i, l_i, alpha = _softmax_tile(
            s, m_i, l_i, lo, offs_m, seqlen_k, off, window_left, window_right, needs_mask,
            scale_log2, BLOCK_N, BOUNDED_LEFT, BOUNDED_RIGHT)  # fmt: skip
        p_op = gl.convert_layout(p.to(dtype), p_layout)
        for t in range(1, n_tiles):
            start_n = lo + t * BLOCK_N
            k_slot = _ready(k_ready, t, STAGES)
            k = k_smem.index(k_slot).reshape([BLOCK_N, HEAD_DIM]).permute((1, 0))
            s_tok = warpgroup_mma(q_tile, k, s_init, use_acc=False, is_async=True)
            v_slot = _ready(v_ready, t - 1, STAGES)
            v = v_smem.index(v_slot).reshape([BLOCK_N, HEAD_DIM])
            acc_tok = warpgroup_mma(p_op, v, acc, is_async=True)
            s = warpgroup_mma_wait(1, deps=(s_tok,))  # S(t) done; P(t-1)·V(t-1) runs on
            mbarrier.arrive(k_empty.index(k_slot))
            needs_mask = (start_n < full_lo) | (start_n >= full_hi)
            p, m_i, l_i, alpha = _softmax_tile(
                s, m_i, l_i, start_n, offs_m, seqlen_k, off, window_left, window_right,
                needs_mask, scale_log2, BLOCK_N, BOUNDED_LEFT, BOUNDED_RIGHT)  # fmt: skip
            acc, p_op = warpgroup_mma_wait(0, deps=(acc_tok, p_op))
            mbarrier.arrive(v_empty.index(v_slot))
            acc = acc * gl.convert_layout(alpha, o_rows)[:, None]
            p_op = gl.convert_layout(p.to(dtype), p_layout)
        v_slot = _ready(v_ready, n_tiles - 1, STAGES)
        v = v_smem.index(v_slot).reshape([BLOCK_N, HEAD_DIM])
        acc = warpgroup_mma(p_op, v, acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=(acc,))
        mbarrier.arrive(v_empty.index(v_slot))

    # Rows with no visible key: l = 0, out = 0, lse = -inf.
    empty = l_i == 0.0
    inv_l = 1.0 / gl.where(empty, 1.0, l_i)
    lse = gl.where(empty, float("-inf"), (m_i + gl.log2(gl.where(empty, 1.0, l_i))) * LN2)
    out = acc * gl.convert_layout(inv_l, o_rows)[:, None]
    # This half's Q buffer is free now; the TMA store clips rows past Sq.
    q_tile.store(out.to(dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(o_desc, [b, h, row0, 0], q_smem.index(HALF))
    l_ptrs = (Lse + b.to(gl.int64) * stride_lb + h.to(gl.int64) * stride_lh
              + offs_m.to(gl.int64) * stride_lm)
    gl.store(l_ptrs, lse, mask=offs_m < seqlen_q)
    tma.store_wait(0)


@gluon.jit
def _fwd_sm90_kernel(
    q_desc, k_desc, v_desc, o_desc, Lse, stride_lb, stride_lh, stride_lm,
    H, GROUP, seqlen_q, seqlen_k, num_m_blocks, scale_log2, window_left, window_right,
    HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr, BOTTOM_RIGHT: gl.constexpr, BOUNDED_LEFT: gl.constexpr,
    BOUNDED_RIGHT: gl.constexpr,
):  # fmt: skip
    # Grid order as in forward.py: query blocks of one head back to back, last first.
    pid = gl.program_id(0)
    bh = pid // num_m_blocks
    m_block = num_m_blocks - 1 - pid % num_m_blocks
    b = bh // H
    h = bh % H
    hk = h // GROUP
    start_m = m_block * BLOCK_M
    off = diagonal_offset(seqlen_q, seqlen_k, BOTTOM_RIGHT)
    lo, full_lo, full_hi, hi = key_range(
        start_m, seqlen_k, off, window_left, window_right,
        BLOCK_M, BLOCK_N, BOUNDED_LEFT, BOUNDED_RIGHT)  # fmt: skip
    n_tiles = gl.cdiv(hi - lo, BLOCK_N)
    HALF_M: gl.constexpr = BLOCK_M // 2

    dtype: gl.constexpr = q_desc.dtype
    q_smem = gl.allocate_shared_memory(dtype, [2] + q_desc.block_type.shape, q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=2)  # one arrival per softmax warpgroup
        mbarrier.init(v_empty.index(i), count=2)

    # Tuples built inline: constexprs stored in a variable first would turn into tensors.
    gl.warp_specialize(
        [(_softmax_partition, (
            o_desc, Lse, stride_lb, stride_lh, stride_lm, q_smem, k_smem, v_smem, q_bar,
            k_ready, v_ready, k_empty, v_empty, b, h, start_m, lo, full_lo, full_hi, n_tiles,
            seqlen_q, seqlen_k, off, scale_log2, window_left, window_right,
            0, HEAD_DIM, HALF_M, BLOCK_N, STAGES, BOUNDED_LEFT, BOUNDED_RIGHT)),
         (_softmax_partition, (
            o_desc, Lse, stride_lb, stride_lh, stride_lm, q_smem, k_smem, v_smem, q_bar,
            k_ready, v_ready, k_empty, v_empty, b, h, start_m, lo, full_lo, full_hi, n_tiles,
            seqlen_q, seqlen_k, off, scale_log2, window_left, window_right,
            1, HEAD_DIM, HALF_M, BLOCK_N, STAGES, BOUNDED_LEFT, BOUNDED_RIGHT)),
         (_load_partition, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar,
                            k_ready, v_ready, k_empty, v_empty, b, h, hk, start_m, lo,
                            n_tiles, BLOCK_N, HALF_M, STAGES))],
        worker_num_warps=[4, 1], worker_num_regs=[232, 24])  # fmt: skip


# The kernel pays more per program than forward.py (partition start-up, Q's load and the
# output store are not overlapped with other work), so it wins only when each query
# sees enough keys: v5's bench (PERFORMANCE.md) had it 1.3-1.7x ahead at S >= 4096 and
# up to 0.6x behind at S <= 1024 causal and with a 1024-key window.
MIN_KEYS_PER_QUERY = 2048


def supports(spec: AttentionSpec, q, k, v, bias, alibi_slopes) -> bool:
    """True where this kernel runs the call: the calls hopper.runs_call names, with
    enough keys per query to pay for its start-up."""
    return (hopper.runs_call(spec, q, k, v, bias, alibi_slopes)
            and hopper.keys_per_query(spec) >= MIN_KEYS_PER_QUERY)


def forward(spec: AttentionSpec, q, k, v, out, lse) -> None:
    """Fills out (B, Sq, H, D) and lse (B, H, Sq) for a call `supports` accepted."""
    num_m_blocks = triton.cdiv(spec.seqlen_q, BLOCK_M)
    _fwd_sm90_kernel[(num_m_blocks * spec.batch * spec.heads,)](
        hopper.descriptor(q, BLOCK_M // 2), hopper.descriptor(k, BLOCK_N),
        hopper.descriptor(v, BLOCK_N), hopper.descriptor(out, BLOCK_M // 2), lse, *lse.stride(),
        spec.heads, spec.group, spec.seqlen_q, spec.seqlen_k, num_m_blocks,
        spec.scale * LOG2E.value, spec.window_left, spec.window_right,
        HEAD_DIM=spec.head_dim_qk, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, STAGES=STAGES,
        BOTTOM_RIGHT=spec.bottom_right, BOUNDED_LEFT=spec.window_left >= 0,
        BOUNDED_RIGHT=spec.window_right >= 0, num_warps=4,
    )  # fmt: skip
