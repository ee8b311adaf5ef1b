"""kernels/dispatch.py: which kernel family runs a call, and the calls no kernel runs.

The Gluon kernels need a Hopper GPU; on the CPU these tests check that no call goes
there, the feature rules that hold whatever the device, and the empty calls answered
without a launch. The GPU tests of test_forward/test_backward check which family ran."""

import dataclasses

import pytest
import torch

import memattn
from memattn import reference
from memattn.check import FLOOR, Case, check_backward, relative_error
from memattn.kernels import dispatch
from memattn.kernels.common import TILE_BIAS_ALIGNMENT, copy_rows, padded_rows, rows_aligned
from memattn.spec import check_call

from .conftest import DEVICE
from .test_forward import assert_results

gluon = pytest.mark.skipif(dispatch.hopper is None, reason="Triton without Gluon's Hopper API")


def spec_and_inputs(b=2, sq=16, sk=16, h=2, d=64, bias_shape=None, varlen=False, dv=None,
                    **options):  # fmt: skip
    """A call's spec and inputs (V's head dim dv, d's if None); varlen: the b sequences
    packed (sq queries, sk keys each)."""
    lead = (b * sq,) if varlen else (b, sq)
    lead_k = (b * sk,) if varlen else (b, sk)
    q = torch.randn(*lead, h, d, device=DEVICE, dtype=torch.float16)
    k = torch.randn(*lead_k, h, d, device=DEVICE, dtype=torch.float16)
    v = torch.randn(*lead_k, h, dv or d, device=DEVICE, dtype=torch.float16)
    bias = None if bias_shape is None else torch.randn(bias_shape, device=DEVICE,
                                                        dtype=torch.float16)  # fmt: skip
    if varlen:
        options.update(
            cu_seqlens_q=torch.arange(0, b * sq + 1, sq, device=DEVICE, dtype=torch.int32),
            cu_seqlens_k=torch.arange(0, b * sk + 1, sk, device=DEVICE, dtype=torch.int32),
            max_seqlen_q=sq, max_seqlen_k=sk)  # fmt: skip
    return check_call(q, k, v, bias=bias, **options), q, k, v, bias


@pytest.mark.skipif(DEVICE != "cpu", reason="CPU tensors")
def test_cpu_calls_run_the_tile_kernels():
    spec, q, k, v, bias = spec_and_inputs(causal=True)
    assert not dispatch.gluon_forward(spec, q, k, v, bias)
    assert not dispatch.gluon_backward(spec, q, k, v, q, bias, None, (True, True, True, False))


@gluon
@pytest.mark.parametrize(
    "d, bias_shape, options, need_dbias, computes",
    [
        (128, None, {}, False, True),
        (256, None, {}, False, True),
        (256, (2, 2, 16, 16), {}, False, True),  # D=256: a bias read,
        (256, (2, 2, 16, 16), {}, True, True),  # a full one's gradient (dS stored),
        (256, (1, 2, 16, 16), {}, True, True),  # one summed over batch or heads (atomics)
        (256, (2, 2, 16, 16), dict(softcap=5.0), True, False),  # not beside softcap
        (256, None, dict(dropout_p=0.1), False, True),  # dropout, ALiBi, softcap: yes
        (256, None, dict(alibi_slopes=torch.rand(2)), False, True),
        (256, None, dict(softcap=5.0, causal=True), False, True),
        (128, (2, 2, 16, 16), {}, True, True),  # a full bias's gradient is dS
        (128, (1, 2, 16, 16), {}, True, True),  # one over the batch: TMA reduce-adds
        (64, (2, 1, 16, 16), {}, True, True),  # over the heads
        (128, (16, 16), {}, True, True),  # over both
        (128, (1, 2, 16, 12), {}, True, True),  # (over padded rows where Sk % 8 != 0)
        (128, (1, 2, 16, 16), dict(varlen=True), True, True),  # packed sequences too
        (128, (2, 2, 16, 16), dict(varlen=True), True, True),  # (a full bias: stored)
        (128, (2, 2, 1, 16), {}, True, True),  # one over the queries: summed in registers
        (128, (1, 2, 1, 16), {}, True, True),  # also over the batch (partial sums)
        (128, (2, 1, 1, 12), {}, True, True),  # any key count: stored by pointer
        (128, (2, 2, 16, 1), {}, True, False),  # one over the keys is not
        (256, (2, 1, 1, 16), {}, False, True),  # D=256: a key row read (by pointer)
        (256, (2, 1, 1, 16), {}, True, True),  # and its gradient (summed in registers)
        (128, (2, 2, 16, 12), {}, True, True),  # TMA stores over padded rows, any Sk
        (64, (1, 2, 16, 16), dict(dropout_p=0.1), True, True),  # bias tiles beside dropout
        (128, (1, 2, 16, 16), dict(dropout_p=0.1), True, True),  # (128: bits through dS)
        (256, (1, 2, 16, 16), dict(dropout_p=0.1), True, True),  # (256: bits through P)
        (128, (2, 1, 1, 16), dict(dropout_p=0.1), True, True),  # (a key row: no tiles)
        (128, (2, 2, 16, 12), {}, False, True),  # (without its gradient, any)
        (128, None, dict(softcap=5.0), False, True),  # softcap: tanh' in dS
        (64, (2, 2, 16, 16), dict(softcap=5.0), False, True),
        (128, (2, 2, 16, 16), dict(softcap=5.0), True, True),  # its gradient: dS before
        (128, (1, 2, 16, 16), dict(softcap=5.0), True, True),  # tanh', which dK's and dQ's
        (64, (2, 2, 1, 16), dict(softcap=5.0), True, True),  # carry
        (256, (2, 2, 16, 16), dict(softcap=5.0), True, False),  # (past 128 columns, not)
    ],
)  # fmt: skip
def test_gluon_backward_computes(d, bias_shape, options, need_dbias, computes):
    sk = bias_shape[-1] if bias_shape and bias_shape[-1] > 1 else 16  # (…, 1): over keys
    spec, _, _, _, bias = spec_and_inputs(d=d, sk=sk, bias_shape=bias_shape, **options)
    assert dispatch.gluon_backward_computes(spec, bias, need_dbias) is computes


@gluon
@pytest.mark.parametrize(
    "d, seqlen, options, gluon_backward",
    [(64, 512, dict(causal=True), True),  # 256 keys a query
     (64, 256, dict(causal=True), False),  # 128: the tile backward
     (64, 4096, dict(window=(63, 0)), False),  # 64
     (128, 256, dict(causal=True), True),  # D=128: at every count
     (128, 4096, dict(window=(31, 0)), True)],
)  # fmt: skip
def test_gluon_kernels_at_few_keys_per_query(d, seqlen, options, gluon_backward, monkeypatch):
    """The Gluon forward at any count of keys a query; the Gluon backward too but at
    D=64 below backward_sm90.MIN_KEYS_PER_QUERY."""
    monkeypatch.setattr(dispatch, "_gluon_takes", lambda *args: True)  # a Hopper GPU's call
    spec, q, k, v, bias = spec_and_inputs(d=d, sq=seqlen, sk=seqlen, **options)
    assert dispatch.gluon_forward(spec, q, k, v, bias)
    needs = (True, True, True, False)
    assert dispatch.gluon_backward(spec, q, k, v, q, bias, None, needs) is gluon_backward


@gluon
@pytest.mark.parametrize(
    "d, bias_shape, takes",
    [(128, None, True), (256, None, True),
     (128, (2, 2, 16, 16), True),  # bias tiles, added after the cap
     (128, (2, 1, 1, 16), False),  # a key row: S would start from it, before the cap
     (64, None, False)],  # the D=64 forward: the tile kernel (no slower: MUFU-bound)
)  # fmt: skip
def test_gluon_forward_takes_softcap_above_d64_without_a_key_row(d, bias_shape, takes,
                                                                 monkeypatch):  # fmt: skip
    monkeypatch.setattr(dispatch, "_gluon_takes", lambda *args: True)  # a Hopper GPU's call
    spec, q, k, v, bias = spec_and_inputs(d=d, bias_shape=bias_shape, softcap=5.0)
    assert dispatch.gluon_forward(spec, q, k, v, bias) is takes


@gluon
@pytest.mark.parametrize(
    "bias_shape, varlen, sequences, kind",
    [((2, 2, 16, 16), False, 2, "full"),  # dS is the gradient
     ((2, 2, 16, 16), True, 2, "full"),  # a plane each sequence
     ((1, 2, 16, 16), False, 2, "summed"),  # over a dense batch: the fp32 buffer
     ((1, 2, 16, 16), True, 2, "added"),  # a plane per head the sequences share
     ((1, 2, 16, 16), True, 3, "summed"),  # more sequences than PACKED_BIAS_ADDS
     ((1, 1, 16, 16), True, 2, "summed"),  # shared by the heads too
     ((2, 1, 1, 16), True, 2, "row")],  # summed over queries in registers
)  # fmt: skip
@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
def test_bias_gradient_kinds(bias_shape, varlen, sequences, kind, deterministic,
                             monkeypatch):  # fmt: skip
    """dbias_kind_of: a plane per head shared by at most PACKED_BIAS_ADDS packed
    sequences takes their dS added into the gradient itself; any other broadcast, the
    fp32 buffer, in turns ("ordered") in deterministic dense calls."""
    monkeypatch.setattr(dispatch.backward_sm90.shared, "PACKED_BIAS_ADDS", 2)
    spec, *_, bias = spec_and_inputs(b=sequences, bias_shape=bias_shape, varlen=varlen,
                                     deterministic=deterministic)  # fmt: skip
    if deterministic and kind == "summed" and not varlen:
        kind = "ordered"
    assert dispatch.backward_sm90.dbias_kind_of(spec, bias) == kind


@gluon
@pytest.mark.parametrize(
    "bias_shape, inner",
    [((2, 2, 16, 16), (False, False)),  # a full bias: nothing summed
     ((1, 2, 16, 16), (True, False)),  # over the batch
     ((2, 1, 16, 16), (False, True)),  # over the heads
     ((16, 16), (False, False)),  # over both: every program at once, the shipped order
     ((1, 1, 1, 16), (False, False))],  # a key row: summed in registers
)  # fmt: skip
def test_summed_bias_gradient_puts_its_broadcast_dim_inner(bias_shape, inner, monkeypatch):
    """SUMMED_BIAS_INNER orders the backward's programs with the one dimension a summed
    bias gradient broadcasts over innermost; off, the shipped order for every bias.
    Without a gradient, BIAS_TILES_BATCH_INNER puts the batch inner for tiles shared
    over the batch alone (their reads meet in L2); off, the shipped order."""
    spec, _, _, _, bias = spec_and_inputs(bias_shape=bias_shape)
    kind = dispatch.backward_sm90.dbias_kind_of(spec, bias)
    assert dispatch.backward_sm90.narrow.inner_dims(spec, bias, kind) == inner
    read_only = (True, False) if inner == (True, False) else (False, False)
    assert dispatch.backward_sm90.narrow.inner_dims(spec, bias, None) == read_only
    monkeypatch.setattr(dispatch.backward_sm90.narrow, "SUMMED_BIAS_INNER", False)
    monkeypatch.setattr(dispatch.backward_sm90.narrow, "BIAS_TILES_BATCH_INNER", False)
    assert dispatch.backward_sm90.narrow.inner_dims(spec, bias, kind) == (False, False)
    assert dispatch.backward_sm90.narrow.inner_dims(spec, bias, None) == (False, False)


@gluon
@pytest.mark.parametrize(
    "bias_shape, inner",
    [((1, 2, 16, 16), True),  # a plane per head shared over the batch
     ((2, 2, 16, 16), False), ((2, 1, 16, 16), False), ((16, 16), False),
     ((1, 2, 1, 16), False)],  # a key row: no tiles
)  # fmt: skip
def test_forward_reads_a_bias_shared_over_the_batch_batch_inner(bias_shape, inner,
                                                                 monkeypatch):  # fmt: skip
    """BIAS_BATCH_INNER: the forward's programs go batch after batch within a head for
    bias tiles shared over the batch alone (their reads meet in L2); off, head after
    head for every bias."""
    from memattn.kernels import forward_sm90

    spec, _, _, _, bias = spec_and_inputs(bias_shape=bias_shape)
    bias_row = forward_sm90.hopper.bias_row(spec, bias)
    dims = forward_sm90.hopper.bias_dims(bias)
    monkeypatch.setattr(forward_sm90.hopper, "sm_count", lambda device_index: 132)
    forward_sm90.hopper.forget_plans()
    try:
        on = forward_sm90.plan(spec, bias_row, dims, 0, 0).constexprs["BATCH_INNER"]
        monkeypatch.setattr(forward_sm90, "BIAS_BATCH_INNER", False)
        forward_sm90.hopper.forget_plans()
        off = forward_sm90.plan(spec, bias_row, dims, 0, 0).constexprs["BATCH_INNER"]
    finally:
        forward_sm90.hopper.forget_plans()
    assert (on, off) == (inner, False)


def _forward_plan(monkeypatch, seqlen: int, d: int, heads: int, options: dict):
    """The Gluon forward's plan of a B1 call (S = seqlen, H = heads, head dim d) on 132
    SMs, made afresh and forgotten after."""
    from memattn.kernels import forward_sm90

    spec = spec_and_inputs(b=1, sq=seqlen, sk=seqlen, h=heads, d=d, **options)[0]
    monkeypatch.setattr(forward_sm90.hopper, "sm_count", lambda device_index: 132)
    forward_sm90.hopper.forget_plans()
    try:
        return forward_sm90.plan(spec, False, (0, 0), 0, 0)
    finally:
        forward_sm90.hopper.forget_plans()


@gluon
@pytest.mark.parametrize(
    "seqlen, d, options, rows, own",
    [(8192, 64, dict(causal=True), 192, True), (8192, 64, dict(window=(100, 0)), 192, True),
     # no right bound: every row of a block sees as far
     (8192, 64, dict(window=(100, -1)), 192, False), (8192, 64, {}, 192, False),
     (4096, 64, dict(causal=True), 128, False), (8192, 128, dict(causal=True), 128, False)],
)  # fmt: skip
def test_forward_warpgroups_keep_their_own_key_ranges_in_192_row_blocks(
        seqlen, d, options, rows, own, monkeypatch):  # fmt: skip
    """OWN_KEY_RANGES: under a right bound the three 64-row warpgroups of a 192-row
    block (D=64 from MIN_SEQLEN_Q_D64_MASKED) mask and walk their own rows' keys;
    128-row blocks keep the block's."""
    plan = _forward_plan(monkeypatch, seqlen, d, 1, options)
    assert (plan.constexprs["BLOCK_M"], plan.constexprs["OWN_RANGES"]) == (rows, own)


@gluon
@pytest.mark.parametrize(
    "seqlen, d, options, full",
    [(4096, 128, {}, True), (4000, 128, {}, False),  # the last key tile part-filled
     (4096, 128, dict(causal=True), False), (4096, 128, dict(window=(100, -1)), False),
     (4096, 64, {}, False), (4096, 256, {}, False),  # compiled with the mask's code
     (4096, 128, dict(softcap=30.0), False), (4096, 128, dict(dropout_p=0.1), False),
     (4096, 128, dict(dv=64), False)],
)  # fmt: skip
def test_forward_compiles_the_mask_out_where_keys_fill_every_tile(seqlen, d, options, full,
                                                                 monkeypatch):  # fmt: skip
    """FULL_TILES: a dense call without bounds or features whose keys fill every tile
    runs a step loop without the mask's code, at the head dims where that measured
    faster."""
    assert _forward_plan(monkeypatch, seqlen, d, 1, options).constexprs["FULL_TILES"] == full


@gluon
@pytest.mark.parametrize(
    "seqlen, d, options, by_rank, table",
    [(16384, 256, dict(causal=True), 256, False),  # 128 blocks: a program per block
     (8192, 256, dict(causal=True), 0, False),  # 64 blocks: D=256 from 96
     (4096, 256, dict(causal=True), 0, False),
     (8192, 64, dict(causal=True), 256, True),  # 43 blocks: persistent, the host's deal
     (16384, 64, dict(window=(-1, 100)), 256, True),  # a right bound alone
     (4096, 64, dict(causal=True), 0, False),  # 32 blocks: D=64 from 40
     (16384, 128, dict(causal=True), 0, False),  # D=128 keeps its folded strides
     (16384, 64, dict(window=(100, 0)), 0, False), (16384, 64, {}, 0, False),
     (16384, 256, dict(window=(100, 0)), 0, False), (16384, 256, {}, 0, False)],
)  # fmt: skip
def test_forward_causal_heads_go_rank_by_rank(seqlen, d, options, by_rank, table,
                                              monkeypatch):  # fmt: skip
    """MASKED_BY_RANK_BLOCKS: under a right bound alone, heads of MIN_BLOCKS_BY_RANK
    query blocks or more at D 64/256 go rank by rank in groups of heads: at D=64
    persistent programs take the blocks the host dealt them (RANK_TABLE), every block
    once; at D=256 a program per block. Windows bounded on the left, no mask, shorter
    heads and D=128 keep their schedule."""
    plan = _forward_plan(monkeypatch, seqlen, d, 3, options)
    blocks, items = plan.counts
    assert (plan.constexprs["BY_RANK"], plan.constexprs["TABLE"]) == (by_rank, table)
    if by_rank:
        assert not plan.constexprs["FOLD"]
    if table:
        assert plan.programs == min(132, items)
        offsets = plan.schedule[:plan.programs + 1]
        assert offsets[0] == plan.programs + 1 and offsets[-1] == len(plan.schedule)
        assert sorted(plan.schedule[offsets[0]:]) == list(range(items))
    elif by_rank:
        assert plan.programs == items == 3 * blocks and plan.schedule is None


@gluon
@pytest.mark.parametrize("why", ["capturing", "too many blocks"])
def test_forward_without_its_table_takes_folded_strides(why, monkeypatch):
    """Where the host's table cannot be used (a CUDA graph captures before it is on the
    device: tabled=False; more blocks than RANK_TABLE_ITEMS), a causal D=64 call takes
    the folded strides of persistent programs, no table."""
    from memattn.kernels import forward_sm90

    if why == "too many blocks":
        monkeypatch.setattr(forward_sm90, "RANK_TABLE_ITEMS", 4 * 86 - 1)  # 192-row blocks
    spec = spec_and_inputs(b=1, sq=16384, sk=16384, h=4, d=64, causal=True)[0]
    monkeypatch.setattr(forward_sm90.hopper, "sm_count", lambda device_index: 132)
    forward_sm90.hopper.forget_plans()
    try:
        plan = forward_sm90.plan(spec, False, (0, 0), 0, 0, tabled=why != "capturing")
    finally:
        forward_sm90.hopper.forget_plans()
    assert not plan.constexprs["TABLE"] and plan.schedule is None
    assert plan.constexprs["BY_RANK"] == 0 and plan.constexprs["FOLD"]
    assert plan.programs == 132


@gluon
@pytest.mark.parametrize(
    "b, h, bias_shape, options, heads",
    [(3, 8, (1, 8, 16, 16), dict(causal=True), 4),  # a plane per head the sequences share
     (3, 2, (1, 1, 16, 16), dict(window=(5, 3)), 2),  # one plane: at most H heads together
     (3, 8, (3, 8, 16, 16), dict(causal=True), 0),  # a plane per sequence: nothing shared
     (3, 8, (1, 8, 16, 16), dict(window=(5, -1)), 0),  # no right bound: blocks of equal work
     (3, 8, (1, 8, 16, 16), {}, 0),
     (3, 8, (1, 8, 1, 16), dict(causal=True), 0),  # a key row: no tiles
     (1, 8, (1, 8, 16, 16), dict(causal=True), 0),  # one sequence
     (129, 8, (1, 8, 16, 16), dict(causal=True), 0)],  # more than POSITION_SEQS
)  # fmt: skip
def test_packed_forward_goes_by_position_for_a_shared_bias_plane(b, h, bias_shape, options,
                                                                 heads, monkeypatch):  # fmt: skip
    """POSITION_HEADS: packed sequences sharing bias tiles under a right bound go by
    position (hopper.packed_position_block), heads in groups of POSITION_HEADS (at most
    H); every other packed or dense call goes sequence by sequence (0)."""
    from memattn.kernels import forward_sm90

    spec, q, _, _, bias = spec_and_inputs(b=b, h=h, bias_shape=bias_shape, varlen=True,
                                          **options)  # fmt: skip
    bias_row = forward_sm90.hopper.bias_row(spec, bias)
    dims = forward_sm90.hopper.bias_dims(bias)
    monkeypatch.setattr(forward_sm90.hopper, "sm_count", lambda device_index: 132)
    forward_sm90.hopper.forget_plans()
    try:
        plan = forward_sm90.plan(spec, bias_row, dims, q.shape[0], 0)
        dense = spec_and_inputs(b=b, h=h, bias_shape=bias_shape, **options)[0]
        dense_plan = forward_sm90.plan(dense, bias_row, dims, 0, 0)
    finally:
        forward_sm90.hopper.forget_plans()
    assert plan.constexprs["POSITION_HEADS"] == heads
    assert dense_plan.constexprs["POSITION_HEADS"] == 0


@gluon
@pytest.mark.parametrize(
    "scale, bias_shape, takes",
    [(0.125, (2, 1, 1, 16), True), (2.0, (1, 2, 1, 16), True),
     (0.0, (2, 1, 1, 16), False),  # a key row goes in as bias / scale
     (0.0, (2, 2, 16, 16), True)],  # bias tiles: any scale
)  # fmt: skip
def test_gluon_forward_takes_key_rows_at_positive_scales(scale, bias_shape, takes,
                                                         monkeypatch):  # fmt: skip
    """The Gluon forward's S wgmma starts from a key row in Q K^T's units, bias / scale
    (hopper.bias_row_scores): a softmax scale of 0 with one runs the tile forward."""
    monkeypatch.setattr(dispatch, "_gluon_takes", lambda *args: True)  # a Hopper GPU's call
    spec, q, k, v, bias = spec_and_inputs(d=128, bias_shape=bias_shape, scale=scale)
    assert dispatch.gluon_forward(spec, q, k, v, bias) is takes


@gluon
@pytest.mark.parametrize(
    "d, options, dbias_kind, buffers",
    [(64, {}, None, 2),
     (64, dict(dropout_p=0.1), None, 1),  # dropout's scratch: one
     (64, {}, "full", 0),  # dS leaves by TMA from the warpgroups
     (64, {}, "summed", 0),
     (128, dict(deterministic=True), "ordered", 0),  # the warpgroups add dQ in turns
     (64, {}, "added", 0),
     (64, {}, "row", 2),
     (128, {}, None, 0),  # DQ_WRITER: off at Dqk=128
     (128, dict(varlen=True), None, 2),  # but on for packed sequences without a mask
     (128, dict(varlen=True, causal=True), None, 0),
     (128, dict(causal=True, deterministic=True), None, 2)],  # ORDERED_DQ's turns
)  # fmt: skip
def test_backward_dq_writer_where_dqk_and_the_bias_gradient_allow(d, options, dbias_kind,
                                                                 buffers, monkeypatch):  # fmt: skip
    """The dQ writer warp's buffers (DQ_BUFS) in the plan: at the Dqk DQ_WRITER names
    (DQ_WRITER_PACKED_UNMASKED: packed sequences without a mask) and for ORDERED_DQ's
    calls, not beside a bias gradient sent by TMA; and at Dqk=128 too once DQ_WRITER
    says so."""
    spec = spec_and_inputs(d=d, sq=256, sk=256, **options)[0]
    backward_sm90 = dispatch.backward_sm90
    monkeypatch.setattr(backward_sm90.hopper, "sm_count", lambda device_index: 132)
    backward_sm90.hopper.forget_plans()  # plans are made from the knobs
    try:
        assert backward_sm90.narrow._plan(spec, False, dbias_kind, (False, False), 0, 0).constexprs[
            "DQ_BUFS"] == buffers
        monkeypatch.setattr(backward_sm90.narrow, "DQ_WRITER", {64: True, 128: True})
        backward_sm90.hopper.forget_plans()
        on = backward_sm90.narrow._plan(spec, False, dbias_kind, (False, False), 0, 0).constexprs
    finally:
        backward_sm90.hopper.forget_plans()
    tiles = dbias_kind in backward_sm90.shared.TILE_GRADIENTS
    assert on["DQ_BUFS"] == (buffers or (0 if tiles else 2))


@gluon
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("varlen", [False, True])
@pytest.mark.parametrize("knob", [True, False])
def test_idle_warpgroups_for_packed_sequences(d, varlen, knob, monkeypatch):
    """A last block's warpgroup past its sequence does no work (forward_sm90's
    IDLE_WARPGROUPS, backward_sm90's IDLE_HALVES) in packed calls; dense ones keep code
    without the check, also at lengths whose last block ends within its first half
    (1000: 104 rows past 7 blocks, 4000: 32)."""
    fsm, bsm = dispatch.forward_sm90, dispatch.backward_sm90
    monkeypatch.setattr(fsm, "IDLE_WARPGROUPS", knob)
    monkeypatch.setattr(bsm.narrow, "IDLE_HALVES", knob)
    monkeypatch.setattr(bsm.hopper, "sm_count", lambda device_index: 132)
    for length in (1000, 4000):
        spec, q, k = spec_and_inputs(b=3, sq=length, sk=length, d=d, varlen=varlen)[:3]
        tokens = (q.shape[0], k.shape[0]) if varlen else (0, 0)
        bsm.hopper.forget_plans()
        try:
            forward = fsm.plan(spec, False, (1, 1), tokens[0], 0).constexprs
            backward = bsm.narrow._plan(spec, False, None, (False, False), tokens[1], 0).constexprs
        finally:
            bsm.hopper.forget_plans()
        assert forward["IDLE_ROWS"] is (knob and varlen)
        assert backward["IDLE_KEYS"] is (knob and varlen)


@gluon
@pytest.mark.parametrize(
    "options, varlen, inner, persistent, fold",
    [({}, False, (False, False), "strides", False),
     (dict(causal=True), False, (False, False), "strides", True),  # blocks paired by work
     (dict(window=(100, 0)), False, (False, False), "strides", True),
     (dict(window=(100, -1)), False, (False, False), "strides", False),
     ({}, True, (False, False), "per block", False),  # blocks past a sequence's end
     ({}, False, (True, False), "per block", False),  # a summed bias gradient's order
     (dict(causal=True, deterministic=True), False, (False, False), "dealt", False),
     (dict(window=(100, -1), deterministic=True), False, (False, False), "dealt", False),
     (dict(causal=True, deterministic=True), True, (False, False), "per block", False),
     (dict(deterministic=True), False, (True, False), "per block", False)],
)  # fmt: skip
def test_backward_programs_persistent_where_the_blocks_order_is_free(
        options, varlen, inner, persistent, fold, monkeypatch):  # fmt: skip
    """The D 64/128 backward runs a program per SM at most, each walking key blocks in
    hopper.work_item's strides (paired by work under a right bound), except where the
    blocks' order is not free: packed sequences, a summed bias gradient's programs side
    by side, ORDERED_DQ's turns. Those turns of a dense batch without inner dims, which
    wait only on blocks earlier in the grid's order, walk the blocks the host dealt each
    program in that order (ORDERED_DEALT: the schedule's own test is test_hopper's)."""
    bsm = dispatch.backward_sm90
    monkeypatch.setattr(bsm.hopper, "sm_count", lambda device_index: 5)
    spec = spec_and_inputs(b=3, sq=1024, sk=1024, h=2, d=64, varlen=varlen, **options)[0]
    bsm.hopper.forget_plans()
    try:
        plan = bsm.narrow._plan(spec, False, None, inner, 3 * 1024 if varlen else 0, 0)
    finally:
        bsm.hopper.forget_plans()
    blocks = 3 * 2 * (1024 // bsm.narrow.BLOCK_N)
    if varlen:  # common.packed_items over the keys: one item more a (sequence, kv head)
        blocks = 3 * 2 * (1024 // bsm.narrow.BLOCK_N + 1)
    mode = {"per block": bsm.narrow.PER_BLOCK, "strides": bsm.narrow.STRIDES,
            "dealt": bsm.narrow.DEALT}[persistent]
    assert plan.constexprs["PERSISTENT"] == mode
    assert plan.constexprs["FOLD"] is fold
    assert plan.counts == (1024 // bsm.narrow.BLOCK_N, blocks, bsm.narrow.SPREAD_STEPS)
    assert plan.programs == (blocks if persistent == "per block" else 5)  # test_hopper's
    assert (plan.schedule is not None) is (persistent == "dealt")


@gluon
@pytest.mark.parametrize("options, persistent", [(dict(causal=True), False),
                                                 (dict(window=(100, 0)), False), ({}, True)])
def test_backward_masked_long_heads_run_a_program_per_block(options, persistent,
                                                            monkeypatch):  # fmt: skip
    """Past MASKED_PERSISTENT_MAX_BLOCKS key blocks a head, masked D=64 calls run a
    program per block (heaviest first) instead of folded strides; unmasked ones stay
    persistent."""
    bsm = dispatch.backward_sm90
    monkeypatch.setattr(bsm.hopper, "sm_count", lambda device_index: 5)
    monkeypatch.setattr(bsm.narrow, "MASKED_PERSISTENT_MAX_BLOCKS", 7)
    spec = spec_and_inputs(b=1, sq=1024, sk=1024, h=2, d=64, **options)[0]  # 8 blocks
    bsm.hopper.forget_plans()
    try:
        plan = bsm.narrow._plan(spec, False, None, (False, False), 0, 0)
    finally:
        bsm.hopper.forget_plans()
    assert plan.constexprs["PERSISTENT"] == (bsm.narrow.STRIDES if persistent
                                             else bsm.narrow.PER_BLOCK)
    assert not plan.constexprs["FOLD"]
    assert plan.programs == (5 if persistent else 2 * 8)


@gluon
@pytest.mark.parametrize("options, by_rank",
                         [({}, 0), (dict(causal=True), 256), (dict(window=(100, 0)), 256),
                          (dict(window=(100, -1)), 0),
                          (dict(causal=True, deterministic=True), 0)])  # fmt: skip
def test_masked_d128_backward_takes_its_blocks_rank_by_rank(options, by_rank,
                                                           monkeypatch):  # fmt: skip
    """Under a right bound at D=128 the backward runs a program per key block, heads in
    groups of MASKED_BY_RANK_BLOCKS blocks at least taking their blocks rank by rank
    (hopper.rank_major_item), not persistent programs (past SHORT_CAUSAL_KEYS keys)."""
    bsm = dispatch.backward_sm90
    monkeypatch.setattr(bsm.hopper, "sm_count", lambda device_index: 5)
    monkeypatch.setattr(bsm.shared, "SHORT_CAUSAL_KEYS", 512)
    spec = spec_and_inputs(b=3, sq=1024, sk=1024, h=2, d=128, **options)[0]
    bsm.hopper.forget_plans()
    try:
        plan = bsm.narrow._plan(spec, False, None, (False, False), 0, 0)
    finally:
        bsm.hopper.forget_plans()
    persistent = by_rank == 0  # ORDERED_DQ's dealt (test_backward_programs_persistent...)
    assert plan.constexprs["BY_RANK"] == by_rank
    assert bool(plan.constexprs["PERSISTENT"]) is persistent
    assert plan.programs == (5 if persistent else 3 * 2 * 8)  # one per SM, or per block


@gluon
@pytest.mark.parametrize("sk, options, folded", [
    (1024, dict(causal=True), True), (1024, dict(causal=True, align="bottom_right"), True),
    (1025, dict(causal=True), False),  # past SHORT_CAUSAL_KEYS
    (1024, dict(window=(100, 0)), False), (1024, dict(causal=True, deterministic=True), False),
    (1024, {}, False)])  # fmt: skip
def test_short_causal_d128_backward_runs_folded_strides(sk, options, folded, monkeypatch):
    """Causal D=128 calls of at most SHORT_CAUSAL_KEYS keys run as masked D=64 calls do:
    folded persistent strides (not rank by rank), dQ converted by head; longer ones,
    windows and deterministic calls keep their plans, unmasked ones their strides."""
    bsm = dispatch.backward_sm90
    monkeypatch.setattr(bsm.hopper, "sm_count", lambda device_index: 5)
    spec = spec_and_inputs(b=3, sq=1000, sk=sk, h=2, d=128, **options)[0]
    assert bsm.shared.folds_short_causal(spec) is folded
    assert bsm.shared.converts_dq_by_head(spec) is folded
    bsm.hopper.forget_plans()
    try:
        plan = bsm.narrow._plan(spec, False, None, (False, False), 0, 0)
    finally:
        bsm.hopper.forget_plans()
    if folded:
        assert plan.constexprs["BY_RANK"] == 0 and plan.constexprs["FOLD"]
        assert plan.constexprs["PERSISTENT"] == bsm.narrow.STRIDES and plan.programs == 5
    elif options.get("causal") and not options.get("deterministic"):
        assert plan.constexprs["BY_RANK"] > 0 and not plan.constexprs["FOLD"]


@gluon
@pytest.mark.parametrize("d, dv, options, bias_shape, per_step", [
    (128, 128, {}, None, False), (128, 128, dict(causal=True), None, False),
    (128, 128, dict(varlen=True), None, True), (128, 128, dict(varlen=True, causal=True), None,
                                                 True),  # packed sequences at 128/128
    (128, 64, dict(varlen=True), None, False), (64, 64, dict(varlen=True), None, False),
    (128, 128, dict(dropout_p=0.1), None, True), (128, 128, dict(softcap=30.0), None, True),
    (128, 128, {}, (1, 2, 16, 16), True), (128, 128, {}, (2, 1, 1, 16), True),
    (128, 64, dict(dropout_p=0.1), None, True), (64, 128, dict(softcap=30.0), None, True),
    (128, 64, {}, None, False), (64, 64, {}, (2, 1, 1, 16), True),
    (64, 64, dict(dropout_p=0.1), None, False), (64, 64, {}, (1, 2, 16, 16), False)])  # fmt: skip
def test_backward_makes_its_kv_views_each_step_where_they_would_spill(
        d, dv, options, bias_shape, per_step, monkeypatch):  # fmt: skip
    """KV_VIEWS_PER_STEP: the D 64/128 backward makes K's and V's views in each step where
    a feature holds registers across it beside a head dim of 128 (dropout, softcap,
    ALiBi, a bias), or a key row at D=64, and for packed sequences at 128/128 (where
    that measured faster); once a program otherwise."""
    bsm = dispatch.backward_sm90
    monkeypatch.setattr(bsm.hopper, "sm_count", lambda device_index: 5)
    spec, _, _, _, bias = spec_and_inputs(d=d, dv=dv, bias_shape=bias_shape, **options)
    bsm.hopper.forget_plans()
    try:
        plan = bsm.narrow._plan(spec, bsm.hopper.bias_row(spec, bias), None, (False, False), 0, 0)
    finally:
        bsm.hopper.forget_plans()
    assert plan.constexprs["KV_VIEWS_PER_STEP"] is per_step


@gluon
@pytest.mark.parametrize("varlen", [False, True])
@pytest.mark.parametrize("inner", [(False, False), (True, False)], ids=["packed grid", "inner"])
def test_only_packed_programs_past_their_end_may_return_first(varlen, inner, monkeypatch):
    """SKIP_EMPTY_KEY_BLOCKS lets the backward's programs past a packed sequence's end
    return first on the grid of the longest sequence's key blocks (SUMMED_BIAS_INNER's
    orders); the packed grid returns them in _packed_key_item, and a dense call's (no
    query under a mask) must still store zeros."""
    spec = spec_and_inputs(d=128, varlen=varlen)[0]
    backward_sm90 = dispatch.backward_sm90
    monkeypatch.setattr(backward_sm90.hopper, "sm_count", lambda device_index: 132)
    backward_sm90.hopper.forget_plans()
    try:
        plan = backward_sm90.narrow._plan(spec, False, None, inner, 0, 0)
        assert plan.constexprs["SKIP_PAST_END"] is (varlen and inner[0])
        monkeypatch.setattr(backward_sm90.narrow, "SKIP_EMPTY_KEY_BLOCKS", False)
        backward_sm90.hopper.forget_plans()  # plans are made from the knobs
        plan = backward_sm90.narrow._plan(spec, False, None, inner, 0, 0)
    finally:
        backward_sm90.hopper.forget_plans()
    assert not plan.constexprs["SKIP_PAST_END"]


@gluon
@pytest.mark.parametrize(
    "dqk, dv, bias_shape, options, forward, backward",
    [
        (128, 128, None, {}, True, True),
        (64, 64, None, {}, True, True),
        (256, 256, None, {}, True, True),
        (192, 128, None, dict(causal=True), True, True),  # MLA: O leaves through Q's buffer
        (192, 128, (2, 1, 1, 16), {}, True, True),  # a key row: 1 KiB more
        (192, 128, (2, 2, 16, 16), {}, True, True),  # bias tiles: 64-key tiles
        (192, 128, None, dict(dropout_p=0.1), True, True),  # dropout's scratch: room
        (128, 64, (2, 2, 16, 16), {}, True, True),
        (128, 64, None, dict(causal=True, dropout_p=0.1), True, True),
        (256, 128, None, {}, True, True),  # the wide kernels, as D=256
        (256, 64, None, dict(causal=True), True, True),
        (192, 64, None, {}, True, True),  # Q and K split, dK's columns 128 + 64
        # the head dims alone: gluon_backward_computes turns this bias away past Dqk=128
        (256, 128, (2, 2, 16, 16), {}, True, True),
        (64, 128, None, {}, True, True),  # V wider than q·k: O and dV as at D=128
        (128, 256, None, {}, True, True),  # V of 256 columns: D=256's tiles, the wide kernels
        (64, 256, None, dict(causal=True), True, True),
        (192, 256, None, {}, True, True),  # O in a buffer of its own: 224 KiB
        (192, 256, (2, 2, 16, 16), {}, False, True),  # bias tiles: no room
        (192, 192, None, {}, False, False),  # V's head dims: 64, 128, 256
        (96, 96, None, {}, False, False),
    ],
)  # fmt: skip
def test_gluon_head_dims(dqk, dv, bias_shape, options, forward, backward):
    """The Gluon forward's head dims: any pair of q·k's 64, 128, 192 or 256 and V's 64,
    128 or 256, where shared memory holds the buffers; the backward's: the same pairs
    (past 128 columns, bias, ALiBi and dropout are what gluon_backward_computes turns
    away)."""
    q = torch.randn(2, 16, 2, dqk, dtype=torch.float16)
    v = torch.randn(2, 16, 2, dv, dtype=torch.float16)
    bias = None if bias_shape is None else torch.randn(bias_shape, dtype=torch.float16)
    spec = check_call(q, q, v, bias=bias, **options)
    bias_row = dispatch.hopper.bias_row(spec, bias)
    assert dispatch.forward_sm90.takes_head_dims(spec, bias_row) is forward
    assert dispatch.backward_sm90.takes_head_dims(spec) is backward
    assert dispatch.hopper.qk_split(dqk) == (64 if dqk == 192 else 32 if dqk == 96 else 0)


def test_dk_dv_tiles_fit_their_staging_buffer():
    """The D 64/128 backward stages each warpgroup's dK and dV tiles (64 keys x Dqk, x Dv,
    16-bit) for their TMA stores in one of its dQ buffers (a dq_split part, fp32): every
    pair's dK fits there, and dV where V is no wider than q·k (else DV_STAGED sends it by
    plain stores: at 64/128 it overran the buffer, and dropout's one buffer a warpgroup
    showed it)."""
    from memattn.kernels.backward_sm90 import narrow, shared

    for dqk, dv in shared.HEAD_DIM_PAIRS:
        if max(dqk, dv) > 128:  # the wide kernels stage through a Q or dO slot
            continue
        for rows in {shared.BLOCK_M, narrow.BLOCK_M_D64} if dqk == 64 else {shared.BLOCK_M}:
            part_rows, part_cols = shared.dq_split(dqk, rows)
            buffer = part_rows * part_cols * 4
            assert 64 * dqk * 2 <= buffer, (dqk, rows)
            assert dv > dqk or 64 * dv * 2 <= buffer, (dqk, dv, rows)


def test_split_head_dims_take_the_split_backward():
    """Dqk=192 / Dv=128 (SPLIT_HEAD_DIM_PAIRS), Q and K split: no bias.
    _bwd_split_kernel adds dQ into the fp32 buffer, packed sequences too; deterministic
    calls and those with dropout, ALiBi or softcap take the D=256 kernels, whose dQ is
    written in the output dtype in one order (packed sequences too)."""
    backward_sm90 = dispatch.backward_sm90
    q = torch.randn(2, 16, 2, 192, dtype=torch.float16)
    v = torch.randn(2, 16, 2, 128, dtype=torch.float16)
    spec = check_call(q, q, v, causal=True)
    assert (192, 128) in backward_sm90.shared.SPLIT_HEAD_DIM_PAIRS
    assert backward_sm90.takes_head_dims(spec)
    assert backward_sm90.shared.fuses_split_dq(spec) and backward_sm90.dq_in_fp32(spec)
    assert backward_sm90.shared.dq_split(192, 64) == (64, 64)
    deterministic = check_call(q, q, v, causal=True, deterministic=True)
    assert not backward_sm90.shared.fuses_split_dq(deterministic)
    assert not backward_sm90.dq_in_fp32(deterministic)
    assert dispatch._gluon_deterministic(deterministic, None, False)
    assert dispatch.gluon_backward_computes(spec, None, False)
    for features in (dict(dropout_p=0.1), dict(softcap=5.0), dict(alibi_slopes=torch.rand(2))):
        with_feature = check_call(q, q, v, **features)  # the wide kernels take these
        assert dispatch.gluon_backward_computes(with_feature, None, False)
        assert not backward_sm90.shared.fuses_split_dq(with_feature)
        assert backward_sm90.is_wide(with_feature)
    assert backward_sm90.hopper.qk_split(192) == 64
    # packed sequences: on the fused kernel, deterministic ones on the wide kernels
    cu = torch.tensor([0, 5, 16], dtype=torch.int32)
    packed = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=11, max_seqlen_k=11)
    varlen = check_call(q[0], q[0], v[0], causal=True, **packed)
    assert dispatch.gluon_backward_computes(varlen, None, False)
    assert backward_sm90.shared.fuses_split_dq(varlen)
    varlen_det = check_call(q[0], q[0], v[0], causal=True, deterministic=True, **packed)
    assert dispatch.gluon_backward_computes(varlen_det, None, False)
    assert backward_sm90.is_wide(varlen_det)


@gluon
@pytest.mark.parametrize(
    "dqk, dv, forward, backward",
    [
        (128, 128, (128, 128), (128, 128)),  # the kernels' own
        (192, 64, (192, 64), (192, 64)),
        (96, 96, (128, 128), (128, 128)),  # the next wider: Phi-3's 96, Phi-2's 80
        (80, 80, (128, 128), (128, 128)),
        (72, 64, (72, 64), (128, 64)),  # 1.78x the work: the backward alone
        (40, 40, (64, 64), (64, 64)),
        (32, 32, (32, 32), (64, 64)),  # twice the work: the backward alone
        (24, 24, (24, 24), (24, 24)),  # no kernel's (the tile kernels)
        (64, 17, (64, 17), (64, 17)),
        (160, 128, (192, 128), (192, 128)),  # Q and K split, 128 + 64 columns
        (200, 200, (256, 256), (256, 256)),
        (48, 112, (64, 128), (64, 128)),
        (128, 192, (128, 256), (128, 256)),  # V: 64, 128, 256
    ],
)  # fmt: skip
def test_kernel_head_dims(dqk, dv, forward, backward):
    """Head dims the Gluon kernels are not built for run as the next wider ones
    (kernel_spec) within MAX_PADDED_WORK; the spec is the call's but for them."""
    q = torch.randn(2, 16, 2, dqk, dtype=torch.float16)
    v = torch.randn(2, 16, 2, dv, dtype=torch.float16)
    spec = check_call(q, q, v, causal=True)
    for which, kernel in (("forward", forward), ("backward", backward)):
        assert dispatch.kernel_head_dims(dqk, dv, which) == kernel
        kspec = dispatch.kernel_spec(spec, which)
        assert (kspec.head_dim_qk, kspec.head_dim_v) == kernel
        assert dataclasses.replace(kspec, head_dim_qk=dqk, head_dim_v=dv) == spec
        assert kspec.scale == pytest.approx(dqk**-0.5)  # the call's own


@gluon
@pytest.mark.parametrize("varlen", [False, True])
@pytest.mark.parametrize("bias_shape, kv_stages", [
    (None, 3), ((3, 1, 1024, 1024), 2), ((3, 1, 1, 1024), 3), ((3, 2, 1024, 1024), 2)])
def test_wide_backward_plans(varlen, bias_shape, kv_stages):
    """The wide kernels' launches: dK/dV a program per 64-key block, dQ one per 128-query
    block (packed sequences: common.packed_items over the keys and over the queries, one
    item more a (sequence, head)); bias tiles beside K's in the dQ kernel take a stage
    of its K and V rings, a key row (read by pointer) none; a bias gradient made by the
    dK/dV kernel (DBIAS_FULL, DBIAS_SUM, DBIAS_ROW)."""
    bsm = dispatch.backward_sm90
    spec, _, _, _, bias = spec_and_inputs(b=3, sq=1024, sk=1024, h=2, d=256, varlen=varlen,
                                          bias_shape=bias_shape)  # fmt: skip
    row = bsm.hopper.bias_row(spec, bias)
    tokens = (3 * 1024, 3 * 1024) if varlen else (0, 0)
    kinds = [None] + ([bsm.dbias_kind_of(spec, bias)] if bias is not None else [])
    for kind in kinds:
        dkdv, dq = bsm.wide._plans_wide(spec, row, kind, *tokens, 0)
        assert dkdv.programs == 3 * 2 * (1024 // bsm.wide.BLOCK_N_WIDE + varlen)
        assert dq.programs == 3 * 2 * (1024 // 128 + varlen)
        for plan in (dkdv, dq):
            assert plan.constexprs["IS_VARLEN"] is varlen
            assert plan.constexprs["HAS_BIAS"] is (bias is not None and not row)
            assert plan.constexprs["BIAS_ROW"] is row
        flags = tuple(dkdv.constexprs[f"DBIAS_{k}"] for k in ("FULL", "SUM", "ROW"))
        assert flags == (kind == "full", kind == "summed", kind == "row")
        assert not any(f"DBIAS_{k}" in dq.constexprs for k in ("FULL", "SUM", "ROW"))
        # dQ's kernel starts as the dK/dV grid's last wave frees SMs (DQ_AS_DEPENDENT)
        assert dkdv.constexprs["DQ_DEPENDENT"] and dq.constexprs["DEPENDENT"]
        assert dq.constexprs["launch_pdl"] and "launch_pdl" not in dkdv.constexprs
    assert dq.constexprs["KV_STAGES"] == kv_stages


@gluon
@pytest.mark.parametrize("dv, bias_shape, grad, options, by_role", [
    (256, None, False, {}, True), (256, None, False, dict(causal=True), True),
    (256, None, False, dict(window=(100, 7)), True), (256, None, False, dict(varlen=True), True),
    (256, None, False, dict(h_kv=1), True),  # GQA
    (256, None, False, dict(softcap=30.0, window=(100, 0)), True),
    (256, None, False, dict(alibi_slopes=torch.rand(2)), True),
    (256, (2, 1, 1, 64), False, {}, True), (256, (2, 1, 1, 64), True, {}, True),  # a key row
    (128, None, False, {}, False),  # another V width
    (256, (2, 2, 64, 64), False, {}, False),  # bias tiles: no room beside P's slots
    (256, (1, 2, 64, 64), True, {}, False),
    (256, None, False, dict(dropout_p=0.1), False)])  # fmt: skip
def test_wide_dk_dv_by_role_without_bias_tiles_or_dropout(dv, bias_shape, grad, options, by_role,
                                                         monkeypatch):  # fmt: skip
    """BY_ROLE: the D=256 dK/dV kernel's warpgroups split its matmuls by role (one P and
    dV, the other dS and dK) at 256/256, masked, packed or grouped, beside softcap,
    ALiBi and a key row's bias and gradient; the split by keys and columns beside bias
    tiles, dropout and other V widths, and where the knob is off."""
    bsm = dispatch.backward_sm90
    options = dict(options)
    varlen = options.pop("varlen", False)
    h_kv = options.pop("h_kv", 2)
    spec, q, _, _, bias = spec_and_inputs(sq=64, sk=64, h=2, d=256, dv=dv, varlen=varlen,
                                          bias_shape=bias_shape, **options)  # fmt: skip
    if h_kv != 2:
        k = torch.randn(2, 64, h_kv, 256, dtype=torch.float16)
        spec = check_call(q, k, k, **options)
    row = bsm.hopper.bias_row(spec, bias)
    kind = bsm.dbias_kind_of(spec, bias) if grad else None
    assert bsm.wide.by_role(spec, row, kind) is by_role
    tokens = (2 * 64, 2 * 64) if varlen else (0, 0)
    bsm.hopper.forget_plans()
    try:
        dkdv, _ = bsm.wide._plans_wide(spec, row, kind, *tokens, 0)
        assert dkdv.constexprs["ROLES"] is by_role
        monkeypatch.setattr(bsm.wide, "BY_ROLE", False)
        assert not bsm.wide.by_role(spec, row, kind)
    finally:
        bsm.hopper.forget_plans()


@gluon
@pytest.mark.parametrize("seqlen, options, by_rank, fold", [
    (8192, dict(causal=True), 256, False), (4096, dict(causal=True), 0, True),  # 64, 32 blocks
    (8192, dict(window=(100, 0)), 0, True), (8192, {}, 0, False)])  # fmt: skip
def test_wide_dq_takes_causal_heads_of_many_blocks_rank_by_rank(seqlen, options, by_rank, fold):
    """The wide dQ kernel's grid as the forward's D=256 one: under a right bound alone,
    heads of DQ_MIN_BLOCKS_BY_RANK query blocks or more a program per block, rank by
    rank in groups (DQ_MASKED_BY_RANK_BLOCKS); shorter or windowed heads in folded pairs."""
    bsm = dispatch.backward_sm90
    spec = spec_and_inputs(b=1, sq=seqlen, sk=seqlen, h=3, d=256, **options)[0]
    bsm.hopper.forget_plans()
    try:
        _, dq = bsm.wide._plans_wide(spec, False, None, 0, 0, 0)
    finally:
        bsm.hopper.forget_plans()
    assert (dq.constexprs["BY_RANK"], dq.constexprs["FOLD"]) == (by_rank, fold)
    assert dq.programs == 3 * (seqlen // 128) // (2 if fold else 1)


@gluon
@pytest.mark.parametrize("b, bias_shape, kind, strides", [
    (1, (1, 2, 16, 16), "full", (2 * 16 * 16, 16 * 16, 16)),
    (1, (2, 16, 16), "full", (2 * 16 * 16, 16 * 16, 16)),  # (H, Sq, Sk) at B = 1
    (2, (2, 16, 16), "summed", (2 * 16 * 16, 16 * 16, 16)),  # over the batch
    (2, (16, 16), "summed", (16 * 16, 16 * 16, 16)),  # over both
    (1, (1, 1, 1, 16), "row", (2 * 16, 16, 0)),  # the (B, H, Sk) buffer's
])  # fmt: skip
def test_wide_grad_strides(b, bias_shape, kind, strides):
    """The (batch, head, query) strides the wide dK/dV kernel takes a bias gradient by: a
    full one's, or a summed one's fp32 buffer in the bias's shape, as a 4-D view whatever
    dims the bias has; a key row's (B, H, Sk) fp32 buffer's with no query stride."""
    bsm = dispatch.backward_sm90
    spec, _, _, _, bias = spec_and_inputs(b=b, h=2, d=256, bias_shape=bias_shape)
    assert bsm.dbias_kind_of(spec, bias) == kind
    grad = (torch.empty(spec.batch, spec.heads, spec.seqlen_k) if kind == "row"
            else torch.empty(bias.shape))  # fmt: skip
    assert bsm.wide.wide_grad_strides(spec, grad, kind) == strides
    assert bsm.wide.wide_grad_strides(spec, None, None) == (0, 0, 0)


@gluon
@pytest.mark.parametrize("dqk", [64, 128, 192])
def test_wide_v_takes_the_wide_backward(dqk):
    """V of 256 columns beside a narrower q·k: the wide kernels, dQ written in the
    output dtype (deterministic as it is), what they compute (dropout, packed sequences,
    a bias, the gradient of a full one or a key row); the forward on D=256's tiles with O
    in a buffer of its own."""
    backward_sm90, forward_sm90 = dispatch.backward_sm90, dispatch.forward_sm90
    q = torch.randn(2, 16, 2, dqk, dtype=torch.float16)
    v = torch.randn(2, 16, 2, 256, dtype=torch.float16)
    spec = check_call(q, q, v, causal=True)
    assert backward_sm90.is_wide(spec) and not backward_sm90.shared.fuses_split_dq(spec)
    assert not backward_sm90.dq_in_fp32(spec)
    assert backward_sm90.wide.dq_block_n(spec) == backward_sm90.wide.DQ_BLOCK_N[256]
    assert dispatch._gluon_deterministic(check_call(q, q, v, deterministic=True), None, False)
    assert dispatch.gluon_backward_computes(spec, None, False)
    assert dispatch.gluon_backward_computes(check_call(q, q, v, dropout_p=0.1), None, False)
    bias = torch.randn(2, 2, 16, 16, dtype=torch.float16)  # read, and a full one's gradient
    assert dispatch.gluon_backward_computes(check_call(q, q, v, bias=bias), bias, False)
    assert dispatch.gluon_backward_computes(check_call(q, q, v, bias=bias), bias, True)
    shared = bias[:1]  # and one summed over the batch (by atomics: not deterministic)
    assert dispatch.gluon_backward_computes(check_call(q, q, v, bias=shared), shared, True)
    det = check_call(q, q, v, bias=shared, deterministic=True)
    assert not dispatch._gluon_deterministic(det, shared, True)
    assert dispatch._gluon_deterministic(det, shared, False)
    cu = torch.tensor([0, 5, 16], dtype=torch.int32)
    varlen = check_call(q[0], q[0], v[0], cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=11,
                        max_seqlen_k=11)
    assert dispatch.gluon_backward_computes(varlen, None, False)
    assert forward_sm90.tile_dim(dqk, 256) == 256 and not forward_sm90.o_in_q(dqk, 256)
    assert forward_sm90.o_in_q(dqk, 128) is (dqk == 192)



def _visits(n, seqlen_q, off, left, right, block_m, block_n):
    """The query tiles (first rows) key block n's program walks: common.query_range's
    lo and hi, restated in Python (left, right: None where unbounded)."""
    lo = 0 if right is None else max(n * block_n - off - right, 0) // block_m * block_m
    hi = seqlen_q if left is None else min(seqlen_q, (n + 1) * block_n - off + left)
    return list(range(lo, max(hi, lo), block_m))


@gluon
@pytest.mark.parametrize(
    "seqlen_q, seqlen_k, align, window",
    [(777, 1030, "top_left", None), (2000, 333, "top_left", None), (64, 4096, "top_left", None),
     (1531, 1531, "top_left", (-1, 0)), (1000, 300, "bottom_right", (-1, 0)),
     (300, 1000, "bottom_right", (-1, 0)), (900, 900, "top_left", (200, 0)),
     (600, 1000, "top_left", (300, 40)), (4096, 4096, "top_left", None),
     (9000, 9000, "top_left", None), (700, 9100, "top_left", None),  # more than 66 blocks
     (900, 900, "top_left", (200, -1)), (1000, 300, "bottom_right", (100, -1)),
     (300, 1000, "bottom_right", (500, -1)), (2000, 2000, "top_left", (0, -1))],
)  # fmt: skip
@pytest.mark.parametrize("block_m", [64, 128])
def test_ordered_dq_turns_follow_the_walks(seqlen_q, seqlen_k, align, window, block_m):
    """ORDERED_DQ's turns (backward_sm90.turns.dq_add_turn), run in Python against the walks
    the programs make (_query_tile's, rotated without bounds where a head's blocks all
    fit on half of 132 SMs: rotates_dq): at every query tile the turns of the key blocks
    that add into it are 0, 1, ... in the order the blocks reach it, ties in the order
    the programs start (under a right bound the later block first, as the grid is
    then; rotated, the later block first too, all running at once). In that order no
    rotated program waits in the steady state, and no two wait on each other: a turn
    waits only on a program that reached the tile earlier in its own walk, or as early
    and started before it."""
    bsm = dispatch.backward_sm90
    block_n = bsm.narrow.BLOCK_N
    left, right = (-1, -1) if window is None else window
    off = seqlen_k - seqlen_q if align == "bottom_right" else 0
    num_n = -(-seqlen_k // block_n)
    rotate = left < 0 and right < 0 and num_n <= 132 // 2
    assert rotate == (window is None and num_n <= 66)
    later_first = rotate or right >= 0
    arrivals = {}  # first row -> [(step, tie, turn)]
    for n in range(num_n):
        tiles = _visits(n, seqlen_q, off, None if left < 0 else left,
                        None if right < 0 else right, block_m, block_n)  # fmt: skip
        rot = n * len(tiles) // num_n if rotate else 0
        for step in range(len(tiles)):
            start_m = tiles[(step + rot) % len(tiles)]
            turn = bsm.turns.dq_add_turn.fn(n, start_m, num_n, len(tiles), off, left, right,
                                      block_m, block_n, left >= 0, right >= 0, rotate)
            arrivals.setdefault(start_m, []).append((step, -n if later_first else n, turn))
    assert arrivals
    for start_m, blocks in arrivals.items():
        assert [turn for _, _, turn in sorted(blocks)] == list(range(len(blocks))), start_m


@gluon
@pytest.mark.parametrize(
    "options, varlen, bias_shape, ordered, rotate",
    [(dict(causal=True), False, None, True, False),
     ({}, False, None, True, True),
     (dict(window=(300, 40)), False, None, True, False),
     (dict(window=(300, -1)), False, None, True, False),  # a left bound alone: first first
     (dict(causal=True), True, None, True, False),  # packed sequences: their own blocks
     ({}, True, None, True, True),
     (dict(causal=True), False, (2, 2, 16, 16), False, False),  # dS leaves by TMA
     (dict(causal=True), False, (2, 1, 1, 16), True, False),  # a key row's gradient
     (dict(causal=True), False, (1, 2, 16, 16), True, False),  # summed: "ordered"
     ({}, False, (2, 1, 16, 16), True, True)],
)  # fmt: skip
def test_ordered_dq_takes_deterministic_calls(options, varlen, bias_shape, ordered, rotate,
                                              monkeypatch):  # fmt: skip
    """ORDERED_DQ takes deterministic D 64/128 calls of dense or packed batches, without
    a bias gradient sent by TMA but a summed one's (added in turns too, "ordered"); there
    the plan has the dQ writer warp (not beside the summed tiles: the compute warpgroups
    add dQ themselves), and the rotated walk without a right bound. Off, and for calls
    that are not deterministic, nothing changes."""
    bsm = dispatch.backward_sm90
    monkeypatch.setattr(bsm.hopper, "sm_count", lambda device_index: 132)
    spec, *_, bias = spec_and_inputs(d=128, bias_shape=bias_shape, varlen=varlen,
                                     deterministic=True, **options)  # fmt: skip
    kind = None if bias is None else bsm.dbias_kind_of(spec, bias)
    monkeypatch.setattr(bsm.narrow, "ORDERED_DQ", False)
    assert not bsm.orders_dq(spec, kind)
    monkeypatch.setattr(bsm.narrow, "ORDERED_DQ", True)
    bsm.hopper.forget_plans()  # plans are made from the knobs
    try:
        plan = bsm.narrow._plan(spec, bsm.hopper.bias_row(spec, bias), kind, (False, False), 0, 0)
    finally:
        bsm.hopper.forget_plans()
    assert bsm.orders_dq(spec, kind) is ordered
    assert plan.constexprs["ORDERED"] is ordered
    assert plan.constexprs["ROTATE"] == (bsm.narrow.ROTATE_BY_BLOCK if rotate
                                         else bsm.narrow.ROTATE_NONE)
    assert (plan.constexprs["DQ_BUFS"] > 0) is (ordered and kind != "ordered")
    assert plan.constexprs["DBIAS_SUM"] is (kind == "ordered")
    plain = dataclasses.replace(spec, deterministic=False)
    assert not bsm.orders_dq(plain, kind)


@gluon
@pytest.mark.parametrize("bias_shape, inner, rotate",
                         [((1, 4), (True, False), False),  # over the batch alone
                          ((2, 1), (False, True), False),  # over the kv heads
                          ((), (False, False), True)])  # over both: the shipped order
def test_ordered_bias_sum_keeps_the_summed_order(bias_shape, inner, rotate, monkeypatch):
    """An "ordered" bias gradient runs its programs in the summed gradient's order (a
    tile's adds from programs side by side, whose turns then come close together), its
    key blocks last first under a right bound; its dQ turns rotate only where all the
    programs among which a head's blocks lie fit on half the SMs."""
    bsm = dispatch.backward_sm90
    monkeypatch.setattr(bsm.hopper, "sm_count", lambda device_index: 8)
    sk = 4 * bsm.narrow.BLOCK_N
    spec, *_, bias = spec_and_inputs(d=128, h=4, sk=sk, deterministic=True,
                                     bias_shape=(*bias_shape, 16, sk))  # fmt: skip
    kind = bsm.dbias_kind_of(spec, bias)
    assert kind == "ordered"
    plain = dataclasses.replace(spec, deterministic=False)
    assert bsm.narrow.inner_dims(spec, bias, kind) == inner
    assert bsm.narrow.inner_dims(plain, bias, bsm.dbias_kind_of(plain, bias)) == inner
    assert bsm.narrow.rotates_dq(spec, inner) is rotate  # 4 blocks a head, x2 or x4


@gluon
@pytest.mark.parametrize("batch, heads, kv_heads", [(3, 4, 2), (2, 6, 6), (1, 4, 1)])
@pytest.mark.parametrize("bias_dims", [(1, "H"), ("B", 1), (1, 1)], ids=str)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("stagger", [0, 1, 2])
def test_ordered_bias_sum_turns_follow_the_programs(batch, heads, kv_heads, bias_dims,
                                                    causal, stagger, monkeypatch):  # fmt: skip
    """An "ordered" bias gradient's turns (backward_sm90.turns.bias_sum_turn), run in
    Python over the programs in the order the grid starts them (_key_block's, with the
    summed order's inner dims and, under a right bound, key blocks last first, each
    batch's `stagger` ranks after the one before where the batch alone is inner:
    narrow._staggered_item): at each summed tile the (b, h)s that add into it take turns
    0, 1, ... in the order their programs start (a program's GQA heads in its walk's
    order), so that a program waits only on programs started before it or on its own
    earlier steps (dQ's turns too, under the causal mask); and the tiles' counters are
    within the count backward() allocates."""
    bsm = dispatch.backward_sm90
    monkeypatch.setattr(bsm.narrow.gl, "cdiv", lambda a, b: -(-a // b))  # run in Python
    monkeypatch.setattr(bsm.narrow.gl, "minimum", min)
    monkeypatch.setattr(bsm.narrow.gl, "maximum", max)
    block_m, block_n, seqlen_q, seqlen_k = 64, bsm.narrow.BLOCK_N, 300, 520
    planes_b = batch if bias_dims[0] == "B" else 1
    planes_h = heads if bias_dims[1] == "H" else 1
    q = torch.zeros(batch, seqlen_q, heads, 64)
    k = torch.zeros(batch, seqlen_k, kv_heads, 64)
    bias = torch.zeros(planes_b, planes_h, seqlen_q, seqlen_k)
    spec = check_call(q, k, k, bias=bias, causal=causal, deterministic=True)
    kind = bsm.dbias_kind_of(spec, bias)
    if (planes_b, planes_h) == (batch, heads):  # nothing summed: a full gradient
        assert kind == "full"
        return
    assert kind == "ordered"
    batch_inner, head_inner = bsm.narrow.inner_dims(spec, bias, kind)
    num_n, group, tiles_q = -(-seqlen_k // block_n), heads // kv_heads, -(-seqlen_q // block_m)
    staggered = causal and (batch_inner, head_inner) == (True, False) and stagger > 0
    order = []  # (b, kv head, key block) in the order the grid starts them
    for pid in range(batch * kv_heads * num_n):
        item = bsm.narrow._staggered_item.fn(pid, num_n, batch, stagger) if staggered else pid
        rest = item
        if batch_inner or head_inner:
            b = rest % batch if batch_inner else None
            rest //= batch if batch_inner else 1
            hk = rest % kv_heads if head_inner else None
            rest //= kv_heads if head_inner else 1
            n, rest = rest % num_n, rest // num_n
            hk = rest % kv_heads if hk is None else hk
            rest //= 1 if head_inner else kv_heads
            b = rest if b is None else b
        else:
            (b, hk), n = divmod(rest // num_n, kv_heads), rest % num_n
        order.append((b, hk, num_n - 1 - n if causal else n))
    if staggered:  # each kv head's blocks by rank + stagger * batch, then batch
        for head in range(kv_heads):
            keys = [(num_n - 1 - n + stagger * b, b) for b, hk, n in order if hk == head]
            assert keys == sorted(keys) and len(set(keys)) == batch * num_n
    arrivals, dq_arrivals, locks = {}, {}, set()
    for start, (b, hk, n) in enumerate(order):
        for g in range(group):
            h = hk * group + g
            for m in range(tiles_q):
                if causal and n * block_n > m * block_m + block_m - 1:
                    continue  # no row of the tile sees the block
                lock, turn = bsm.turns.bias_sum_turn.fn(
                    b, h, m * block_m, n * block_n, seqlen_q, seqlen_k, heads, planes_b,
                    planes_h, block_m, block_n)  # fmt: skip
                arrivals.setdefault(lock, []).append((start, g, turn))
                locks.add(lock)
                if causal:  # dQ's turns: the later block first, started first
                    dq_turn = bsm.turns.dq_add_turn.fn(
                        n, m * block_m, num_n, 0, 0, -1, 0, block_m, block_n, False, True,
                        False)  # fmt: skip
                    dq_arrivals.setdefault((b, h, m), []).append((start, dq_turn))
    assert max(locks) < planes_b * planes_h * tiles_q * num_n
    summed = batch * heads // (planes_b * planes_h)
    for lock, adds in arrivals.items():
        assert [turn for _, _, turn in sorted(adds)] == list(range(summed)), lock
    for tile, adds in dq_arrivals.items():
        assert [turn for _, turn in sorted(adds)] == list(range(len(adds))), tile


@gluon
@pytest.mark.parametrize("batch, heads, kv_heads, seqlen_q", [
    (2, 6, 3, 520),  # GQA heads summed within a program too
    (3, 8, 8, 700),
    (1, 4, 4, 130)])  # more kv heads than query tiles: some start together
@pytest.mark.parametrize("spread_steps", [0, 1, 2])
def test_spread_bias_sum_turns_follow_the_visits(batch, heads, kv_heads, seqlen_q,
                                                 spread_steps, monkeypatch):  # fmt: skip
    """A bias gradient summed over heads, without bounds (narrow.walk_rotation's
    SPREAD_OVER_KV_HEADS): the kv heads start their walks spread_steps apart, and each
    summed tile's turns (turns.spread_sum_turn) go 0, 1, ... in the order they reach it (by
    step, the later kv head first at the same step), so that every wait is on an add made
    at an earlier step or by a program that gets there at once; a head's key blocks
    still reach each of its dQ tiles at the same step (dQ adds first block first, behind
    no later one). One shared over batches keeps its walks alike. Run in Python."""
    bsm = dispatch.backward_sm90
    narrow, turns = bsm.narrow, bsm.turns
    monkeypatch.setattr(turns.gl, "cdiv", lambda a, b: -(-a // b))  # run in Python
    monkeypatch.setattr(turns.gl, "minimum", min)
    monkeypatch.setattr(turns, "spread_span", turns.spread_span.fn)
    monkeypatch.setattr(bsm.hopper, "sm_count", lambda device_index: 2 * max(batch, kv_heads))
    block_m, block_n, seqlen_k = 64, narrow.BLOCK_N, 4 * narrow.BLOCK_N
    q = torch.zeros(batch, seqlen_q, heads, 64)
    k = torch.zeros(batch, seqlen_k, kv_heads, 64)

    def rotation(planes):
        bias = torch.zeros(*planes, seqlen_q, seqlen_k)
        spec = check_call(q, k, k, bias=bias, deterministic=True)
        kind = bsm.dbias_kind_of(spec, bias)
        return spec, narrow.walk_rotation(spec, kind, narrow.inner_dims(spec, bias, kind))

    if batch > 1:  # summed over the batch: the walks alike
        assert rotation((1, heads))[1] == narrow.ROTATE_NONE
    spec, rotate = rotation((batch, 1))
    assert rotate == narrow.SPREAD_OVER_KV_HEADS
    assert narrow.walk_rotation(spec, None, (False, True)) != rotate  # dQ's turns alone
    num_n, group, tiles = -(-seqlen_k // block_n), heads // kv_heads, -(-seqlen_q // block_m)
    blocks = (0, batch * kv_heads * num_n, kv_heads, None, None, seqlen_q, seqlen_k, num_n, -1,
              -1, spread_steps)  # fmt: skip
    arrivals, dq_steps = {}, {}
    for b in range(batch):
        for hk in range(kv_heads):
            span = turns.spread_span(tiles, blocks)
            for n in range(num_n):
                rot = turns.walk_start.fn(hk, n * block_n, tiles, seqlen_k, blocks, block_n,
                                          rotate)  # fmt: skip
                for t in range(group * tiles):  # _query_tile's walk
                    g, m = divmod(t, tiles)
                    m = (m + rot) % tiles
                    h = hk * group + g
                    lock, _ = turns.bias_sum_turn.fn(
                        b, h, m * block_m, n * block_n, seqlen_q, seqlen_k, heads, batch, 1,
                        block_m, block_n)  # fmt: skip
                    turn = g * kv_heads + turns.spread_sum_turn.fn(m, hk, kv_heads, span)
                    arrivals.setdefault(lock, []).append(((t, -hk), turn))  # as step_turns
                    dq_steps.setdefault((b, h, m), set()).add(t)
    for lock, adds in arrivals.items():
        assert len({when for when, _ in adds}) == heads, lock  # no two at once, same rank
        assert [turn for _, turn in sorted(adds)] == list(range(heads)), lock
    assert all(len(steps) == 1 for steps in dq_steps.values())


def _take_turns(walks: list[list]) -> dict:
    """Runs the programs' walks (each a list of steps, a step its (lock, turn) waits) in
    Python, each program as far as its turns let it, over and over; asserts that every
    program finishes (none waits on a turn that never comes) and returns the counters."""
    counters, at = {}, [0] * len(walks)
    moved = True
    while moved:
        moved = False
        for p, walk in enumerate(walks):
            while at[p] < len(walk) and all(counters.get(lock, 0) == turn
                                            for lock, turn in walk[at[p]]):
                for lock, _ in walk[at[p]]:
                    counters[lock] = counters.get(lock, 0) + 1
                at[p] += 1
                moved = True
    assert at == [len(walk) for walk in walks], "a program waits for a turn that never comes"
    return counters


@gluon
@pytest.mark.parametrize("options, seqlen_q, seqlen_k", [
    (dict(causal=True), 700, 1030),
    (dict(causal=True), 1000, 1024),  # 8 blocks a head: folded on 5 SMs, not on 3
    (dict(causal=True, align="bottom_right"), 1030, 700),
    (dict(window=(200, 30)), 900, 900),
    (dict(window=(300, -1)), 600, 1030),  # a left bound alone: first block first
    ({}, 500, 1030)])  # no bound, more blocks than half the SMs: first block first
@pytest.mark.parametrize("summed", [False, True], ids=["dq", "dq and 11QK's sum"])
@pytest.mark.parametrize("sms", [3, 5])
def test_dealt_ordered_programs_take_every_turn(options, seqlen_q, seqlen_k, summed, sms,
                                                monkeypatch):  # fmt: skip
    """ORDERED_DEALT: the persistent programs walk the blocks the host dealt them
    (plan.schedule) or, a summed bias gradient's under a causal mask with an even count
    of blocks a head, hopper.work_item's folded strides (ORDERED_SUM_FOLD), each block's
    steps in order, a step done once its turns come (dQ's tile and, with a bias summed
    over batch and heads, the summed tile's), counting them on. Run in Python over
    those walks, every program finishes: no program waits on a block that a program
    waiting on it holds; and every (b, h) adds into each summed tile."""
    bsm = dispatch.backward_sm90
    narrow, turns = bsm.narrow, bsm.turns
    monkeypatch.setattr(bsm.hopper, "sm_count", lambda device_index: sms)
    monkeypatch.setattr(turns.gl, "cdiv", lambda a, b: -(-a // b))  # run in Python
    batch, heads, kv_heads = 2, 4, 2
    q = torch.zeros(batch, seqlen_q, heads, 64)
    k = torch.zeros(batch, seqlen_k, kv_heads, 64)
    bias = torch.zeros(seqlen_q, seqlen_k) if summed else None
    spec = check_call(q, k, k, bias=bias, deterministic=True, **options)
    kind = bsm.dbias_kind_of(spec, bias) if summed else None
    assert kind == ("ordered" if summed else None)
    inner = narrow.inner_dims(spec, bias, kind)
    bsm.hopper.forget_plans()
    try:
        plan = narrow._plan(spec, False, kind, inner, 0, 0)
    finally:
        bsm.hopper.forget_plans()
    assert plan.constexprs["ROTATE"] == narrow.ROTATE_NONE
    block_m, block_n = plan.constexprs["BLOCK_M"], narrow.BLOCK_N
    num_n, items = plan.counts[:2]
    folds = (summed and spec.window_left < 0 and spec.window_right >= 0 and num_n % 2 == 0
             and num_n // 2 <= sms)
    assert plan.constexprs["FOLD"] is folds
    if folds:  # hopper.work_item's folded strides, light block first
        assert plan.constexprs["PERSISTENT"] == narrow.STRIDES
        dealt = []
        for p in range(plan.programs):
            count = bsm.hopper.work_items.fn(p, plan.programs, items, True)
            pairs = [bsm.hopper.work_item.fn(p, j, plan.programs, num_n, True)
                     for j in range(count)]  # fmt: skip
            dealt.append([head * num_n + rank for head, rank in pairs])
    else:
        assert plan.constexprs["PERSISTENT"] == narrow.DEALT
        table = plan.schedule
        dealt = [table[table[p]:table[p + 1]] for p in range(plan.programs)]
    assert plan.programs <= sms and sorted(sum(map(list, dealt), [])) == list(range(items))
    left, right = spec.window_left, spec.window_right
    off = seqlen_k - seqlen_q if spec.bottom_right else 0

    def steps(item):  # _key_block's item: (b, kv head), then its block (last first, bounded)
        (b, hk), rank = divmod(item // num_n, kv_heads), item % num_n
        n = num_n - 1 - rank if right >= 0 else rank
        tiles = _visits(n, seqlen_q, off, None if left < 0 else left,
                        None if right < 0 else right, block_m, block_n)  # fmt: skip
        for g in range(spec.group):
            for start_m in tiles:
                h = hk * spec.group + g
                waits = [(("dq", b, h, start_m), turns.dq_add_turn.fn(
                    n, start_m, num_n, len(tiles), off, left, right, block_m, block_n,
                    left >= 0, right >= 0, narrow.ROTATE_NONE))]  # fmt: skip
                if summed:
                    lock, turn = turns.bias_sum_turn.fn(b, h, start_m, n * block_n, seqlen_q,
                                                        seqlen_k, heads, 1, 1, block_m, block_n)
                    waits.append((("sum", lock), turn))
                yield waits

    counters = _take_turns([[waits for item in items_p for waits in steps(item)]
                            for items_p in dealt])
    if summed:  # every (b, h) added into each summed tile (one mask for all)
        sums = [count for lock, count in counters.items() if lock[0] == "sum"]
        assert sums and set(sums) == {batch * heads}


@gluon
@pytest.mark.parametrize("planes, causal, together", [
    ((1, 1), False, "a head's blocks"),  # rotated walks: turns round a head's blocks
    ((1, "H"), False, None),  # the batch inner, every wait on a block before
    (("B", 1), False, "a block's kv heads"),  # the kv heads inner, walks spread over them
    (("B", 1), True, None),  # ... under a causal mask: last block first, walks alike
])  # fmt: skip
@pytest.mark.parametrize("seqlen_q, seqlen_k, kv_heads", [(500, 520, 2), (130, 300, 4),
                                                         (700, 640, 2)])
@pytest.mark.parametrize("sms", [10, 13, 23])
def test_persistent_ordered_sums_take_every_turn(planes, causal, together, seqlen_q, seqlen_k,
                                                 kv_heads, sms, monkeypatch):  # fmt: skip
    """ORDERED_SUM_PERSISTENT: a deterministic call with a bias gradient summed over
    batch or heads ("ordered") runs persistent programs in hopper.work_item's strides
    over its grid (shared._key_block's order, the summed dims inner), as many as the SMs
    hold whole groups of the blocks that must run together, so that each round of
    strides is whole groups. Run in Python over those walks (each block's query tiles as
    the kernel walks them, its GQA heads in turn), a step done once its turns come
    (turns.step_turns': the summed tile's and dQ's): every program finishes, every block
    is walked once, and every tile takes every add."""
    bsm = dispatch.backward_sm90
    narrow, turns = bsm.narrow, bsm.turns
    monkeypatch.setattr(bsm.hopper, "sm_count", lambda device_index: sms)
    monkeypatch.setattr(turns.gl, "cdiv", lambda a, b: -(-a // b))  # run in Python
    monkeypatch.setattr(turns.gl, "minimum", min)
    for name in ("_query_tile", "bias_sum_turn", "spread_sum_turn", "dq_add_turn",
                 "dq_tile_lock", "dq_tile", "spread_span"):
        monkeypatch.setattr(turns, name, getattr(turns, name).fn)
    monkeypatch.setattr(narrow, "ORDERED_SUM_PERSISTENT", {64: True, 128: True})
    batch, heads = 3, 4
    q = torch.zeros(batch, seqlen_q, heads, 64)
    k = torch.zeros(batch, seqlen_k, kv_heads, 64)
    planes = (batch if planes[0] == "B" else 1, heads if planes[1] == "H" else 1)
    bias = torch.zeros(*planes, seqlen_q, seqlen_k)
    spec = check_call(q, k, k, bias=bias, deterministic=True, causal=causal)
    kind = bsm.dbias_kind_of(spec, bias)
    inner = narrow.inner_dims(spec, bias, kind)
    assert kind == "ordered"
    bsm.hopper.forget_plans()
    try:
        plan = narrow._plan(spec, False, kind, inner, 0, 0)
    finally:
        bsm.hopper.forget_plans()
    num_n, items = plan.counts[:2]
    rotate = plan.constexprs["ROTATE"]
    batch_inner, head_inner = inner
    if rotate == narrow.ROTATE_BY_BLOCK:  # every block among which a head's lie
        together = "a head's blocks"
    group = {"a head's blocks": num_n * (batch if batch_inner else 1)
             * (kv_heads if head_inner else 1), "a block's kv heads": kv_heads,
             None: 1}[together]  # fmt: skip
    assert rotate == {"a head's blocks": narrow.ROTATE_BY_BLOCK, None: narrow.ROTATE_NONE,
                      "a block's kv heads": narrow.SPREAD_OVER_KV_HEADS}[together]
    assert plan.constexprs["PERSISTENT"] == narrow.STRIDES and not plan.constexprs["FOLD"]
    assert plan.programs == sms // group * group
    block_m, block_n = plan.constexprs["BLOCK_M"], narrow.BLOCK_N
    right = 0 if causal else -1
    blocks = (0, plan.programs, kv_heads, None, None, seqlen_q, seqlen_k, num_n, -1, right,
              narrow.SPREAD_STEPS)  # fmt: skip

    def steps(item):  # shared._key_block's item, then the block's walk (step_turns')
        rest = item
        if batch_inner:
            b, rest = rest % batch, rest // batch
        if head_inner:
            hk, rest = rest % kv_heads, rest // kv_heads
        n, rest = rest % num_n, rest // num_n
        n = num_n - 1 - n if causal else n  # DESCENDING under a right bound
        if not head_inner:
            hk, rest = rest % kv_heads, rest // kv_heads
        b = b if batch_inner else rest
        tiles = _visits(n, seqlen_q, 0, None, 0 if causal else None, block_m, block_n)
        n_tiles, lo = len(tiles), tiles[0] if tiles else 0
        rot = turns.walk_start.fn(hk, n * block_n, n_tiles, seqlen_k, blocks, block_n, rotate)
        block = (b, hk, spec.group, lo, n_tiles, rot, n * block_n, seqlen_q, seqlen_k, 0, -1,
                 right, heads, *planes, turns.spread_span(n_tiles, blocks))  # fmt: skip
        for t in range(spec.group * n_tiles):
            sum_lock, sum_turn, dq_lock, dq_turn = turns.step_turns.fn(
                t, block, block_m, block_n, False, causal, rotate)
            yield [(("sum", sum_lock), sum_turn), (("dq", dq_lock), dq_turn)]

    dealt = []
    for p in range(plan.programs):
        count = bsm.hopper.work_items.fn(p, plan.programs, items, False)
        dealt.append([p + j * plan.programs for j in range(count)])
    assert sorted(sum(dealt, [])) == list(range(items))
    counters = _take_turns([[waits for item in items_p for waits in steps(item)]
                            for items_p in dealt])
    sums = [count for lock, count in counters.items() if lock[0] == "sum"]
    assert sums and set(sums) == {batch * heads // (planes[0] * planes[1])}
    n_tiles = -(-seqlen_q // block_m)
    dq_counts = [count for lock, count in counters.items() if lock[0] == "dq"]
    assert len(dq_counts) == batch * heads * n_tiles
    if not causal:
        assert set(dq_counts) == {num_n}


@gluon
@pytest.mark.parametrize("d, planes, causal, rotate, programs", [
    (128, None, False, "by block", None),  # no bias: a program a block
    (64, None, False, "by block", None),
    (128, (1, 1), False, "by block", 128), (64, (1, 1), False, "by block", None),  # 32 a head
    (128, (4, 1), False, "spread", 132), (64, (4, 1), False, "spread", None),  # 4 kv heads
    (128, (1, 4), False, "none", 132),
    (128, (1, 4), True, "none", None)])  # batches started staggered: a program a block
def test_ordered_sums_persistent_by_head_dim(d, planes, causal, rotate, programs, monkeypatch):
    """ORDERED_SUM_PERSISTENT as shipped (B4 Sq64 Sk4096 H4, 132 SMs): deterministic
    calls of a bias gradient summed over batch or heads run persistent strides of whole
    groups at D=128 (a head's 32 rotated blocks, a block's 4 kv heads, or one block), a
    program per block at D=64 or where the batches start staggered
    (ORDERED_BATCH_STAGGER); calls without a bias gradient a program per block; with the
    knob off, every one a program per block."""
    bsm = dispatch.backward_sm90
    narrow = bsm.narrow
    monkeypatch.setattr(bsm.hopper, "sm_count", lambda device_index: 132)
    spec, *_, bias = spec_and_inputs(b=4, sq=64, sk=4096, h=4, d=d, deterministic=True,
                                     causal=causal, bias_shape=planes and (*planes, 64, 4096))
    kind = None if bias is None else bsm.dbias_kind_of(spec, bias)
    assert kind == (None if bias is None else "ordered")
    inner = narrow.inner_dims(spec, bias, kind)
    plans, shipped = [], narrow.ORDERED_SUM_PERSISTENT
    for knob in (shipped, dict.fromkeys(shipped, False)):
        monkeypatch.setattr(narrow, "ORDERED_SUM_PERSISTENT", knob)
        bsm.hopper.forget_plans()
        try:
            plans.append(narrow._plan(spec, False, kind, inner, 0, 0))
        finally:
            bsm.hopper.forget_plans()
    assert (plans[0].constexprs["BATCH_STAGGER"] > 0) is causal
    items = 4 * 4 * 4096 // narrow.BLOCK_N
    rotation = {"by block": narrow.ROTATE_BY_BLOCK, "spread": narrow.SPREAD_OVER_KV_HEADS,
                "none": narrow.ROTATE_NONE}[rotate]
    assert all(plan.constexprs["ROTATE"] == rotation for plan in plans)
    modes = [(plan.constexprs["PERSISTENT"], plan.programs) for plan in plans]
    assert modes == [(narrow.STRIDES, programs) if programs else (narrow.PER_BLOCK, items),
                     (narrow.PER_BLOCK, items)]


@gluon
def test_ordered_dq_rotates_only_where_a_whole_head_runs(monkeypatch):
    """Without bounds the rotated turns go round a head's key blocks, so they must all
    run at once: at most half the SMs' worth; longer calls, and windows bounded on the
    left alone, add first block first instead (no such limit), as do masks last first;
    and so does every call with ORDERED_ROTATE off."""
    bsm = dispatch.backward_sm90
    monkeypatch.setattr(bsm.narrow, "ORDERED_DQ", True)
    monkeypatch.setattr(bsm.hopper, "sm_count", lambda device_index: 8)
    fits = spec_and_inputs(d=128, sk=4 * bsm.narrow.BLOCK_N, deterministic=True)[0]
    long = spec_and_inputs(d=128, sk=5 * bsm.narrow.BLOCK_N, deterministic=True)[0]
    causal = spec_and_inputs(d=128, sk=5 * bsm.narrow.BLOCK_N, deterministic=True, causal=True)[0]
    left = spec_and_inputs(d=128, sk=4 * bsm.narrow.BLOCK_N, deterministic=True, window=(30, -1))[0]
    assert all(bsm.orders_dq(spec, None) for spec in (fits, long, causal, left))
    assert [bsm.narrow.rotates_dq(spec) for spec in (fits, long, causal, left)] == [
        True, False, False, False]
    monkeypatch.setattr(bsm.narrow, "ORDERED_ROTATE", False)  # tools' A/B: first first
    assert not bsm.narrow.rotates_dq(fits)


@gluon
@pytest.mark.parametrize(
    "d, bias_shape, varlen, takes",
    [(128, (2, 2, 16, 16), False, True),  # a full gradient: dQ = scale dS K, one matmul
     (64, (2, 2, 16, 16), False, True),
     (128, (1, 2, 16, 16), False, False),  # summed: dS and dQ added in turns
     (64, (16, 16), False, False),  # over batch and heads alike
     (128, (2, 2, 1, 16), False, False),  # a key row: ORDERED_DQ's
     (128, (2, 2, 16, 16), True, False)],  # packed sequences: the tile kernels
)  # fmt: skip
def test_deterministic_full_bias_gradient_takes_dq_from_ds(d, bias_shape, varlen, takes):
    """dq_from_full_bias: a deterministic dense call with a full bias's gradient runs the
    Gluon backward and takes dQ from the stored dS by one matmul; not otherwise, and
    never outside deterministic calls."""
    bsm = dispatch.backward_sm90
    spec, *_, bias = spec_and_inputs(d=d, bias_shape=bias_shape, varlen=varlen,
                                     deterministic=True, causal=True)  # fmt: skip
    kind = bsm.dbias_kind_of(spec, bias)
    assert bsm.dq_from_full_bias(spec, kind) is takes
    assert not bsm.dq_from_full_bias(dataclasses.replace(spec, deterministic=False), kind)
    if takes:
        assert dispatch._gluon_deterministic(spec, bias, True)
        assert not bsm.orders_dq(spec, kind)  # the writer's buffers have no room
    assert bsm.dq_from_full_bias(spec, None) is False  # no gradient asked of the bias


def _half(*shape):
    return torch.randn(*shape, device=DEVICE, dtype=torch.float16)


@pytest.mark.parametrize(
    "make, copied",
    [(lambda: _half(2, 2, 16, 19)[..., :16], True),  # rows 19 elements apart
     (lambda: _half(2, 2, 16, 32)[..., :16], False),  # 32 apart: read where they lie
     (lambda: _half(2, 2, 16, 16).transpose(-1, -2), True),  # keys strided
     (lambda: _half(16, 16).expand(2, 2, 16, 16), False),  # broadcast: strides 0
     (lambda: _half(2 * 16 + 8)[1:33].view(2, 1, 1, 16), True),  # a base 2 bytes off
     (lambda: _half(2, 1, 1, 16), False)],  # a key row
    ids=["rows 19 apart", "rows 32 apart", "keys strided", "broadcast", "base unaligned",
         "key row"],
)  # fmt: skip
def test_tile_kernels_read_biases_over_aligned_rows(make, copied, monkeypatch):
    """The tile kernels load a bias 16 bytes at a time where its rows are aligned to
    TILE_BIAS_ALIGNMENT elements: dispatch hands them, forward and backward, the bias
    itself where they are, else a copy over aligned rows with the same values
    (common.aligned_bias)."""
    bias = make()
    _, q, k, v, _ = spec_and_inputs(d=16)
    spec = check_call(q, k, v, bias=bias)
    read = []
    forward, backward = dispatch.tiles_forward.forward, dispatch.tiles_backward.backward
    monkeypatch.setattr(dispatch.tiles_forward, "forward",
                        lambda *a: read.append(a[4]) or forward(*a))
    monkeypatch.setattr(dispatch.tiles_backward, "backward",
                        lambda *a: read.append(a[8]) or backward(*a))
    out, lse = dispatch.forward(spec, q, k, v, bias, None, None, None, None)
    dispatch.backward(spec, out, None, q, k, v, out, lse, bias, None, None, None, None,
                      (True, True, True, False))  # fmt: skip
    assert len(read) == 2, "a call ran another kernel family"
    for r in read:
        assert torch.equal(r, bias) and r.shape == bias.shape
        assert (r.data_ptr() != bias.data_ptr()) == copied
        assert rows_aligned(r, TILE_BIAS_ALIGNMENT)


@pytest.mark.parametrize(
    "make",
    [lambda: _half(2, 3, 17, 21),
     lambda: _half(2, 3, 21, 17).transpose(-1, -2),  # keys strided
     lambda: _half(17, 1).expand(2, 3, 17, 21),  # broadcast: strides 0
     lambda: _half(3, 17, 21)[:, 1:9],  # 3-D, a view
     lambda: _half(5, 1200)[:, 3:1100],  # 2-D, rows past one block of keys
     lambda: _half(1 + 21)[1:],  # 1-D, a base 2 bytes off
     lambda: _half(3, 2, 1037),  # contiguous, rows past COPY_BLOCK_KEYS: in order
     lambda: _half(2, 2, 3, 2048),  # (rows of whole blocks)
     lambda: _half(2, 0, 5, 3).transpose(-1, -2)],  # empty: nothing to launch
    ids=["4-D", "keys strided", "broadcast", "3-D view", "2-D long rows", "1-D",
         "in order", "in order, whole blocks", "empty"],
)  # fmt: skip
def test_copy_rows_copies_any_layout_into_rows(make):
    """common.copy_rows (Triton, the interpreter on CPU): a tensor in any strides into
    rows padded to TILE_BIAS_ALIGNMENT (never writing the padding), and back from
    those rows into a contiguous tensor: the same values. Contiguous rows of
    COPY_BLOCK_KEYS or more go in order (FLAT), the rest by rows."""
    src = make()
    padded = padded_rows(src.shape, src.dtype, src.device, TILE_BIAS_ALIGNMENT)
    base = padded.as_strided((padded.untyped_storage().nbytes() // 2,), (1,), 0)
    base.fill_(float("nan"))
    assert copy_rows(src, padded) is padded and torch.equal(padded, src)
    assert base.isnan().sum() == base.numel() - src.numel(), "the padding written"
    back = copy_rows(padded, torch.full(src.shape, float("nan"), dtype=src.dtype,
                                        device=src.device))  # fmt: skip
    assert back.is_contiguous() and torch.equal(back, src)


@pytest.mark.parametrize("which", ["no queries", "no keys", "no batch"])
def test_empty_calls_need_no_kernel(which, monkeypatch):
    """Empty calls: the forward launches nothing without queries or a batch (a call
    without keys runs its kernel, which writes out 0 and lse -inf); the backward of each
    launches nothing and gives zero gradients of the inputs' shapes, None for those not
    asked."""
    sizes = {"no queries": dict(sq=0), "no keys": dict(sk=0), "no batch": dict(b=0)}[which]
    spec, q, k, v, bias = spec_and_inputs(bias_shape=(1, 2, 1, 1), **sizes)

    def no_launch(*args):
        raise AssertionError("a kernel was launched")

    monkeypatch.setattr(dispatch.tiles_backward, "backward", no_launch)
    if which != "no keys":
        monkeypatch.setattr(dispatch.tiles_forward, "forward", no_launch)
    out, lse = dispatch.forward(spec, q, k, v, bias, None, None, None, None)
    assert out.shape == (*q.shape[:3], v.shape[-1]) and lse.shape == (q.shape[0], 2, q.shape[1])
    assert not out.any() and torch.isneginf(lse).all()
    grads = dispatch.backward(spec, out, None, q, k, v, out, lse, bias, None, None, None, None,
                              (True, False, True, True))  # fmt: skip
    assert grads[1] is None
    for g, t in zip((grads[0], grads[2], grads[3]), (q, v, bias)):
        assert g.shape == t.shape and g.dtype == t.dtype and not g.any()


@pytest.mark.parametrize("bias_shape", [(2, 1, 13, 1), (1, 1, 1, 1), (13, 1), ()])
@pytest.mark.parametrize("through_lse", [False, True])
def test_bias_constant_along_keys_gradient_without_kernels(bias_shape, through_lse, monkeypatch):
    """A bias constant along the keys shifts each row's scores alike, which softmax
    ignores and lse follows: its gradient is exactly 0 through out, and through lse
    grad_lse summed over what it broadcasts, given without asking the kernels for it
    (their dS row sums would leave rounding). dq, dk, dv and dbias as the reference's
    autograd gives them, within twice the float32 reference's error."""
    gen = torch.Generator().manual_seed(len(bias_shape))

    def randn(*shape):
        return torch.randn(shape, generator=gen, dtype=torch.float64).to(DEVICE)

    inputs = (randn(2, 13, 2, 16), randn(2, 21, 2, 16), randn(2, 21, 2, 8), randn(*bias_shape))
    g_out, g_lse = randn(2, 13, 2, 8), randn(2, 2, 13)
    asked = []  # the gradients the kernels were asked for
    tiles = dispatch.tiles_backward.backward
    monkeypatch.setattr(dispatch.tiles_backward, "backward",
                        lambda *a: asked.append(a[-1]) or tiles(*a))  # fmt: skip

    def gradients(fn, dtype, expand_bias=False):
        leaves = [t.to(dtype).requires_grad_(True) for t in inputs]
        if expand_bias:  # its gradient is dS, what dbias sums
            leaves[3] = leaves[3].detach().expand(2, 2, 13, 21).clone().requires_grad_(True)
        out, lse = fn(*leaves[:3], bias=leaves[3], causal=True, return_lse=True)
        loss = (out * g_out.to(dtype)).sum()
        if through_lse:
            loss = loss + (lse * g_lse.to(lse.dtype)).sum()
        return torch.autograd.grad(loss, leaves)

    got = gradients(memattn.attention, torch.float32)
    assert asked == [(True, True, True, False)]
    exact = gradients(reference.attention, torch.float64)
    plain = gradients(reference.attention, torch.float32)
    assert got[3].shape == bias_shape
    if not through_lse:
        assert not got[3].any()
        assert exact[3].abs().max() < 1e-12  # what the shortcut relies on
    d_s = gradients(reference.attention, torch.float64, expand_bias=True)[3]
    scales = [0.0, 0.0, 0.0, d_s.norm().item()]  # dbias's error against dS's size
    for g, ref, low, scale in zip(got, exact, plain, scales):
        allowed = 2 * relative_error(low, ref, scale) + FLOOR[torch.float32]
        assert relative_error(g, ref, scale) <= allowed


def test_bias_constant_along_keys_alone_asking_runs_no_kernel(monkeypatch):
    """Only such a bias asks for a gradient: it is computed without the kernels, and
    nothing else runs (the preprocess neither)."""
    def no_launch(*args):
        raise AssertionError("a backward kernel ran")

    monkeypatch.setattr(dispatch.tiles_backward, "backward", no_launch)
    monkeypatch.setattr(dispatch.backward_sm90, "run", no_launch)
    q, k, v = (torch.randn(2, 9, 2, 8, device=DEVICE) for _ in range(3))
    bias = torch.randn(2, 1, 9, 1, device=DEVICE, requires_grad=True)
    out, lse = memattn.attention(q, k, v, bias=bias, causal=True, return_lse=True)
    g_lse = torch.randn_like(lse)
    (dbias,) = torch.autograd.grad((out, lse), [bias], (torch.randn_like(out), g_lse))
    assert torch.equal(dbias, g_lse.sum(1, keepdim=True)[..., None])


@pytest.mark.parametrize("bias", ["BHQ1", "1HQ1", "Q1"])
def test_packed_bias_constant_along_keys_gradient_through_lse(bias, monkeypatch):
    """Packed sequences: grad_lse, (H, tokens), goes to each sequence's positions of the
    bias's (B, H, max_seqlen_q, 1) rows; rows that see no key (a sequence without keys,
    the first rows under a bottom-right mask) and positions past a sequence's end get 0.
    Against float64 autograd through the reference, the kernels not asked for dbias."""
    case = Case("packed row bias", lengths_q=(5, 0, 7, 4), lengths_k=(3, 4, 9, 0), bias=bias,
                options=dict(causal=True, align="bottom_right", max_seqlen_q=9,
                             max_seqlen_k=11))  # fmt: skip
    asked = []
    tiles = dispatch.tiles_backward.backward
    monkeypatch.setattr(dispatch.tiles_backward, "backward",
                        lambda *a: asked.append(a[-1]) or tiles(*a))  # fmt: skip
    assert_results(check_backward(case, torch.float32, DEVICE, seed=3, lse_grad=True))
    assert asked == [(True, True, True, False)]


@gluon
@pytest.mark.parametrize(
    "d, dv, options, varlen, by_head",
    [(64, 64, dict(causal=True), False, True),
     (64, 64, dict(window=(100, 20)), False, True),
     (128, 128, {}, True, True),  # packed sequences: a grid with a tail
     (128, 128, dict(causal=True), True, True),
     (128, 128, dict(causal=True, sq=2048, sk=2048), False, False),  # MASKED_BY_HEAD
     (128, 128, dict(causal=True), False, True),  # ... but short heads (SHORT_CAUSAL_KEYS)
     (128, 64, dict(window=(100, 20)), False, False),
     (128, 128, {}, False, False),  # dense without a mask: programs that end together
     (192, 128, dict(causal=True), False, False),  # _bwd_split_kernel's conversion
     (256, 256, dict(causal=True), False, False)],  # the wide kernels: no fp32 dQ
)  # fmt: skip
def test_dq_conversion_by_head_takes_grids_with_tails(d, dv, options, varlen, by_head,
                                                      monkeypatch):  # fmt: skip
    """DQ_CONVERTED_BY_HEAD converts dQ by (sequence, kv head) where the D 64/128 kernel
    adds it in fp32 and its grid has a tail: packed calls, masked dense ones at Dqk=64
    (MASKED_BY_HEAD) and short causal ones at 128 (SHORT_CAUSAL_KEYS), launched as
    dependents (DEPENDENT_LAUNCHES). Either knob off, no call does."""
    bsm = dispatch.backward_sm90
    spec, *_ = spec_and_inputs(d=d, dv=dv, varlen=varlen, **options)
    assert bsm.shared.converts_dq_by_head(spec) is by_head
    for knob in ("DQ_CONVERTED_BY_HEAD", "DEPENDENT_LAUNCHES"):
        with monkeypatch.context() as m:
            m.setattr(bsm.shared, knob, False)
            assert not bsm.shared.converts_dq_by_head(spec)


@gluon
@pytest.mark.parametrize("options", [{}, dict(causal=True)], ids=["full", "causal"])
def test_plans_inside_sharing_sms_take_a_program_per_block(options, monkeypatch):
    """Inside memattn.sharing_sms the Gluon forward and the D 64/128 backward launch a
    program per block where they run persistent programs outside it (one per SM at
    most), and each side's plan is cached for that side alone. The context resets on
    leaving, an exception too."""
    import memattn
    from memattn.kernels import backward_sm90, forward_sm90, shares_sms

    spec = spec_and_inputs(b=1, sq=4096, sk=4096, h=16, d=128, **options)[0]
    monkeypatch.setattr(forward_sm90.hopper, "sm_count", lambda device_index: 132)
    forward_sm90.hopper.forget_plans()

    def plans():  # the forward's programs, the backward's PERSISTENT constexpr
        forward = forward_sm90.plan(spec, False, (0, 0), 0, 0)
        backward = backward_sm90.narrow._plan(spec, False, None, (False, False), 0, 0)
        return forward, backward

    try:
        forward, backward = plans()
        with memattn.sharing_sms():
            assert shares_sms()
            shared_forward, shared_backward = plans()
        assert plans() == (forward, backward)  # the same objects: cached per side
        with pytest.raises(RuntimeError), memattn.sharing_sms():
            raise RuntimeError
        assert not shares_sms()
    finally:
        forward_sm90.hopper.forget_plans()
    blocks = 16 * 4096 // 128  # query blocks (forward), key blocks (backward)
    assert forward.programs <= 132 and shared_forward.programs == (
        blocks // 2 if shared_forward.constexprs["FOLD"] else blocks)
    persistent = backward.constexprs["PERSISTENT"]
    assert shared_backward.constexprs["PERSISTENT"] == backward_sm90.narrow.PER_BLOCK.value
    # unmasked, both persistent outside; under the causal mask D=128's backward takes a
    # program per block rank by rank anyway (MASKED_BY_RANK_BLOCKS)
    assert persistent == (backward_sm90.narrow.STRIDES.value if not options
                          else backward_sm90.narrow.PER_BLOCK.value)  # fmt: skip


@gluon
def test_sharing_sms_keeps_the_rank_order_without_the_hosts_table(monkeypatch):
    """A causal D=64 forward of many blocks a head goes rank by rank: outside
    memattn.sharing_sms through persistent programs walking the host's table
    (RANK_TABLE), inside it a program per block in the same rank order, no table."""
    import memattn
    from memattn.kernels import forward_sm90

    spec = spec_and_inputs(b=1, sq=16384, sk=16384, h=4, d=64, causal=True)[0]
    monkeypatch.setattr(forward_sm90.hopper, "sm_count", lambda device_index: 132)
    forward_sm90.hopper.forget_plans()
    try:
        outside = forward_sm90.plan(spec, False, (0, 0), 0, 0)
        with memattn.sharing_sms():
            inside = forward_sm90.plan(spec, False, (0, 0), 0, 0)
    finally:
        forward_sm90.hopper.forget_plans()
    blocks = 4 * -(-16384 // outside.constexprs["BLOCK_M"])
    assert (outside.constexprs["TABLE"], outside.programs <= 132) == (True, True)
    assert (inside.constexprs["TABLE"], inside.programs) == (False, blocks)
    assert inside.constexprs["BY_RANK"] == outside.constexprs["BY_RANK"] > 0
    assert inside.schedule is None


@gluon
def test_sharing_sms_leaves_the_deterministic_programs_their_order(monkeypatch):
    """A deterministic causal D=128 backward runs the programs the host dealt in the
    grid's order (ORDERED_DEALT) inside memattn.sharing_sms as outside it: their order of
    adds is what makes the gradients the same bit for bit."""
    import memattn
    from memattn.kernels import backward_sm90

    spec = spec_and_inputs(b=1, sq=4096, sk=4096, h=16, d=128, causal=True,
                           deterministic=True)[0]  # fmt: skip
    monkeypatch.setattr(backward_sm90.hopper, "sm_count", lambda device_index: 132)
    backward_sm90.hopper.forget_plans()
    try:
        outside = backward_sm90.narrow._plan(spec, False, None, (False, False), 0, 0)
        with memattn.sharing_sms():
            inside = backward_sm90.narrow._plan(spec, False, None, (False, False), 0, 0)
    finally:
        backward_sm90.hopper.forget_plans()
    dealt = backward_sm90.narrow.DEALT.value
    assert outside.constexprs["PERSISTENT"] == inside.constexprs["PERSISTENT"] == dealt
    assert inside.schedule == outside.schedule and inside.programs == outside.programs
