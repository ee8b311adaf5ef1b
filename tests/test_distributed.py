"""memattn.distributed: ring attention over a process group against memattn.attention on
the whole sequence, forward and every gradient.

CPU (CI): 2 and 4 processes on gloo, kernels through Triton's interpreter, float32 at
small sizes. Every rank builds the same whole-sequence inputs, runs both, and compares
its shard of the single-process results with what the ring gave it.
"""

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import memattn
from memattn import distributed as cp

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


def _check_rank(world: int, case: dict):
    layout, heads, kv_heads = case["layout"], case["heads"], case["kv_heads"]
    options = case["options"]
    gen = torch.Generator().manual_seed(0)
    seqlen, d = 8 * world, 16
    q = torch.randn(2, seqlen, heads, d, generator=gen)
    k = torch.randn(2, seqlen, kv_heads, d, generator=gen)
    v = torch.randn(2, seqlen, kv_heads, d, generator=gen)
    grad_out = torch.randn(2, seqlen, heads, d, generator=gen)
    grad_lse = torch.randn(2, heads, seqlen, generator=gen)

    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = memattn.attention(*leaves, return_lse=True, **options)
    grads = torch.autograd.grad((out, lse), leaves, (grad_out, grad_lse))

    cut = lambda t, dim=1: cp.shard(t, layout=layout, dim=dim)  # noqa: E731
    shards = [cut(t).requires_grad_() for t in (q, k, v)]
    out_s, lse_s = cp.context_parallel_attention(*shards, layout=layout, return_lse=True,
                                                 **options)  # fmt: skip
    grads_s = torch.autograd.grad((out_s, lse_s), shards, (cut(grad_out), cut(grad_lse, 2)))

    expected = [cut(out), cut(lse, 2), *(cut(g) for g in grads)]
    for name, got, want in zip(("out", "lse", "dq", "dk", "dv"), [out_s, lse_s, *grads_s],
                               expected, strict=True):  # fmt: skip
        torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5, msg=lambda m, n=name: n + m)
    whole = out.detach()  # unshard is shard's inverse, bit for bit
    assert torch.equal(cp.unshard(cut(whole), layout=layout), whole)


CASES = [
    (2, dict(layout="zigzag", heads=2, kv_heads=2, options=dict(causal=True))),
    (2, dict(layout="zigzag", heads=2, kv_heads=1, options=dict(window=(5, 3)))),
    (4, dict(layout="contiguous", heads=2, kv_heads=2,
             options=dict(causal=True, window=(11, -1), align="bottom_right"))),
    (2, dict(layout="contiguous", heads=4, kv_heads=2, options=dict(softcap=2.0, scale=0.3))),
    (4, dict(layout="zigzag", heads=4, kv_heads=1, options=dict(causal=True))),
    (4, dict(layout="contiguous", heads=2, kv_heads=2,
             options=dict(causal=True, deterministic=True))),
]  # fmt: skip


@cpu_only
@pytest.mark.parametrize("world, case", CASES,
                         ids=[f"{w}-{c['layout']}-{'-'.join(c['options'])}" for w, c in CASES])
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


def test_refuses_what_it_cannot_yet_split():
    """Options that need global positions in the kernels are refused before any
    communication, naming the argument."""
    q = torch.zeros(1, 4, 2, 8)
    for kwargs, name in ((dict(dropout_p=0.1), "dropout_p"),
                         (dict(alibi_slopes=torch.ones(2)), "alibi_slopes")):  # fmt: skip
        with pytest.raises(ValueError, match=f"^{name} is not supported"):
            cp.context_parallel_attention(q, q, q, **kwargs)
    with pytest.raises(ValueError, match="^layout must be one of"):
        cp.context_parallel_attention(q, q, q, layout="striped")
