"""Few queries, long keys (decode and chunked prefill): a split-KV forward.

With Sq <= 64 queries a sequence, a program per (query block, head) leaves most of the
GPU idle and reads K and V once per query head. Here a program owns one KV head of one
sequence and a stretch of its keys (a split), and its rows are the queries of every
query head of that KV head's GQA group: row r is query head h = hk * GROUP + r // SQ
and query i = r % SQ (SQ the padded Sq). Each K/V tile is then read once for the whole
group, and the splits spread long keys over the SMs. Each split writes its partial
output (normalised by its own sum) and lse in fp32; `_merge_kernel` combines them
through their lse: lse = log sum_s exp(lse_s), out = sum_s exp(lse_s - lse) out_s.
With one split the kernel writes out and lse itself.

Every option of the tile forward holds, through the same jit helpers (masks, softcap,
bias, ALiBi, dropout's keep bits keyed by the row's own head and query: the backward
replays them), in dense and packed (varlen) batches.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait
from triton.runtime.errors import OutOfResources

from ..spec import AttentionSpec
from . import tuning
from .common import alibi_strides, cdiv, diagonal_offset, philox_key, sequence_bounds
from .forward import (
    _fwd_tiles,
    bias_strides,
    dense_strides,
    feature_switches,
    lse_strides,
    normalised,
)

MAX_QUERIES = 64  # per sequence: more run the tile or Gluon forward
MIN_KEYS = 4096  # fewer, and a program per query block fills the GPU well enough
MIN_SPLIT_KEYS = 512  # keys per split at least: each split costs a partial output
MAX_SPLITS = 128  # the merge holds every split's partial row in registers
# Programmatic dependent launch (sm_90+): each kernel is launched while the one before
# it in the stream ends, and waits for its writes (griddepcontrol.wait) before its first
# global access. A decode step is a few hundred µs, and each launch's gap a few of them.
# (The split-KV kernel does not let the merge launch early: that cost more than it hid.)
PDL = True


def takes(spec: AttentionSpec) -> bool:
    """Whether this kernel runs the forward of a call: few queries per sequence and
    many keys (the padded lengths in varlen mode), at no global positions."""
    return spec.seqlen_q <= MAX_QUERIES and spec.seqlen_k >= MIN_KEYS and not spec.positioned


@triton.jit
def _split_kv_kernel(
    Q, K, V, Out, Lse, OutPart, LsePart, Bias, Alibi, Rng, CuSeqQ, CuSeqK,
    stride_qb, stride_qm, stride_qh, stride_qd,
    stride_kb, stride_kn, stride_kh, stride_kd,
    stride_vb, stride_vn, stride_vh, stride_vd,
    stride_ob, stride_om, stride_oh, stride_od,
    stride_lb, stride_lh, stride_lm,
    stride_bb, stride_bh, stride_bm, stride_bn,
    stride_ab, stride_ah,
    BATCH, H, KV_HEADS, GROUP, SQ, seqlen_k, num_m_blocks, num_splits, split_keys,
    scale, softcap, window_left, window_right, dropout_p,
    DQK: tl.constexpr, DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    IS_VARLEN: tl.constexpr, BOTTOM_RIGHT: tl.constexpr,
    BOUNDED_LEFT: tl.constexpr, BOUNDED_RIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    HAS_DROPOUT: tl.constexpr, DOT_PRECISION: tl.constexpr, SPLIT: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    # One program per (sequence, KV head, row block, split) on a 1-D grid; the splits
    # of one (sequence, KV head) run side by side.
    if PDL:  # the kernel before this one may still run: its writes (q, k, v) first
        gdc_wait()
    pid = tl.program_id(0)
    split = pid % num_splits
    rest = pid // num_splits
    m_block = rest % num_m_blocks
    bhk = rest // num_m_blocks
    b = bhk // KV_HEADS
    hk = bhk % KV_HEADS
    q_start, k_start, seqlen_q, seqlen_k = sequence_bounds(
        CuSeqQ, CuSeqK, b, SQ, seqlen_k, IS_VARLEN)
    if SPLIT and IS_VARLEN:  # the splits follow the batch's keys (plan): the merge
        if split * split_keys >= seqlen_k:  # reads none past a sequence's own
            return
    off = diagonal_offset(seqlen_q, seqlen_k, BOTTOM_RIGHT)

    rows = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    h = hk * GROUP + rows // SQ  # the row's query head
    i = rows % SQ  # and its query
    row_ok = (rows < GROUP * SQ) & (i < seqlen_q)
    offs_m = tl.where(row_ok, i, seqlen_q)  # a row past the end is masked as such
    h = tl.where(rows < GROUP * SQ, h, hk * GROUP)

    # 64-bit base offsets: batch * stride and token * stride can pass 2**31.
    b64 = tl.cast(b, tl.int64)
    h64 = h.to(tl.int64)
    hk64 = tl.cast(hk, tl.int64)
    i64 = (q_start + offs_m).to(tl.int64)
    k_base = K + b64 * stride_kb + hk64 * stride_kh + tl.cast(k_start, tl.int64) * stride_kn
    v_base = V + b64 * stride_vb + hk64 * stride_vh + tl.cast(k_start, tl.int64) * stride_vn
    bias_rows = Bias  # a stand-in, never read, without a bias
    if HAS_BIAS:  # indexed by positions inside the sequence, also in varlen mode
        bias_rows = Bias + b64 * stride_bb + h64 * stride_bh + offs_m.to(tl.int64) * stride_bm
    slope = 0.0
    if HAS_ALIBI:
        slope = tl.load(Alibi + b64 * stride_ab + h64 * stride_ah, mask=row_ok, other=0.0)
        slope = slope[:, None]
    seed, rng_offset = philox_key(Rng, HAS_DROPOUT)
    bh = (b * H + h)[:, None]  # dropout's counter: the row's own head

    offs_dqk = tl.arange(0, BLOCK_DQK)
    offs_dv = tl.arange(0, BLOCK_DV)
    q = tl.load(Q + b64 * stride_qb + h64[:, None] * stride_qh + i64[:, None] * stride_qm
                + offs_dqk[None, :] * stride_qd,
                mask=row_ok[:, None] & (offs_dqk[None, :] < DQK), other=0.0)  # fmt: skip

    # The keys any row may see (queries 0 .. seqlen_q - 1), within this split's stretch.
    lo = split * split_keys
    hi = tl.minimum(lo + split_keys, seqlen_k)
    if BOUNDED_RIGHT:
        hi = tl.minimum(hi, seqlen_q - 1 + off + window_right + 1)
    if BOUNDED_LEFT:
        lo = tl.maximum(lo, (tl.maximum(off - window_left, 0) // BLOCK_N) * BLOCK_N)
    hi = tl.where(seqlen_q > 0, tl.maximum(hi, lo), lo)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    # Every tile masked: a memory-bound loop, where the mask's arithmetic is free. No
    # global positions (takes() leaves calls that have them to the tile kernels).
    acc, m_i, l_i = _fwd_tiles(
        acc, m_i, l_i, q, k_base, v_base, bias_rows,
        stride_kn, stride_kd, stride_vn, stride_vd, stride_bn,
        offs_m, offs_dqk, offs_dv, lo, hi,
        seqlen_q, seqlen_k, off, scale, softcap, slope, window_left, window_right,
        seed, rng_offset, bh, dropout_p, 0, 0,
        DQK, DV, BLOCK_M, BLOCK_N, BLOCK_DQK, BLOCK_DV, True, BOUNDED_LEFT,
        BOUNDED_RIGHT, HAS_BIAS, HAS_ALIBI, HAS_SOFTCAP, HAS_DROPOUT, DOT_PRECISION, True)

    out, lse = normalised(acc, m_i, l_i, dropout_p, HAS_DROPOUT)
    out_mask = row_ok[:, None] & (offs_dv[None, :] < DV)
    if SPLIT:  # (split, B, H, SQ, DV) and (split, B, H, SQ), contiguous, fp32
        flat = ((split * BATCH + b).to(tl.int64) * H + h64) * SQ + offs_m.to(tl.int64)
        tl.store(OutPart + flat[:, None] * DV + offs_dv[None, :], out, mask=out_mask)
        tl.store(LsePart + flat, lse, mask=row_ok)
    else:
        tl.store(Out + b64 * stride_ob + h64[:, None] * stride_oh + i64[:, None] * stride_om
                 + offs_dv[None, :] * stride_od, out.to(Out.dtype.element_ty), mask=out_mask)
        tl.store(Lse + b64 * stride_lb + h64 * stride_lh + i64 * stride_lm, lse, mask=row_ok)


@triton.jit
def _merge_kernel(
    OutPart, LsePart, Out, Lse, CuSeqQ, CuSeqK,
    stride_ob, stride_om, stride_oh, stride_od,
    stride_lb, stride_lh, stride_lm,
    H, SQ, num_splits, split_rows, split_keys,
    DV: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_DV: tl.constexpr,
    IS_VARLEN: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """out and lse of one query of one (sequence, head) from every split's partial
    results, all splits at once (a loop over them waits on each load in turn):
    lse = log sum_s exp(lse_s), out = sum_s exp(lse_s - lse) out_s. A split that saw no
    key has lse_s = -inf and weighs 0; a row no split saw gets out 0 and lse -inf.
    Packed sequences: a sequence's own splits alone, those its keys reach (the split
    kernel writes no other)."""
    if PDL:  # launched as the split-KV kernel ends: its partial results first
        gdc_wait()
    pid = tl.program_id(0)
    i = pid % SQ
    bh = pid // SQ
    b = bh // H
    h = bh % H
    q_start, _, seqlen_q, seqlen_k = sequence_bounds(CuSeqQ, CuSeqK, b, SQ, 0, IS_VARLEN)
    if i < seqlen_q:
        splits = tl.arange(0, BLOCK_S)
        split_ok = splits < num_splits
        if IS_VARLEN:
            split_ok &= splits * split_keys < seqlen_k
        rows = splits.to(tl.int64) * split_rows + (b.to(tl.int64) * H + h) * SQ + i
        lse_s = tl.load(LsePart + rows, mask=split_ok, other=float("-inf"))
        m = tl.max(lse_s, 0)
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        w = tl.exp(lse_s - m_safe)  # 0 for a split that saw no key
        offs_dv = tl.arange(0, BLOCK_DV)
        seen = split_ok & (lse_s > float("-inf"))
        out_s = tl.load(OutPart + rows[:, None] * DV + offs_dv[None, :],
                        mask=seen[:, None] & (offs_dv[None, :] < DV), other=0.0)  # fmt: skip
        total = tl.sum(w, 0)
        empty = total == 0.0
        out = tl.sum(w[:, None] * out_s, 0) / tl.where(empty, 1.0, total)
        lse = tl.where(empty, float("-inf"), m_safe + tl.log(tl.where(empty, 1.0, total)))
        row = tl.cast(q_start + i, tl.int64)
        b64 = tl.cast(b, tl.int64)
        tl.store(Out + b64 * stride_ob + h * stride_oh + row * stride_om + offs_dv * stride_od,
                 out.to(Out.dtype.element_ty), mask=offs_dv < DV)  # fmt: skip
        tl.store(Lse + b64 * stride_lb + h * stride_lh + row * stride_lm, lse)


# A launch aims at one wave: as many programs as fit on the SMs at once (shared memory
# decides, at most PROGRAMS_PER_SM), no split shorter than MIN_SPLIT_KEYS. The
# interpreter pretends to INTERPRETER_PROGRAMS, so that tests at small sizes split.
SHARED_MEMORY = 227 * 1024
PROGRAMS_PER_SM = 4
INTERPRETER_PROGRAMS = 16
# 64 rows a program (a GQA group's queries, e.g. 4 heads x 16) at D <= 128: 64 keys in
# three stages (96 KiB) let two programs share an SM, one's loads under the other's
# matmuls and softmax, and the keys split twice as far. H200, H32/8, GB/s of K and V
# (tools/ab.py, medians of 5), B8 Sq16 Sk32768 / B1 Sq16 Sk131072: this tile 3936 / 3685;
# 64 keys, 8 warps, four stages (one program an SM) 2983 / 3090; 64 keys, two stages
# 3124 / 2935; 32 keys, three stages 3231 / 2973; 128 keys, 8 warps, two stages 2654 /
# 2575; 64 keys, 8 warps, two stages 2485 / 2334.
WIDE_ROWS_TILE = tuning.Config(64, 64, 4, 3)
# Fewer rows (Sq=1: a GQA group's 4 queries, padded to 16) at D <= 128: the tile's keys,
# warps and stages (192 KiB, one program an SM). H200, GB/s, medians of 5, B64 Sk4096 /
# B8 Sk32768 / B1 Sk131072: this 4281 / 4294 / 3974; 64 keys at four stages 4263 / 4319
# / 3984, three 3836 / 4253 / 3929, two 3499 / 4271 / 3921; 32 keys at three 4258 / 4216
# / 3898; 128 keys at two 3808 / 3209 / 3152. None ahead by more than a point: kept.
FEW_ROWS_TILE = (128, 4, 3)
# Every call's last tile: one stage of 16 keys and 16 rows (49152 bytes at Dqk = Dv =
# 256 in float32, sm_90 compile), for GPUs with less shared memory (an A100 has 163
# KiB, consumer GPUs 99) where no larger tile fits.
SMALLEST_TILE = tuning.Config(16, 16, 4, 1)

try:  # on CUDA, launches go past JITFunction.run's per-call binding (hopper.Launcher)
    from . import hopper

    _launch_split_kv = hopper.Launcher(_split_kv_kernel)
    _launch_merge = hopper.Launcher(_merge_kernel)
except ImportError:  # a Triton without Gluon's Hopper API: Triton's own launches
    hopper = None


def configs(spec: AttentionSpec, interpreting: bool) -> tuple[tuning.Config, ...]:
    """Tiles for the split-KV kernel, largest first (a bias's tiles take shared memory
    too: tuning.launch_fitting moves down the list where one does not fit)."""
    if interpreting:
        return (tuning.Config(16, 16, 1, 1),)
    block_m = min(64, max(16, triton.next_power_of_2(spec.group * spec.seqlen_q)))
    if spec.dtype == torch.float32:  # twice the bytes a tile: H100, H32/8 D128, GB/s
        # at Sq=1 Sk=32768 / Sq=16: 32 keys 3 stages 2944 / 826, 64 keys 2 stages 2515 /
        # 711 (the tiles below, 4 stages, do not fit)
        if max(spec.head_dim_qk, spec.head_dim_v) > 128:  # 64 rows of Dqk 192 / Dv 128
            # asked 245760 bytes at 32 keys, 2 stages (sm_90 compile), D 256 262144
            tiles = (tuning.Config(block_m, 16, 4, 2), tuning.Config(min(block_m, 32), 16, 4, 2))
        else:
            tiles = (tuning.Config(block_m, 32, 4, 3), tuning.Config(block_m, 32, 4, 2))
        return tuple(dict.fromkeys(tiles + (SMALLEST_TILE,)))
    block_n = 64 if max(spec.head_dim_qk, spec.head_dim_v) > 128 else 128
    fitting = (tuning.Config(block_m, 64, 4, 3), tuning.Config(block_m, 32, 4, 2), SMALLEST_TILE)
    if block_n == 64:
        first = tuning.Config(block_m, 64, 4, 3)
    else:
        first = WIDE_ROWS_TILE if block_m == 64 else tuning.Config(block_m, *FEW_ROWS_TILE)
    return tuple(dict.fromkeys((first,) + fitting))


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _wave(spec: AttentionSpec, cfg: tuning.Config, device) -> tuple[int, int]:
    """(programs one wave holds, keys a split at least: MIN_SPLIT_KEYS, a tile under
    the interpreter)."""
    if device.type != "cuda":
        return INTERPRETER_PROGRAMS, cfg.block_n
    shared = (cfg.num_stages * cfg.block_n * (spec.head_dim_qk + spec.head_dim_v)
              * spec.dtype.itemsize)  # K's and V's rings
    per_sm = max(1, min(PROGRAMS_PER_SM, SHARED_MEMORY // shared))
    return per_sm * _sm_count(device.index), MIN_SPLIT_KEYS


def num_splits(spec: AttentionSpec, programs: int, cfg: tuning.Config, device) -> int:
    """How many stretches to split the keys into: as many as one wave of programs holds
    beside ``programs`` (sequence, KV head, row block) triples, each at least
    MIN_SPLIT_KEYS long (a tile under the interpreter)."""
    wave, min_keys = _wave(spec, cfg, device)
    return max(1, min(spec.seqlen_k // min_keys, wave // programs, MAX_SPLITS))


def packed_keys(spec: AttentionSpec, k: torch.Tensor) -> int:
    """`plan`'s tokens_k: packed sequences' keys in all, to the next power of 2 (a decode
    loop's growing caches keep one plan for many steps); 0 for dense batches."""
    return triton.next_power_of_2(k.shape[0]) if spec.varlen else 0


def plan(spec: AttentionSpec, cfg: tuning.Config, device: torch.device,
         tokens_k: int = 0) -> tuple[int, ...]:  # fmt: skip
    """(row blocks, programs per split, splits, keys per split) of a launch with tiles
    ``cfg`` (on CUDA worked out once per spec and tokens_k: `_plans`). Packed sequences (tokens_k:
    `packed_keys`) of different lengths: a split is the batch's keys spread over one
    wave, a power of 2, so that a long sequence takes many splits and a short one few
    (its others return at once), not the longest's keys over as many splits as the
    batch leaves room for, which gives a long sequence beside short ones few programs."""
    num_m_blocks = cdiv(spec.group * spec.seqlen_q, cfg.block_m)
    programs = spec.batch * spec.kv_heads * num_m_blocks
    if tokens_k:
        wave, min_keys = _wave(spec, cfg, device)
        per_key = spec.kv_heads * num_m_blocks  # programs that read a key
        split_keys = max(min_keys, cfg.block_n,
                         triton.next_power_of_2(cdiv(tokens_k * per_key, wave)),
                         triton.next_power_of_2(cdiv(spec.seqlen_k, MAX_SPLITS)))
    else:
        splits = num_splits(spec, programs, cfg, device)
        split_keys = cdiv(cdiv(spec.seqlen_k, splits), cfg.block_n) * cfg.block_n
    return num_m_blocks, programs, cdiv(spec.seqlen_k, split_keys), split_keys


def forward(spec: AttentionSpec, q, k, v, bias, alibi_slopes, rng_state, cu_seqlens_q,
            cu_seqlens_k, out, lse) -> None:  # fmt: skip
    """Fills out (q's layout, Dv) and lse (float32) of a call `takes` accepted."""
    if hopper is None or q.device.type != "cuda":
        return _forward_by_triton(spec, q, k, v, bias, alibi_slopes, rng_state,
                                  cu_seqlens_q, cu_seqlens_k, out, lse)  # fmt: skip
    # A decode step's GPU time is a few hundred µs: the host's before the launch shows.
    # So the launch is planned once per spec (`_plans`) and, where a call repeats the
    # last's tensors, launched from the arguments prepared then (hopper.Launcher).
    level = _LEVEL.get(spec, 0)
    tokens_k = packed_keys(spec, k)
    while True:
        split_plan, merge_plan = _plans(spec, q.device.index, level, tokens_k)
        try:
            _launch_on_cuda(spec, split_plan, merge_plan, q, k, v, bias, alibi_slopes,
                            rng_state, cu_seqlens_q, cu_seqlens_k, out, lse)  # fmt: skip
            return
        except OutOfResources:  # a bias's tiles too: the next smaller tiles
            if level + 1 == len(configs(spec, False)):
                raise
            if len(_LEVEL) >= 4096:  # many distinct shapes: start over
                _LEVEL.clear()
            level = _LEVEL[spec] = level + 1


_LEVEL: dict[AttentionSpec, int] = {}  # per spec, the first of `configs` that fits


def _make_plans(spec: AttentionSpec, device_index: int, level: int, tokens_k: int):
    """(the split-KV kernel's hopper.Plan, the merge's or None) with the tiles of
    ``configs(spec)[level]``; cached per spec, device, level and `packed_keys`
    (`_plans`)."""
    cfg = configs(spec, False)[level]
    num_m_blocks, programs, splits, split_keys = plan(spec, cfg, torch.device("cuda", device_index),
                                                      tokens_k)  # fmt: skip
    switches = feature_switches(spec, "decode")
    pdl = PDL and torch.cuda.get_device_capability(device_index)[0] >= 9
    split_plan = hopper.Plan(
        programs * splits, (num_m_blocks, splits, split_keys),
        dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, SPLIT=splits > 1, PDL=pdl,
             launch_pdl=pdl, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **switches))
    merge_plan = None
    if splits > 1:
        merge_plan = hopper.Plan(
            spec.batch * spec.heads * spec.seqlen_q, (splits,),
            dict(DV=spec.head_dim_v, BLOCK_S=triton.next_power_of_2(splits),
                 BLOCK_DV=switches["BLOCK_DV"], IS_VARLEN=spec.varlen, PDL=pdl,
                 launch_pdl=pdl, num_warps=4 if splits <= 32 else 8))  # fmt: skip
    return split_plan, merge_plan


_plans = hopper.plan_cache(_make_plans) if hopper is not None else None  # forget_plans empties


def _launch_on_cuda(spec, split_plan, merge_plan, q, k, v, bias, alibi_slopes, rng_state,
                    cu_seqlens_q, cu_seqlens_k, out, lse) -> None:  # fmt: skip
    num_m_blocks, splits, split_keys = split_plan.counts
    out_part, lse_part = _partials(spec, splits, lse)
    key = hopper.tensor_key
    call = (split_plan, key(q), key(k), key(v), key(out), key(lse), out_part.data_ptr(),
            lse_part.data_ptr(), key(bias), key(alibi_slopes), key(rng_state),
            key(cu_seqlens_q), key(cu_seqlens_k))  # fmt: skip
    if not _launch_split_kv.launch_prepared(split_plan.programs, call):
        tensors = (q, k, v, out, lse, out_part, lse_part, bias, alibi_slopes, rng_state,
                   cu_seqlens_q, cu_seqlens_k)  # fmt: skip
        ints = _split_ints(spec, q, k, v, out, lse, bias, alibi_slopes, split_plan.counts)
        kinds = tuple(None if t is None else (t.dtype, hopper.aligned(t)) for t in tensors)
        _launch_split_kv((split_plan.programs,), *tensors, *ints, *_floats(spec),
                         variant=(split_plan, ints, kinds), prepare=call,
                         **split_plan.constexprs)  # fmt: skip
    if merge_plan is None:
        return
    call = (merge_plan, out_part.data_ptr(), lse_part.data_ptr(), key(out), key(lse),
            key(cu_seqlens_q), key(cu_seqlens_k))  # fmt: skip
    if not _launch_merge.launch_prepared(merge_plan.programs, call):
        tensors = (out_part, lse_part, out, lse, cu_seqlens_q, cu_seqlens_k)
        ints = _merge_ints(spec, out, lse, splits, split_keys)
        kinds = tuple(None if t is None else (t.dtype, hopper.aligned(t)) for t in tensors)
        _launch_merge((merge_plan.programs,), *tensors, *ints, variant=(merge_plan, ints, kinds),
                      prepare=call, **merge_plan.constexprs)  # fmt: skip


def _partials(spec: AttentionSpec, splits: int, lse: torch.Tensor):
    """The splits' partial outputs (split, B, H, Sq, Dv) and lse (split, B, H, Sq), fp32;
    with one split lse stands in for both, never written."""
    if splits == 1:
        return lse, lse
    shape = (splits, spec.batch, spec.heads, spec.seqlen_q)
    return (torch.empty((*shape, spec.head_dim_v), dtype=torch.float32, device=lse.device),
            torch.empty(shape, dtype=torch.float32, device=lse.device))  # fmt: skip


def _split_ints(spec, q, k, v, out, lse, bias, alibi_slopes, counts) -> tuple:
    """The split-KV kernel's int arguments: strides, sizes, counts."""
    return (*dense_strides(q, spec.varlen), *dense_strides(k, spec.varlen),
            *dense_strides(v, spec.varlen), *dense_strides(out, spec.varlen),
            *lse_strides(lse, spec.varlen), *bias_strides(bias, spec),
            *alibi_strides(alibi_slopes),
            spec.batch, spec.heads, spec.kv_heads, spec.group, spec.seqlen_q, spec.seqlen_k,
            *counts)  # fmt: skip


def _floats(spec) -> tuple:
    return (spec.scale, spec.softcap, spec.window_left, spec.window_right, spec.dropout_p)


def _merge_ints(spec, out, lse, splits, split_keys) -> tuple:
    return (*dense_strides(out, spec.varlen), *lse_strides(lse, spec.varlen), spec.heads,
            spec.seqlen_q, splits, spec.batch * spec.heads * spec.seqlen_q, split_keys)


def _forward_by_triton(spec: AttentionSpec, q, k, v, bias, alibi_slopes, rng_state,
                       cu_seqlens_q, cu_seqlens_k, out, lse) -> None:  # fmt: skip
    """`forward` through Triton's own launches: the interpreter, or no Gluon API."""
    switches = feature_switches(spec, "decode")
    interpreting = q.device.type == "cpu"
    parts = {}

    def launch(cfg: tuning.Config):
        num_m_blocks, programs, splits, split_keys = plan(spec, cfg, q.device,
                                                          packed_keys(spec, k))
        out_part, lse_part = _partials(spec, splits, lse)
        _split_kv_kernel[(programs * splits,)](
            q, k, v, out, lse, out_part, lse_part, bias, alibi_slopes, rng_state,
            cu_seqlens_q, cu_seqlens_k,
            *_split_ints(spec, q, k, v, out, lse, bias, alibi_slopes,
                         (num_m_blocks, splits, split_keys)),
            *_floats(spec), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, SPLIT=splits > 1,
            PDL=False, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **switches,
        )  # fmt: skip
        parts.update(splits=splits, split_keys=split_keys, out=out_part, lse=lse_part)

    tuning.launch_fitting("decode", spec, configs(spec, interpreting), launch)
    splits = parts["splits"]
    if splits > 1:
        _merge_kernel[(spec.batch * spec.heads * spec.seqlen_q,)](
            parts["out"], parts["lse"], out, lse, cu_seqlens_q, cu_seqlens_k,
            *_merge_ints(spec, out, lse, splits, parts["split_keys"]),
            DV=spec.head_dim_v, BLOCK_S=triton.next_power_of_2(splits),
            BLOCK_DV=switches["BLOCK_DV"], IS_VARLEN=spec.varlen, PDL=False,
            num_warps=1 if interpreting else (4 if splits <= 32 else 8),
        )  # fmt: skip
