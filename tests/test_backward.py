"""The backward kernels against float64 autograd through the reference.

CPU (CI): Triton's interpreter at small odd sizes, float32 and float16. GPU
(`pytest -m gpu`): real sizes, bfloat16/float16, and determinism by comparing bits.
"""

import dataclasses
import math
import os
import subprocess
import sys
import zlib
from unittest import mock

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import memattn
from memattn import reference
from memattn.check import (
    FEATURE_CASES,
    FLOOR,
    Case,
    check_backward,
    check_forward,
    gpu_sized,
    make_inputs,
    relative_error,
)
from memattn.kernels import backward as backward_kernels
from memattn.kernels import tuning

from .conftest import capture, cpu_only
from .test_forward import (
    HOPPER_CASES,
    assert_results,
    bias_row,
    hopper_kernel_runs_here,
    record_launches,
)

# Every feature case, each with a bias that needs a gradient where the case has one.
BIAS_BROADCASTS = ["BHQK", "1HQK", "B1QK", "BH1K", "BHQ1", "11Q1", "QK", "K"]


@cpu_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("case", FEATURE_CASES, ids=lambda c: c.name)
def test_gradients_cpu(case, dtype):
    assert_results(check_backward(case, dtype, "cpu", seed=zlib.crc32(case.name.encode()) % 1000))


@cpu_only
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("bias", BIAS_BROADCASTS)
def test_bias_gradient_broadcast_cpu(bias, deterministic):
    """dbias is reduced over every broadcast dimension, returned in the bias's shape and
    dtype; GQA and causal on, so heads and skipped tiles are in play."""
    case = Case(f"bias {bias}", bias=bias, seqlen_q=29, seqlen_k=41,
                options=dict(causal=True, deterministic=deterministic))
    assert_results(check_backward(case, torch.float32, "cpu", seed=3))


@cpu_only
def test_bias_without_grad_cpu():
    """A bias that asks no gradient is only read: dq, dk and dv against the reference."""
    case = Case("bias 1HQK read", bias="1HQK", seqlen_q=29, seqlen_k=41,
                options=dict(causal=True))
    results = check_backward(case, torch.float32, "cpu", seed=5, bias_grad=False)
    assert [r.what for r in results] == ["dq", "dk", "dv"]
    assert_results(results)


@cpu_only
def test_bias_gradient_shape_and_dtype_cpu():
    x = make_inputs(Case("bias", bias="1H1K"), torch.float16, "cpu")
    bias = x.kwargs.pop("bias").float().requires_grad_(True)
    out = memattn.attention(x.q, x.k, x.v, bias=bias)
    (dbias,) = torch.autograd.grad(out.float().sum(), [bias])
    assert dbias.shape == bias.shape and dbias.dtype == torch.float32


@cpu_only
def test_varlen_bias_gradient_and_empty_sequences_cpu():
    case = Case("varlen bias grad", lengths_q=(5, 0, 21, 3), lengths_k=(9, 4, 0, 17),
                bias="BHQK", options=dict(causal=True, align="bottom_right"))
    assert_results(check_backward(case, torch.float32, "cpu", seed=8))


@cpu_only
@settings(max_examples=8, deadline=None)
@given(st.lists(st.integers(0, 150), min_size=1, max_size=7).filter(lambda ls: sum(ls) > 0),
       st.booleans())
@example([130, 0, 77, 301, 6, 1], True)
@example([1, 0, 700, 1, 1], True)  # one long among short ones: most of a block grid's programs idle
@example([77, 77, 77], False)  # a dense batch: rows of 77 + slack, padded to 16
@example([1], False)
def test_row_stats_cpu(lengths, packed):
    """The preprocess fills the backward's row statistics (common.row_stats_buffer), for
    packed sequences or a dense batch (``lengths`` all the first one's): sequence b's rows
    from common.packed_stats_start on (a dense batch's from 0 in its own plane), a
    multiple of 4 tokens past the previous sequence's slack, lse * log2(e) (+inf where
    lse is -inf) and delta - grad_lse there, then STATS_SLACK rows of +inf and 0 (a
    tile's rows past the sequence get P = 0), in rows whose stride 16 divides; nothing
    else read."""
    from memattn.kernels.common import STATS_SLACK, row_stats_buffer

    gen = torch.Generator().manual_seed(len(lengths) + 100 * packed)
    if not packed:
        lengths = [lengths[0] or 1] * len(lengths)
    tokens, heads, dv = sum(lengths), 3, 24
    q = torch.randn(tokens, heads, 32, generator=gen)
    out, grad_out = (torch.randn(tokens, heads, dv, generator=gen) for _ in range(2))
    lse, grad_lse = (torch.randn(heads, tokens, generator=gen) for _ in range(2))
    lse[1, tokens // 2] = float("-inf")
    cu = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)
    if packed:
        spec = memattn.spec.check_call(q, q, out, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                       max_seqlen_q=max(lengths), max_seqlen_k=max(lengths))
        call = (out, grad_out, lse, grad_lse, cu)
    else:  # (B, S, H, D) and lse (B, H, S): the same tokens, a sequence a batch
        batch, seqlen = len(lengths), lengths[0]
        dense = [t.view(batch, seqlen, heads, -1) for t in (q, out, grad_out)]
        spec = memattn.spec.check_call(dense[0], dense[0], dense[1])
        call = (dense[1], dense[2], *(t.view(heads, batch, seqlen).transpose(0, 1)
                                      for t in (lse, grad_lse)), None)
    stats = row_stats_buffer(call[2], packed, len(lengths)).fill_(float("nan"))  # poisoned
    assert stats.stride(-2) % 16 == 0
    grid, args, constexprs = backward_kernels.delta_launch(spec, *call, stats)
    backward_kernels._delta_kernel[grid](*args, **constexprs)

    planes = stats.flatten(1, 2) if not packed else stats[:, 0]  # (2, [B ×] H, rows)
    rows = planes.shape[-1]
    read = torch.zeros(len(lengths), rows, dtype=torch.bool)  # rows the backward reads
    want_lse2 = torch.zeros(len(lengths), heads, rows)
    want_delta = torch.zeros_like(want_lse2, dtype=torch.float64)  # exact
    bound = torch.zeros_like(want_delta)  # delta's rounding; 0 in the slack: zeros there
    products = out.double() * grad_out.double()
    row_delta = products.sum(-1).T - grad_lse.double()
    # delta is a float32 sum of Dv products (and grad_lse) in the kernel's order: its
    # rounding is within fp32's bound for such a sum, whatever the order
    row_bound = (dv + 1) * torch.finfo(torch.float32).eps * (
        products.abs().sum(-1).T + grad_lse.double().abs())  # fmt: skip
    row_lse2 = torch.where(lse == float("-inf"), float("inf"), lse * math.log2(math.e))
    end = 0
    for b, (first, length) in enumerate(zip(cu.tolist(), lengths)):
        start = (first + (STATS_SLACK.value + 4) * b + 3) // 4 * 4 if packed else 0
        assert start % 4 == 0 and start >= end, "aligned, after the previous sequence"
        end = start + length
        want_lse2[b, :, start:end] = row_lse2[:, first : first + length]
        want_delta[b, :, start:end] = row_delta[:, first : first + length]
        bound[b, :, start:end] = row_bound[:, first : first + length]
        read[b, start:end] = True
        if length:  # rows past the end: P = 0 (delta 0, so that dS = 0 dP is 0 too)
            want_lse2[b, :, end : end + STATS_SLACK.value] = float("inf")
            read[b, end : end + STATS_SLACK.value] = True
            end += STATS_SLACK.value
        assert end <= rows
        if not packed:
            end = 0
    # every sequence's statistics where the backward reads them: packed ones in the one
    # plane, dense ones in their batch's
    for b in range(len(lengths)):
        got = planes[:, b * heads : (b + 1) * heads] if not packed else planes
        mask = read[b]
        torch.testing.assert_close(got[0][:, mask], want_lse2[b][:, mask], rtol=1e-6, atol=0)
        assert ((got[1].double() - want_delta[b]).abs() <= bound[b])[:, mask].all()


def _tile_spec(head_dim, lengths, batch, seqlen):
    """(spec, q, cu_seqlens) for dq_tiles' tests: packed ``lengths`` or a dense batch."""
    if lengths:
        q = torch.randn(sum(lengths), 3, head_dim)
        cu = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)
        spec = memattn.spec.check_call(q, q, q, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                       max_seqlen_q=max(lengths), max_seqlen_k=max(lengths))
        return spec, q, cu, [(0, first, n) for first, n in zip(cu.tolist(), lengths)]
    q = torch.randn(batch, seqlen, 3, head_dim)
    spec = memattn.spec.check_call(q, q, q)
    return spec, q, None, [(b, 0, seqlen) for b in range(batch)]


@cpu_only
def test_packed_preprocess_grid_grows_with_tokens():
    """The preprocess and dQ's conversion run common.packed_items' programs over packed
    sequences (a grid over each sequence's blocks to the longest: 256 sequences, one of
    16384 tokens, would launch 256 * 256 programs a head, almost all idle)."""
    from memattn.kernels import backward_sm90
    from memattn.kernels.common import packed_items, row_stats_buffer

    lengths = [16384] + [64] * 255
    tokens, heads = sum(lengths), 2
    q = torch.empty(tokens, heads, 128)
    cu = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)
    spec = memattn.spec.check_call(q, q, q, cu_seqlens_q=cu, cu_seqlens_k=cu,
                                   max_seqlen_q=16384, max_seqlen_k=16384)
    lse = torch.empty(heads, tokens)
    stats = row_stats_buffer(lse, True, len(lengths))
    grid, _, _ = backward_kernels.delta_launch(spec, q, q, lse, None, cu, stats)
    assert grid == (packed_items(256, tokens, heads, 64),) == (heads * (tokens // 64 + 256),)
    buffer = backward_sm90.shared.dq_tiles(spec, tokens, 64, "cpu")
    grid, _, _ = backward_sm90.dq_from_tiles_launch(spec, buffer, 64, q, cu)
    assert grid == (packed_items(256, tokens, heads, 64),)


_TILE_CASES = dict(
    head_dim=st.sampled_from([64, 128, 192]), rows=st.sampled_from([64, 128]),
    lengths=st.one_of(st.just(()), st.lists(st.integers(1, 300), min_size=1, max_size=4)),
    batch=st.integers(1, 2), seqlen=st.integers(1, 300))


def _tiles_of(spec, cu, seqs, rows):
    """[(b, h, tile, first token, rows it holds)] of every dQ tile the kernel adds into,
    tile numbered as common.dq_tile numbers them."""
    out = []
    for index, (b, first, n) in enumerate(seqs):
        for m in range(math.ceil(n / rows)):
            tile = m + (first // rows + index if cu is not None else 0)
            for h in range(spec.heads):
                out.append((b, h, tile, first + m * rows, min(rows, n - m * rows)))
    return out


@cpu_only
@settings(max_examples=8, deadline=None)
@given(**_TILE_CASES, by_head=st.booleans())
@example(head_dim=64, rows=128, lengths=[130, 3], batch=1, seqlen=1, by_head=False)  # halves
# of the rows; of the columns; thirds of the columns; from the queue (DQ_CONVERTED_BY_HEAD)
@example(head_dim=128, rows=64, lengths=[], batch=2, seqlen=77, by_head=False)
@example(head_dim=192, rows=64, lengths=[], batch=2, seqlen=77, by_head=False)
@example(head_dim=64, rows=128, lengths=[130, 0, 300], batch=1, seqlen=1, by_head=True)
def test_dq_tiles_read_back_cpu(head_dim, rows, lengths, batch, seqlen, by_head):
    """_dq_from_tiles_kernel reads each dQ tile of dq_tiles' buffer, its warpgroups'
    parts (dq_split) each laid out in its registers' order as hopper.accumulator_order's
    bases say, back into dQ's rows: every row of every sequence exactly, times the
    softmax scale (the main kernels leave it out), and nothing from a tile's rows past
    its sequence. by_head: persistent programs (here 3) take the tiles from the queue
    once every head's blocks are counted, each tile once (the queue ends one past the
    tiles a program), and a sequence without keys gets zeros."""
    from memattn.kernels import backward_sm90, hopper

    if head_dim > 64 and rows == 128:
        rows = 64  # D 128 and 192 take 64 rows a step
    spec, q, cu, seqs = _tile_spec(head_dim, lengths, batch, seqlen)
    buffer = backward_sm90.shared.dq_tiles(spec, q.shape[0], rows, "cpu").fill_(float("nan"))
    want = torch.randn(q.shape)
    part_rows, part_cols = backward_sm90.shared.dq_split(head_dim, rows)  # a warpgroup's part
    bases = torch.tensor(hopper.accumulator_order(part_rows, part_cols).offset_bases)
    size = part_rows * part_cols
    bits = (torch.arange(size)[:, None] >> torch.arange(len(bases))) & 1
    at_row, at_col = (bits @ bases).unbind(1)  # the element each offset holds
    plane = buffer.flatten(2)
    for b, h, tile, first, count in _tiles_of(spec, cu, seqs, rows):
        values = torch.randn(rows, head_dim)  # rows past the sequence: junk
        token = (b, slice(first, first + count), h) if cu is None else (
            slice(first, first + count), h)
        values[:count] = want[token]
        parts = rows * head_dim // size  # of the columns, or halves of the rows
        for part in range(parts):
            first_row, first_col = ((part * part_rows, 0) if part_rows < rows
                                    else (0, part * part_cols))
            start = (parts * tile + part) * size
            plane[b, h, start : start + size] = values[first_row + at_row, first_col + at_col]
    dq = torch.full_like(q, float("nan"))
    heads_done, cu_k = None, cu
    if by_head:  # every head's blocks counted (more than any target), the queue at 0
        heads_done = torch.full((spec.batch * spec.kv_heads + 1,), 1 << 20, dtype=torch.int32)
        heads_done[-1] = 0
        if cu is not None:  # the first sequence without keys: its dQ is 0, whatever its
            cu_k = cu.clone()  # tiles hold (the preprocess may not have zeroed them yet)
            cu_k[1] = 0
            want[: cu[1]] = 0
    with mock.patch.object(hopper, "sm_count", lambda device_index: 1), \
            mock.patch.object(backward_sm90.shared, "DQ_CONVERSION_PROGRAMS_PER_SM", 3):
        grid, args, constexprs = backward_sm90.dq_from_tiles_launch(
            spec, buffer, rows, dq, cu, cu_seqlens_k=cu_k, heads_done=heads_done,
            block_counts=1)  # fmt: skip
    backward_sm90._dq_from_tiles_kernel[grid](*args, **constexprs)
    assert torch.equal(dq, want * torch.tensor(spec.scale, dtype=torch.float32))
    if by_head:
        tiles = args[-2]
        assert grid == (min(tiles, 3),) and heads_done[-1] == tiles + grid[0]


@cpu_only
@settings(max_examples=8, deadline=None)
@given(**_TILE_CASES)
@example(head_dim=64, rows=128, lengths=[130, 3], batch=1, seqlen=1)
@example(head_dim=192, rows=64, lengths=[], batch=2, seqlen=77)  # zeroed in three pieces
def test_preprocess_zeroes_dq_tiles_cpu(head_dim, rows, lengths, batch, seqlen):
    """The preprocess zeroes every dQ tile the Gluon backward adds into (_tiles_of, as
    common.dq_tile numbers them), in a buffer that held NaN."""
    from memattn.kernels import backward_sm90
    from memattn.kernels.common import row_stats_buffer

    if head_dim > 64 and rows == 128:
        rows = 64
    spec, q, cu, seqs = _tile_spec(head_dim, lengths, batch, seqlen)
    out, grad_out = torch.randn_like(q), torch.randn_like(q)
    lse = (torch.randn(spec.heads, q.shape[0]) if cu is not None
           else torch.randn(batch, spec.heads, seqlen))  # fmt: skip
    stats = row_stats_buffer(lse, cu is not None, spec.batch)
    buffer = backward_sm90.shared.dq_tiles(spec, q.shape[0], rows, "cpu").fill_(float("nan"))
    grid, args, constexprs = backward_kernels.delta_launch(
        spec, out, grad_out, lse, None, cu, stats, buffer, rows)
    backward_kernels._delta_kernel[grid](*args, **constexprs)
    plane = buffer.flatten(2)
    for b, h, tile, _, _ in _tiles_of(spec, cu, seqs, rows):
        start = 2 * tile * rows * head_dim // 2
        assert torch.equal(plane[b, h, start : start + rows * head_dim],
                           torch.zeros(rows * head_dim)), (b, h, tile)


@cpu_only
def test_only_requested_gradients_cpu():
    """ops.backward computes only what `needs` asks for."""
    x = make_inputs(Case("needs", bias="1HQK"), torch.float32, "cpu")
    out, lse, rng = memattn.ops.forward(x.q, x.k, x.v, **x.kwargs)
    grad = torch.randn_like(out)
    dq, dk, dv, dbias = memattn.ops.backward(grad, x.q, x.k, x.v, out, lse, **x.kwargs,
                                             needs=(False, False, False, True))
    assert dq is None and dk is None and dv is None and dbias.shape == x.kwargs["bias"].shape
    full = memattn.ops.backward(grad, x.q, x.k, x.v, out, lse, **x.kwargs,
                                needs=(True, True, True, True))
    assert torch.equal(dbias, full[3])
    dq, dk, dv, dbias = memattn.ops.backward(grad, x.q, x.k, x.v, out, lse, **x.kwargs,
                                             needs=(True, False, False, False))
    assert dk is None and dv is None and dbias is None and torch.equal(dq, full[0])


@cpu_only
def test_expanded_and_noncontiguous_grad_out_cpu():
    x = make_inputs(Case("grad layout", layout="transposed"), torch.float32, "cpu")
    for t in (x.q, x.k, x.v):
        t.requires_grad_(True)
    out = memattn.attention(x.q, x.k, x.v)
    expanded = torch.randn(1, 1, 1, out.shape[-1]).expand_as(out)
    grads = torch.autograd.grad(out, [x.q, x.k, x.v], expanded)
    grads_contig = torch.autograd.grad(memattn.attention(x.q, x.k, x.v), [x.q, x.k, x.v],
                                       expanded.contiguous())
    for a, b in zip(grads, grads_contig):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


@cpu_only
def test_saved_tensors_are_linear_in_sequence_length():
    """The autograd saves q, k, v, out, lse and the rng state: nothing (S, S)-sized."""
    x = make_inputs(Case("saved", bias=None, seqlen_q=64, seqlen_k=64), torch.float32, "cpu")
    x.q.requires_grad_(True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        memattn.attention(x.q, x.k, x.v, dropout_p=0.1)
    assert saved and max(t.numel() for t in saved) <= x.q.numel()
    assert not any(t.dim() >= 2 and t.shape[-1] == t.shape[-2] == 64 for t in saved)


def _gradients(case: Case, dtype, device):
    """q, k, v (and bias) gradients of one run, dropout seeded alike."""
    x = make_inputs(case, dtype, device, seed=4)
    leaves = [x.q, x.k, x.v] + ([x.kwargs["bias"]] if "bias" in x.kwargs else [])
    for t in leaves:
        t.requires_grad_(True)
    torch.manual_seed(0)
    out = memattn.attention(x.q, x.k, x.v, **x.kwargs)
    return torch.autograd.grad(out, leaves, torch.ones_like(out))


@cpu_only
def test_deterministic_gradients_repeat_bitwise_cpu():
    case = Case("det", bias="1H1K", options=dict(causal=True, dropout_p=0.2, deterministic=True))
    runs = [_gradients(case, torch.float32, "cpu") for _ in range(2)]
    for a, b in zip(*runs):
        assert torch.equal(a, b)


@pytest.fixture
def dq_atomic(monkeypatch):
    """The interpreter's tiles with dQ accumulated by atomics in the dK/dV kernel."""
    config = dataclasses.replace(tuning.INTERPRETER_BACKWARD, dq_atomic=True)
    monkeypatch.setattr(tuning, "backward_override", config)


@pytest.fixture
def dq_kernel_launches(monkeypatch):
    """Counts launches of the separate dQ kernel, to tell which dQ path ran."""
    launches = []
    kernel = backward_kernels._dq_kernel

    class Counting:
        def __getitem__(self, grid):
            launches.append(grid)
            return kernel[grid]

    monkeypatch.setattr(backward_kernels, "_dq_kernel", Counting())
    return launches


@cpu_only
@pytest.mark.parametrize("case", FEATURE_CASES, ids=lambda c: c.name)
def test_gradients_dq_atomic_cpu(case, dq_atomic, dq_kernel_launches):
    results = check_backward(case, torch.float32, "cpu", seed=zlib.crc32(case.name.encode()) % 997)
    assert_results(results)
    # The dQ kernel runs only where the atomic path is not allowed.
    assert bool(dq_kernel_launches) == bool(case.options.get("deterministic"))


@pytest.mark.parametrize("options, sq, sk", [
    (dict(causal=True), 70, 70), (dict(causal=True, align="bottom_right"), 70, 45),
    (dict(causal=True, align="bottom_right"), 30, 77), (dict(window=(9, 3)), 64, 64),
    (dict(window=(5, -1)), 50, 60), ({}, 33, 20)])  # fmt: skip
def test_dq_from_ds_takes_each_chunks_band(options, sq, sk, monkeypatch):
    """dq_from_ds under a mask: chunks of queries (DQ_FROM_DS_ROWS, 16 here) against
    the keys in their band give dQ = scale dS K of the whole product, where dS is 0 at
    the pairs no query sees; GQA's query heads against their key head."""
    monkeypatch.setattr(backward_kernels, "DQ_FROM_DS_ROWS", 16)
    gen = torch.Generator().manual_seed(sq + sk)
    q, k = torch.randn(2, sq, 4, 8, generator=gen), torch.randn(2, sk, 2, 8, generator=gen)
    spec = memattn.spec.check_call(q, k, k, **options)
    seen = memattn.reference.visible_mask(spec, sq, sk, "cpu")
    ds = torch.randn(2, 4, sq, sk, generator=gen) * seen
    dq = torch.full_like(q, float("nan"))
    backward_kernels.dq_from_ds(dq, ds, k, spec)
    want = spec.scale * ds.double() @ k.double().repeat_interleave(2, dim=2).transpose(1, 2)
    torch.testing.assert_close(dq.double(), want.transpose(1, 2), rtol=1e-5, atol=1e-5)


@cpu_only
@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
def test_dq_from_full_bias_gradient_cpu(deterministic, dq_kernel_launches):
    """With a full (B, H, Sq, Sk) bias gradient, dQ = scale * dS K reuses the dS the
    dK/dV kernel wrote: no dQ kernel, in either mode (the matmul is deterministic)."""
    case = Case("full bias", bias="BHQK", seqlen_q=37, seqlen_k=45,
                options=dict(causal=True, dropout_p=0.2, deterministic=deterministic))
    assert_results(check_backward(case, torch.float32, "cpu", seed=11))
    assert not dq_kernel_launches


@cpu_only
def test_dq_alone_uses_the_dq_kernel_cpu(dq_atomic, dq_kernel_launches):
    """Asked for dQ alone, the dQ kernel (3 matmuls) beats running dK/dV for it (5)."""
    x = make_inputs(Case("dq only", bias=None), torch.float32, "cpu")
    out, lse, _ = memattn.ops.forward(x.q, x.k, x.v, **x.kwargs)
    grad = torch.randn_like(out)
    dq, dk, dv, _ = memattn.ops.backward(grad, x.q, x.k, x.v, out, lse, **x.kwargs,
                                         needs=(True, False, False, False))
    assert dk is None and dv is None and len(dq_kernel_launches) == 1
    atomic_dq, *_ = memattn.ops.backward(grad, x.q, x.k, x.v, out, lse, **x.kwargs)
    assert len(dq_kernel_launches) == 1  # the full backward took the atomic path
    torch.testing.assert_close(dq, atomic_dq, rtol=1e-5, atol=1e-6)


@cpu_only
def test_softcap_with_full_bias_gradient_uses_the_dq_kernel_cpu(dq_kernel_launches):
    """The stored dS lacks softcap's tanh' factor, so it cannot give dQ."""
    case = Case("softcap full bias", bias="BHQK", options=dict(softcap=3.0))
    assert_results(check_backward(case, torch.float32, "cpu", seed=12))
    assert dq_kernel_launches


# ---------------------------------------------------------------- GPU, real sizes

GPU_DTYPES = [torch.bfloat16, torch.float16]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
@pytest.mark.parametrize("case", FEATURE_CASES, ids=lambda c: c.name)
def test_gradients_gpu(case, dtype):
    assert_results(check_backward(gpu_sized(case), dtype, "cuda", seed=1))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("options", [{}, {"causal": True}], ids=["full", "causal"])
def test_gradients_head_dims_gpu(head_dim, options, dtype):
    case = Case(f"D={head_dim}", batch=2, heads=4, kv_heads=2, seqlen_q=1531, seqlen_k=2048,
                dqk=head_dim, dv=head_dim, bias="1HQK", options=options)
    assert_results(check_backward(case, dtype, "cuda", seed=head_dim))


@pytest.mark.gpu
@pytest.mark.parametrize("options", [{}, {"causal": True}], ids=["full", "causal"])
def test_gradients_long_sequence_gpu(options):
    case = Case("S=8192", batch=1, heads=2, kv_heads=1, seqlen_q=8192, seqlen_k=8192,
                dqk=128, dv=128, options=options)
    assert_results(check_backward(case, torch.bfloat16, "cuda", seed=5))


@pytest.mark.gpu
def test_gradients_dqk_192_dv_128_gpu():
    case = Case("Dqk=192 Dv=128", seqlen_q=2048, seqlen_k=2048, dqk=192, dv=128,
                bias="BHQK", options=dict(causal=True))
    assert_results(check_backward(case, torch.bfloat16, "cuda", seed=3))


@pytest.mark.gpu
@pytest.mark.parametrize("bias", BIAS_BROADCASTS)
def test_bias_gradient_broadcast_gpu(bias):
    case = Case(f"bias {bias}", bias=bias, batch=2, heads=8, kv_heads=2, seqlen_q=1000,
                seqlen_k=1200, dqk=64, dv=64, options=dict(causal=True))
    assert_results(check_backward(case, torch.bfloat16, "cuda", seed=9))


@pytest.mark.gpu
@pytest.mark.parametrize("deterministic", [True, "global"], ids=["flag", "torch-global"])
def test_deterministic_three_runs_bitwise_gpu(deterministic):
    """Three backward runs give bit-identical gradients, with GQA, dropout and a bias
    gradient broadcast over batch and heads (the one atomic path by default)."""
    case = Case("det", batch=2, heads=8, kv_heads=2, seqlen_q=1500, seqlen_k=1500,
                dqk=128, dv=128, bias="11QK",
                options=dict(causal=True, dropout_p=0.1,
                             deterministic=deterministic is True))  # fmt: skip
    old = torch.are_deterministic_algorithms_enabled()
    try:
        torch.use_deterministic_algorithms(deterministic == "global", warn_only=True)
        runs = [_gradients(case, torch.bfloat16, "cuda") for _ in range(3)]
    finally:
        torch.use_deterministic_algorithms(old)
    for run in runs[1:]:
        for a, b in zip(runs[0], run):
            assert torch.equal(a, b)


@pytest.fixture
def hopper_backward_launches(monkeypatch):
    """Records each launch of the Gluon backward (kernels/backward_sm90/)."""
    if not hopper_kernel_runs_here():
        pytest.skip("the Gluon kernels are built for Hopper (sm_90) and Triton 3.6")
    launched = []
    from memattn.kernels import backward_sm90 as module

    # small sizes run it too
    monkeypatch.setattr(module, "MIN_KEYS_PER_QUERY", dict.fromkeys(module.HEAD_DIMS, 0))
    run = module.backward
    monkeypatch.setattr(module, "backward", lambda *a: launched.append(1) or run(*a))
    return launched


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128])
def test_hopper_dropout_of_every_key_gpu(head_dim, hopper_backward_launches):
    """A p that rounds to a threshold of 2**16 (p >= 1 - 2**-17) drops every key: the
    16-bit uniforms, compared where P and dP are zeroed, never reach it. The output and
    every gradient are zeros, on the Gluon kernels (D=128 stages the mask through dS's
    buffer, D=64 through the compiler's exchange)."""
    gen = torch.Generator(device="cuda").manual_seed(3)
    q, k, v = (torch.randn(2, 300, 4, head_dim, device="cuda", dtype=torch.bfloat16,
                           generator=gen).requires_grad_() for _ in range(3))  # fmt: skip
    out = memattn.attention(q, k, v, causal=True, dropout_p=1.0 - 2.0**-18)
    out.backward(torch.randn_like(out))
    assert hopper_backward_launches, "the call ran the tile backward"
    for name, x in [("out", out), ("dq", q.grad), ("dk", k.grad), ("dv", v.grad)]:
        assert torch.count_nonzero(x) == 0, name


@pytest.mark.gpu
@pytest.mark.parametrize("graphed", [False, True], ids=["eager", "cuda_graph"])
@pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
@pytest.mark.parametrize("head_dims", [(128, 128), (192, 128)], ids=["narrow", "split"])
def test_hopper_backward_sees_the_kernels_before_it_gpu(head_dims, packed, graphed,
                                                        hopper_backward_launches):  # fmt: skip
    """The Hopper backward's kernels launch as programmatic dependents
    (backward_sm90.shared.DEPENDENT_LAUNCHES): each may start while the kernel before it
    in the stream ends, and must wait for that kernel's writes before it reads them.
    Training steps that each copy their query and output gradient into place, then run
    the forward just before the backward (whose output and lse the preprocess reads),
    whose statistics and zeroed dQ buffer (what the main kernel reads and adds into)
    take the memory the step before left, eager and replayed from a CUDA graph (forward
    and backward captured: autograd runs a backward on its forward's stream), against
    each step in float64. Both kernels in the chain: D 64/128's and 192/128's (split)."""
    torch.manual_seed(0)
    steps, heads = 3, 8
    dqk, dv = head_dims
    lengths = [1000, 2048, 700, 333] if packed else [2048, 2048]
    new = lambda *shape: torch.randn(*shape, device="cuda", dtype=torch.bfloat16)  # noqa: E731
    kw = dict(causal=True)
    if packed:
        cu = torch.tensor([0, *lengths], device="cuda").cumsum(0).to(torch.int32)
        kw.update(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(lengths),
                  max_seqlen_k=max(lengths))  # fmt: skip
        rows = (sum(lengths), heads)
    else:
        rows = (len(lengths), lengths[0], heads)
    q, k = (new(*rows, dqk).requires_grad_() for _ in range(2))
    v = new(*rows, dv).requires_grad_()
    queries, grads_out = new(steps, *rows, dqk), new(steps, *rows, dv)
    grad_out = torch.empty_like(grads_out[0])
    results = [torch.empty(steps, *x.shape, device="cuda", dtype=torch.bfloat16)
               for x in (q, k, v)]

    def run():
        for s in range(steps):
            with torch.no_grad():
                q.copy_(queries[s])
                grad_out.copy_(grads_out[s])
            out = memattn.attention(q, k, v, **kw)
            for i, g in enumerate(torch.autograd.grad(out, (q, k, v), grad_out)):
                results[i][s] = g

    run()  # compiles, outside any capture
    if graphed:
        graph, _ = capture(run)
        for r in results:
            r.fill_(float("nan"))
        graph.replay()
    torch.cuda.synchronize()
    assert hopper_backward_launches, "the call ran the tile backward"

    def reference_grads(dtype, s):
        leaves = [x.detach().to(dtype).requires_grad_() for x in (queries[s], k, v)]
        o = reference.attention(*leaves, **kw)
        return torch.autograd.grad(o, leaves, grads_out[s].to(dtype))

    for s in range(steps):
        for name, got, exact, low in zip("qkv", (r[s] for r in results),
                                         reference_grads(torch.float64, s),
                                         reference_grads(torch.bfloat16, s)):  # fmt: skip
            err = relative_error(got, exact)
            allowed = 2 * relative_error(low, exact) + FLOOR[torch.bfloat16]
            assert err <= allowed, f"step {s} d{name}: error {err:.3g} > allowed {allowed:.3g}"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
@pytest.mark.parametrize("case", HOPPER_CASES, ids=lambda c: c.name)
def test_hopper_backward_gpu(case, dtype, hopper_backward_launches):
    from memattn.kernels import backward_sm90, dispatch

    assert_results(check_backward(case, dtype, "cuda", seed=7))
    dqk, dv = dispatch.kernel_head_dims(case.dqk, case.dv, "backward")  # D=96 as 128
    # backward.py runs by design: past 128 columns (q·k's or V's) softcap with a bias
    # gradient (the suite's calls ask for it) or a deterministic gradient of a bias
    # broadcast over batch or heads with queries (the wide kernels add it by atomics).
    softcap = case.options.get("softcap", 0) > 0
    split = (dqk, dv) in backward_sm90.shared.SPLIT_HEAD_DIM_PAIRS
    summed = case.bias not in (None, "BHQK", "HQK") and not bias_row(case)
    deterministic = case.options.get("deterministic", False)
    wide_plain = max(dqk, dv) <= 128 or not (summed and deterministic
                                             or softcap and case.bias is not None)
    dims = (dqk, dv) in backward_sm90.shared.HEAD_DIM_PAIRS or split
    assert bool(hopper_backward_launches) == (wide_plain and dims), (
        "the Gluon backward runs the bias gradients (of any key count), and 128/64")


# A bias plane per head shared over the batch that asks no gradient: the key-block
# programs go batch after batch within a head (BIAS_TILES_BATCH_INNER), a program per
# block; dq, dk and dv against the reference.
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
@pytest.mark.parametrize("name", ["bias 1HQK causal B3 GQA", "bias 1HQK D64 Sq=2100"])
def test_hopper_backward_bias_without_grad_gpu(name, dtype, hopper_backward_launches,
                                               monkeypatch):  # fmt: skip
    from memattn.kernels import backward_sm90

    orders = []
    inner_dims = backward_sm90.narrow.inner_dims
    monkeypatch.setattr(backward_sm90.narrow, "inner_dims",
                        lambda *a: orders.append(inner_dims(*a)) or orders[-1])
    case = next(c for c in HOPPER_CASES if c.name == name)
    results = check_backward(case, dtype, "cuda", seed=7, bias_grad=False)
    assert [r.what for r in results] == ["dq", "dk", "dv"]
    assert_results(results)
    assert hopper_backward_launches and orders == [(True, False)]


# A bias whose rows TMA cannot read as they are, read by the Gluon kernels over a copy
# (dispatch: common.aligned_bias): rows not whole 16 bytes (Sk not a multiple of 8, a
# padded batch's mask), packed with a plane the sequences share, with dropout; keys
# strided (a transposed bias). Its gradient the Gluon backward computes into buffers of
# its own, over padded rows where Sk is not a multiple of 8 (stored whole, added up by
# TMA in fp32 or, the packed sequences' shared plane, in its dtype). out, lse and the
# gradients against the reference.
COPIED_BIAS_CASES = [
    Case("bias B1QK causal Sk=1001", seqlen_q=777, seqlen_k=1001, dqk=128, dv=128,
         bias="B1QK", options=dict(causal=True)),
    Case("bias 1HQK D64 dropout GQA", heads=4, kv_heads=2, seqlen_q=600, seqlen_k=907,
         dqk=64, dv=64, bias="1HQK", options=dict(dropout_p=0.1)),
    Case("bias 1HQK varlen window", lengths_q=(300, 0, 517), lengths_k=(401, 9, 515),
         dqk=128, dv=128, bias="1HQK", options=dict(window=(200, 30))),
    Case("bias BHQK Dqk192 Dv128 bottom-right", seqlen_q=300, seqlen_k=605, dqk=192, dv=128,
         bias="BHQK", options=dict(causal=True, align="bottom_right")),
    Case("bias BHQK transposed causal", seqlen_q=500, seqlen_k=704, dqk=128, dv=128,
         bias="BHQK", layout="transposed", options=dict(causal=True)),
    Case("bias 1HQK D64 transposed", seqlen_q=600, seqlen_k=904, dqk=64, dv=64,
         bias="1HQK", layout="transposed"),
    Case("bias BHQK causal Sk=1001", seqlen_q=640, seqlen_k=1001, dqk=128, dv=128,
         bias="BHQK", options=dict(causal=True)),
    Case("bias BHQK varlen causal", lengths_q=(300, 0, 517), lengths_k=(401, 9, 515),
         dqk=128, dv=128, bias="BHQK", options=dict(causal=True)),
    Case("bias 11QK deterministic Sk=1003", seqlen_q=700, seqlen_k=1003, dqk=128, dv=128,
         bias="QK", options=dict(deterministic=True)),
    Case("bias BHQK D64 deterministic window", seqlen_q=500, seqlen_k=905, dqk=64, dv=64,
         bias="BHQK", options=dict(window=(300, 0), deterministic=True)),
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
@pytest.mark.parametrize("case", COPIED_BIAS_CASES, ids=lambda c: c.name)
def test_hopper_kernels_read_a_copied_bias_gpu(case, dtype, hopper_backward_launches,
                                               monkeypatch):  # fmt: skip
    from memattn.kernels import dispatch, forward_sm90

    copied, forwards = [], []
    aligned, run = dispatch.aligned_bias, forward_sm90.forward

    def aligned_bias(bias, elements):
        read = aligned(bias, elements)
        copied.append(read is not bias)
        return read

    monkeypatch.setattr(dispatch, "aligned_bias", aligned_bias)
    monkeypatch.setattr(forward_sm90, "forward", lambda *a: forwards.append(1) or run(*a))
    assert_results(check_forward(case, dtype, "cuda", seed=5))
    assert forwards and copied == [True], "the Gluon forward did not read a copy"
    results = check_backward(case, dtype, "cuda", seed=5)
    assert [r.what for r in results] == ["dq", "dk", "dv", "dbias"]
    assert_results(results)
    assert hopper_backward_launches and copied == [True] * 3  # two forwards, the backward


# A bias past 128 columns (a padding mask from transformers at D=256, asking no
# gradient): the wide kernels read it, by TMA tiles beside Q's (dK/dV) and K's (dQ) or,
# constant along queries, as a row of keys by pointer; with dropout, ALiBi, softcap.
# Its gradient ("grad"), from the dK/dV kernel beside dropout and ALiBi: a full bias's
# (dS, stored from registers; under a mask the tiles no query sees zeroed by
# bias_grad_tiles), one broadcast over batch or heads with queries (dS added by atomics
# from registers into an fp32 buffer, packed sequences' shared plane too) and a key
# row's (dS summed over each head's queries in registers); softcap's keeps the tile
# kernels.
WIDE_BIAS_CASES = [
    Case("wide bias BHQK causal", seqlen_q=500, seqlen_k=504, dqk=256, dv=256, bias="BHQK",
         options=dict(causal=True)),
    Case("wide bias 1HQK GQA softcap", heads=4, kv_heads=2, seqlen_q=333, seqlen_k=704,
         dqk=128, dv=256, bias="1HQK", alibi="H", options=dict(softcap=2.0)),
    Case("wide bias B11K window dropout", seqlen_q=600, seqlen_k=1000, dqk=192, dv=128,
         bias="B11K", options=dict(window=(300, 40), dropout_p=0.2)),
    Case("wide bias 1H1K bottom-right", seqlen_q=300, seqlen_k=650, dqk=256, dv=64,
         bias="1H1K", options=dict(causal=True, align="bottom_right")),
    Case("wide varlen bias B11K causal", lengths_q=(300, 0, 517), lengths_k=(400, 9, 517),
         dqk=256, dv=256, bias="B11K", options=dict(causal=True)),
    Case("wide varlen bias 1HQK window", lengths_q=(130, 600, 1), lengths_k=(200, 600, 77),
         dqk=192, dv=128, bias="1HQK", options=dict(window=(100, 20))),
    Case("wide varlen bias BHQK bottom-right GQA", heads=4, kv_heads=2, lengths_q=(300, 0, 517),
         lengths_k=(400, 9, 520), dqk=256, dv=256, bias="BHQK",
         options=dict(causal=True, align="bottom_right")),
    Case("wide bias BH1K alibi dropout GQA", heads=4, kv_heads=2, seqlen_q=333, seqlen_k=704,
         dqk=128, dv=256, bias="BH1K", alibi="H", options=dict(dropout_p=0.2)),
    Case("wide bias HQK B1 window", batch=1, seqlen_q=300, seqlen_k=408, dqk=192, dv=128,
         bias="HQK", options=dict(window=(100, 30))),
]  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("grad", [False, True], ids=["read", "grad"])
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
@pytest.mark.parametrize("case", WIDE_BIAS_CASES, ids=lambda c: c.name)
def test_hopper_wide_backward_bias_gpu(case, dtype, grad, monkeypatch):
    from memattn.kernels import backward_sm90

    if not hopper_kernel_runs_here():
        pytest.skip("the Gluon kernels are built for Hopper (sm_90) and Triton 3.6")
    dkdv = record_launches(monkeypatch, backward_sm90.wide, "_launch_backward_wide")
    dq = record_launches(monkeypatch, backward_sm90.wide, "_launch_dq_wide")
    results = check_backward(case, dtype, "cuda", seed=13 if grad else 11, bias_grad=grad)
    assert [r.what for r in results] == ["dq", "dk", "dv"] + (["dbias"] if grad else [])
    assert_results(results)
    row = bias_row(case)
    full = grad and case.bias in ("BHQK", "HQK")  # HQK: at B = 1
    summed = grad and not (full or row)
    if grad and "softcap" in case.options:
        assert dkdv == [] and dq == []  # the tile kernels
        return
    for launches in (dkdv, dq):
        assert [(c["HAS_BIAS"], c["BIAS_ROW"]) for _, c in launches] == [(not row, row)]
    flags = [(c["DBIAS_FULL"], c["DBIAS_SUM"], c["DBIAS_ROW"]) for _, c in dkdv]
    assert flags == [(full, summed, grad and row)]


# Persistent backward programs (PERSISTENT_BLOCKS): with five of them, each walks key
# blocks of every batch and kv head, its rings, dS and dQ buffers running on from block
# to block, each block's K and V loading while the last one's dK and dV leave through
# the dQ buffers (both at once at D=64's 128-row steps, one after the other elsewhere);
# paired by work under a right bound; dQ's adds from the compute warpgroups and from
# the dQ writer warp (DQ_WRITER) at every Dqk. D 64 (128 and 64 rows a step) and 128,
# Sq far from Sk, GQA, a full bias's gradient, a key row's, dropout, ALiBi, Dqk != Dv.
PERSISTENT_BACKWARD_CASES = [
    "D64 Sq=777 Sk=1030", "D64 Sq=2048 Sk=333", "D128 causal", "causal bottom-right Sq>Sk",
    "window (200, 0)", "GQA 8:2 transposed causal", "bias BHQK window GQA",
    "dropout causal GQA", "alibi BH bias D64 window", "bias B11K causal GQA",
    "bias 1H1K D64 window dropout", "Dqk128 Dv64 window"]  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("writer", [False, True], ids=["dq_by_warpgroups", "dq_writer"])
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
@pytest.mark.parametrize("name", PERSISTENT_BACKWARD_CASES)
def test_hopper_backward_persistent_gpu(name, dtype, writer, hopper_backward_launches,
                                        monkeypatch):  # fmt: skip
    from memattn.kernels import backward_sm90

    monkeypatch.setattr(backward_sm90.narrow, "PERSISTENT_BLOCKS", True)
    monkeypatch.setattr(backward_sm90.narrow, "MASKED_BY_RANK_BLOCKS", {64: 0, 128: 0})
    monkeypatch.setattr(backward_sm90.narrow, "DQ_WRITER", {64: writer, 128: writer})
    monkeypatch.setattr(backward_sm90.hopper, "sm_count", lambda device_index: 5)
    backward_sm90.hopper.forget_plans()  # plans are made from sm_count
    launches = record_launches(monkeypatch, backward_sm90.narrow, "_launch_backward")
    try:
        case = next(c for c in HOPPER_CASES if c.name == name)
        assert_results(check_backward(case, dtype, "cuda", seed=19))
    finally:
        backward_sm90.hopper.forget_plans()
    # No writer beside a (queries, keys) bias's gradient: it leaves by TMA from the
    # compute warpgroups.
    with_writer = writer and (case.bias is None or bias_row(case))
    grids = [(grid, constexprs["PERSISTENT"], constexprs["DQ_BUFS"] > 0)
             for grid, constexprs in launches]  # fmt: skip
    assert grids and all(g == ((5,), backward_sm90.narrow.STRIDES, with_writer)
                         for g in grids), grids


# Masked D=128 backwards with a program per key block, heads in groups taking their
# blocks rank by rank (MASKED_BY_RANK_BLOCKS, hopper.rank_major_item): groups of one
# head, and of three or four with a last group of fewer (B2 x 3 kv heads: 6 heads;
# 25 blocks over 9 or 8 a head).
BY_RANK_CASES = [
    Case("by rank causal", batch=2, heads=6, kv_heads=3, seqlen_q=1031, seqlen_k=1031,
         dqk=128, dv=128, options=dict(causal=True)),
    Case("by rank window bottom-right", batch=2, heads=3, kv_heads=3, seqlen_q=600,
         seqlen_k=900, dqk=128, dv=128, options=dict(window=(200, 0), align="bottom_right")),
    Case("by rank key row causal", batch=2, heads=3, kv_heads=3, seqlen_q=777, seqlen_k=1030,
         dqk=128, dv=128, bias="B11K", options=dict(causal=True)),
]  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("blocks_together", [1, 25], ids=["one head", "three or four heads"])
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
@pytest.mark.parametrize("case", BY_RANK_CASES, ids=lambda c: c.name)
def test_hopper_backward_by_rank_gpu(case, dtype, blocks_together, hopper_backward_launches,
                                     monkeypatch):  # fmt: skip
    from memattn.kernels import backward_sm90

    monkeypatch.setattr(backward_sm90.narrow, "MASKED_BY_RANK_BLOCKS",
                        {64: 0, 128: blocks_together})
    backward_sm90.hopper.forget_plans()
    launches = record_launches(monkeypatch, backward_sm90.narrow, "_launch_backward")
    try:
        assert_results(check_backward(case, dtype, "cuda", seed=23))
    finally:
        backward_sm90.hopper.forget_plans()
    programs = case.batch * case.kv_heads * -(-case.seqlen_k // backward_sm90.narrow.BLOCK_N)
    grids = [(grid, constexprs["PERSISTENT"], constexprs["BY_RANK"])
             for grid, constexprs in launches]  # fmt: skip
    assert grids and all(g == ((programs,), backward_sm90.narrow.PER_BLOCK, blocks_together)
                         for g in grids), grids


# The wide dQ kernel (D=256) under a right bound alone: a program per query block,
# groups of heads rank by rank (wide.DQ_MASKED_BY_RANK_BLOCKS; groups of 16 blocks here:
# two heads of 9 blocks, the last group of B2 x 3 heads one), beside a bias, dropout,
# bottom-right.
WIDE_BY_RANK_CASES = [
    Case("wide by rank causal GQA", batch=2, heads=3, kv_heads=1, seqlen_q=1031, seqlen_k=1031,
         dqk=256, dv=256, options=dict(causal=True)),
    Case("wide by rank bias 1HQK causal", batch=2, heads=3, kv_heads=3, seqlen_q=1031,
         seqlen_k=904, dqk=256, dv=256, bias="1HQK", options=dict(causal=True)),
    Case("wide by rank dropout bottom-right", batch=1, heads=3, kv_heads=3, seqlen_q=1031,
         seqlen_k=1200, dqk=256, dv=128,
         options=dict(causal=True, align="bottom_right", dropout_p=0.2)),
]  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("case", WIDE_BY_RANK_CASES, ids=lambda c: c.name)
def test_hopper_backward_wide_dq_by_rank_gpu(case, hopper_backward_launches, monkeypatch):
    from memattn.kernels import backward_sm90

    monkeypatch.setattr(backward_sm90.wide, "DQ_MASKED_BY_RANK_BLOCKS", 16)
    monkeypatch.setattr(backward_sm90.wide, "DQ_MIN_BLOCKS_BY_RANK", 1)
    backward_sm90.hopper.forget_plans()
    launches = record_launches(monkeypatch, backward_sm90.wide, "_launch_dq_wide")
    try:
        assert_results(check_backward(case, torch.bfloat16, "cuda", seed=29))
    finally:
        backward_sm90.hopper.forget_plans()
    blocks = -(-case.seqlen_q // 128)
    grids = [(grid, constexprs["BY_RANK"], constexprs["FOLD"]) for grid, constexprs in launches]
    assert grids and all(g == ((case.batch * case.heads * blocks,), 16, False)
                         for g in grids), grids


# A bias plane per head that packed sequences share (backward_sm90.shared.PACKED_BIAS_ADDS):
# each sequence's dS tiles added into the 16-bit gradient ("added"), or, past the
# sequence count, into the fp32 buffer ("summed"); 20 sequences of mixed lengths (empty
# ones too), causal, D 64 and 128.
_PACKED_LENGTHS = (300, 0, 517, 64, 129, 1, 704, 33, 256, 90, 411, 5, 128, 640, 77, 200, 3,
                   380, 150, 600)  # the longest's keys in rows of whole 16 bytes (TMA)
PACKED_SHARED_BIAS = Case("packed shared bias", heads=4, kv_heads=2, bias="1HQK",
                          lengths_q=_PACKED_LENGTHS, lengths_k=_PACKED_LENGTHS,
                          options=dict(causal=True))  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("kind", ["added", "summed"])
def test_packed_shared_bias_gradient_gpu(kind, head_dim, dtype, hopper_backward_launches,
                                         monkeypatch):  # fmt: skip
    from memattn.kernels import backward_sm90

    monkeypatch.setattr(backward_sm90.shared, "PACKED_BIAS_ADDS", 32 if kind == "added" else 19)
    backward_sm90.hopper.forget_plans()  # plans are made from the knobs
    launches = record_launches(monkeypatch, backward_sm90.narrow, "_launch_backward")
    case = PACKED_SHARED_BIAS.scaled(dqk=head_dim, dv=head_dim)
    try:
        assert_results(check_backward(case, dtype, "cuda", seed=23))
    finally:
        backward_sm90.hopper.forget_plans()
    tiles = {"added": 2, "summed": 0}[kind]
    assert launches and all(c["DBIAS_TILES"] == tiles and c["DBIAS_SUM"] == (kind == "summed")
                            for _, c in launches)  # fmt: skip


# Dqk=192 / Dv=128, Q and K split into 128 + 64 columns (backward_sm90.shared.SPLIT_HEAD_DIM_PAIRS):
# calls without bias, ALiBi or dropout, as at D=256; _bwd_split_kernel, or the D=256
# kernels for deterministic calls (dense batches; packed ones run backward.py there).
SPLIT_CASES = [
    Case("Dqk192 Dv128", batch=2, heads=2, kv_heads=2, seqlen_q=333, seqlen_k=1000, dqk=192,
         dv=128),
    Case("Dqk192 Dv128 S=1500 GQA 4:1", batch=1, heads=4, kv_heads=1, seqlen_q=1500,
         seqlen_k=1500, dqk=192, dv=128),
    Case("Dqk192 Dv128 causal GQA", heads=4, kv_heads=2, seqlen_q=700, seqlen_k=901, dqk=192,
         dv=128, options=dict(causal=True)),
    Case("Dqk192 Dv128 window bottom-right", batch=1, seqlen_q=1100, seqlen_k=650, dqk=192,
         dv=128, options=dict(window=(200, 30), align="bottom_right")),
]  # fmt: skip


# Packed sequences on _bwd_split_kernel: empty and one-token sequences, a sequence
# ending inside a warpgroup's keys (dK and dV by plain stores), Sq != Sk per sequence.
SPLIT_VARLEN_CASES = [
    Case("Dqk192 Dv128 varlen causal GQA", heads=4, kv_heads=2, lengths_q=(300, 0, 777, 1),
         lengths_k=(300, 0, 777, 1), dqk=192, dv=128, options=dict(causal=True)),
    Case("Dqk192 Dv128 varlen", heads=2, kv_heads=2, lengths_q=(129, 640, 33),
         lengths_k=(500, 96, 1000), dqk=192, dv=128),
    Case("Dqk192 Dv128 varlen window bottom-right", heads=2, kv_heads=1, lengths_q=(700, 50),
         lengths_k=(300, 901), dqk=192, dv=128,
         options=dict(window=(200, 30), align="bottom_right")),
]  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
@pytest.mark.parametrize("case", SPLIT_CASES + SPLIT_VARLEN_CASES, ids=lambda c: c.name)
def test_split_head_dims_backward_gpu(case, dtype, hopper_backward_launches, monkeypatch):
    """The gradients against the reference from _bwd_split_kernel."""
    from memattn.kernels import backward_sm90

    fused = record_launches(monkeypatch, backward_sm90.split, "_launch_split")
    wide = record_launches(monkeypatch, backward_sm90.wide, "_launch_backward_wide")
    assert_results(check_backward(case, dtype, "cuda", seed=11))
    assert fused and not wide, "the call did not run _bwd_split_kernel"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
@pytest.mark.parametrize("case", SPLIT_CASES, ids=lambda c: c.name)
def test_split_head_dims_deterministic_gpu(case, dtype, hopper_backward_launches,
                                           monkeypatch):  # fmt: skip
    """Deterministic calls at Dqk=192 / Dv=128 on the D=256 kernels (dQ from a kernel
    of its own, adding in a fixed order): against the reference, and two runs bit for
    bit."""
    from memattn.kernels import backward_sm90

    fused = record_launches(monkeypatch, backward_sm90.split, "_launch_split")
    wide = record_launches(monkeypatch, backward_sm90.wide, "_launch_backward_wide")
    det = dataclasses.replace(case, options=dict(case.options, deterministic=True))
    assert_results(check_backward(det, dtype, "cuda", seed=12))
    assert wide and not fused, "the deterministic call did not run the D=256 kernels"
    hopper_backward_launches.clear()
    runs = [_gradients(det, dtype, "cuda") for _ in range(2)]
    assert len(hopper_backward_launches) == 2, "deterministic calls fell back to backward.py"
    for a, b in zip(*runs):
        assert torch.equal(a, b)


# The dQ writer warp where DQ_WRITER leaves it off (Dqk=128), for calls a program per
# key block (packed sequences) as well as persistent: two buffers a warpgroup, or one
# beside dropout or bias tiles; GQA, packed rows.
DQ_WRITER_CASES = ["D64 Sq=777 Sk=1030", "D128 causal", "GQA 8:2 transposed causal",
                   "dropout causal GQA", "bias K Sq=2100 Sk=333", "varlen D128 causal",
                   "Dqk128 Dv64 window"]  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("name", DQ_WRITER_CASES)
def test_backward_dq_writer_at_every_dqk_gpu(name, hopper_backward_launches, monkeypatch):
    from memattn.kernels import backward_sm90

    monkeypatch.setattr(backward_sm90.narrow, "DQ_WRITER", {64: True, 128: True})
    backward_sm90.hopper.forget_plans()  # plans are made from the knobs
    launches = record_launches(monkeypatch, backward_sm90.narrow, "_launch_backward")
    try:
        case = next(c for c in HOPPER_CASES if c.name == name)
        assert_results(check_backward(case, torch.bfloat16, "cuda", seed=13))
    finally:
        backward_sm90.hopper.forget_plans()
    assert launches and all(constexprs["DQ_BUFS"] > 0 for _, constexprs in launches)


# ORDERED_DQ: deterministic calls on the Gluon backward, each dQ tile's adds in a fixed
# order, dense and packed batches. The three orders (a right bound: last key block
# first; none: round from the block whose walk starts at the tile; a left bound alone,
# or a head's blocks more than half the SMs: first block first), D 64 (128 rows a step)
# and 128, GQA, Sq far from Sk, one key block, dropout (one dQ buffer), a key row's
# gradient, ALiBi, Dqk != Dv, 32 key blocks a head contending for turns, and persistent
# programs walking the blocks the host dealt them (ORDERED_DEALT) or folded strides
# (ORDERED_SUM_FOLD), beside a summed bias gradient's turns too.
ORDERED_CASES = ["D64 Sq=777 Sk=1030", "D64 Sq=2048 Sk=333", "D128 causal",
                 "causal bottom-right Sq>Sk", "window (200, 0)", "GQA 8:2 transposed causal",
                 "one tile", "dropout causal GQA", "bias K Sq=2100 Sk=333",
                 "bias B11K causal GQA", "alibi H causal GQA", "Dqk128 Dv64 window",
                 "ordered D128 S4096", "ordered D128 S4096 causal", "varlen D128 causal",
                 "varlen D128 GQA", "varlen D64 GQA bottom-right",
                 "ordered left window bottom-right GQA", "ordered D64 first first Sk=1500",
                 "ordered varlen D128 first first", "softcap causal bottom-right GQA",
                 "dealt D64 causal GQA", "dealt D128 first first", "folded 11QK D64 causal GQA",
                 "dealt 11QK D128 window bottom-right", "strided 11QK D128 GQA",
                 "strided 11QK D64", "strided 1HQK D128 GQA", "strided B1QK D64 spread",
                 "strided B1QK D128 causal"]  # fmt: skip
_ORDERED_EXTRA = [
    Case("ordered D128 S4096", batch=1, heads=4, kv_heads=2, seqlen_q=4096, seqlen_k=4096,
         dqk=128, dv=128),
    Case("ordered D128 S4096 causal", batch=1, heads=4, kv_heads=2, seqlen_q=4096,
         seqlen_k=4096, dqk=128, dv=128, options=dict(causal=True)),
    Case("ordered left window bottom-right GQA", heads=4, kv_heads=2, seqlen_q=1100,
         seqlen_k=1500, dqk=128, dv=128, options=dict(window=(300, -1), align="bottom_right")),
    Case("ordered D64 first first Sk=1500", heads=4, kv_heads=2, seqlen_q=900, seqlen_k=1500,
         dqk=64, dv=64),
    Case("ordered varlen D128 first first", heads=4, kv_heads=2, lengths_q=(700, 0, 1300, 64),
         lengths_k=(500, 5, 1304, 64), dqk=128, dv=128),
    # ORDERED_DEALT on 5 SMs: each program walks blocks of several heads, last first
    # under a right bound, first first without one; with a bias summed over batch and
    # heads, in turns too, folded under a causal mask (ORDERED_SUM_FOLD)
    Case("dealt D64 causal GQA", batch=2, heads=4, kv_heads=2, seqlen_q=1000, seqlen_k=1000,
         dqk=64, dv=64, options=dict(causal=True)),
    Case("dealt D128 first first", batch=2, heads=2, seqlen_q=600, seqlen_k=1030, dqk=128,
         dv=128),
    Case("folded 11QK D64 causal GQA", batch=2, heads=4, kv_heads=2, seqlen_q=904,
         seqlen_k=904, dqk=64, dv=64, bias="QK", options=dict(causal=True)),
    Case("dealt 11QK D128 window bottom-right", batch=2, heads=4, kv_heads=2, seqlen_q=700,
         seqlen_k=904, dqk=128, dv=128, bias="QK",
         options=dict(window=(200, 0), align="bottom_right")),
    # ORDERED_SUM_PERSISTENT (at both head dims): strides of whole groups of the blocks
    # that run together. Over batch and heads on 17 SMs, 8 key blocks a head rotate: two
    # heads a round of 16 programs; over the batch (batch inner) on 5 SMs, each block
    # alone; over the heads on 9 SMs, 4 kv heads spread: two blocks' a round of 8; and
    # under a causal mask, each block alone on 5
    Case("strided 11QK D128 GQA", batch=2, heads=4, kv_heads=2, seqlen_q=1000,
         seqlen_k=1000, dqk=128, dv=128, bias="QK"),
    Case("strided 11QK D64", batch=3, heads=2, seqlen_q=904, seqlen_k=904, dqk=64, dv=64,
         bias="QK"),
    Case("strided 1HQK D128 GQA", batch=3, heads=4, kv_heads=2, seqlen_q=700, seqlen_k=904,
         dqk=128, dv=128, bias="1HQK"),
    Case("strided B1QK D64 spread", batch=2, heads=8, kv_heads=4, seqlen_q=500,
         seqlen_k=1032, dqk=64, dv=64, bias="B1QK"),
    Case("strided B1QK D128 causal", batch=2, heads=4, kv_heads=2, seqlen_q=704,
         seqlen_k=704, dqk=128, dv=128, bias="B1QK", options=dict(causal=True)),
]  # fmt: skip
# The SMs the child pretends the GPU has: a head's 12 key blocks (11 of the longest
# sequence) more than half of 8, so that the unbounded turns go first block first
# (rotates_dq) at a size the suite can run.
# The "strided" cases' SMs and the programs they run: whole groups of the blocks that
# run together.
_ORDERED_STRIDES = {"strided 11QK D128 GQA": (17, 16), "strided 11QK D64": (17, 16),
                    "strided 1HQK D128 GQA": (5, 5), "strided B1QK D64 spread": (9, 8),
                    "strided B1QK D128 causal": (5, 5)}
_ORDERED_SMS = {"ordered D64 first first Sk=1500": 8, "ordered varlen D128 first first": 8,
                **{c.name: 5 for c in _ORDERED_EXTRA if c.name.startswith(("dealt", "folded"))},
                **{name: sms for name, (sms, _) in _ORDERED_STRIDES.items()}}


def ordered_dq_child(name: str) -> None:
    """test_ordered_dq_backward_gpu's work, in a process of its own: the case's
    deterministic gradients against the reference on the Gluon backward, then three runs
    bit for bit; the "dealt" cases on the blocks the host dealt each program, the
    "folded" one on persistent folded strides, the "strided" ones on strides of whole
    groups (ORDERED_SUM_PERSISTENT), their bits then the same from a program per block."""
    from memattn.kernels import backward_sm90

    backward_sm90.MIN_KEYS_PER_QUERY = dict.fromkeys(backward_sm90.HEAD_DIMS, 0)
    if name in _ORDERED_SMS:
        backward_sm90.hopper.sm_count = lambda device_index: _ORDERED_SMS[name]
    if name.startswith("strided"):
        backward_sm90.narrow.ORDERED_SUM_PERSISTENT = {64: True, 128: True}
    launched = []
    run = backward_sm90.backward
    backward_sm90.backward = lambda *a: launched.append(1) or run(*a)
    case = next(c for c in HOPPER_CASES + _ORDERED_EXTRA if c.name == name)
    det = dataclasses.replace(case, options=dict(case.options, deterministic=True))
    with pytest.MonkeyPatch.context() as monkeypatch:
        launches = record_launches(monkeypatch, backward_sm90.narrow, "_launch_backward")
        assert_results(check_backward(det, torch.bfloat16, "cuda", seed=17))
    assert launched, "the deterministic call fell back to backward.py"
    narrow = backward_sm90.narrow
    if name.startswith(("dealt", "folded", "strided")):
        mode = {"dealt": (narrow.DEALT, False), "folded": (narrow.STRIDES, True),
                "strided": (narrow.STRIDES, False)}[name.split()[0]]
        programs = _ORDERED_STRIDES[name][1] if name in _ORDERED_STRIDES else 5
        grids = [(grid, (c["PERSISTENT"], c["FOLD"])) for grid, c in launches]
        assert grids and all(g == ((programs,), mode) for g in grids), grids
    runs = [_gradients(det, torch.bfloat16, "cuda") for _ in range(3)]
    if name.startswith("strided"):  # the same adds, in the same order, a program per block
        narrow.ORDERED_SUM_PERSISTENT = {64: False, 128: False}
        backward_sm90.hopper.forget_plans()
        runs.append(_gradients(det, torch.bfloat16, "cuda"))
    for grads in runs[1:]:
        for a, b in zip(runs[0], grads):
            assert torch.equal(a, b), "two deterministic runs differ"


@pytest.mark.gpu
@pytest.mark.parametrize("name", ORDERED_CASES)
def test_ordered_dq_backward_gpu(name):
    """ORDERED_DQ in a subprocess with a time limit: a program waiting for a turn that
    never comes would hang the GPU, and with it every later test of the worker."""
    if not hopper_kernel_runs_here():
        pytest.skip("the Gluon kernels are built for Hopper (sm_90) and Triton 3.6")
    code = f"from tests.test_backward import ordered_dq_child; ordered_dq_child({name!r})"
    env = dict(os.environ, MEMATTN_POISON_OUTPUTS="1")
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=180, env=env, cwd=os.path.dirname(os.path.dirname(
                                  os.path.abspath(__file__))))  # fmt: skip
    except subprocess.TimeoutExpired:
        pytest.fail("ORDERED_DQ hung (a turn never came) or ran past 180 s")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


LSE_GRADIENT_CASES = [
    Case("lse D64", batch=2, heads=4, kv_heads=2, seqlen_q=301, seqlen_k=301, dqk=64,
         dv=64, options=dict(causal=True)),
    Case("lse D256", batch=2, heads=4, kv_heads=2, seqlen_q=301, seqlen_k=301, dqk=256,
         dv=256, options=dict(causal=True)),
    # sequences starting at tokens 130, 207 and 508: their stats are moved to multiples of 4
    Case("lse packed D128", heads=4, kv_heads=2, dqk=128, dv=128, lengths_q=(130, 0, 77, 301, 6),
         lengths_k=(130, 0, 77, 301, 6), options=dict(causal=True)),
]  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("case", LSE_GRADIENT_CASES, ids=lambda c: c.name)
def test_hopper_backward_gradient_through_lse_gpu(case, hopper_backward_launches):
    """A gradient flowing into lse enters the Gluon backward as delta - grad_lse, in the
    preprocess's row statistics (padded for TMA: 301 queries pad to 304; packed
    sequences' at common.packed_stats_start): dq, dk, dv against float64 autograd
    through the reference, within twice the reference's own error in bf16."""
    x = make_inputs(case, torch.bfloat16, "cuda", seed=11)
    leaves = [t.requires_grad_(True) for t in (x.q, x.k, x.v)]
    out, lse = memattn.attention(*leaves, **x.kwargs, return_lse=True)
    g_out, g_lse = torch.randn_like(out), torch.randn_like(lse)
    grads = torch.autograd.grad((out, lse), leaves, (g_out, g_lse))
    assert hopper_backward_launches

    def reference_grads(dtype):
        ls = [t.detach().to(dtype).requires_grad_(True) for t in leaves]
        o, lse_ref = memattn.reference.attention(*ls, **x.kwargs, return_lse=True)
        return torch.autograd.grad((o, lse_ref), ls, (g_out.to(dtype), g_lse.to(dtype)))

    exact, low = reference_grads(torch.float64), reference_grads(torch.bfloat16)
    for name, g, ref, g_low in zip(("dq", "dk", "dv"), grads, exact, low):
        err, bound = relative_error(g, ref), 2 * relative_error(g_low, ref) + FLOOR[torch.bfloat16]
        assert err <= bound, f"{name}: relative error {err:.3g} > {bound:.3g}"


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [128, 256])
def test_deterministic_backward_on_hopper_gpu(head_dim, hopper_backward_launches):
    """Deterministic calls on the Gluon backward: at D=128 dQ's fp32 reduce-adds go in a
    fixed order (backward_sm90.narrow.ORDERED_DQ), at D=256 dQ has a kernel of its own that
    adds in one. Two runs agree bit for bit, and the gradients match the reference."""
    case = Case("det plain", batch=2, heads=8, kv_heads=2, seqlen_q=1500, seqlen_k=1500,
                dqk=head_dim, dv=head_dim, options=dict(causal=True, deterministic=True))
    runs = [_gradients(case, torch.bfloat16, "cuda") for _ in range(2)]
    assert hopper_backward_launches, "the deterministic call fell back to backward.py"
    for a, b in zip(*runs):
        assert torch.equal(a, b)
    assert_results(check_backward(case, torch.bfloat16, "cuda", seed=5))


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim, dropout_p", [(64, 0.0), (128, 0.0), (128, 0.2)])
def test_deterministic_full_bias_gradient_on_hopper_gpu(head_dim, dropout_p,
                                                        hopper_backward_launches):  # fmt: skip
    """Deterministic calls with a full bias's gradient on the Gluon backward: the kernel
    stores dS whole, and dQ comes from it by one matmul (backward_sm90.dq_from_full_bias),
    not from the kernel's adds. Two runs agree bit for bit, and the gradients (the
    bias's too) match the reference. With dropout the keep bits go through the dS
    buffers the stores read from (KEEP_IN_DS)."""
    case = Case("det full bias", batch=2, heads=8, kv_heads=2, seqlen_q=1000, seqlen_k=1104,
                dqk=head_dim, dv=head_dim, bias="BHQK",
                options=dict(causal=True, align="bottom_right", deterministic=True,
                             dropout_p=dropout_p))
    runs = [_gradients(case, torch.bfloat16, "cuda") for _ in range(2)]
    assert hopper_backward_launches, "the deterministic call fell back to backward.py"
    for a, b in zip(*runs):
        assert torch.equal(a, b)
    assert_results(check_backward(case, torch.bfloat16, "cuda", seed=9))


ORDERED_BIAS_SUM_CASES = [
    # over the batch: (kv head, batch, key block) programs, the right bound's turns
    Case("1HQK causal bottom-right GQA", batch=3, heads=8, kv_heads=2, seqlen_q=1000,
         seqlen_k=1104, dqk=128, dv=128, bias="1HQK",
         options=dict(causal=True, align="bottom_right")),
    # over the heads: dQ's turns rotate round a head's blocks (no bound)
    Case("B1QK D64", batch=2, heads=6, kv_heads=3, seqlen_q=777, seqlen_k=904, dqk=64,
         dv=64, bias="B1QK"),
    # over both, a window; and with softcap, whose dS leaves before tanh's derivative
    Case("QK window", batch=2, heads=4, seqlen_q=640, seqlen_k=704, dqk=128, dv=128,
         bias="QK", options=dict(window=(200, 30))),
    Case("1HQK softcap", batch=2, heads=4, seqlen_q=500, seqlen_k=640, dqk=128, dv=128,
         bias="1HQK", options=dict(softcap=20.0)),
    Case("11QK D64 dropout causal", batch=2, heads=4, kv_heads=1, seqlen_q=600,
         seqlen_k=600, dqk=64, dv=64, bias="QK", options=dict(causal=True, dropout_p=0.15)),
    # no bound, too many key blocks for dQ's turns to rotate (18 x 4 programs on 132
    # SMs): over the batch the walks stay alike, over the heads they spread over the kv
    # heads (narrow.walk_rotation), GQA heads summed within each program
    Case("1HQK many blocks", batch=4, heads=4, kv_heads=2, seqlen_q=900, seqlen_k=2200,
         dqk=128, dv=128, bias="1HQK"),
    Case("B1QK spread GQA", batch=2, heads=8, kv_heads=4, seqlen_q=700, seqlen_k=2200,
         dqk=128, dv=128, bias="B1QK"),
]  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("case", ORDERED_BIAS_SUM_CASES, ids=lambda c: c.name)
def test_deterministic_summed_bias_gradient_on_hopper_gpu(case, hopper_backward_launches):
    """Deterministic calls with the gradient of a bias broadcast over batch or heads
    (dbias_kind_of's "ordered"): the D 64/128 kernel adds each (b, h)'s dS tile into the
    fp32 gradient, and dQ's tiles into theirs, in turns. Three runs agree bit for bit,
    and the gradients (the bias's too) match the reference. Over the batch under a right
    bound each batch's blocks start after the batch before's (ORDERED_BATCH_STAGGER)."""
    from memattn.kernels import backward_sm90

    case = dataclasses.replace(case, options=dict(case.options, deterministic=True))
    runs = [_gradients(case, torch.bfloat16, "cuda") for _ in range(3)]
    assert hopper_backward_launches, "the deterministic call fell back to backward.py"
    x = make_inputs(case, torch.bfloat16, "cuda", seed=4)
    spec = memattn.spec.check_call(x.q, x.k, x.v, **x.kwargs)
    assert backward_sm90.dbias_kind_of(spec, x.kwargs["bias"]) == "ordered"
    narrow = backward_sm90.narrow
    inner = narrow.inner_dims(spec, x.kwargs["bias"], "ordered")
    if case.name.startswith("1HQK causal"):
        assert narrow.batch_stagger(spec, True, inner) == narrow.ORDERED_BATCH_STAGGER > 0
    if "many blocks" in case.name or "spread" in case.name:
        assert narrow.walk_rotation(spec, "ordered", inner) == (
            narrow.SPREAD_OVER_KV_HEADS if "spread" in case.name else narrow.ROTATE_NONE)
    for run in runs[1:]:
        for a, b in zip(runs[0], run):
            assert torch.equal(a, b)
    assert_results(check_backward(case, torch.bfloat16, "cuda", seed=9))


@pytest.mark.gpu
def test_persistent_ordered_backward_adds_as_a_program_per_block_gpu(hopper_backward_launches,
                                                                     monkeypatch):  # fmt: skip
    """Persistent ORDERED_DQ programs change which program makes each add, never the
    order of a tile's adds (the turns fix it): a deterministic causal call with a bias
    summed over batch and heads gives the same bits from five persistent programs on
    folded strides (ORDERED_SUM_FOLD), on the blocks the host dealt them
    (ORDERED_DEALT), from a program per block (both off), and from the plan a call
    takes where the table cannot reach the device (a CUDA graph capturing first:
    tabled=False, a program per block); and the gradients match the reference."""
    from memattn.kernels import backward_sm90

    narrow = backward_sm90.narrow
    case = Case("persistent 11QK D64 causal", batch=2, heads=4, kv_heads=2, seqlen_q=1000,
                seqlen_k=1000, dqk=64, dv=64, bias="QK",
                options=dict(causal=True, deterministic=True))  # fmt: skip
    monkeypatch.setattr(backward_sm90.hopper, "sm_count", lambda device_index: 5)
    launches = record_launches(monkeypatch, narrow, "_launch_backward")
    runs = []
    try:
        for fold, dealt, on_device in [(True, True, True), (False, True, True),
                                       (False, False, True), (False, True, False)]:
            backward_sm90.hopper.forget_plans()
            with monkeypatch.context() as m:
                m.setattr(narrow, "ORDERED_SUM_FOLD", fold)
                m.setattr(narrow, "ORDERED_DEALT", dealt)
                if not on_device:
                    m.setattr(backward_sm90.hopper, "schedule_on_device",
                              lambda plan, device_index: None)
                runs.append(_gradients(case, torch.bfloat16, "cuda"))
        backward_sm90.hopper.forget_plans()
        assert_results(check_backward(case, torch.bfloat16, "cuda", seed=9))
    finally:
        backward_sm90.hopper.forget_plans()
    blocks = 2 * 2 * 8
    modes = [(grid, c["PERSISTENT"], c["FOLD"]) for grid, c in launches]
    assert modes[:4] == [((5,), narrow.STRIDES, True), ((5,), narrow.DEALT, False),
                         ((blocks,), narrow.PER_BLOCK, False),
                         ((blocks,), narrow.PER_BLOCK, False)], modes
    for run in runs[1:]:
        for a, b in zip(runs[0], run):
            assert torch.equal(a, b), "persistent and per-block gradients differ"


@pytest.mark.gpu
def test_deterministic_summed_bias_gradient_needs_no_expanded_buffer_gpu():
    """A deterministic gradient of a bias shared by every batch and head takes the bias's
    own fp32 buffer, not a (B, H, Sq, Sk) one: the backward's peak beyond its inputs and
    outputs stays below a quarter of what the expanded buffer would take."""
    case = Case("11QK", batch=4, heads=16, seqlen_q=1024, seqlen_k=1024, dqk=64, dv=64,
                bias="QK", options=dict(causal=True, deterministic=True))
    x = make_inputs(case, torch.bfloat16, "cuda", seed=4)
    leaves = [x.q, x.k, x.v, x.kwargs["bias"]]
    for t in leaves:
        t.requires_grad_(True)
    out = memattn.attention(x.q, x.k, x.v, **x.kwargs)
    grad = torch.randn_like(out)
    torch.autograd.grad(out, leaves, grad, retain_graph=True)  # compiled and warm
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    grads = torch.autograd.grad(out, leaves, grad, retain_graph=True)
    torch.cuda.synchronize()
    grads_bytes = sum(g.numel() * g.element_size() for g in grads)
    expanded = case.batch * case.heads * case.seqlen_q * case.seqlen_k * 2
    extra = torch.cuda.max_memory_allocated() - before - grads_bytes
    assert extra < expanded / 4, f"{extra / 2**20:.1f} MiB beyond the gradients"


FLOAT32_CASES = [
    Case("fp32 D64 causal bias", seqlen_q=777, seqlen_k=901, dqk=64, dv=64, bias="1HQK",
         options=dict(causal=True)),
    Case("fp32 D128 causal GQA bias", seqlen_q=300, seqlen_k=421, dqk=128, dv=128,
         bias="1HQK", options=dict(causal=True, align="bottom_right")),
    Case("fp32 D256 window ALiBi dropout", seqlen_q=250, seqlen_k=333, dqk=256, dv=256,
         alibi="H", options=dict(window=(100, 20), dropout_p=0.1)),
]  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("case", FLOAT32_CASES, ids=lambda c: c.name)
def test_gradients_float32_gpu(case):
    """float32 gradients at every head dim (3xTF32 dots, IEEE in the backward past 128
    columns: forward.dot_precision) within float32's tolerance whatever allow_tf32 says:
    the reference follows it (without: plain float32's error), the kernels do not."""
    old = torch.backends.cuda.matmul.allow_tf32
    try:
        for allow in (False, True):
            torch.backends.cuda.matmul.allow_tf32 = allow
            assert_results(check_backward(case, torch.float32, "cuda", seed=2))
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old


@pytest.mark.gpu
def test_gradients_float32_wide_large_scores_gpu():
    """float32 at Dqk 256 / Dv 128 with scores of std ~3 (scale 0.241): the backward's
    IEEE scores against the forward's 3xTF32 lse put dV 1.43x over its tolerance (H200)
    until the backward took an lse of its own dots (forward.rescored_lse)."""
    case = Case("fp32 D256/128 scale 0.241", batch=3, seqlen_q=719, seqlen_k=719, heads=3,
                kv_heads=3, dqk=256, dv=128, layout="transposed", options=dict(scale=0.241))
    assert_results(check_backward(case, torch.float32, "cuda", seed=105))


@cpu_only
@pytest.mark.parametrize("packed", [False, True], ids=["dense", "packed"])
def test_rescored_lse_is_the_forwards_under_the_interpreter(packed):
    """float32 past 128 columns: the backward's lse is made again with its own dots
    (forward.rescored_lse), the forward's masks and score terms (causal, a window, a
    bias, ALiBi, softcap), no P·V. The interpreter's dots are float32's whatever their
    precision, and the tiles are the forward's: the same lse bit for bit. Where the
    backward's dots are the forward's (128 columns, 16-bit inputs) none is made."""
    from memattn import ops
    from memattn.check import reference_spec
    from memattn.kernels import forward as forward_kernels

    sizes = (dict(lengths_q=(20, 0, 17), lengths_k=(25, 9, 11)) if packed
             else dict(batch=2, seqlen_q=45, seqlen_k=37))  # fmt: skip
    options = dict(causal=True, align="bottom_right", window=(30, 5), softcap=20.0)
    for dqk, dtype, made in [(192, torch.float32, True), (128, torch.float32, False),
                             (192, torch.bfloat16, False)]:  # fmt: skip
        case = Case("rescore", heads=2, kv_heads=1, dqk=dqk, dv=128, bias="1HQK",
                    alibi="H", options=options, **sizes)  # fmt: skip
        x = make_inputs(case, dtype, "cpu", seed=dqk)
        _, lse, _ = ops.forward(x.q, x.k, x.v, **x.kwargs)
        spec = reference_spec(x)
        cu = (x.kwargs.get("cu_seqlens_q"), x.kwargs.get("cu_seqlens_k"))
        unread = torch.full_like(lse, float("nan"))  # lse's shape alone is taken
        rescored = forward_kernels.rescored_lse(spec, x.q, x.k, x.v, x.kwargs["bias"],
                                                x.kwargs["alibi_slopes"], *cu, unread)
        if not made:
            assert rescored is None, (dqk, dtype)
            continue
        assert torch.isinf(lse).any() and torch.isfinite(lse).any()  # rows with no key too
        assert torch.equal(rescored, lse)


@pytest.mark.parametrize(
    "head_dim, options, rows",
    [(64, {}, 128), (64, dict(causal=True), 128), (64, dict(bias="row"), 128),
     (64, dict(window=(300, 7)), 128), (64, dict(bias="tile"), 64),
     (64, dict(dropout_p=0.1), 64), (64, dict(alibi=True), 64), (128, {}, 64),
     (128, dict(bias="row"), 64)],
)  # fmt: skip
def test_hopper_backward_query_rows_a_step(head_dim, options, rows, monkeypatch):
    """The Gluon backward walks 128 query rows a step at D=64 (FA4's step), 64 where the
    buffers or registers do not allow it: beside bias tiles (shared memory), with dropout
    or ALiBi (spills), and at D=128 (dK and dV take 128 registers a thread)."""
    from memattn.kernels import backward_sm90
    from memattn.spec import check_call

    monkeypatch.setattr(backward_sm90.hopper, "sm_count", lambda device_index: 132)
    options = dict(options)
    q = torch.empty(2, 1024, 4, head_dim, dtype=torch.bfloat16)
    k = torch.empty(2, 1024, 2, head_dim, dtype=torch.bfloat16)
    bias = options.pop("bias", None)
    if bias is not None:  # a key row (key padding) or (B, H, Sq, Sk) tiles
        bias = torch.empty((2, 1, 1, 1024) if bias == "row" else (2, 4, 1024, 1024))
    if options.pop("alibi", False):
        options["alibi_slopes"] = torch.ones(4)
    spec = check_call(q, k, k, bias=bias, **options)
    bias_row = backward_sm90.hopper.bias_row(spec, bias)
    kind = None if bias is None else backward_sm90.dbias_kind_of(spec, bias)
    plan = backward_sm90.narrow._plan(spec, bias_row, kind, (False, False), 0, 0)
    assert plan.constexprs["BLOCK_M"] == rows
