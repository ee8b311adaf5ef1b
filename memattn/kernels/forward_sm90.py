"""Hopper forward kernel in Gluon, warp-specialised (FlashAttention-3's structure).

What the tile-level kernel (forward.py) cannot express: Triton's compiler runs every
warp of a program in lockstep through load, matmul and softmax, so the tensor cores
idle during each softmax. Here a program is a load warp and two or three softmax
warpgroups of 64 query rows each (a 128- or 192-row query block, `forward` says which):
- the load warp fetches Q, then K and V tiles by TMA into a two-stage ring of shared
  memory, each slot refilled as soon as every consumer releases it (mbarriers);
- each softmax warpgroup keeps S(t) = Q·K(t)ᵀ and O += P(t-1)·V(t-1) in flight
  together as asynchronous wgmmas and computes the softmax of S(t) while
  P(t-1)·V(t-1) runs; at Dqk <= 128 on dense batches they issue their wgmmas in
  turns (named barriers), so that one's softmax overlaps the others' matmuls; else
  they drift apart freely, to the same end.
Programs run persistent: one per SM at most walks the query blocks in strides (under a
mask in pairs of blocks of equal work), and with two Q buffers (where shared memory
holds them) each block's Q and first tiles load while the previous block ends
(`_fwd_sm90_kernel`; at D=256 masked calls run a program per pair; causal heads of
many blocks go rank by rank, at D=64 as the host dealt them to the persistent programs
(hopper.rank_table), at D=256 a program per block). The output leaves
by a TMA store, which clips rows past Sq; TMA loads zero-fill past S. Packed sequences
(varlen) are one batch of all tokens to TMA, their blocks handed out dynamically
sequence by sequence (hopper.packed_block) or, where the sequences share a bias plane
under a right bound, by position across them (hopper.packed_position_block), blocks
past a sequence's end skipped by both partitions; loads start at each sequence's first
token, and O leaves by masked pointer stores (a TMA store would clip at the packed
tensor's end, not the sequence's).

A bias comes by TMA: the load warp puts each key tile's BLOCK_M x BLOCK_N bias tile in
a ring beside K's, each warpgroup reads its rows. A bias constant along queries (key
padding) instead comes as one row per key tile, fp32 divided by the scale from
hopper.bias_row_scores, by TMA beside its K tile (on K's barrier): each warpgroup's S
wgmma starts from it, so the softmax is the unbiased one. (Loaded by pointer, its latency
showed wherever the row changed from one query block to the next: a row per head ran
at 310 TFLOP/s against 465 for one per batch.) Dropout's keep bits come from
hopper.dropout_keep, drawn while the warpgroup's matmuls run; P·V takes the kept
probabilities and the output the 1 / (1 - p).

Covers bf16/fp16, q·k head dims 64, 128, 192 and 256 with V's 64, 128 or 256, any pair
(192/128 as in MLA: O leaves through Q's buffer, as at 256), GQA, causal masks either
way, sliding windows, ALiBi, softcap (not with a key row, which S starts from before the
cap), a bias (TMA tiles, or a key row; at 192/128 its tiles take 64-key tiles,
`key_tile`), dropout, dense and packed batches, where shared memory holds their buffers
(`buffers`; dispatch.py says which); every other call runs forward.py (fp32 too).
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

from ..spec import AttentionSpec
from . import hopper, shares_sms
from .common import (
    LN2,
    LOG2E,
    alibi_distance,
    alibi_strides,
    cdiv,
    key_range,
    packed_items,
    philox_key,
    tanh,
    visible,
)

ROWS = gl.constexpr(64)  # query rows per softmax warpgroup
# Query rows per program: two softmax warpgroups (128), or three (192) for unmasked
# calls at D=64 with Sq >= 2048. There the exp2s weigh as much as the matmuls (one MUFU
# op per score against 4·64 flops), and a third warpgroup gives the tensor cores two
# others' matmuls to run while one computes its softmax (FA3 takes 192 rows at D=64):
# 440 -> 465 TFLOP/s at S=4096, 464 -> 505 at S=16384. At Sq=1024 a sixth block of
# 192 rows is two-thirds padding (384 -> 367). Under masks (causal, windows) the
# diagonal tiles' mask arithmetic spills at three warpgroups' 160 registers (6-16
# values there, not in the unmasked loop), and the blocks' work is uneven: causal
# S16384 445-459 -> 490-493, S8192 421-445 -> 435-439 (after the masks by query
# bounds, tools/ab.py --rounds 4 in three calls: 430 / 438 / 440 -> 444 / 454 / 449),
# S4096 419-423 -> 381-385 (419 -> 408), S2048 376 -> 243; so from
# MIN_SEQLEN_Q_D64_MASKED. Tools set BLOCK_M_D64 to A/B.
BLOCK_M = 128
BLOCK_M_D64 = 192
MIN_SEQLEN_Q_D64 = 2048
MIN_SEQLEN_Q_D64_MASKED = 8192
REGS_3 = gl.constexpr(160)  # per thread, for three softmax warpgroups beside the load warp
# Under a right bound (causal, windows) a 64-row warpgroup of a 192-row block sees fewer
# keys than the block's last row: each warpgroup masks the tiles its own diagonal
# crosses, not the block's two or three, and skips those past its last row (it passes
# their turns and releases their slots). Tools set OWN_KEY_RANGES to A/B, then call
# hopper.forget_plans().
OWN_KEY_RANGES = True
# At D=256 (O: 128 accumulators a thread, against a 64-key tile's 32 scores) a row's
# running max moves only when a tile's max passes it by more than this (log2 units): P
# then stays below 2^8, exact all the same (l and O are kept against the same max), and
# O's rescale, a multiply an accumulator, is skipped at the tiles where no row of the
# warpgroup moved (FA4's Blackwell forward rescales so). Finding that out takes a
# reduction across the warpgroup's warps through shared memory, which cost more than
# the multiplies it saved at D=64 and 256/128 (H100: S16384 D64 499-523 -> 463, 256/128
# S4096 causal -3 %) and as much at D=128. 0: O rescaled at every tile.
RESCALE_THRESHOLD = 8.0
LAZY_RESCALE_MIN_COLUMNS = 4  # O's columns per key of a tile from which it applies
# The softmax warpgroups issue their wgmmas in turns (FA3's and FA4's warp scheduler
# barriers: a named barrier each, waited on before a warpgroup's issues and handed to
# the next after), on dense batches up to this head dim (H100: +1.6 % at D 64/128,
# +2-4 % at Dqk=192 / Dv=128, -2 % at D=256 and on packed batches); 0: never.
TURNS_MAX_HEAD_DIM = 192
TURN_BARRIER = gl.constexpr(8)  # the first warpgroup's; Gluon's partitions use the low ids
# Packed sequences' items go to the softmax warpgroups through a ring of INFO_STAGES
# slots of INFO_FIELDS int32 (_hand_item, _taken_item): 128 bytes.
INFO_STAGES = gl.constexpr(4)
INFO_FIELDS = gl.constexpr(8)
# The tables below go by tile_dim: the q·k head dim (V's may be narrower: 192/128 as in
# MLA, 128/64, 256/128), or 256 where V is 256 columns wide (64/256, 128/256, 192/256):
# O's 128 registers a thread take D=256's 64-key tiles.
# Keys per tile. At D=256 a warpgroup's O takes 128 registers a thread, so S takes 64
# keys (32 more), and K and V tiles are 32 KiB each, as at D=128.
BLOCK_N = {64: 128, 128: 128, 192: 128, 256: 64}
# Beside a bias's tiles: at 192 a ring of 128-key K tiles (96 KiB) leaves no room for
# one, so the keys go 64 a tile there, as at D=256 (`key_tile`).
BLOCK_N_WITH_BIAS = {64: 128, 128: 128, 192: 64, 256: 64}
STAGES = 2  # K and V each: 2 x 32 KiB at D=128 and 256, plus Q's and O's 32 KiB each
# At D=256 Q's and O's buffers would be 64 KiB each, and at 192/128 K's ring is 96 KiB:
# O goes out through Q's buffer (each warpgroup's own rows), whose next fill then waits
# for the store to have read them; where O's tile fits there (o_in_q).
O_IN_Q = {64: False, 128: False, 192: True, 256: True}
# Where O's own buffer leaves no room beside a bias's tiles (at D=128 with dropout's
# scratch), O goes out through Q's buffer instead (`buffers`); Q has one slot there
# either way. A second bias slot in those 32 KiB did not pay (PERFORMANCE.md).
O_IN_Q_WITH_BIAS = {64: False, 128: True, 192: True, 256: True}
# A bias's tiles (ROWS x BLOCK_N per warpgroup) take what shared memory is left, up to
# this many slots: two at D=64 (one at 64/128 beside dropout's scratch) and at 192 (its
# 64-key tiles: 160 KiB in all), one at 128 (224 KiB) and 256 (208 KiB).
BIAS_STAGES = {64: 2, 128: 1, 192: 2, 256: 1}
# Programs run persistent (PERSISTENT): one per SM at most, each walking query blocks
# in strides (hopper.work_item), under a mask (FOLD) in pairs of blocks whose work adds
# up to the same, as static strides need. Masked calls at D 64/128 gained from it over
# a program per pair (S=1024 causal, GPU alone: 280 -> 302 TFLOP/s at D=64, 392 ->
# 424 at D=128). At D=256 they keep that schedule (MASKED_PERSISTENT), a program per
# pair from MIN_BLOCKS_TO_FOLD blocks on and per block below: a block there waits for
# the previous one's O to leave Q's buffer (O_IN_Q), and persistent lost (S=512 causal
# 308 -> 280, S=2048 527 -> 501; S=512 folded 279 against 307 unfolded). At Dqk=192
# (O in Q's buffer too, but 128 columns of it) persistent paid, with the turns (H100,
# tools/ab.py --rounds 5, Dv=128, H10: causal S4096 578 -> 609, S8192 617 -> 643,
# S1024 399 -> 428; the turns alone 592, 635, 416; the bench's H16 row unchanged).
# Tools set these to A/B, then call hopper.forget_plans().
FOLD = "masked"
PERSISTENT = True
MASKED_PERSISTENT = {64: True, 128: True, 192: True, 256: False}
MIN_BLOCKS_TO_FOLD = {64: 0, 128: 0, 192: 5, 256: 5}
# Under a right bound alone (causal: a block's work falls with its rank), heads of at
# least MIN_BLOCKS_BY_RANK query blocks go rank by rank instead, the (batch, head)s in
# groups of at least MASKED_BY_RANK_BLOCKS blocks (hopper.rank_major_item, the masked
# D=128 backward's order), so that the heaviest blocks go first and the grid ends on
# short ones, where pairs in static strides end as unevenly as their count (D64 S16384
# causal: 1376 pairs, 10.4 a program, 11 the most). At D=256 (no persistent programs)
# a program per block takes them, the hardware handing them out: H200, tools/ab.py,
# folded -> groups of 256 blocks (medians of 5): S16384 causal 662 -> 677 TFLOP/s; not
# at S8192 (641 -> 640) or S4096 (597 -> 591, medians of 3); larger groups lost (512 /
# 1024 blocks: 666 / 657: K and V shared less in L2). Where masked programs are
# persistent (D=64; RANK_TABLE), they take the blocks the host dealt each
# (hopper.rank_table: a list schedule by key tiles, as if each took the next as it
# freed), keeping the overlap of a block's start with the last one's end that a program
# per block gives up. H200, medians of 3-5: folded -> a program per block, S16384
# causal 477 -> 480, S8192 454 -> 456; a program per block -> the table (another day),
# S16384 481 -> 491 (two calls), S8192 462 -> 477. Off at D=128: a program per block
# lost (S4096 causal 570 -> 528, S8192 596 -> 584), the table paid nothing (S4096 572
# -> 564, S8192 594 -> 594, S16384 607 -> 608; S1024 445 -> 459 once), nor with a
# block's cost in the deal counted 2 or 4 key tiles more (569 / 562, 595 / 590, 610 /
# 606): the tail the model (tools/grid_model.py) puts at 3 % is not there. Up to
# RANK_TABLE_ITEMS blocks (the host deals them once a plan; past that many waves the
# tail is small); where a CUDA graph captures a call before its table is on the device
# (hopper.schedule_on_device), the call takes the folded strides. 0: off. Tools set
# these to A/B, then call hopper.forget_plans().
MASKED_BY_RANK_BLOCKS = {64: 256, 128: 0, 192: 0, 256: 256}
MIN_BLOCKS_BY_RANK = {64: 40, 128: 0, 192: 0, 256: 96}
RANK_TABLE = True  # False: a program per block wherever the rank order is on
RANK_TABLE_ITEMS = 1 << 16
# A bias of tiles shared over the batch, a plane per head ((1, H, Sq, Sk): relative
# positions), is read batch after batch within a head (hopper.query_block's
# BATCH_INNER): programs side by side then read each of its tiles together, from L2,
# where head after head each batch read the whole bias from memory again (B4 S4096
# H16: 2 GiB, as much as a full (B, H, Sq, Sk) bias). H100, tools/ab.py (head after
# head -> batch inner; main kernel per call, torch.profiler; bench timing, medians of
# 9): 1252 -> 1064 us, 439 -> 452 TFLOP/s; causal 674 -> 612 us, 411 -> 448. Tools set
# it to A/B, then call hopper.forget_plans().
BIAS_BATCH_INNER = True
# Packed sequences that share a bias plane (bias batch 1, indexed by positions inside
# each sequence) under a right bound: items go by position rather than sequence by
# sequence (hopper.packed_position_block), in groups of this many heads, so that the
# sequences' blocks at one position read its bias tiles together from L2; up to
# hopper.POSITION_SEQS sequences. Sequence by sequence each read its own copy from
# memory: the bench's causal documents with a (1, H, 4000, 4000) bias read 1.03 GB
# where the same documents with a (1, 1, 4000, 4000) one read 361 MB (H100, base
# clocks; 330 against 373 TFLOP/s). Four heads: their K and V (32 MB at 16k tokens,
# D=128) stay in L2 from one position to the next (eight lost at 16 documents of 1024
# and 4 of 4096). 0: sequence by sequence. Tools set it to A/B, then call
# hopper.forget_plans().
POSITION_HEADS = 4
# Q's buffers: two where shared memory holds them, so that a program's next query
# block loads while this one runs. Tools set MAX_Q_STAGES to A/B.
MAX_Q_STAGES = 2
# Packed sequences: a softmax warpgroup whose rows all lie past its sequence (a last
# block of at most BLOCK_M - ROWS rows) does no work and passes its tiles on, so the
# other warpgroups' wgmmas have the tensor cores alone (_softmax_block's IDLE_ROWS).
# H100, tools/ab.py --variants default,no_idle --rounds 3: the bench's documents 549 ->
# 565 TFLOP/s, causal 483 -> 497. Dense lengths that end so lost (B4 S4000: D=128 593
# -> 580, D=256 663 -> 653: the check's code, D=256's 16 bytes of spills). Tools set it
# to A/B, then call hopper.forget_plans().
IDLE_WARPGROUPS = True
# Without a mask's bounds, a dense call whose keys fill every tile (Sk a multiple of
# BLOCK_N) needs no mask: where on (by the tiles' head dim), its step loop is compiled
# without the mask's code (80 of the D=128 loop's 545 instructions). H200, tools/ab.py
# --rounds 5, mask code -> none: D128 S16384 632 -> 641, S4096 617 -> 632, S1024 579 ->
# 583; but D64 S16384 511 -> 483 and D256 S16384 720 -> 683 (ptxas schedules the
# loop without the branch otherwise). So the loops of features (a bias, ALiBi,
# dropout, softcap) and of another V width, each scheduled apart and not measured
# without it, keep it. Tools set it to A/B, then call hopper.forget_plans().
FULL_TILES = {64: False, 128: True, 192: False, 256: False}
# Shared memory kept clear for the compiler's scratch of dropout's keep-bit exchange
# (hopper.dropout_keep's convert_layout): 7.7-8.3 KiB in sm_90 compiles (D=128 with
# bias tiles 204,928 bytes in all, 192/128 221,280, D=256 with bias tiles 221,312, of
# the 232,448 a block may take). Tools set it to A/B, then call hopper.forget_plans().
DROPOUT_SCRATCH = 12 * 1024
SHARED_MEMORY = 227 * 1024  # an H100 block's opt-in maximum


@gluon.jit
def _load_partition(
    loads, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
    Q_STAGES: gl.constexpr, FOLD: gl.constexpr, TABLE: gl.constexpr, QK_SPLIT: gl.constexpr,
    HAS_BIAS: gl.constexpr, BIAS_STAGES: gl.constexpr, BIAS_ROW: gl.constexpr,
    IS_VARLEN: gl.constexpr, BOTTOM_RIGHT: gl.constexpr, BOUNDED_LEFT: gl.constexpr,
    BOUNDED_RIGHT: gl.constexpr, BATCH_INNER: gl.constexpr, POSITION_HEADS: gl.constexpr,
):  # fmt: skip
    """One warp: each query block's Q into its ring, then its K (with a bias row), bias
    and V tiles into theirs as slots come free. The rings' index runs on across the
    program's query blocks, so the next block's first tiles load while this one's last
    are still in use. With QK_SPLIT, Q's and K's last QK_SPLIT columns go to buffers of
    their own (q2, k2) on the same barriers. Packed sequences (IS_VARLEN): the items
    come from a dynamic schedule, the first the program's own, each next one from
    ``Tickets``; this warp hands each item with work to the softmax warpgroups through
    ``info_smem``, then one past the last item. ``loads``: its runtime arguments
    (_fwd_sm90_kernel builds the tuple)."""
    (q_desc, k_desc, v_desc, bias_desc, q2_desc, k2_desc, q_smem, k_smem, v_smem, bias_smem,
     q2_smem, k2_smem, q_ready, q_empty, k_ready, v_ready, bias_ready, k_empty, v_empty,
     bias_empty, info_smem, info_ready, info_empty, Tickets, Schedule, pid, programs,
     batches, H, GROUP, bias_batches, bias_heads, num_m_blocks, n_items, CuSeqQ, CuSeqK,
     seqlen_q, seqlen_k, window_left, window_right) = loads
    kv = 0  # key tiles loaded so far
    qi = 0  # query blocks loaded so far: the Q ring's index
    if IS_VARLEN:
        g = pid
        while g < n_items:  # n_items: the grid's items
            following = programs + hopper.take_ticket(Tickets)  # its latency hides here
            if POSITION_HEADS > 0:
                (b, h, hk, start_m, q_start, k_start, seqlen_q_b, seqlen_k_b, _, lo, _, _,
                 n_tiles) = hopper.packed_position_block(
                    g, H, GROUP, num_m_blocks, CuSeqQ, CuSeqK, window_left, window_right,
                    BLOCK_M, BLOCK_N, BOTTOM_RIGHT, BOUNDED_LEFT, BOUNDED_RIGHT,
                    POSITION_HEADS)  # fmt: skip
            else:
                (b, h, hk, start_m, q_start, k_start, seqlen_q_b, seqlen_k_b, _, lo, _, _,
                 n_tiles) = hopper.packed_block(
                    g, H, GROUP, num_m_blocks, CuSeqQ, CuSeqK, window_left, window_right,
                    BLOCK_M, BLOCK_N, BOTTOM_RIGHT, BOUNDED_LEFT, BOUNDED_RIGHT)  # fmt: skip
            if start_m < seqlen_q_b:  # else past its sequence's blocks: nothing to do
                _hand_item(info_smem, info_ready, info_empty, qi, g, b, h, start_m, q_start,
                           seqlen_q_b, seqlen_k_b)
                kv, qi = _load_block(loads, b, h, hk, start_m, q_start, k_start, lo, n_tiles,
                                     kv, qi, BLOCK_M, BLOCK_N, STAGES, Q_STAGES, QK_SPLIT,
                                     HAS_BIAS, BIAS_STAGES, BIAS_ROW, IS_VARLEN)  # fmt: skip
            elif POSITION_HEADS > 0:  # past the grid's last item: so is every later ticket
                following = n_items
            g = following
        _hand_item(info_smem, info_ready, info_empty, qi, n_items, 0, 0, 0, 0, 0, 0)
    else:
        for j in range(n_items):
            (b, h, hk, start_m, q_start, k_start, _, _, _, lo, _, _,
             n_tiles) = hopper.query_block(
                pid, j, programs, H, GROUP, num_m_blocks, seqlen_q, seqlen_k, window_left,
                window_right, BLOCK_M, BLOCK_N, FOLD, BOTTOM_RIGHT, BOUNDED_LEFT,
                BOUNDED_RIGHT, BATCH_INNER, batches, Schedule, TABLE)  # fmt: skip
            kv, qi = _load_block(loads, b, h, hk, start_m, q_start, k_start, lo, n_tiles, kv,
                                 qi, BLOCK_M, BLOCK_N, STAGES, Q_STAGES, QK_SPLIT, HAS_BIAS,
                                 BIAS_STAGES, BIAS_ROW, IS_VARLEN)  # fmt: skip


@gluon.jit
def _load_block(
    loads, b, h, hk, start_m, q_start, k_start, lo, n_tiles, kv, qi, BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr, STAGES: gl.constexpr, Q_STAGES: gl.constexpr,
    QK_SPLIT: gl.constexpr, HAS_BIAS: gl.constexpr, BIAS_STAGES: gl.constexpr,
    BIAS_ROW: gl.constexpr, IS_VARLEN: gl.constexpr,
):  # fmt: skip
    """_load_partition's work for one query block: its Q, then its key tiles; returns
    the rings' running indices (key tiles, query blocks) after it."""
    (q_desc, k_desc, v_desc, bias_desc, q2_desc, k2_desc, q_smem, k_smem, v_smem, bias_smem,
     q2_smem, k2_smem, q_ready, q_empty, k_ready, v_ready, bias_ready, k_empty, v_empty,
     bias_empty, _, _, _, _, _, _, _, _, _, _, bias_batches, bias_heads, _, _, _, _, _,
     _, _, _) = loads
    split_col: gl.constexpr = q_desc.block_type.shape[3]  # where Q's and K's split starts
    q_bytes: gl.constexpr = (q_desc.block_type.nbytes + q2_desc.block_type.nbytes
                             if QK_SPLIT > 0 else q_desc.block_type.nbytes)
    PARTS: gl.constexpr = BLOCK_M // ROWS
    b_tma = 0 if IS_VARLEN else b  # packed sequences: one batch of all tokens
    # A Q slot is free once every warpgroup has its block's last S (or, with O in
    # Q's buffer, has stored O from it).
    slot = hopper.claim(q_ready, q_empty, qi, PARTS * q_bytes, Q_STAGES)
    for i in gl.static_range(PARTS):
        row = q_start + start_m + i * ROWS
        tma.async_copy_global_to_shared(q_desc, [b_tma, h, row, 0], q_ready.index(slot),
                                        q_smem.index(slot * PARTS + i))
        if QK_SPLIT > 0:
            tma.async_copy_global_to_shared(q2_desc, [b_tma, h, row, split_col],
                                            q_ready.index(slot),
                                            q2_smem.index(slot * PARTS + i))
    bias_b = b % bias_batches  # 0 where the bias broadcasts over batches
    bias_h = h % bias_heads
    # a bias row's keys come with K's, on its barrier, as K's split columns do
    k_bytes: gl.constexpr = k_desc.block_type.nbytes + (
        bias_desc.block_type.nbytes if BIAS_ROW else 0) + (
        k2_desc.block_type.nbytes if QK_SPLIT > 0 else 0)
    for t in range(n_tiles):
        slot = hopper.claim(k_ready, k_empty, kv + t, k_bytes, STAGES)
        key = k_start + lo + t * BLOCK_N
        tma.async_copy_global_to_shared(k_desc, [b_tma, hk, key, 0], k_ready.index(slot),
                                        k_smem.index(slot))
        if QK_SPLIT > 0:
            tma.async_copy_global_to_shared(k2_desc, [b_tma, hk, key, split_col],
                                            k_ready.index(slot), k2_smem.index(slot))
        if BIAS_ROW:  # indexed by positions inside the sequence
            tma.async_copy_global_to_shared(
                bias_desc, [bias_b, bias_h, lo + t * BLOCK_N], k_ready.index(slot),
                bias_smem.index(slot))
        if HAS_BIAS:  # one ROWS x BLOCK_N tile per warpgroup
            slot = hopper.claim(bias_ready, bias_empty, kv + t,
                                PARTS * bias_desc.block_type.nbytes, BIAS_STAGES)
            for i in gl.static_range(PARTS):
                tma.async_copy_global_to_shared(
                    bias_desc, [bias_b, bias_h, start_m + i * ROWS, lo + t * BLOCK_N],
                    bias_ready.index(slot), bias_smem.index(slot * PARTS + i))
        slot = hopper.claim(v_ready, v_empty, kv + t, v_desc.block_type.nbytes, STAGES)
        tma.async_copy_global_to_shared(
            v_desc, [b_tma, hk, k_start + lo + t * BLOCK_N, 0], v_ready.index(slot),
            v_smem.index(slot))
    kv += n_tiles
    qi += 1
    return kv, qi


@gluon.jit
def _hand_item(info_smem, info_ready, info_empty, i, g, b, h, start_m, q_start, seqlen_q,
               seqlen_k):  # fmt: skip
    """Load warp: the i-th item with work (grid item g) to the softmax warpgroups, once
    they have read the one INFO_STAGES before it; g = the grid's item count: no more."""
    STAGES: gl.constexpr = info_smem.shape[0]
    slot = i % STAGES
    mbarrier.wait(info_empty.index(slot), ((i // STAGES) & 1) ^ 1, pred=i >= STAGES)
    layout: gl.constexpr = gl.BlockedLayout([INFO_FIELDS], [32], [gl.num_warps()], [0])
    field = gl.arange(0, INFO_FIELDS, layout=layout)
    values = (gl.where(field == 0, g, 0) + gl.where(field == 1, b, 0)
              + gl.where(field == 2, h, 0) + gl.where(field == 3, start_m, 0)
              + gl.where(field == 4, q_start, 0) + gl.where(field == 5, seqlen_q, 0)
              + gl.where(field == 6, seqlen_k, 0))
    info_smem.index(slot).store(values)
    gl.thread_barrier()  # every lane's store before the arrive (one thread's release)
    mbarrier.arrive(info_ready.index(slot))


@gluon.jit
def _taken_item(info_smem, info_ready, info_empty, i):
    """Softmax warpgroup: the i-th item _hand_item handed, (g, b, h, start_m, q_start,
    seqlen_q, seqlen_k); its slot released once read."""
    STAGES: gl.constexpr = info_smem.shape[0]
    slot = hopper.arrived(info_ready, i, STAGES)
    layout: gl.constexpr = gl.BlockedLayout([INFO_FIELDS], [32], [gl.num_warps()], [0])
    field = gl.arange(0, INFO_FIELDS, layout=layout)
    values = info_smem.index(slot).load(layout)
    mbarrier.arrive(info_empty.index(slot))
    return (gl.sum(gl.where(field == 0, values, 0), axis=0),
            gl.sum(gl.where(field == 1, values, 0), axis=0),
            gl.sum(gl.where(field == 2, values, 0), axis=0),
            gl.sum(gl.where(field == 3, values, 0), axis=0),
            gl.sum(gl.where(field == 4, values, 0), axis=0),
            gl.sum(gl.where(field == 5, values, 0), axis=0),
            gl.sum(gl.where(field == 6, values, 0), axis=0))


@gluon.jit
def _softmax_tile(
    s, m_i, l_i, start_n, offs_m, bias, slope, seqlen_k, off, window_left, window_right,
    needs_mask, scale_log2, softcap, BLOCK_N: gl.constexpr, HAS_BIAS: gl.constexpr,
    HAS_ALIBI: gl.constexpr, BOUNDED_LEFT: gl.constexpr, BOUNDED_RIGHT: gl.constexpr,
    THRESHOLD: gl.constexpr, HAS_SOFTCAP: gl.constexpr,
):  # fmt: skip
    """Online-softmax step on raw scores s (a key row's bias already in them: _scores;
    with a bias tile, the tile in natural units, fp32; and ALiBi's slope for this head);
    m_i is kept in scaled log2 units, with a bias tile in natural units (see below).
    THRESHOLD > 0: m moves only where the tile's max passes it by more
    (RESCALE_THRESHOLD); alpha is then exactly 1 where it did not. HAS_SOFTCAP: the
    scaled scores capped first (softcap * tanh(s / softcap), common.tanh as the tile
    kernels have it, so that either backward recomputes the same P), the bias and ALiBi
    added after."""
    offs_n = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s.type.layout))
    if HAS_SOFTCAP:  # natural units from here: the scale is spent
        s = tanh(s * (scale_log2 * LN2 / softcap), True) * softcap  # 16-bit inputs
        scale_log2 = LOG2E
    if HAS_BIAS:
        # Natural units: one FMA a score adds the tile. In log2 units the bias is scaled
        # too, and a finite bias near -FLT_MAX (eager masks' finfo.min) times log2(e)
        # overflows to -inf, turning a row the reference averages into an empty one:
        # that took a clamp and a select a score more.
        s = s * (scale_log2 * LN2) + bias
        if HAS_ALIBI:
            s = gl.fma(alibi_distance(offs_m[:, None], offs_n[None, :], off), -slope, s)
        scale_log2 = 1.0
    if HAS_ALIBI and not HAS_BIAS:  # in the raw scores' units, so that the scale stays
        # folded into exp2's FMA: one FMA a score adds ALiBi
        s = gl.fma(alibi_distance(offs_m[:, None], offs_n[None, :], off),
                   -(slope * LOG2E / scale_log2), s)
    if needs_mask:
        if (BOUNDED_LEFT or BOUNDED_RIGHT) and BLOCK_N > 64:
            mask = _visible(offs_m, start_n, seqlen_k, off, window_left, window_right, BLOCK_N,
                            BOUNDED_LEFT, BOUNDED_RIGHT)
        else:  # keys past Sk only (one compare a score already), or D=256 (_visible)
            mask = visible(offs_m[:, None], offs_n[None, :], seqlen_k, off, window_left,
                           window_right, BOUNDED_LEFT, BOUNDED_RIGHT)
        s = gl.where(mask, s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, 1) * scale_log2)
    if THRESHOLD > 0:  # m moves only past the threshold (-inf + t stays -inf)
        m_new = gl.where(m_new > m_i + (THRESHOLD * LN2 if HAS_BIAS else THRESHOLD), m_new,
                         m_i)
    # Rows with no visible key yet keep m = -inf: subtract 0 there (no -inf - -inf).
    m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
    if HAS_BIAS:  # the difference first: s and m may be near -FLT_MAX
        p = gl.exp2((s - m_safe[:, None]) * LOG2E)
        alpha = gl.exp2((m_i - m_safe) * LOG2E)
    else:
        p = gl.exp2(s * scale_log2 - m_safe[:, None])
        alpha = gl.exp2(m_i - m_safe)
    l_i = l_i * alpha + gl.sum(p, 1)
    return p, m_new, l_i, alpha


@gluon.jit
def _visible(queries, start_n, seqlen_k, off, window_left, window_right,
             BLOCK_N: gl.constexpr, BOUNDED_LEFT: gl.constexpr,
             BOUNDED_RIGHT: gl.constexpr):  # fmt: skip
    """common.visible for a (queries, keys) tile of keys [start_n, + BLOCK_N) under a
    causal mask or a window: each query's last (and first) visible key column first,
    Sk folded in, so that a score is one compare of its column, a constant, against its
    row's bound (two in a window): common.visible's compares of Sk and of the mask's
    bounds each kept a select (the masked variants' code at D=128: 4498 -> 4098
    instructions causal, 5114 -> 4770 in a window). Not at D=256 (64-key tiles beside
    O's 128 registers a thread): the bounds spilled more there (bottom-right causal 24 ->
    44 bytes) and did not pay (S4096 causal 626 / 602 -> 604 / 603 TFLOP/s)."""
    layout: gl.constexpr = queries.type.layout.parent  # the tile's
    cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))
    diag = queries + off - start_n  # key column of the query's diagonal
    last = seqlen_k - 1 - start_n
    if BOUNDED_RIGHT:
        mask = cols[None, :] <= gl.minimum(diag + window_right, last)[:, None]
    else:
        mask = cols[None, :] <= last
    if BOUNDED_LEFT:
        mask = mask & (cols[None, :] >= (diag - window_left)[:, None])
    return mask


@gluon.jit
def _bias(
    bias_smem, bias_ready, bias_empty, i, layout: gl.constexpr, PART: gl.constexpr,
    PARTS: gl.constexpr, BLOCK_N: gl.constexpr, BIAS_STAGES: gl.constexpr,
    HAS_BIAS: gl.constexpr,
):  # fmt: skip
    """The bias tile of this warpgroup's rows and key tile i, fp32, in the scores'
    layout (its TMA slot released at once); 0.0 without one."""
    bias = 0.0
    if HAS_BIAS:
        slot = hopper.arrived(bias_ready, i, BIAS_STAGES)
        tile = bias_smem.index(slot * PARTS + PART).reshape([ROWS, BLOCK_N])
        bias = tile.load(layout).to(gl.float32)
        # The tile's reads (generic proxy) ordered before the TMA that refills the slot
        # (async proxy): without the fence a warp's ldmatrix could still be in flight
        # when the refill landed (D=256: a few rows' scores from the next tile's bias).
        fence_async_shared()
        mbarrier.arrive(bias_empty.index(slot))
    return bias


@gluon.jit
def _scores(q_tile, q2_tile, k_smem, k2_smem, bias_smem, slot, s_init, BLOCK_N: gl.constexpr,
            QK_MAIN: gl.constexpr, QK_SPLIT: gl.constexpr, BIAS_ROW: gl.constexpr):
    """S = Q K(slot)^T as asynchronous wgmmas: one, or with QK_SPLIT a second one
    adding Q's and K's last QK_SPLIT columns (shapes are powers of 2: 192 = 128 + 64).
    With a bias constant along queries (BIAS_ROW), S starts from the keys of K's slot in
    it, as hopper.bias_row_scores made them (fp32, in Q K^T's units; TMA's zeros past
    Sk): the softmax is then the unbiased one, where adding them cost an FMA a score."""
    k = k_smem.index(slot).reshape([BLOCK_N, QK_MAIN]).permute((1, 0))
    if BIAS_ROW:
        row = bias_smem.index(slot).reshape([BLOCK_N]).load(
            gl.SliceLayout(0, s_init.type.layout))
        s = warpgroup_mma(q_tile, k, gl.broadcast(row[None, :], s_init)[0], is_async=True)
    else:
        s = warpgroup_mma(q_tile, k, s_init, use_acc=False, is_async=True)
    if QK_SPLIT > 0:
        k2 = k2_smem.index(slot).reshape([BLOCK_N, QK_SPLIT]).permute((1, 0))
        s = warpgroup_mma(q2_tile, k2, s, is_async=True)
    return s


@gluon.jit
def _keep(seed, rng_offset, bh, row0, start_n, BLOCK_N: gl.constexpr,
          HAS_DROPOUT: gl.constexpr):
    """The dropout keep mask of this warpgroup's rows and key tile; 0 without dropout."""
    keep = 0
    if HAS_DROPOUT:
        keep = hopper.dropout_keep(seed, rng_offset, bh, row0, start_n, ROWS, BLOCK_N, False)
    return keep


@gluon.jit
def _dropped(p, keep, dropout_p, HAS_DROPOUT: gl.constexpr):
    """P with the dropped entries zeroed (the 1 / (1 - p) goes into the output)."""
    if HAS_DROPOUT:
        p = hopper.dropped(p, keep, dropout_p, True)
    return p


@gluon.jit
def _softmax_partition(
    shared, PART: gl.constexpr, HEAD_DIM_QK: gl.constexpr, HEAD_DIM_V: gl.constexpr,
    QK_SPLIT: gl.constexpr, BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr, STAGES: gl.constexpr, Q_STAGES: gl.constexpr,
    FOLD: gl.constexpr, TABLE: gl.constexpr, O_IN_Q: gl.constexpr, HAS_BIAS: gl.constexpr,
    BIAS_STAGES: gl.constexpr, BIAS_ROW: gl.constexpr, HAS_ALIBI: gl.constexpr,
    HAS_DROPOUT: gl.constexpr, IS_VARLEN: gl.constexpr, BOTTOM_RIGHT: gl.constexpr,
    BOUNDED_LEFT: gl.constexpr, BOUNDED_RIGHT: gl.constexpr, THRESHOLD: gl.constexpr,
    TURNS: gl.constexpr, BATCH_INNER: gl.constexpr, OWN_RANGES: gl.constexpr,
    HAS_SOFTCAP: gl.constexpr, IDLE_ROWS: gl.constexpr, FULL_TILES: gl.constexpr,
):  # fmt: skip
    """One warpgroup: query rows [start_m + PART * ROWS, + ROWS) of each of the
    program's query blocks, over every key tile. S(t) and P(t-1)·V(t-1) are in flight
    together; the softmax of S(t) runs while P(t-1)·V(t-1) does. ``shared``: the
    runtime arguments every softmax warpgroup takes (_fwd_sm90_kernel builds it). Packed
    sequences (IS_VARLEN): the items the load warp hands over (_taken_item), until one
    past the grid's last."""
    (o_desc, Out, stride_om, stride_oh, Lse, Alibi, stride_lb, stride_lh, stride_lm,
     stride_ab, stride_ah, q_smem, k_smem, v_smem, o_smem, bias_smem, q2_smem, k2_smem,
     q_ready, q_empty, k_ready, v_ready, bias_ready, k_empty, v_empty, bias_empty, info_smem,
     info_ready, info_empty, Schedule, pid, programs, batches, H, GROUP, num_m_blocks,
     n_items, max_seqlen_q, max_seqlen_k, scale_log2, window_left, window_right, seed,
     rng_offset, dropout_p, _softcap) = shared
    PARTS: gl.constexpr = BLOCK_M // ROWS
    kv = 0  # key tiles consumed so far: the ring's running index
    qi = 0  # query blocks taken so far: the Q ring's index
    if PART == PARTS - 1:  # the first turn is the first warpgroup's
        _turn_pass(PART, PARTS, TURNS)
    if IS_VARLEN:
        more = True
        while more:
            g, b, h, start_m, q_start, seqlen_q, seqlen_k = _taken_item(
                info_smem, info_ready, info_empty, qi)
            more = g < n_items
            if more:
                off, lo, full_lo, full_hi, n_tiles = hopper.block_keys(
                    start_m, seqlen_q, seqlen_k, window_left, window_right, BLOCK_M, BLOCK_N,
                    True, BOTTOM_RIGHT, BOUNDED_LEFT, BOUNDED_RIGHT)  # fmt: skip
                kv, qi = _softmax_block(
                    shared, b, h, h // GROUP, start_m, q_start, seqlen_q, seqlen_k, off, lo,
                    full_lo, full_hi, n_tiles, kv, qi, PART, HEAD_DIM_QK, HEAD_DIM_V, QK_SPLIT,
                    BLOCK_M, BLOCK_N, STAGES, Q_STAGES, O_IN_Q, HAS_BIAS, BIAS_STAGES, BIAS_ROW,
                    HAS_ALIBI, HAS_DROPOUT, IS_VARLEN, BOUNDED_LEFT, BOUNDED_RIGHT,
                    THRESHOLD, TURNS, OWN_RANGES, HAS_SOFTCAP, IDLE_ROWS, FULL_TILES)  # fmt: skip
    else:
        for j in range(n_items):
            (b, h, hk, start_m, q_start, _, seqlen_q, seqlen_k, off, lo, full_lo, full_hi,
             n_tiles) = hopper.query_block(
                pid, j, programs, H, GROUP, num_m_blocks, max_seqlen_q, max_seqlen_k,
                window_left, window_right, BLOCK_M, BLOCK_N, FOLD, BOTTOM_RIGHT, BOUNDED_LEFT,
                BOUNDED_RIGHT, BATCH_INNER, batches, Schedule, TABLE)  # fmt: skip
            kv, qi = _softmax_block(
                shared, b, h, hk, start_m, q_start, seqlen_q, seqlen_k, off, lo, full_lo,
                full_hi, n_tiles, kv, qi, PART, HEAD_DIM_QK, HEAD_DIM_V, QK_SPLIT, BLOCK_M,
                BLOCK_N, STAGES, Q_STAGES, O_IN_Q, HAS_BIAS, BIAS_STAGES, BIAS_ROW, HAS_ALIBI,
                HAS_DROPOUT, IS_VARLEN, BOUNDED_LEFT, BOUNDED_RIGHT, THRESHOLD, TURNS,
                OWN_RANGES, HAS_SOFTCAP, IDLE_ROWS, FULL_TILES)  # fmt: skip
    tma.store_wait(0)


@gluon.jit
def _turn_wait(PART: gl.constexpr, PARTS: gl.constexpr, TURNS: gl.constexpr):
    """This warpgroup's turn to issue wgmmas (TURNS; the one before has passed it on)."""
    if TURNS:
        hopper.named_barrier(TURN_BARRIER + PART, 256, False)


@gluon.jit
def _turn_pass(PART: gl.constexpr, PARTS: gl.constexpr, TURNS: gl.constexpr):
    """The next warpgroup's turn (TURNS)."""
    if TURNS:
        hopper.named_barrier(TURN_BARRIER + (PART + 1) % PARTS, 256, True)


@gluon.jit
def _pass_tiles(k_ready, v_ready, bias_ready, k_empty, v_empty, bias_empty, kv, first, n_tiles,
                PART: gl.constexpr, PARTS: gl.constexpr, STAGES: gl.constexpr,
                HAS_BIAS: gl.constexpr, BIAS_STAGES: gl.constexpr,
                TURNS: gl.constexpr):  # fmt: skip
    """A block's key tiles [first, n_tiles) past this warpgroup's rows: each one's turn
    and slots passed on once loaded (the other warpgroups use them), no work."""
    for t in range(first, n_tiles):
        _turn_wait(PART, PARTS, TURNS)
        _turn_pass(PART, PARTS, TURNS)
        mbarrier.arrive(k_empty.index(hopper.arrived(k_ready, kv + t, STAGES)))
        if HAS_BIAS:
            mbarrier.arrive(bias_empty.index(hopper.arrived(bias_ready, kv + t, BIAS_STAGES)))
        mbarrier.arrive(v_empty.index(hopper.arrived(v_ready, kv + t, STAGES)))


@gluon.jit
def _needs_mask(start_n, full_lo, full_hi, FULL_TILES: gl.constexpr):
    """Whether key tile start_n is masked: outside the block's unmasked tiles [full_lo,
    full_hi); a constant False where every tile is full and unbounded (FULL_TILES), so
    that the mask's code is compiled out."""
    if FULL_TILES:
        return False
    return (start_n < full_lo) | (start_n >= full_hi)


@gluon.jit
def _softmax_block(
    shared, b, h, hk, start_m, q_start, seqlen_q, seqlen_k, off, lo, full_lo, full_hi,
    n_tiles, kv, qi, PART: gl.constexpr, HEAD_DIM_QK: gl.constexpr,
    HEAD_DIM_V: gl.constexpr, QK_SPLIT: gl.constexpr, BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr, STAGES: gl.constexpr, Q_STAGES: gl.constexpr,
    O_IN_Q: gl.constexpr, HAS_BIAS: gl.constexpr, BIAS_STAGES: gl.constexpr,
    BIAS_ROW: gl.constexpr, HAS_ALIBI: gl.constexpr, HAS_DROPOUT: gl.constexpr,
    IS_VARLEN: gl.constexpr, BOUNDED_LEFT: gl.constexpr, BOUNDED_RIGHT: gl.constexpr,
    THRESHOLD: gl.constexpr, TURNS: gl.constexpr, OWN_RANGES: gl.constexpr,
    HAS_SOFTCAP: gl.constexpr, IDLE_ROWS: gl.constexpr, FULL_TILES: gl.constexpr,
):  # fmt: skip
    """_softmax_partition's work for one query block (hopper.query_block's values);
    returns the rings' running indices (key tiles, query blocks) after it."""
    (o_desc, Out, stride_om, stride_oh, Lse, Alibi, stride_lb, stride_lh, stride_lm,
     stride_ab, stride_ah, q_smem, k_smem, v_smem, o_smem, bias_smem, q2_smem, k2_smem,
     q_ready, q_empty, k_ready, v_ready, bias_ready, k_empty, v_empty, bias_empty, _, _, _,
     _, _, _, _, H, _, _, _, _, _, scale_log2, window_left, window_right, seed, rng_offset,
     dropout_p, softcap) = shared
    QK_MAIN: gl.constexpr = HEAD_DIM_QK - QK_SPLIT  # Q's and K's columns in q_smem, k_smem
    PARTS: gl.constexpr = BLOCK_M // ROWS
    dtype: gl.constexpr = o_desc.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM_V, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)
    s_init = gl.zeros([ROWS, BLOCK_N], gl.float32, layout=s_layout)
    o_buf = o_smem.index(PART)  # with O_IN_Q this warpgroup's Q (one Q slot then)
    if O_IN_Q and HEAD_DIM_V != QK_MAIN:  # O's narrower tile in Q's bytes
        o_buf = o_buf._reinterpret(dtype, o_desc.block_type.shape, o_desc.layout)

    bh = b * H + h  # dropout's stream
    slope = 0.0
    if HAS_ALIBI:
        slope = gl.load(Alibi + b.to(gl.int64) * stride_ab + h.to(gl.int64) * stride_ah)
    row0 = start_m + PART * ROWS
    offs_m = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, s_layout))
    n_own = n_tiles  # the key tiles this warpgroup computes, [lo, lo + n_own * BLOCK_N)
    if OWN_RANGES:  # its own rows' ranges (OWN_KEY_RANGES); the block's lo stays the
        # tiles' origin, and its tiles below the warpgroup's own lo are masked ones
        _, full_lo, full_hi, own_hi = key_range(
            row0, seqlen_k, off, window_left, window_right, ROWS, BLOCK_N, BOUNDED_LEFT,
            BOUNDED_RIGHT)  # fmt: skip
        n_own = gl.minimum(gl.maximum(gl.cdiv(own_hi - lo, BLOCK_N), 1), n_tiles)
    works = n_tiles > 0
    if IDLE_ROWS:  # every row past the sequence's (its last block's other half): no
        works = (n_tiles > 0) & (row0 < seqlen_q)  # work, the tiles passed on (the other
        # warpgroup's wgmmas run alone)
    m_i = gl.full([ROWS], float("-inf"), gl.float32, layout=gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([ROWS], gl.float32, layout=gl.SliceLayout(1, s_layout))
    acc = gl.zeros([ROWS, HEAD_DIM_V], gl.float32, layout=o_layout)
    q_slot = hopper.arrived(q_ready, qi, Q_STAGES)
    q_tile = q_smem.index(q_slot * PARTS + PART).reshape([ROWS, QK_MAIN])
    q2_tile = q_tile  # a stand-in without a split
    if QK_SPLIT > 0:
        q2_tile = q2_smem.index(q_slot * PARTS + PART).reshape([ROWS, QK_SPLIT])

    if works:
        # Tile 0 alone: its softmax has no P·V to overlap with.
        slot = hopper.arrived(k_ready, kv, STAGES)
        _turn_wait(PART, PARTS, TURNS)
        s = _scores(q_tile, q2_tile, k_smem, k2_smem, bias_smem, slot, s_init, BLOCK_N,
                    QK_MAIN, QK_SPLIT, BIAS_ROW)
        _turn_pass(PART, PARTS, TURNS)
        keep = _keep(seed, rng_offset, bh, row0, lo, BLOCK_N, HAS_DROPOUT)
        s = warpgroup_mma_wait(0, deps=(s,))
        mbarrier.arrive(k_empty.index(slot))
        bias = _bias(bias_smem, bias_ready, bias_empty, kv, s_layout, PART, PARTS, BLOCK_N,
                     BIAS_STAGES, HAS_BIAS)
        needs_mask = _needs_mask(lo, full_lo, full_hi, FULL_TILES)
        p_, m_i, l_i, alpha = _softmax_tile(
            s, m_i, l_i, lo, offs_m, bias, slope, seqlen_k, off, window_left,
            window_right, needs_mask, scale_log2, softcap, BLOCK_N, HAS_BIAS, HAS_ALIBI,
            BOUNDED_LEFT, BOUNDED_RIGHT, THRESHOLD, HAS_SOFTCAP)  # fmt: skip
        p_op = gl.convert_layout(_dropped(p_, keep, dropout_p, HAS_DROPOUT).to(dtype), p_layout)
        for t in range(1, n_own):
            start_n = lo + t * BLOCK_N
            k_slot = hopper.arrived(k_ready, kv + t, STAGES)
            _turn_wait(PART, PARTS, TURNS)
            s_tok = _scores(q_tile, q2_tile, k_smem, k2_smem, bias_smem, k_slot, s_init,
                            BLOCK_N, QK_MAIN, QK_SPLIT, BIAS_ROW)
            v_slot = hopper.arrived(v_ready, kv + t - 1, STAGES)
            v = v_smem.index(v_slot).reshape([BLOCK_N, HEAD_DIM_V])
            acc_tok = warpgroup_mma(p_op, v, acc, is_async=True)
            _turn_pass(PART, PARTS, TURNS)
            # Philox's integer work runs while the tensor cores do S(t) and P·V.
            keep = _keep(seed, rng_offset, bh, row0, start_n, BLOCK_N, HAS_DROPOUT)
            s = warpgroup_mma_wait(1, deps=(s_tok,))  # S(t) done; P(t-1)·V(t-1) runs on
            mbarrier.arrive(k_empty.index(k_slot))
            bias = _bias(bias_smem, bias_ready, bias_empty, kv + t, s_layout, PART, PARTS,
                         BLOCK_N, BIAS_STAGES, HAS_BIAS)
            needs_mask = _needs_mask(start_n, full_lo, full_hi, FULL_TILES)
            p_, m_i, l_i, alpha = _softmax_tile(
                s, m_i, l_i, start_n, offs_m, bias, slope, seqlen_k, off, window_left,
                window_right, needs_mask, scale_log2, softcap, BLOCK_N, HAS_BIAS, HAS_ALIBI,
                BOUNDED_LEFT, BOUNDED_RIGHT, THRESHOLD, HAS_SOFTCAP)  # fmt: skip
            if THRESHOLD > 0:  # whether any of the warpgroup's rows moved its max
                moved = gl.max((alpha != 1.0).to(gl.int32), 0)
            acc, p_op = warpgroup_mma_wait(0, deps=(acc_tok, p_op))
            mbarrier.arrive(v_empty.index(v_slot))
            if THRESHOLD > 0:
                if moved != 0:
                    acc = acc * gl.convert_layout(alpha, o_rows)[:, None]
            else:
                acc = acc * gl.convert_layout(alpha, o_rows)[:, None]
            p_op = gl.convert_layout(_dropped(p_, keep, dropout_p, HAS_DROPOUT).to(dtype), p_layout)
        if not O_IN_Q:  # every S of this block is done: Q may be refilled
            mbarrier.arrive(q_empty.index(q_slot))
        v_slot = hopper.arrived(v_ready, kv + n_own - 1, STAGES)
        v = v_smem.index(v_slot).reshape([BLOCK_N, HEAD_DIM_V])
        _turn_wait(PART, PARTS, TURNS)
        acc = warpgroup_mma(p_op, v, acc, is_async=True)
        _turn_pass(PART, PARTS, TURNS)
        acc = warpgroup_mma_wait(0, deps=(acc,))
        mbarrier.arrive(v_empty.index(v_slot))
        _pass_tiles(k_ready, v_ready, bias_ready, k_empty, v_empty, bias_empty, kv, n_own,
                    n_tiles, PART, PARTS, STAGES, HAS_BIAS, BIAS_STAGES, TURNS)  # fmt: skip
    else:
        if not O_IN_Q:
            mbarrier.arrive(q_empty.index(q_slot))
        if IDLE_ROWS:
            if n_tiles > 0:  # the turn a working warpgroup takes for its last P·V
                _turn_wait(PART, PARTS, TURNS)
                _turn_pass(PART, PARTS, TURNS)
            _pass_tiles(k_ready, v_ready, bias_ready, k_empty, v_empty, bias_empty, kv, 0,
                        n_tiles, PART, PARTS, STAGES, HAS_BIAS, BIAS_STAGES, TURNS)  # fmt: skip
    kv += n_tiles

    _store_block_output(acc, m_i, l_i, o_buf, o_desc, Out, stride_om, stride_oh, Lse, stride_lb,
                        stride_lh, stride_lm, q_empty, q_slot, b, h, q_start, row0, offs_m,
                        seqlen_q, scale_log2, dropout_p, HAS_DROPOUT, HAS_BIAS, BIAS_ROW,
                        IS_VARLEN, O_IN_Q, o_layout)  # fmt: skip
    qi += 1
    return kv, qi


@gluon.jit
def _store_block_output(
    acc, m_i, l_i, o_buf, o_desc, Out, stride_om, stride_oh, Lse, stride_lb, stride_lh,
    stride_lm, q_empty, q_slot, b, h, q_start, row0, offs_m, seqlen_q, scale_log2, dropout_p,
    HAS_DROPOUT: gl.constexpr, HAS_BIAS: gl.constexpr, BIAS_ROW: gl.constexpr,
    IS_VARLEN: gl.constexpr, O_IN_Q: gl.constexpr, o_layout: gl.constexpr,
):  # fmt: skip
    """A warpgroup's rows [row0, + ROWS) of a query block out: O normalised by the row
    sums (acc, fp32), by TMA store through o_buf (with O_IN_Q the warpgroup's Q slot,
    released to the load warp once the store has read it), or by plain stores where a
    packed sequence ends inside the rows; and the lse from the row statistics (m_i in
    scaled log2 units, with a bias tile in natural units: _softmax_tile)."""
    HEAD_DIM_V: gl.constexpr = acc.shape[1]
    dtype: gl.constexpr = o_desc.dtype
    o_rows: gl.constexpr = gl.SliceLayout(1, o_layout)
    # Rows with no visible key: l = 0, out = 0, lse = -inf.
    empty = l_i == 0.0
    inv_l = 1.0 / gl.where(empty, 1.0, l_i)
    if HAS_DROPOUT:  # kept probabilities weigh 1 / (1 - p)
        inv_l = inv_l / (1.0 - dropout_p)
    log2_l = gl.log2(gl.where(empty, 1.0, l_i))
    if HAS_BIAS:  # m in natural units; the backwards recompute scores with the
        # bias clamped at -2e38 (add_bias_alibi_log2), and so the lse
        lse = gl.where(empty, float("-inf"), gl.maximum(m_i + log2_l * LN2, -2.0e38))
    else:
        if BIAS_ROW:  # rows that saw only keys at the row's floor (finfo.min biases:
            # hopper.bias_row_scores) leave the lse the backwards' clamped scores give
            m_i = gl.where(m_i <= -hopper.BIAS_ROW_FLOOR * scale_log2, -2.0e38 * LOG2E, m_i)
        lse = gl.where(empty, float("-inf"), (m_i + log2_l) * LN2)
    out = acc * gl.convert_layout(inv_l, o_rows)[:, None]
    if IS_VARLEN and row0 + ROWS > seqlen_q:
        # A TMA store clips at the packed tensor's end, not at the sequence's: rows
        # past it belong to the next sequence. Plain masked stores there.
        rows = gl.arange(0, ROWS, layout=o_rows)
        cols = gl.arange(0, HEAD_DIM_V, layout=gl.SliceLayout(0, o_layout))
        tokens = (q_start + row0 + rows).to(gl.int64)
        o_ptrs = (Out + tokens[:, None] * stride_om + h.to(gl.int64) * stride_oh
                  + cols[None, :])
        # O's own columns: HEAD_DIM_V may span more (dispatch.kernel_spec)
        gl.store(o_ptrs, out.to(dtype),
                 mask=(row0 + rows < seqlen_q)[:, None] & (cols < o_desc.shape[3])[None, :])
        if O_IN_Q:
            mbarrier.arrive(q_empty.index(q_slot))
    else:
        tma.store_wait(0)  # the previous block's store has read o_buf (one thread
        # issued it)
        gl.thread_barrier()
        o_buf.reshape([ROWS, HEAD_DIM_V]).store(out.to(dtype))
        fence_async_shared()
        # The TMA store clips rows past Sq; it runs on while the next block starts.
        tma.async_copy_shared_to_global(o_desc, [0 if IS_VARLEN else b, h,
                                                 q_start + row0, 0], o_buf)
        if O_IN_Q:  # o_buf is this warpgroup's Q: refilled once the store has read it
            tma.store_wait(0)
            gl.thread_barrier()
            mbarrier.arrive(q_empty.index(q_slot))
    l_ptrs = (Lse + b.to(gl.int64) * stride_lb + h.to(gl.int64) * stride_lh
              + (q_start + offs_m).to(gl.int64) * stride_lm)
    gl.store(l_ptrs, lse, mask=offs_m < seqlen_q)


@gluon.jit
def _fwd_sm90_kernel(
    q_desc, k_desc, v_desc, o_desc, bias_desc, q2_desc, k2_desc, Out, Lse, Rng, Alibi,
    CuSeqQ, CuSeqK, Tickets, Schedule, stride_om, stride_oh, stride_lb, stride_lh, stride_lm,
    stride_ab, stride_ah, H, GROUP, bias_batches, bias_heads, seqlen_q, seqlen_k, num_m_blocks,
    num_items, scale_log2, window_left, window_right, dropout_p, softcap,
    HEAD_DIM_QK: gl.constexpr, HEAD_DIM_V: gl.constexpr, QK_SPLIT: gl.constexpr,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
    Q_STAGES: gl.constexpr, FOLD: gl.constexpr, BY_RANK: gl.constexpr, TABLE: gl.constexpr,
    O_IN_Q: gl.constexpr, HAS_BIAS: gl.constexpr, BIAS_STAGES: gl.constexpr,
    BIAS_ROW: gl.constexpr,
    HAS_ALIBI: gl.constexpr, HAS_DROPOUT: gl.constexpr, IS_VARLEN: gl.constexpr,
    BOTTOM_RIGHT: gl.constexpr, BOUNDED_LEFT: gl.constexpr, BOUNDED_RIGHT: gl.constexpr,
    THRESHOLD: gl.constexpr, TURNS: gl.constexpr, BATCH_INNER: gl.constexpr,
    OWN_RANGES: gl.constexpr, POSITION_HEADS: gl.constexpr, HAS_SOFTCAP: gl.constexpr,
    IDLE_ROWS: gl.constexpr, FULL_TILES: gl.constexpr,
):  # fmt: skip
    # The programs (one per SM at most, persistent) walk the num_items query blocks in
    # strides (hopper.work_item), folded under a mask: pairs of blocks whose work adds
    # up to the same; or the blocks the host dealt each (TABLE: hopper.rank_table);
    # packed sequences' items (hopper.packed_block) as each program frees
    # (_load_partition). A block's start overlaps the previous one's end.
    pid = gl.program_id(0)
    programs = gl.num_programs(0)
    if TABLE:  # the blocks the host dealt this program: pid its first entry from here on
        first = gl.load(Schedule + pid)
        n_items = gl.load(Schedule + pid + 1) - first
        pid = first
    elif IS_VARLEN:
        n_items = num_items
    else:
        if BY_RANK > 0:  # a program per block (MASKED_BY_RANK_BLOCKS)
            pid = hopper.rank_major_item(pid, programs, num_m_blocks,
                                         gl.cdiv(BY_RANK, num_m_blocks))
        n_items = hopper.work_items(pid, programs, num_items, FOLD)
    batches = 1  # dense batches' count, for BATCH_INNER's order (hopper.query_block)
    if BATCH_INNER:
        batches = num_items // (num_m_blocks * H)
    seed, rng_offset = philox_key(Rng, HAS_DROPOUT)

    PARTS: gl.constexpr = BLOCK_M // ROWS  # softmax warpgroups
    dtype: gl.constexpr = q_desc.dtype
    q_smem = gl.allocate_shared_memory(dtype, [Q_STAGES * PARTS] + q_desc.block_type.shape,
                                       q_desc.layout)
    if O_IN_Q:
        o_smem = q_smem
    else:
        o_smem = gl.allocate_shared_memory(dtype, [PARTS] + o_desc.block_type.shape,
                                           o_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
    q_ready, q_empty = hopper.ring(Q_STAGES, PARTS)
    k_ready, k_empty = hopper.ring(STAGES, PARTS)
    v_ready, v_empty = hopper.ring(STAGES, PARTS)
    if HAS_BIAS:
        bias_smem = gl.allocate_shared_memory(
            dtype, [BIAS_STAGES * PARTS] + bias_desc.block_type.shape, bias_desc.layout)
        bias_ready, bias_empty = hopper.ring(BIAS_STAGES, PARTS)
    elif BIAS_ROW:  # a row of keys beside each K slot, on K's barriers
        bias_smem = gl.allocate_shared_memory(gl.float32, [STAGES] + bias_desc.block_type.shape,
                                              bias_desc.layout)
        bias_ready, bias_empty = k_ready, k_empty
    else:  # stand-ins, never touched
        bias_smem, bias_ready, bias_empty = k_smem, k_ready, k_empty
    if QK_SPLIT > 0:  # Q's and K's last columns
        q2_smem = gl.allocate_shared_memory(
            dtype, [Q_STAGES * PARTS] + q2_desc.block_type.shape, q2_desc.layout)
        k2_smem = gl.allocate_shared_memory(dtype, [STAGES] + k2_desc.block_type.shape,
                                            k2_desc.layout)
    else:  # stand-ins, never touched
        q2_smem, k2_smem = q_smem, k_smem
    if IS_VARLEN:  # the items the load warp hands the softmax warpgroups
        info_smem = gl.allocate_shared_memory(gl.int32, [INFO_STAGES, INFO_FIELDS],
                                              gl.SwizzledSharedLayout(1, 1, 1, [0]))
        info_ready, info_empty = hopper.ring(INFO_STAGES, PARTS)
    else:  # stand-ins, never touched
        info_smem, info_ready, info_empty = k_smem, k_ready, k_empty

    # Runtime values only: a constexpr stored in a variable would turn into a tensor, so
    # the constexprs go into each partition's arguments inline.
    shared = (o_desc, Out, stride_om, stride_oh, Lse, Alibi, stride_lb, stride_lh, stride_lm,
              stride_ab, stride_ah, q_smem, k_smem, v_smem, o_smem, bias_smem, q2_smem,
              k2_smem, q_ready, q_empty, k_ready, v_ready, bias_ready, k_empty, v_empty,
              bias_empty, info_smem, info_ready, info_empty, Schedule, pid, programs, batches, H,
              GROUP, num_m_blocks, n_items, seqlen_q, seqlen_k, scale_log2, window_left,
              window_right, seed, rng_offset, dropout_p, softcap)
    loads = (q_desc, k_desc, v_desc, bias_desc, q2_desc, k2_desc, q_smem, k_smem, v_smem,
             bias_smem, q2_smem, k2_smem, q_ready, q_empty, k_ready, v_ready, bias_ready,
             k_empty, v_empty, bias_empty, info_smem, info_ready, info_empty, Tickets, Schedule,
             pid, programs, batches, H, GROUP, bias_batches, bias_heads, num_m_blocks, n_items,
             CuSeqQ, CuSeqK, seqlen_q, seqlen_k, window_left, window_right)
    if PARTS == 2:
        gl.warp_specialize([
            (_softmax_partition, (shared, 0, HEAD_DIM_QK, HEAD_DIM_V, QK_SPLIT, BLOCK_M, BLOCK_N,
                                  STAGES, Q_STAGES, FOLD, TABLE, O_IN_Q, HAS_BIAS, BIAS_STAGES,
                                  BIAS_ROW, HAS_ALIBI, HAS_DROPOUT, IS_VARLEN, BOTTOM_RIGHT,
                                  BOUNDED_LEFT, BOUNDED_RIGHT, THRESHOLD, TURNS, BATCH_INNER,
                                  OWN_RANGES, HAS_SOFTCAP, IDLE_ROWS, FULL_TILES)),
            (_softmax_partition, (shared, 1, HEAD_DIM_QK, HEAD_DIM_V, QK_SPLIT, BLOCK_M, BLOCK_N,
                                  STAGES, Q_STAGES, FOLD, TABLE, O_IN_Q, HAS_BIAS, BIAS_STAGES,
                                  BIAS_ROW, HAS_ALIBI, HAS_DROPOUT, IS_VARLEN, BOTTOM_RIGHT,
                                  BOUNDED_LEFT, BOUNDED_RIGHT, THRESHOLD, TURNS, BATCH_INNER,
                                  OWN_RANGES, HAS_SOFTCAP, IDLE_ROWS, FULL_TILES)),
            (_load_partition, (loads, BLOCK_M, BLOCK_N, STAGES, Q_STAGES, FOLD, TABLE, QK_SPLIT,
                               HAS_BIAS, BIAS_STAGES, BIAS_ROW, IS_VARLEN, BOTTOM_RIGHT,
                               BOUNDED_LEFT, BOUNDED_RIGHT, BATCH_INNER, POSITION_HEADS)),
        ], worker_num_warps=[4, 1], worker_num_regs=[232, 24])  # fmt: skip
    else:
        gl.warp_specialize([
            (_softmax_partition, (shared, 0, HEAD_DIM_QK, HEAD_DIM_V, QK_SPLIT, BLOCK_M, BLOCK_N,
                                  STAGES, Q_STAGES, FOLD, TABLE, O_IN_Q, HAS_BIAS, BIAS_STAGES,
                                  BIAS_ROW, HAS_ALIBI, HAS_DROPOUT, IS_VARLEN, BOTTOM_RIGHT,
                                  BOUNDED_LEFT, BOUNDED_RIGHT, THRESHOLD, TURNS, BATCH_INNER,
                                  OWN_RANGES, HAS_SOFTCAP, IDLE_ROWS, FULL_TILES)),
            (_softmax_partition, (shared, 1, HEAD_DIM_QK, HEAD_DIM_V, QK_SPLIT, BLOCK_M, BLOCK_N,
                                  STAGES, Q_STAGES, FOLD, TABLE, O_IN_Q, HAS_BIAS, BIAS_STAGES,
                                  BIAS_ROW, HAS_ALIBI, HAS_DROPOUT, IS_VARLEN, BOTTOM_RIGHT,
                                  BOUNDED_LEFT, BOUNDED_RIGHT, THRESHOLD, TURNS, BATCH_INNER,
                                  OWN_RANGES, HAS_SOFTCAP, IDLE_ROWS, FULL_TILES)),
            (_softmax_partition, (shared, 2, HEAD_DIM_QK, HEAD_DIM_V, QK_SPLIT, BLOCK_M, BLOCK_N,
                                  STAGES, Q_STAGES, FOLD, TABLE, O_IN_Q, HAS_BIAS, BIAS_STAGES,
                                  BIAS_ROW, HAS_ALIBI, HAS_DROPOUT, IS_VARLEN, BOTTOM_RIGHT,
                                  BOUNDED_LEFT, BOUNDED_RIGHT, THRESHOLD, TURNS, BATCH_INNER,
                                  OWN_RANGES, HAS_SOFTCAP, IDLE_ROWS, FULL_TILES)),
            (_load_partition, (loads, BLOCK_M, BLOCK_N, STAGES, Q_STAGES, FOLD, TABLE, QK_SPLIT,
                               HAS_BIAS, BIAS_STAGES, BIAS_ROW, IS_VARLEN, BOTTOM_RIGHT,
                               BOUNDED_LEFT, BOUNDED_RIGHT, BATCH_INNER, POSITION_HEADS)),
        ], worker_num_warps=[4, 4, 1], worker_num_regs=[REGS_3, REGS_3, 24])  # fmt: skip


HEAD_DIMS = (64, 128, 192, 256)  # q·k
HEAD_DIMS_V = (64, 128, 256)


_launch_forward = hopper.Launcher(_fwd_sm90_kernel)


@hopper.plan_cache  # dispatch asks on every call (takes_head_dims); made from the knobs
def tile_dim(head_dim_qk: int, head_dim_v: int) -> int:
    """The head dim whose tiles (BLOCK_N and the tables beside it) a call takes: Dqk's,
    or D=256's where V is wider than 128 columns."""
    return 256 if head_dim_v > 128 else head_dim_qk


def key_tile(head_dim_qk: int, head_dim_v: int, has_bias: bool) -> int:
    """Keys a tile (the kernel's BLOCK_N): BLOCK_N's, or BLOCK_N_WITH_BIAS's beside a
    bias read by tiles."""
    return (BLOCK_N_WITH_BIAS if has_bias else BLOCK_N)[tile_dim(head_dim_qk, head_dim_v)]


def o_in_q(head_dim_qk: int, head_dim_v: int) -> bool:
    """Whether O's tile fits Q's first columns' (not at 64/256, 128/256 or 192/256) and
    leaves through Q's buffer by O_IN_Q (beside a bias: `buffers`)."""
    return O_IN_Q[tile_dim(head_dim_qk, head_dim_v)] and _o_fits_q(head_dim_qk, head_dim_v)


def _o_fits_q(head_dim_qk: int, head_dim_v: int) -> bool:
    return head_dim_v <= head_dim_qk - hopper.qk_split(head_dim_qk)


def buffers(head_dim_qk: int, head_dim_v: int, parts: int, has_bias: bool, bias_row: bool,
            dropout: bool) -> tuple[int, int, bool]:  # fmt: skip
    """(Q slots, bias tile slots, O in Q's buffer) a program gets beside the K and V
    rings: the most bias slots (BIAS_STAGES) that leave room for one Q slot, O in a
    buffer of its own where that fits too (o_in_q; beside bias tiles O_IN_Q_WITH_BIAS
    lets O go through Q's where its own leaves no room), then two Q slots where they fit
    (one with O in Q's buffer).
    (0, 0, False) where not even one Q slot fits: dispatch then runs forward.py.
    Dropout's exchange of keep bits takes scratch of its own (DROPOUT_SCRATCH)."""
    tile = tile_dim(head_dim_qk, head_dim_v)
    rows, block_n = ROWS.value, key_tile(head_dim_qk, head_dim_v, has_bias)
    q_tile = rows * head_dim_qk * 2  # one warpgroup's rows of Q
    kv = STAGES * block_n * (head_dim_qk + head_dim_v) * 2  # the K and V rings
    if bias_row:  # fp32, a row beside each K slot
        kv += STAGES * block_n * 4
    # 2 KiB for the barriers and the compiler's own (~400 bytes at D=128, sm_90 build)
    budget = SHARED_MEMORY - 2 * 1024 - (DROPOUT_SCRATCH if dropout else 0)
    o_ways = [o_in_q(head_dim_qk, head_dim_v)]  # O's own buffer first, then Q's
    if (not o_ways[0] and has_bias and O_IN_Q_WITH_BIAS[tile]
            and _o_fits_q(head_dim_qk, head_dim_v)):
        o_ways.append(True)
    for bias_stages in range(BIAS_STAGES[tile], 0, -1) if has_bias else (0,):
        for with_o in o_ways:
            taken = kv + bias_stages * parts * rows * block_n * 2
            if not with_o:
                taken += parts * rows * head_dim_v * 2
            most = 1 if with_o else MAX_Q_STAGES
            fits = [s for s in range(1, most + 1) if taken + s * parts * q_tile <= budget]
            if fits:
                return max(fits), bias_stages, with_o
    return 0, 0, False


def takes_head_dims(spec: AttentionSpec, bias_row: bool) -> bool:
    """Whether the kernel is built for these head dims (HEAD_DIMS, HEAD_DIMS_V: any pair
    of them, tiles by tile_dim) and shared memory holds this call's buffers
    (`buffers`)."""
    dqk, dv = spec.head_dim_qk, spec.head_dim_v
    if dqk not in HEAD_DIMS or dv not in HEAD_DIMS_V:
        return False
    return buffers(dqk, dv, 2, spec.has_bias and not bias_row, bias_row,
                   spec.dropout_p > 0)[0] > 0  # fmt: skip


@hopper.plan_cache
def plan(spec: AttentionSpec, bias_row: bool, bias_dims: tuple[int, int], tokens_q: int,
         device_index: int, tabled: bool = True) -> hopper.Plan:  # fmt: skip
    """The forward's launch for this spec (hopper.Plan), from this module's knobs (who sets
    them calls hopper.forget_plans); bias_row: the bias is one row of keys
    (hopper.bias_row), loaded beside K; bias_dims: its (batch, head) sizes
    (hopper.bias_dims), (0, 0) without one; tokens_q: packed sequences' query tokens in all
    (0 for dense batches); tabled: a host-built schedule may be used (RANK_TABLE).
    Counts: query blocks per head (packed: sequences), work items."""
    masked = spec.window_left >= 0 or spec.window_right >= 0
    tile_bias = spec.has_bias and not bias_row
    # Three warpgroups have 160 registers a thread: no room for dropout or ALiBi.
    three_parts = (spec.head_dim_qk == spec.head_dim_v == 64
                   and spec.dropout_p == 0 and not spec.has_alibi
                   and spec.seqlen_q >= (MIN_SEQLEN_Q_D64_MASKED if masked
                                         else MIN_SEQLEN_Q_D64))
    block_m = BLOCK_M_D64 if three_parts else BLOCK_M
    tile = tile_dim(spec.head_dim_qk, spec.head_dim_v)
    block_n = key_tile(spec.head_dim_qk, spec.head_dim_v, tile_bias)
    num_m_blocks = cdiv(spec.seqlen_q, block_m)
    # Packed sequences walk their blocks sequence by sequence instead (hopper.query_block).
    by_rank = hopper.rank_order(spec, num_m_blocks, MASKED_BY_RANK_BLOCKS[tile],
                                MIN_BLOCKS_BY_RANK[tile])
    num_items = num_m_blocks * spec.batch * spec.heads
    # Inside sharing_sms a program per block (persistent ones with fixed shares would
    # wait, whole, for SMs another kernel holds).
    persistent_ok = PERSISTENT and not shares_sms()
    table = bool(by_rank) and RANK_TABLE and persistent_ok and MASKED_PERSISTENT[tile]
    if table and not (tabled and num_items <= RANK_TABLE_ITEMS):
        table, by_rank = False, 0
    fold = not spec.varlen and not by_rank and (FOLD is True or (
        FOLD == "masked" and masked and num_m_blocks >= MIN_BLOCKS_TO_FOLD[tile]))
    persistent = persistent_ok and (table or not by_rank) and (
        not masked or MASKED_PERSISTENT[tile])
    counts = (num_m_blocks, num_items)
    q_slots, bias_slots, with_o = buffers(spec.head_dim_qk, spec.head_dim_v,
                                          block_m // ROWS.value, tile_bias, bias_row,
                                          spec.dropout_p > 0)  # fmt: skip
    if spec.varlen:
        num_items = packed_items(spec.batch, tokens_q, spec.heads, block_m)
        counts = (spec.batch, num_items)
    programs = hopper.programs(num_items, fold, persistent, device_index)
    schedule = None
    if table:
        tiles = hopper.right_bound_tiles(spec, num_m_blocks, block_m, block_n)
        schedule = tuple(hopper.rank_table(tiles, spec.batch * spec.heads, by_rank, programs))
    constexprs = dict(
        HEAD_DIM_QK=spec.head_dim_qk, HEAD_DIM_V=spec.head_dim_v,
        QK_SPLIT=hopper.qk_split(spec.head_dim_qk), BLOCK_M=block_m, BLOCK_N=block_n,
        STAGES=STAGES,
        Q_STAGES=q_slots, FOLD=fold, BY_RANK=by_rank, TABLE=table, O_IN_Q=with_o,
        HAS_BIAS=tile_bias,
        BIAS_STAGES=max(bias_slots, 1), BIAS_ROW=bias_row,
        HAS_ALIBI=spec.has_alibi, HAS_SOFTCAP=spec.softcap > 0,
        HAS_DROPOUT=spec.dropout_p > 0, IS_VARLEN=spec.varlen,
        BOTTOM_RIGHT=spec.bottom_right, BOUNDED_LEFT=spec.window_left >= 0,
        BOUNDED_RIGHT=spec.window_right >= 0,
        THRESHOLD=(float(RESCALE_THRESHOLD)
                   if spec.head_dim_v >= LAZY_RESCALE_MIN_COLUMNS * block_n else 0.0),
        TURNS=not spec.varlen and tile <= TURNS_MAX_HEAD_DIM,
        OWN_RANGES=OWN_KEY_RANGES and spec.window_right >= 0 and block_m > 2 * ROWS.value,
        IDLE_ROWS=IDLE_WARPGROUPS and spec.varlen,
        FULL_TILES=(FULL_TILES[tile] and not masked and not spec.varlen
                    and spec.seqlen_k % block_n == 0 and spec.head_dim_v == spec.head_dim_qk
                    and not spec.has_bias and not spec.has_alibi and spec.dropout_p == 0
                    and spec.softcap == 0),
        POSITION_HEADS=(min(POSITION_HEADS, spec.heads)
                        if spec.varlen and tile_bias and bias_dims[0] == 1
                        and spec.window_right >= 0 and 1 < spec.batch <= hopper.POSITION_SEQS.value
                        else 0),
        BATCH_INNER=(BIAS_BATCH_INNER and tile_bias and not spec.varlen
                     and hopper.shared_over_batch(spec, bias_dims)),
        num_warps=4,
    )  # fmt: skip
    return hopper.Plan(programs, counts, constexprs, schedule)


def forward(spec: AttentionSpec, q, k, v, bias, alibi_slopes, rng_state, cu_seqlens_q,
            cu_seqlens_k, out, lse) -> None:
    """Fills out (B, Sq, H, D), or (Tq, H, D) packed, and lse (B, H, Sq), or (H, Tq), for
    a call dispatch.gluon_forward took; spec's head dims are the kernel's
    (dispatch.kernel_spec: the tensors' may be narrower); rng_state: dropout's [seed,
    offset] (memattn.dropout), None without dropout."""
    bias_row = hopper.bias_row(spec, bias)
    bias_dims = (0, 0) if bias is None else hopper.bias_dims(bias)
    tokens_q = q.shape[0] if spec.varlen else 0
    how, schedule = hopper.plan_with_schedule(
        plan, (spec, bias_row, bias_dims, tokens_q, q.device.index), q.device.index, lse)
    if bias_row:  # (B', H', Sk) fp32 in Q K^T's units: S starts from it, by TMA
        bias = hopper.bias_row_scores(bias, spec.scale)
    # What the launch's arguments are made of beside the plan, shapes included (the
    # spec does not fix packed sequences' token counts, which the descriptors hold):
    # once launched, a call of the same key skips making them
    # (hopper.Launcher.launch_prepared).
    # Packed sequences' dynamic schedule counts its items taken here (zeroed per call).
    tickets = torch.zeros(1, dtype=torch.int32, device=q.device) if spec.varlen else lse
    call = (how, *map(hopper.tensor_key, (q, k, v, out, lse, bias, alibi_slopes, rng_state,
                                           cu_seqlens_q, cu_seqlens_k, tickets,
                                           schedule)))  # fmt: skip
    if _launch_forward.launch_prepared(how.programs, call):
        return
    block_n = how.constexprs["BLOCK_N"]
    stride_om = stride_oh = 0  # O leaves by TMA but for packed sequences' last blocks
    lse_strides = lse.stride()
    if spec.varlen:  # one batch of all tokens; lse by pointer, rows masked
        q, k, v = q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)
        stride_om, stride_oh = out.stride(0), out.stride(1)
        lse_strides = (0, *lse.stride())
    split = how.constexprs["QK_SPLIT"]
    main = spec.head_dim_qk - split  # Q's and K's columns in their first buffers
    q_desc, k_desc = hopper.descriptor(q, ROWS.value, main), hopper.descriptor(k, block_n, main)
    q2_desc, k2_desc = q_desc, k_desc  # stand-ins, never read without a split
    if split:
        q2_desc = hopper.descriptor(q, ROWS.value, split)
        k2_desc = hopper.descriptor(k, block_n, split)
    o_desc = hopper.descriptor(out.unsqueeze(0) if spec.varlen else out, ROWS.value,
                               spec.head_dim_v)
    bias_desc, bias_batches, bias_heads = q_desc, 1, 1  # a stand-in, never read
    if bias_row:
        bias_batches, bias_heads = bias.shape[:2]
        block = (1, 1, block_n)
        bias_desc = hopper.make_descriptor(bias, list(bias.shape), list(bias.stride()), block,
                                           hopper.shared_layout(block, torch.float32))
    elif bias is not None:
        bias_desc = hopper.bias_descriptor(bias, ROWS.value, block_n)
        bias_batches, bias_heads = bias_desc.shape[:2]
    alibi_batch_stride, alibi_head_stride = alibi_strides(alibi_slopes)
    # What fixes the arguments' specialisation and the constexprs (hopper.Launcher): the
    # plan, the ints it does not fix (packed lse's stride is the token count), the
    # pointers' alignment. out and lse are fresh, so aligned.
    variant = (how, *lse_strides, bias_batches, bias_heads, alibi_batch_stride,
               alibi_head_stride, hopper.aligned(rng_state), hopper.aligned(alibi_slopes),
               hopper.aligned(cu_seqlens_q), hopper.aligned(cu_seqlens_k))  # fmt: skip
    _launch_forward(
        (how.programs,),
        q_desc, k_desc, hopper.descriptor(v, block_n, spec.head_dim_v), o_desc, bias_desc,
        q2_desc, k2_desc,
        out, lse, rng_state, alibi_slopes, cu_seqlens_q, cu_seqlens_k, tickets, schedule,
        stride_om, stride_oh, *lse_strides, alibi_batch_stride, alibi_head_stride,
        spec.heads, spec.group, bias_batches, bias_heads, spec.seqlen_q, spec.seqlen_k,
        *how.counts, spec.scale * LOG2E.value, spec.window_left, spec.window_right,
        spec.dropout_p, spec.softcap, variant=variant, prepare=call, **how.constexprs,
    )  # fmt: skip
