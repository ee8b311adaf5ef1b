"""memattn.distributed: ring attention over a process group against memattn.attention on
the whole sequence, forward and every gradient.

CPU (CI): 2 and 4 processes on gloo, kernels through Triton's interpreter, float32 at
small sizes. Every rank builds the same whole-sequence inputs, runs both, and compares
its shard of the single-process results with what the ring gave it.
GPU (marked gpu, one process per GPU, NCCL, 1, 2 or 4 GPUs as the machine has): bf16 at
real sizes against the float64 reference on the whole sequence, within twice the error
of the reference computed in bf16 by plain PyTorch.
"""

import contextlib
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import memattn
from memattn import distributed as cp
from memattn.check import FLOOR, relative_error

from .conftest import DEVICE

cpu_only = pytest.mark.skipif(DEVICE != "cpu", reason="gloo on CPU tensors")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, case: dict):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        _check_rank(world, case)
    finally:
        dist.destroy_process_group()


def _nccl_worker(rank: int, world: int, port: int, case: dict):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world)
    try:
        _check_rank_gpu(world, case)
    finally:
        dist.destroy_process_group()


def _check_rank_gpu(world: int, case: dict):
    layout, options = case["layout"], dict(case["options"])
    heads, kv_heads, d, seqlen = 8, 2, 128, 2048 * world
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, seqlen, h, d, generator=gen).cuda()
               for h in (heads, kv_heads, kv_heads))  # fmt: skip
    grad_out = torch.randn(1, seqlen, heads, d, generator=gen).cuda()
    if case.get("alibi"):
        options["alibi_slopes"] = torch.rand(heads, generator=gen).cuda()
    if options.get("dropout_p"):
        options["rng_state"] = torch.tensor([987654321, 3], dtype=torch.int64).cuda()

    def whole(dtype):  # the reference on the whole sequence, forward and gradients
        leaves = [t.to(dtype).requires_grad_() for t in (q, k, v)]
        keep = None
        if options.get("dropout_p"):
            keep = memattn.dropout_mask(options["rng_state"], options["dropout_p"], 1, heads,
                                        seqlen, seqlen)  # fmt: skip
        kw = {n: val for n, val in options.items() if n not in ("dropout_p", "rng_state")}
        out = memattn.reference.attention(*leaves, **kw, dropout_p=options.get("dropout_p", 0.0),
                                          dropout_keep=keep)  # fmt: skip
        return [out, *torch.autograd.grad(out, leaves, grad_out.to(dtype))]

    exact, plain = whole(torch.float64), whole(torch.bfloat16)
    cut = lambda t: cp.shard(t, layout=layout)  # noqa: E731
    shards = [cut(t).to(torch.bfloat16).requires_grad_() for t in (q, k, v)]
    out = cp.context_parallel_attention(*shards, layout=layout, **options)
    got = [out, *torch.autograd.grad(out, shards, cut(grad_out).to(torch.bfloat16))]
    for name, g, e, p in zip(("out", "dq", "dk", "dv"), got, exact, plain, strict=True):
        err = relative_error(g, cut(e))
        bound = 2 * relative_error(cut(p), cut(e)) + FLOOR[torch.bfloat16]
        assert err <= bound, f"rank {dist.get_rank()} {name}: {err:.3g} > {bound:.3g}"


NCCL_CASES = [
    dict(layout="zigzag", options=dict(causal=True)),
    dict(layout="contiguous", alibi=True, options=dict(window=(1500, 0))),
    dict(layout="zigzag", alibi=True, options=dict(causal=True, dropout_p=0.1)),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", NCCL_CASES,
                         ids=["-".join(c["options"]) + ("-alibi" if c.get("alibi") else "")
                              for c in NCCL_CASES])  # fmt: skip
def test_ring_on_gpus_with_nccl_gpu(case):
    """The ring on every GPU of the machine (1, 2 or 4; one GPU runs the one-rank ring:
    its kernels, merges and accumulators without a transfer), bf16, 16k tokens on four
    GPUs: the error from the float64 whole-sequence reference within twice the plain
    bf16 reference's."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    world = 4 if count >= 4 else min(count, 2)
    mp.spawn(_nccl_worker, args=(world, _free_port(), case), nprocs=world, join=True)


def _check_rank(world: int, case: dict):
    layout, heads, kv_heads = case["layout"], case["heads"], case["kv_heads"]
    options = dict(case["options"])
    gen = torch.Generator().manual_seed(0)
    seqlen, d = case.get("tokens_per_rank", 8) * world, 16
    q = torch.randn(2, seqlen, heads, d, generator=gen)
    k = torch.randn(2, seqlen, kv_heads, d, generator=gen)
    v = torch.randn(2, seqlen, kv_heads, d, generator=gen)
    grad_out = torch.randn(2, seqlen, heads, d, generator=gen)
    grad_lse = torch.randn(2, heads, seqlen, generator=gen)
    if case.get("alibi"):
        options["alibi_slopes"] = torch.rand(heads, generator=gen)
    ring_options = dict(options)
    if options.get("dropout_p"):  # one mask for both: the whole call's
        if case.get("give_rng"):
            options["rng_state"] = torch.tensor([123456789, 7], dtype=torch.int64)
            ring_options["rng_state"] = options["rng_state"]
        else:  # the ring draws it on rank 0 (seeded 1000 below) and broadcasts it
            options["rng_state"] = _drawn_with_seed(1000)

    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse, _ = memattn.ops.forward(*leaves, **options)
    grads = torch.autograd.grad((out, lse), leaves, (grad_out, grad_lse))

    cut = lambda t, dim=1: cp.shard(t, layout=layout, dim=dim)  # noqa: E731
    shards = [cut(t).requires_grad_() for t in (q, k, v)]
    if "rng_state" in options and "rng_state" not in ring_options:
        torch.manual_seed(1000 + dist.get_rank())  # apart on each rank: rank 0's counts
    with _kernel_calls_sharing_sms() as sharing:
        out_s, lse_s = cp.context_parallel_attention(*shards, layout=layout, return_lse=True,
                                                     **ring_options)  # fmt: skip
        grads_s = torch.autograd.grad((out_s, lse_s), shards,
                                      (cut(grad_out), cut(grad_lse, 2)))  # fmt: skip
    # every block's kernels beside the transfers (memattn.sharing_sms), and only those
    assert sharing and all(sharing) and not memattn.kernels.shares_sms(), sharing

    expected = [cut(out), cut(lse, 2), *(cut(g) for g in grads)]
    for name, got, want in zip(("out", "lse", "dq", "dk", "dv"), [out_s, lse_s, *grads_s],
                               expected, strict=True):  # fmt: skip
        torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5, msg=lambda m, n=name: n + m)
    whole = out.detach()  # unshard is shard's inverse, bit for bit
    assert torch.equal(cp.unshard(cut(whole), layout=layout), whole)


@contextlib.contextmanager
def _kernel_calls_sharing_sms():
    """Records, for each memattn.ops.forward/backward call made inside, whether it ran
    inside memattn.sharing_sms."""
    seen, real = [], (memattn.ops.forward, memattn.ops.backward)

    def spy(fn):
        def call(*args, **kwargs):
            seen.append(memattn.kernels.shares_sms())
            return fn(*args, **kwargs)
        return call

    memattn.ops.forward, memattn.ops.backward = map(spy, real)
    try:
        yield seen
    finally:
        memattn.ops.forward, memattn.ops.backward = real


def _drawn_with_seed(seed: int) -> torch.Tensor:
    """The [seed, offset] memattn draws with torch's generator seeded ``seed``."""
    torch.manual_seed(seed)
    return memattn.dropout.new_rng_state("cpu")


CASES = [
    (2, dict(layout="zigzag", heads=2, kv_heads=2, options=dict(causal=True))),
    (2, dict(layout="zigzag", heads=2, kv_heads=1, options=dict(window=(5, 3)))),
    (4, dict(layout="contiguous", heads=2, kv_heads=2,
             options=dict(causal=True, window=(11, -1), align="bottom_right"))),
    (2, dict(layout="contiguous", heads=4, kv_heads=2, options=dict(softcap=2.0, scale=0.3))),
    (4, dict(layout="zigzag", heads=4, kv_heads=1, options=dict(causal=True))),
    (4, dict(layout="contiguous", heads=2, kv_heads=2,
             options=dict(causal=True, deterministic=True))),
    # global positions: ALiBi's distances and dropout's mask across shards
    (2, dict(layout="zigzag", heads=4, kv_heads=2, alibi=True, options=dict(causal=True))),
    (4, dict(layout="contiguous", heads=2, kv_heads=2, alibi=True,
             options=dict(window=(5, 3)))),
    (2, dict(layout="zigzag", heads=2, kv_heads=2, tokens_per_rank=16, give_rng=True,
             options=dict(causal=True, dropout_p=0.3))),
    (4, dict(layout="contiguous", heads=4, kv_heads=2, tokens_per_rank=8, alibi=True,
             options=dict(dropout_p=0.2))),
]  # fmt: skip


@cpu_only
@pytest.mark.parametrize(
    "world, case", CASES,
    ids=[f"{w}-{c['layout']}-{'-'.join(c['options'])}{'-alibi' if c.get('alibi') else ''}"
         for w, c in CASES])  # fmt: skip
def test_ring_matches_the_whole_sequence(world, case):
    mp.spawn(_worker, args=(world, _free_port(), case), nprocs=world, join=True)


@pytest.mark.parametrize("c", [1, 4, 7])
def test_blocks_cut_the_band_exactly(c):
    """Each (query chunk, key chunk) block: the rows and keys it keeps, with its window
    top-left on them, see exactly the pairs the band (left, right) shifted by the
    chunks' distance d shows; an empty block is skipped."""
    from memattn.distributed.context_parallel import _block

    i, j = torch.arange(c)[:, None], torch.arange(c)[None, :]
    for d in range(-3 * c, 3 * c + 1):
        for left in (-1, 0, 1, 2, c, 2 * c + 1):
            for right in (-1, 0, 1, 3, c + 2):
                want = torch.ones(c, c, dtype=torch.bool)
                if left >= 0:
                    want &= j >= i + d - left
                if right >= 0:
                    want &= j <= i + d + right
                view = _block(d, c, left, right)
                got = torch.zeros(c, c, dtype=torch.bool)
                if view is not None:
                    q_lo, q_hi, k_lo, k_hi, (l2, r2) = view
                    ii = torch.arange(q_hi - q_lo)[:, None]
                    jj = torch.arange(k_hi - k_lo)[None, :]
                    seen = torch.ones(q_hi - q_lo, k_hi - k_lo, dtype=torch.bool)
                    if l2 >= 0:
                        seen &= jj >= ii - l2
                    if r2 >= 0:
                        seen &= jj <= ii + r2
                    assert seen.any(), (d, left, right, view)  # skipped if empty
                    got[q_lo:q_hi, k_lo:k_hi] = seen
                assert torch.equal(got, want), (d, left, right, view)


def test_refuses_what_it_cannot_split():
    """Dropout on chunks off a multiple of 8 tokens or under a left-bounded window (a
    block's first key must sit at a multiple of 8), and unknown layouts, are refused
    before any communication, naming the argument."""
    q = torch.zeros(1, 4, 2, 8)
    with pytest.raises(ValueError, match="^dropout_p needs chunks of a multiple of 8"):
        cp.context_parallel_attention(q, q, q, dropout_p=0.1)
    q16 = torch.zeros(1, 16, 2, 8)
    with pytest.raises(ValueError, match="^dropout_p with a window bounded on the left"):
        cp.context_parallel_attention(q16, q16, q16, dropout_p=0.1, window=(4, 0))
    with pytest.raises(ValueError, match="^layout must be one of"):
        cp.context_parallel_attention(q, q, q, layout="striped")


def _check_merge_into(device: str, rows: int, heads: int, dv: int, part_dtype):
    """memattn.kernels.merge.merge_into on views of larger tensors (the ring's out and
    lse chunks) against the merge in float64: rows where either side or both saw no
    key (lse = -inf) included; the larger tensors untouched outside the views."""
    from memattn.kernels.merge import merge_into

    gen = torch.Generator().manual_seed(rows)
    big_out = torch.randn(2, rows + 9, heads, dv, generator=gen)
    big_lse = torch.randn(2, heads, rows + 9, generator=gen) * 4
    part = torch.randn(2, rows, heads, dv, generator=gen).to(part_dtype)
    part_lse = torch.randn(2, heads, rows, generator=gen) * 4
    big_lse[:, :, 5:8] = float("-inf")  # rows 0-2 of the view: nothing merged yet
    part_lse[:, :, 1:4] = float("-inf")  # rows 1-3: the part saw no key (row 1, 2: both)
    out, lse = big_out[:, 5:5 + rows], big_lse[:, :, 5:5 + rows]
    want_lse = torch.logaddexp(lse.double(), part_lse.double())
    safe = torch.where(torch.isneginf(want_lse), 0.0, want_lse)
    w_old = torch.exp(lse.double() - safe).transpose(1, 2)[..., None]
    w_new = torch.exp(part_lse.double() - safe).transpose(1, 2)[..., None]
    want_out = out.double() * w_old + part.double() * w_new
    both_empty = torch.isneginf(want_lse).transpose(1, 2)[..., None]
    want_out = torch.where(both_empty, out.double(), want_out)
    outside = (big_out.clone(), big_lse.clone())
    big_out, big_lse = big_out.to(device), big_lse.to(device)
    out, lse = big_out[:, 5:5 + rows], big_lse[:, :, 5:5 + rows]
    merge_into(out, lse, part.to(device), part_lse.to(device))
    torch.testing.assert_close(out.cpu().double(), want_out, rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(lse.cpu().double(), want_lse, rtol=2e-6, atol=2e-6)
    assert torch.isneginf(lse[:, :, 1:3]).all()
    for got, before in zip((big_out, big_lse), outside, strict=True):
        cut = (slice(None), slice(None, 5)) if got.dim() == 4 else (slice(None),) * 2 + (
            slice(None, 5),)  # fmt: skip
        assert torch.equal(got[cut].cpu(), before[cut])


@cpu_only
def test_merge_into_is_the_merge_through_the_lse():
    _check_merge_into("cpu", 37, 3, 40, torch.float32)


@pytest.mark.gpu
def test_merge_into_is_the_merge_through_the_lse_gpu():
    _check_merge_into("cuda", 1000, 4, 128, torch.bfloat16)
