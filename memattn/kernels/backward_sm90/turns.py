"""The deterministic Hopper backward's adds in a fixed order (narrow.py's ORDERED_DQ and
"ordered" bias gradients): several programs add into each fp32 tile of dQ (one a key
block) or of a bias gradient summed over batch or heads (one a (b, h)), by TMA
reduce-add, whose order would otherwise change the rounding from run to run. Each tile
has an int32 counter; a program waits until it reads its turn (hopper.wait_turn), adds,
and counts the turn on once its add has landed (hopper.end_turn). What is here says,
for a program's step, which counter and which turn (dq_tile_lock, dq_add_turn,
bias_sum_turn, step_turns), and where each program's walk over its query tiles starts
(walk_start), chosen so that the turns come in the order the programs reach a tile:
a program then waits only on adds made before its own, never on one that waits for
it. Plain integer arithmetic in jit functions, so that tests run the turns in Python
(their ``.fn``) over the programs in the order the grid starts them."""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from .. import hopper
from ..common import dq_tile
from .shared import _query_tile

# How a program's walk over its query tiles rotates (the ROTATE constexpr): not at all,
# by key block (ORDERED_DQ's dQ turns, dq_add_turn), or by kv head among the kv heads
# whose "ordered" bias gradient tiles add up (a bias shared over heads:
# narrow.walk_rotation).
ROTATE_NONE = gl.constexpr(0)
ROTATE_BY_BLOCK = gl.constexpr(1)
SPREAD_OVER_KV_HEADS = gl.constexpr(2)


@gluon.jit
def walk_start(hk, start_n, n_tiles, seqlen_k, blocks, BLOCK_N: gl.constexpr,
               ROTATE: gl.constexpr):  # fmt: skip
    """The query tile a program's walk starts at: ROTATE_BY_BLOCK, n * n_tiles // num_n
    for block n of the num_n of its (sequence's) keys (ORDERED_DQ, dq_add_turn);
    SPREAD_OVER_KV_HEADS, hk * span // kv heads (spread_span), so that the kv heads reach
    each summed tile steps apart (spread_sum_turn); 0 otherwise. The partitions take
    it from here, so that they walk alike. ``blocks``: narrow._program_block's."""
    rot = 0
    if ROTATE == ROTATE_BY_BLOCK:
        rot = (start_n // BLOCK_N) * n_tiles // gl.cdiv(seqlen_k, BLOCK_N)
    if ROTATE == SPREAD_OVER_KV_HEADS:
        rot = hk * spread_span(n_tiles, blocks) // blocks[2]
    return rot


@gluon.jit
def spread_span(n_tiles, blocks):
    """SPREAD_OVER_KV_HEADS: the query tiles over which the kv heads (``blocks[2]``,
    narrow._program_block's) start their walks, SPREAD_STEPS (``blocks[10]``) apart;
    all n_tiles where there are fewer or that is 0."""
    span = n_tiles
    if blocks[10] > 0:
        span = gl.minimum(n_tiles, blocks[2] * blocks[10])
    return span


@gluon.jit
def spread_sum_turn(tile, hk, kv_heads, span):
    """SPREAD_OVER_KV_HEADS: kv head hk's turn among the kv heads at its walk's tile
    ``tile``, each kv head's walk starting at hk * span // kv_heads (walk_start):
    the order they reach it in, first the last kv head whose walk starts at that tile or
    before it, then the ones before that, wrapping round (kv heads whose walks start at
    the same tile reach it at once, the later one first). Each then waits on an add
    made steps before its own instead of queueing behind the kv head before it. Plain
    integer arithmetic, so that tests can run it in Python."""
    starter = ((tile + 1) * kv_heads - 1) // span
    if starter > kv_heads - 1:
        starter = kv_heads - 1
    return (starter - hk + kv_heads) % kv_heads


@gluon.jit
def dq_add_turn(n, start_m, num_n, n_tiles, off, window_left, window_right,
                BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BOUNDED_LEFT: gl.constexpr,
                BOUNDED_RIGHT: gl.constexpr, ROTATE: gl.constexpr):  # fmt: skip
    """ORDERED_DQ: key block n's place among the key blocks that add into the dQ tile of
    rows [start_m, + BLOCK_M) of one head, the order in which they reach it. With a
    right bound (causal, windows) each program starts at its first query tile, later
    the further right its keys, so the blocks add last first: the tile's last block
    (the last whose keys a row of the tile sees) first. Without one, ROTATE: every
    block sees every tile, and each program starts its walk at tile n * n_tiles //
    num_n (_query_tile's rot): tile m's adds come from the block that started there, or
    last before it, then the ones before that, wrapping round. Otherwise every block
    walks from the first tile, and they add first first (the tile's first block: the
    first whose keys a row of it sees under a left bound), in the order the programs
    start. Plain integer arithmetic, so that tests can run it in Python."""
    if BOUNDED_RIGHT:
        last = (start_m + BLOCK_M + off + window_right - 1) // BLOCK_N
        if last > num_n - 1:
            last = num_n - 1
        turn = last - n
    elif ROTATE != ROTATE_BY_BLOCK:  # a spread rotates every block of a head alike
        first = 0
        if BOUNDED_LEFT:
            first = start_m + off - window_left
            if first < 0:
                first = 0
            first = first // BLOCK_N
        turn = n - first
    else:
        # the last block whose walk starts at this tile or before it (as spread_sum_turn)
        starter = ((start_m // BLOCK_M + 1) * num_n - 1) // n_tiles
        if starter > num_n - 1:
            starter = num_n - 1
        turn = (starter - n + num_n) % num_n
    return turn


@gluon.jit
def dq_tile_lock(b, h, start_m, q_start, seqlen_q, heads, BLOCK_M: gl.constexpr,
                 IS_VARLEN: gl.constexpr):  # fmt: skip
    """ORDERED_DQ: the index of the dQ tile of rows [start_m, + BLOCK_M) of (b, h)'s
    counter."""
    tile = dq_tile(start_m, q_start, b, BLOCK_M, IS_VARLEN)
    if IS_VARLEN:  # packed sequences' tiles (common.dq_tile), heads inner
        return tile * heads + h
    return (b * heads + h) * gl.cdiv(seqlen_q, BLOCK_M) + tile


@gluon.jit
def bias_sum_turn(b, h, start_m, start_n, seqlen_q, seqlen_k, heads, bias_batches,
                  bias_heads, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):  # fmt: skip
    """A deterministic summed bias gradient (dbias_kind_of's "ordered"): the index of
    the counter of its tile of rows [start_m, + BLOCK_M) and keys [start_n, + BLOCK_N)
    in its plane, and (b, h)'s turn there: its place among the (batch, head)s the plane
    sums, batch-major, the order in which their programs start (narrow.inner_dims). Each of
    them sees the tile (one mask for all), so the turns have no gaps."""
    plane = (b % bias_batches) * bias_heads + h % bias_heads
    tile = (plane * gl.cdiv(seqlen_q, BLOCK_M) + start_m // BLOCK_M) * gl.cdiv(seqlen_k, BLOCK_N)
    turn = h * 0
    per_batch = h * 0 + 1
    if bias_heads == 1:
        turn = h
        per_batch = h * 0 + heads
    if bias_batches == 1:
        turn += b * per_batch
    return tile + start_n // BLOCK_N, turn


@gluon.jit
def step_turns(t, block, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
               BOUNDED_LEFT: gl.constexpr, BOUNDED_RIGHT: gl.constexpr,
               ROTATE: gl.constexpr):  # fmt: skip
    """An "ordered" bias gradient's block step t (a dense batch): its summed gradient
    tile's counter (bias_sum_turn) and the count it must read for (b, h)'s turn, then
    its dQ tile's (dq_tile_lock, dq_add_turn): one a turn (narrow's counting warps,
    _bwd_turn_counter_partition).
    Worked out where needed, not carried across the step: registers are short.
    ``block``: the block's runtime values it takes."""
    (b, hk, GROUP, lo, n_tiles, rot, start_n, seqlen_q, seqlen_k, off, window_left,
     window_right, heads, bias_batches, bias_heads, span) = block
    h, start_m = _query_tile(t, hk, GROUP, lo, n_tiles, BLOCK_M, rot, ROTATE)
    sum_lock, sum_turn = bias_sum_turn(b, h, start_m, start_n, seqlen_q, seqlen_k, heads,
                                       bias_batches, bias_heads, BLOCK_M, BLOCK_N)
    if ROTATE == SPREAD_OVER_KV_HEADS:  # the kv heads in the order they reach the tile,
        # a program's GQA heads in its walk's order, each after all of the last one's
        kv_heads = heads // GROUP
        sum_turn = ((t // n_tiles) * kv_heads
                    + spread_sum_turn((start_m - lo) // BLOCK_M, hk, kv_heads, span))
    dq_turn = dq_add_turn(start_n // BLOCK_N, start_m, gl.cdiv(seqlen_k, BLOCK_N), n_tiles, off,
                          window_left, window_right, BLOCK_M, BLOCK_N, BOUNDED_LEFT,
                          BOUNDED_RIGHT, ROTATE)  # fmt: skip
    dq_lock = dq_tile_lock(b, h, start_m, 0, seqlen_q, heads, BLOCK_M, False)
    return sum_lock, sum_turn, dq_lock, dq_turn


@gluon.jit
def wait_bias_sum_turn(ready, SumLocks, t, block, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                       BOUNDED_LEFT: gl.constexpr, BOUNDED_RIGHT: gl.constexpr,
                       ROTATE: gl.constexpr):  # fmt: skip
    """Before step t's summed tile is added: spins for its turn unless its counter, read
    ahead, already said so (``ready``)."""
    if not ready:
        lock, count, _, _ = step_turns(t, block, BLOCK_M, BLOCK_N, BOUNDED_LEFT,
                                       BOUNDED_RIGHT, ROTATE)  # fmt: skip
        hopper.wait_turn(SumLocks + lock, count)
