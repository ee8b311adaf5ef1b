"""The forward kernel against the float64 reference.

CPU (CI): Triton's interpreter at small odd sizes, float32 and float16 (the interpreter
computes bfloat16 dots wrongly). GPU (`pytest -m gpu`): real sizes, bfloat16/float16.
"""

import zlib

import numpy as np
import pytest
import torch
import triton
import triton.language as tl
from hypothesis import example, given, settings
from hypothesis import strategies as st

import memattn
from memattn.check import (
    FEATURE_CASES,
    Case,
    Inputs,
    check_forward,
    check_forward_on,
    check_forward_repeated,
    gpu_sized,
    make_inputs,
    relative_error,
    repeated_forward_reference,
)
from memattn.kernels import common, forward_sm90, hopper

from .conftest import DEVICE, cpu_only


def assert_results(results):
    failed = [f"{r.what}: error {r.error:.3g} > allowed {r.allowed:.3g}"
              for r in results if not r.passed]  # fmt: skip
    assert not failed, f"{results[0].case.name} {results[0].dtype}: " + "; ".join(failed)


@cpu_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("case", FEATURE_CASES, ids=lambda c: c.name)
def test_features_cpu(case, dtype):
    assert_results(check_forward(case, dtype, "cpu", seed=zlib.crc32(case.name.encode()) % 1000))


EDGE_CASES = [
    Case("Sq=0", seqlen_q=0),
    Case("Sk=0: every row empty", seqlen_k=0),
    Case("no visible key rows", seqlen_q=20, seqlen_k=6,
         options=dict(causal=True, align="bottom_right")),
    Case("window (0, 0)", options=dict(window=(0, 0))),
    Case("single query, many keys", seqlen_q=1, seqlen_k=67, options=dict(causal=True)),
    Case("all-empty varlen", lengths_q=(0, 0), lengths_k=(0, 0)),
    Case("varlen keys but no queries", lengths_q=(0, 3), lengths_k=(5, 0)),
    Case("head dim 256", dqk=256, dv=256, seqlen_q=17, seqlen_k=19, heads=2, kv_heads=1),
]


@cpu_only
@pytest.mark.parametrize("case", EDGE_CASES, ids=lambda c: c.name)
def test_edges_cpu(case):
    assert_results(check_forward(case, torch.float32, "cpu", seed=7))


@cpu_only
def test_bias_minus_inf_masks_rows():
    """An additive -inf bias may mask whole rows: out 0 and lse -inf, never NaN."""
    q, k, v = (torch.randn(1, 9, 2, 16) for _ in range(3))
    bias = torch.randn(1, 2, 9, 9)
    bias[:, :, 3] = float("-inf")
    bias[:, 1, :, 4:] = float("-inf")
    out, lse = memattn.attention(q, k, v, bias=bias, return_lse=True)
    ref, ref_lse = memattn.reference.attention(q.double(), k.double(), v.double(),
                                               bias=bias.double(), return_lse=True)
    assert torch.isfinite(out).all()
    assert torch.equal(out[:, 3], torch.zeros_like(out[:, 3]))
    assert torch.isneginf(lse[:, :, 3]).all()
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)


@cpu_only
def test_bias_finfo_min_rows_average():
    """A finite bias at finfo.min (eager-style masks) must not overflow to -inf in the
    kernels' log2 scaling: a row it hides everywhere averages v, as the reference does;
    -inf still empties a row."""
    q, k, v = (torch.randn(1, 9, 2, 16) for _ in range(3))
    bias = torch.zeros(1, 2, 9, 9)
    bias[:, :, 3] = torch.finfo(torch.float32).min
    bias[:, :, 5] = float("-inf")
    out = memattn.attention(q, k, v, bias=bias)
    ref = memattn.reference.attention(q.double(), k.double(), v.double(), bias=bias.double())
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[0, 3], v.mean(dim=1)[0], atol=1e-5, rtol=1e-5)
    assert torch.equal(out[0, 5], torch.zeros_like(out[0, 5]))


def _philox_4x32_10(seed: int, counter: np.ndarray) -> np.ndarray:
    """Philox-4x32-10 (Salmon et al., SC'11) in NumPy: counter (..., 4) uint32 words,
    the 64-bit seed as the key. Written from the paper, independent of Triton's."""
    c = [counter[..., i].astype(np.uint64) for i in range(4)]
    k0, k1 = np.uint64(seed & 0xFFFFFFFF), np.uint64(seed >> 32)
    mask = np.uint64(0xFFFFFFFF)
    for _ in range(10):
        p0 = np.uint64(0xD2511F53) * c[0]
        p2 = np.uint64(0xCD9E8D57) * c[2]
        c = [(p2 >> np.uint64(32)) ^ c[1] ^ k0, p2 & mask,
             (p0 >> np.uint64(32)) ^ c[3] ^ k1, p0 & mask]  # fmt: skip
        k0, k1 = (k0 + np.uint64(0x9E3779B9)) & mask, (k1 + np.uint64(0xBB67AE85)) & mask
    return np.stack(c, axis=-1).astype(np.uint32)


@cpu_only
def test_dropout_mask_is_the_documented_philox_stream():
    """The keep bits are what kernels/common.py: dropout_keep documents: key 8g + 4i +
    2j + h of (b, h, query) takes half h of word 2j + i of Philox((g, query, b*H + h,
    offset), seed), kept when >= round(p * 2**16). Checked against NumPy's Philox."""
    seed, offset, p = 0x1234_5678_9ABC_DEF0, 12345, 0.3
    batch, heads, sq, sk = 2, 3, 5, 40
    keep = memattn.dropout_mask(torch.tensor([seed, offset]), p, batch, heads, sq, sk)
    bh, query, group = np.meshgrid(np.arange(batch * heads), np.arange(sq),
                                   np.arange(sk // 8), indexing="ij")  # fmt: skip
    counter = np.stack([group, query, bh, np.full_like(bh, offset)], axis=-1).astype(np.uint32)
    words = _philox_4x32_10(seed, counter)  # (BH, Sq, Sk/8, 4)
    halves = np.stack([words & 0xFFFF, words >> 16], axis=-1)  # (..., word, half)
    key = np.arange(8)
    i, j, h = key // 4, (key // 2) % 2, key % 2
    uniforms = halves[..., 2 * j + i, h]  # (BH, Sq, Sk/8, 8)
    expected = uniforms.reshape(batch, heads, sq, sk) >= round(p * 65536)
    assert keep.shape == expected.shape
    assert np.array_equal(keep.numpy(), expected)


@cpu_only
def test_dropout_mask_statistics_and_replay():
    """The keep mask keeps 1 - p of the elements, differs between heads, rows and
    seeds, and repeats under torch.manual_seed; ops.forward replays a given state."""
    p = 0.3
    torch.manual_seed(11)
    rng = memattn.dropout.new_rng_state("cpu")
    keep = memattn.dropout_mask(rng, p, 2, 3, 64, 80)
    n = keep.numel()
    frac = keep.float().mean().item()
    assert abs(frac - (1 - p)) < 4 * (p * (1 - p) / n) ** 0.5
    assert not torch.equal(keep[0, 0], keep[0, 1])
    assert not torch.equal(keep[0, 0], keep[1, 0])
    assert not torch.equal(keep[0, 0, 0], keep[0, 0, 1])
    torch.manual_seed(11)
    assert torch.equal(memattn.dropout.new_rng_state("cpu"), rng)
    other = memattn.dropout_mask(memattn.dropout.new_rng_state("cpu"), p, 2, 3, 64, 80)
    assert not torch.equal(keep, other)

    q, k, v = (torch.randn(2, 19, 3, 16) for _ in range(3))
    out1, _, rng1 = memattn.ops.forward(q, k, v, dropout_p=p)
    out2, _, rng2 = memattn.ops.forward(q, k, v, dropout_p=p, rng_state=rng1)
    assert torch.equal(rng1, rng2) and torch.equal(out1, out2)
    torch.manual_seed(3)
    a = memattn.attention(q, k, v, dropout_p=p)
    torch.manual_seed(3)
    b = memattn.attention(q, k, v, dropout_p=p)
    assert torch.equal(a, b)
    assert not torch.equal(a, memattn.attention(q, k, v, dropout_p=p))


@cpu_only
def test_cpu_without_interpreter_is_refused(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    q = torch.randn(1, 4, 1, 8)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        memattn.attention(q, q, q)


@triton.jit
def _spans_kernel(Out, seqlen_q, seqlen_k, off, window_left, window_right,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BOUNDED_LEFT: tl.constexpr,
                  BOUNDED_RIGHT: tl.constexpr, KEYS: tl.constexpr):  # fmt: skip
    """(lo, full_lo, full_hi, hi) of program i's block, as the kernels clamp them:
    key_range for query block i (KEYS), else query_range for key block i."""
    i = tl.program_id(0)
    if KEYS:
        lo, full_lo, full_hi, hi = common.key_range(
            i * BLOCK_M, seqlen_k, off, window_left, window_right, BLOCK_M, BLOCK_N,
            BOUNDED_LEFT, BOUNDED_RIGHT)  # fmt: skip
    else:
        lo, full_lo, full_hi, hi = common.query_range(
            i * BLOCK_N, seqlen_q, seqlen_k, off, window_left, window_right, BLOCK_M, BLOCK_N,
            BOUNDED_LEFT, BOUNDED_RIGHT)  # fmt: skip
    full_lo = tl.minimum(full_lo, hi)
    full_hi = tl.minimum(full_hi, hi)
    tl.store(Out + i * 4, lo)
    tl.store(Out + i * 4 + 1, full_lo)
    tl.store(Out + i * 4 + 2, full_hi)
    tl.store(Out + i * 4 + 3, hi)


@cpu_only
@settings(max_examples=40, deadline=None)
@given(st.integers(1, 700), st.integers(1, 700), st.booleans(), st.integers(-1, 300),
       st.integers(-1, 300), st.sampled_from([16, 32, 64, 128]),
       st.sampled_from([16, 32, 64, 128]))
@example(4095, 4095, False, -1, -1, 128, 64)
@example(1001, 1001, False, -1, 0, 64, 128)
@example(300, 1000, True, 100, 0, 128, 64)
def test_tile_spans_start_on_tiles(seqlen_q, seqlen_k, bottom_right, left, right, block_m,
                                   block_n):  # fmt: skip
    """Every span of tiles common.key_range and query_range give a block (masked left,
    unmasked, masked right) that holds a tile starts on a multiple of the tile: the
    tile loops tell Triton so (common.tile_start), and a wrong hint would make its
    loads misaligned."""
    off = seqlen_k - seqlen_q if bottom_right else 0
    for keys in (True, False):
        blocks = -(-(seqlen_q if keys else seqlen_k) // (block_m if keys else block_n))
        out = torch.full((blocks, 4), -7, dtype=torch.int32)
        _spans_kernel[(blocks,)](out, seqlen_q, seqlen_k, off, left, right, BLOCK_M=block_m,
                                 BLOCK_N=block_n, BOUNDED_LEFT=left >= 0,
                                 BOUNDED_RIGHT=right >= 0, KEYS=keys)  # fmt: skip
        tile = block_n if keys else block_m
        for lo, full_lo, full_hi, hi in out.tolist():
            assert lo <= full_lo <= full_hi <= hi, (lo, full_lo, full_hi, hi)
            for start, end in ((lo, full_lo), (full_lo, full_hi), (full_hi, hi)):
                assert start == end or start % tile == 0, (keys, start, end)


# ---------------------------------------------------------------- GPU, real sizes

GPU_DTYPES = [torch.bfloat16, torch.float16]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
@pytest.mark.parametrize("case", FEATURE_CASES, ids=lambda c: c.name)
def test_features_gpu(case, dtype):
    assert_results(check_forward(gpu_sized(case), dtype, "cuda", seed=1))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", [64, 80, 128, 192, 256])
@pytest.mark.parametrize("options", [{}, {"causal": True}], ids=["full", "causal"])
def test_head_dims_gpu(head_dim, options, dtype):
    case = Case(f"D={head_dim}", batch=2, heads=4, kv_heads=4, seqlen_q=1531, seqlen_k=2048,
                dqk=head_dim, dv=head_dim, options=options)
    assert_results(check_forward(case, dtype, "cuda", seed=head_dim))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
@pytest.mark.parametrize("options", [{}, {"causal": True}], ids=["full", "causal"])
def test_long_sequences_gpu(options, dtype):
    case = Case("S=8192", batch=1, heads=2, kv_heads=1, seqlen_q=8192, seqlen_k=8192,
                dqk=128, dv=128, bias="1HQK", options=options)
    assert_results(check_forward(case, dtype, "cuda", seed=5))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("bias", [None, "BHQK", "B11K"], ids=["keys", "tile", "row"])
@pytest.mark.parametrize("options", [{}, {"causal": True}], ids=["full", "causal"])
def test_running_max_moves_gpu(options, bias, head_dim, dtype):
    """Scores rising along the keys by 0.7, 4.3, 11.5 and 29 (log2 units) a 128-key tile,
    one rate a head: a row's running max moves at some tiles and not at others
    (forward_sm90.RESCALE_THRESHOLD), through the scores themselves, a bias tile
    (natural units) or a key row (log2 units)."""
    b, s, h = 2, 2048, 4
    gen = torch.Generator(device="cuda").manual_seed(11)
    q, k, v = (torch.randn(b, s, h, head_dim, device="cuda", generator=gen) for _ in range(3))
    rise = torch.tensor([0.5, 3.0, 8.0, 20.0], device="cuda")[:, None] * (
        torch.arange(s, device="cuda") / 128)  # natural units a head, along the keys
    kwargs = dict(options)
    if bias is None:  # q's first column 1, k's carries the rise (times sqrt(D): the scale)
        q[..., 0] = 1.0
        k[..., 0] = (rise * head_dim**0.5).T
    elif bias == "BHQK":
        kwargs["bias"] = rise[None, :, None, :].expand(b, h, s, s).to(dtype).contiguous()
    else:  # one rate for all heads: the row is (B, 1, 1, Sk)
        kwargs["bias"] = rise[2][None, None, None, :].expand(b, 1, 1, s).to(dtype).contiguous()
    case = Case("rising scores", batch=b, seqlen_q=s, seqlen_k=s, heads=h, kv_heads=h,
                dqk=head_dim, dv=head_dim, bias=bias, options=options)
    assert_results(check_forward_on(case, dtype, Inputs(q.to(dtype), k.to(dtype),
                                                        v.to(dtype), kwargs)))


def bias_row(case) -> bool:
    """A bias constant along queries, (B or 1, H or 1, 1, Sk): read as a row of keys."""
    return case.bias is not None and ("1" * (4 - len(case.bias)) + case.bias)[2:] == "1K"


def hopper_kernel_runs_here() -> bool:
    return (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
            and forward_sm90.hopper.enabled)


# Calls the Hopper kernels (kernels/forward_sm90.py, backward_sm90/) take: edges of
# their tile rings and masks at sizes that cross several 128-row blocks and 128-key tiles.
HOPPER_CASES = [
    Case("D64 Sq=777 Sk=1030", seqlen_q=777, seqlen_k=1030, dqk=64, dv=64),
    # 192-row blocks (three warpgroups); the last block's third warpgroup has no row
    Case("D64 Sq=2048 Sk=333", seqlen_q=2048, seqlen_k=333, dqk=64, dv=64),
    Case("D128 causal", seqlen_q=1531, seqlen_k=1531, dqk=128, dv=128,
         options=dict(causal=True)),
    Case("causal bottom-right Sq>Sk", seqlen_q=1000, seqlen_k=300, dqk=128, dv=128,
         options=dict(causal=True, align="bottom_right")),
    Case("window (200, 0)", seqlen_q=900, seqlen_k=900, dqk=128, dv=128,
         options=dict(window=(200, 0))),
    Case("window (0, 0)", seqlen_q=300, seqlen_k=300, dqk=64, dv=64,
         options=dict(window=(0, 0))),
    Case("GQA 8:2 transposed causal", heads=8, kv_heads=2, seqlen_q=700, seqlen_k=700,
         dqk=128, dv=128, layout="transposed", options=dict(causal=True)),
    Case("one key", seqlen_q=300, seqlen_k=1, dqk=64, dv=64),
    # keys filling every tile: the step loop without the mask's code (FULL_TILES)
    Case("D128 full key tiles GQA", heads=4, kv_heads=2, seqlen_q=777, seqlen_k=1024,
         dqk=128, dv=128),
    Case("one tile", seqlen_q=100, seqlen_k=128, dqk=128, dv=128),
    # masked tiles past the whole ones at D=128: the last key tile part-filled, a right
    # bound off the diagonal, bottom-right with more keys than queries
    Case("D128 last key tile part-filled", seqlen_q=300, seqlen_k=1000, dqk=128, dv=128),
    Case("window (-1, 37) bottom-right GQA", heads=4, kv_heads=2, seqlen_q=600, seqlen_k=1100,
         dqk=128, dv=128, options=dict(window=(-1, 37), align="bottom_right")),
    # a right bound's band at a key tile's start or end (one masked tile a block), the
    # diagonal a multiple of 128 off the top-left one, queries past the keys top-left
    Case("D128 causal bottom-right Sk-Sq=256", seqlen_q=700, seqlen_k=956, dqk=128, dv=128,
         options=dict(causal=True, align="bottom_right")),
    Case("D128 causal top-left Sq>Sk", seqlen_q=1000, seqlen_k=300, dqk=128, dv=128,
         options=dict(causal=True)),
    Case("window (-1, 127) GQA", heads=4, kv_heads=2, seqlen_q=900, seqlen_k=900, dqk=128,
         dv=128, options=dict(window=(-1, 127))),
    Case("window (-1, 128)", seqlen_q=520, seqlen_k=777, dqk=128, dv=128,
         options=dict(window=(-1, 128))),
    # a bias by TMA: a full one (its gradient is dS, stored by the backward), one
    # broadcast over heads or the batch (dS added up by TMA reduce-adds), 192-row blocks
    Case("bias BHQK window GQA", heads=4, kv_heads=2, seqlen_q=777, seqlen_k=1032, dqk=128,
         dv=128, bias="BHQK", options=dict(window=(300, 50))),
    Case("bias B1QK causal", seqlen_q=1000, seqlen_k=1000, dqk=128, dv=128, bias="B1QK",
         options=dict(causal=True)),
    # a bias shared over the batch: the forward's programs go batch after batch within
    # a head (BATCH_INNER), folded under a mask
    Case("bias 1HQK D64 Sq=2100", batch=2, seqlen_q=2100, seqlen_k=504, dqk=64, dv=64,
         bias="1HQK"),
    Case("bias 1HQK causal B3 GQA", batch=3, heads=4, kv_heads=2, seqlen_q=900, seqlen_k=1032,
         dqk=128, dv=128, bias="1HQK", options=dict(causal=True)),
    # dropout's keep bits drawn in the wgmma layouts: the forward's (queries, keys) and
    # the backward's (keys, queries), against memattn.dropout_mask
    Case("dropout causal GQA", heads=4, kv_heads=2, seqlen_q=700, seqlen_k=900, dqk=128,
         dv=128, options=dict(causal=True, dropout_p=0.2)),
    Case("dropout D64 Sq=2100 window", batch=1, seqlen_q=2100, seqlen_k=777, dqk=64, dv=64,
         options=dict(window=(400, 100), dropout_p=0.3)),
    # a p that rounds to a threshold of 0: every key kept, by hopper.dropped's compares
    Case("dropout keeping all D64 causal", seqlen_q=500, seqlen_k=700, dqk=64, dv=64,
         options=dict(causal=True, dropout_p=2.0**-18)),
    # bias tiles beside dropout: at D=128 O leaves through Q's buffer (forward_sm90.buffers),
    # and the backward's keep bits go through dS's buffers (KEEP_IN_DS)
    Case("bias 1HQK dropout causal", batch=2, seqlen_q=700, seqlen_k=904, dqk=128, dv=128,
         bias="1HQK", options=dict(causal=True, dropout_p=0.2)),
    Case("bias BHQK dropout window GQA", heads=4, kv_heads=2, seqlen_q=777, seqlen_k=1032,
         dqk=128, dv=128, bias="BHQK", options=dict(window=(300, 50), dropout_p=0.1)),
    # dropout's scratch beside 192/128's buffers, and beside D=256's with bias tiles
    Case("Dqk192 Dv128 dropout causal GQA", heads=4, kv_heads=2, seqlen_q=700, seqlen_k=901,
         dqk=192, dv=128, options=dict(causal=True, dropout_p=0.15)),
    Case("D256 bias 1HQK dropout", batch=2, seqlen_q=333, seqlen_k=520, dqk=256, dv=256,
         bias="1HQK", options=dict(dropout_p=0.1)),
    # bias tiles beside dropout in the backward's wide kernels (192/128's forward: its
    # 64-key tiles)
    Case("Dqk192 Dv128 bias BHQK dropout causal", seqlen_q=600, seqlen_k=712, dqk=192,
         dv=128, bias="BHQK", options=dict(causal=True, dropout_p=0.1)),
    Case("Dqk128 Dv256 bias 1HQK dropout window", batch=2, seqlen_q=500, seqlen_k=704,
         dqk=128, dv=256, bias="1HQK", options=dict(window=(200, 30), dropout_p=0.2)),
    # D=256: the forward's 64-key tiles with O leaving through Q's buffer, two query
    # blocks a program under a mask; the backward's 64-key programs split by head dim
    Case("D256 causal GQA", heads=4, kv_heads=2, seqlen_q=700, seqlen_k=900, dqk=256,
         dv=256, options=dict(causal=True)),
    Case("D256 Sq=333 Sk=1000 window", seqlen_q=333, seqlen_k=1000, dqk=256, dv=256,
         options=dict(window=(200, 30))),
    Case("D256 Sq=1100 Sk=130", seqlen_q=1100, seqlen_k=130, dqk=256, dv=256),
    # V narrower than q·k: O's tile and registers by Dv, Q's and K's by Dqk; at 192/128
    # (MLA) and 256/128 O leaves through Q's buffer, reinterpreted
    Case("Dqk192 Dv128 causal GQA", heads=4, kv_heads=2, seqlen_q=700, seqlen_k=901,
         dqk=192, dv=128, options=dict(causal=True)),
    # bias tiles at 192/128: the forward's keys 64 a tile (forward_sm90.key_tile); rows
    # of keys whole 16 bytes, for TMA
    Case("Dqk192 Dv128 bias 1HQK window GQA", batch=2, heads=4, kv_heads=2, seqlen_q=700,
         seqlen_k=904, dqk=192, dv=128, bias="1HQK", options=dict(window=(300, 20))),
    Case("Dqk192 Dv128 bias B1QK alibi", seqlen_q=333, seqlen_k=648, dqk=192, dv=128,
         bias="B1QK", alibi="H"),
    Case("Dqk192 Dv128 varlen bias 1HQK shared causal", lengths_q=(700, 0, 1300, 64),
         lengths_k=(700, 5, 1304, 64), dqk=192, dv=128, bias="1HQK", options=dict(causal=True)),
    Case("Dqk192 Dv128 varlen key bias", lengths_q=(300, 0, 777), lengths_k=(400, 9, 777),
         dqk=192, dv=128, bias="B11K", alibi="H", options=dict(causal=True)),
    Case("Dqk128 Dv64 window", seqlen_q=600, seqlen_k=1000, dqk=128, dv=64,
         options=dict(window=(300, 40))),
    Case("Dqk128 Dv64 bias dropout", seqlen_q=333, seqlen_k=500, dqk=128, dv=64,
         bias="1H1K", options=dict(dropout_p=0.2)),
    Case("Dqk128 Dv64 varlen causal GQA alibi", heads=4, kv_heads=2, lengths_q=(300, 0, 517),
         lengths_k=(300, 0, 517), dqk=128, dv=64, alibi="H", options=dict(causal=True)),
    Case("Dqk256 Dv128 bottom-right", seqlen_q=300, seqlen_k=650, dqk=256, dv=128,
         options=dict(causal=True, align="bottom_right")),
    # V wider than q·k: O and dV as at D=128 (dV by plain stores: DV_STAGED)
    Case("Dqk64 Dv128 causal GQA", heads=4, kv_heads=2, seqlen_q=700, seqlen_k=901, dqk=64,
         dv=128, options=dict(causal=True)),
    Case("Dqk64 Dv128 varlen key bias dropout", lengths_q=(300, 0, 517), lengths_k=(400, 9, 517),
         dqk=64, dv=128, bias="B11K", options=dict(dropout_p=0.1)),
    Case("Dqk64 Dv128 bias BHQK alibi window", seqlen_q=600, seqlen_k=1000, dqk=64, dv=128,
         bias="BHQK", alibi="H", options=dict(window=(300, 40))),
    Case("Dqk64 Dv128 bias 1HQK summed causal GQA", heads=4, kv_heads=2, seqlen_q=700,
         seqlen_k=904, dqk=64, dv=128, bias="1HQK", options=dict(causal=True)),
    Case("Dqk64 Dv128 softcap bottom-right", seqlen_q=500, seqlen_k=777, dqk=64, dv=128,
         options=dict(causal=True, align="bottom_right", softcap=2.0)),
    Case("Dqk256 Dv64 GQA", heads=4, kv_heads=1, seqlen_q=333, seqlen_k=1000, dqk=256, dv=64),
    Case("Dqk192 Dv64 window", seqlen_q=700, seqlen_k=500, dqk=192, dv=64,
         options=dict(window=(150, 20))),
    # V of 256 columns beside a narrower q·k: the forward's D=256 tiles with O in a
    # buffer of its own (wider than Q's), the backward's wide kernels (at Dqk=64 Q's
    # tiles with a 64-byte swizzle, each warpgroup's dK columns a 32-column slice)
    Case("Dqk128 Dv256 causal GQA", heads=4, kv_heads=2, seqlen_q=700, seqlen_k=901,
         dqk=128, dv=256, options=dict(causal=True)),
    Case("Dqk64 Dv256 window", seqlen_q=600, seqlen_k=1000, dqk=64, dv=256,
         options=dict(window=(300, 40))),
    Case("Dqk192 Dv256 bottom-right", seqlen_q=300, seqlen_k=650, dqk=192, dv=256,
         options=dict(causal=True, align="bottom_right")),
    Case("Dqk128 Dv256 varlen bias dropout", lengths_q=(300, 0, 517), lengths_k=(400, 9, 517),
         dqk=128, dv=256, bias="B11K", options=dict(dropout_p=0.1)),
    # head dims the kernels are not built for, as the next wider (dispatch.kernel_spec):
    # TMA zero-fills the columns past the tensors' own and clips its stores there; the
    # pointer stores (packed sequences' last blocks, dV at Dqk=64) mask them
    Case("D96 causal GQA", heads=4, kv_heads=2, seqlen_q=700, seqlen_k=901, dqk=96, dv=96,
         options=dict(causal=True)),
    Case("D80 varlen key bias dropout", lengths_q=(300, 0, 517), lengths_k=(400, 9, 517),
         dqk=80, dv=80, bias="B11K", options=dict(dropout_p=0.1)),
    Case("D96 bias BHQK window", seqlen_q=600, seqlen_k=1000, dqk=96, dv=96, bias="BHQK",
         options=dict(window=(300, 40))),
    Case("D40 Sq=777 Sk=1030", seqlen_q=777, seqlen_k=1030, dqk=40, dv=40),
    Case("Dqk48 Dv112 varlen causal", lengths_q=(300, 0, 517), lengths_k=(300, 0, 517),
         dqk=48, dv=112, options=dict(causal=True)),
    Case("Dqk160 Dv128 causal", seqlen_q=700, seqlen_k=901, dqk=160, dv=128,
         options=dict(causal=True)),
    Case("Dqk160 Dv128 varlen", lengths_q=(300, 0, 517), lengths_k=(400, 9, 517), dqk=160,
         dv=128),
    Case("D200 bottom-right", seqlen_q=300, seqlen_k=650, dqk=200, dv=200,
         options=dict(causal=True, align="bottom_right")),
    Case("Dqk144 Dv128 window", seqlen_q=600, seqlen_k=1000, dqk=144, dv=128,
         options=dict(window=(300, 40))),
    Case("Dqk88 Dv64 causal GQA", heads=4, kv_heads=2, seqlen_q=700, seqlen_k=901, dqk=88,
         dv=64, options=dict(causal=True)),
    # a bias's gradient at D=256: the Gluon forward, backward.py's backward (a bias read
    # alone, the wide kernels: test_backward.py); dropout, ALiBi and softcap past 128
    # columns in the wide backward kernels too (192/128 leaves its fused kernel for
    # them), dropout's keep bits drawn in both, bit for bit the forward's
    Case("D256 bias BHQK causal", seqlen_q=500, seqlen_k=504, dqk=256, dv=256, bias="BHQK",
         options=dict(causal=True)),
    Case("D256 dropout", seqlen_q=500, seqlen_k=600, dqk=256, dv=256,
         options=dict(dropout_p=0.2)),
    Case("D256 dropout alibi softcap GQA bottom-right", heads=4, kv_heads=2, seqlen_q=333,
         seqlen_k=700, dqk=256, dv=256, alibi="BH",
         options=dict(causal=True, align="bottom_right", dropout_p=0.2, softcap=2.0)),
    Case("Dqk192 Dv128 dropout softcap causal", seqlen_q=700, seqlen_k=901, dqk=192, dv=128,
         options=dict(causal=True, dropout_p=0.2, softcap=2.0)),
    Case("Dqk192 Dv128 alibi window", seqlen_q=600, seqlen_k=1000, dqk=192, dv=128,
         alibi="H", options=dict(window=(300, 40))),
    Case("Dqk128 Dv256 dropout GQA", heads=4, kv_heads=2, seqlen_q=700, seqlen_k=901,
         dqk=128, dv=256, options=dict(dropout_p=0.2)),
    Case("Dqk160 Dv128 softcap alibi", seqlen_q=500, seqlen_k=777, dqk=160, dv=128,
         alibi="BH", options=dict(softcap=2.0)),
    # bias tiles beside dropout's scratch where shared memory holds both (D=64: T5's
    # relative position bias with attention dropout; 128/64; the forward not at 64/128,
    # neither kernel at D=128)
    Case("bias 1HQK D64 dropout", seqlen_q=600, seqlen_k=904, dqk=64, dv=64, bias="1HQK",
         options=dict(dropout_p=0.1)),
    Case("bias BHQK D64 causal dropout GQA", heads=4, kv_heads=2, seqlen_q=777, seqlen_k=1032,
         dqk=64, dv=64, bias="BHQK", options=dict(causal=True, dropout_p=0.2)),
    Case("bias B1QK Dqk128 Dv64 window dropout", seqlen_q=500, seqlen_k=704, dqk=128, dv=64,
         bias="B1QK", options=dict(window=(150, 30), dropout_p=0.2)),
    Case("bias 1HQK Dqk64 Dv128 dropout", seqlen_q=500, seqlen_k=704, dqk=64, dv=128,
         bias="1HQK", options=dict(causal=True, dropout_p=0.2)),
    Case("bias BHQK D128 dropout", seqlen_q=500, seqlen_k=704, dqk=128, dv=128, bias="BHQK",
         options=dict(dropout_p=0.2)),
    # ALiBi in both Gluon kernels: slopes per head or per (batch, head), with a bias, a
    # window, GQA
    Case("alibi H causal GQA", heads=4, kv_heads=2, seqlen_q=700, seqlen_k=900, dqk=128,
         dv=128, alibi="H", options=dict(causal=True)),
    Case("alibi BH bias D64 window", seqlen_q=600, seqlen_k=1000, dqk=64, dv=64, alibi="BH",
         bias="BHQK", options=dict(window=(300, 40))),
    Case("D256 alibi", seqlen_q=300, seqlen_k=400, dqk=256, dv=256, alibi="H"),
    # D=256's dK/dV kernel by role beside softcap (P's slot holds P times tanh's
    # derivative), and beside a key row's bias and its gradient, packed with ALiBi
    Case("D256 softcap window GQA", heads=4, kv_heads=2, seqlen_q=700, seqlen_k=900, dqk=256,
         dv=256, options=dict(window=(300, 0), softcap=20.0)),
    Case("D256 varlen key bias alibi causal", lengths_q=(300, 0, 517), lengths_k=(400, 9, 517),
         dqk=256, dv=256, bias="B11K", alibi="H", options=dict(causal=True)),
    # a bias constant along queries (key padding): a row of keys per key tile (by TMA
    # beside K in the forward, rows padded to 16 bytes; by pointer in the backward); its
    # gradient summed over queries in registers, then over the batch or the heads it
    # broadcasts over; with dropout
    Case("bias B11K causal GQA", heads=4, kv_heads=2, seqlen_q=777, seqlen_k=1030, dqk=128,
         dv=128, bias="B11K", options=dict(causal=True)),
    Case("bias 1H1K D64 window dropout", seqlen_q=600, seqlen_k=900, dqk=64, dv=64,
         bias="1H1K", options=dict(window=(300, 40), dropout_p=0.2)),
    Case("bias K Sq=2100 Sk=333", batch=1, seqlen_q=2100, seqlen_k=333, dqk=64, dv=64,
         bias="K"),
    # packed sequences (varlen): TMA loads at each sequence's first token, O stored by
    # masked pointers (a TMA store would spill into the next sequence), blocks past a
    # short sequence's end empty, an empty sequence, a diagonal per sequence; in the
    # backward, query rows past a sequence's end (the next one's) masked, dK and dV
    # stored from the sequence's first key; a bias, ALiBi and dropout by positions
    # inside each sequence
    Case("varlen D128 causal", lengths_q=(700, 0, 1300, 64), lengths_k=(700, 5, 1300, 64),
         dqk=128, dv=128, options=dict(causal=True)),
    # packed sequences without a mask, and top-left with more keys or queries than the other
    Case("varlen D128 GQA", heads=4, kv_heads=2, lengths_q=(300, 1000, 17, 0),
         lengths_k=(500, 900, 40, 3), dqk=128, dv=128),
    Case("varlen D128 causal Sq!=Sk", lengths_q=(300, 1000, 17), lengths_k=(500, 900, 40),
         dqk=128, dv=128, options=dict(causal=True)),
    Case("varlen D64 GQA bottom-right", heads=4, kv_heads=2, lengths_q=(300, 1000, 17),
         lengths_k=(500, 900, 40), dqk=64, dv=64,
         options=dict(causal=True, align="bottom_right")),
    Case("varlen D64 three warpgroups window", lengths_q=(2100, 300), lengths_k=(333, 900),
         dqk=64, dv=64, options=dict(window=(100, 20))),
    Case("varlen D256", lengths_q=(130, 600, 1), lengths_k=(200, 600, 77), dqk=256, dv=256),
    # past 128 columns the wide backward kernels (192/128 with any of ALiBi, dropout or
    # softcap, or deterministic): key blocks on the packed grid, dQ's query blocks on the
    # forward's, the last rows of a sequence by plain stores
    Case("varlen D256 causal GQA softcap alibi", heads=4, kv_heads=2,
         lengths_q=(700, 0, 1300, 64), lengths_k=(700, 5, 1300, 64), dqk=256, dv=256,
         alibi="BH", options=dict(causal=True, softcap=2.0)),
    Case("varlen Dqk192 Dv128 dropout bottom-right", lengths_q=(300, 1000, 17),
         lengths_k=(500, 900, 40), dqk=192, dv=128,
         options=dict(causal=True, align="bottom_right", dropout_p=0.2)),
    Case("varlen Dqk128 Dv256 window", heads=4, kv_heads=1, lengths_q=(300, 0, 517),
         lengths_k=(400, 9, 517), dqk=128, dv=256, options=dict(window=(150, 30))),
    # without a mask each head's blocks of a sequence go back to back (packed_block)
    Case("varlen D128 GQA", heads=4, kv_heads=2, lengths_q=(700, 0, 1300, 64),
         lengths_k=(500, 5, 1304, 64), dqk=128, dv=128),
    Case("varlen bias alibi", lengths_q=(700, 0, 1300, 64), lengths_k=(700, 5, 1304, 64),
         dqk=128, dv=128, bias="BHQK", alibi="BH", options=dict(causal=True)),
    Case("varlen bias 1HQK shared causal", lengths_q=(700, 0, 1300, 64),
         lengths_k=(700, 5, 1304, 64), dqk=128, dv=128, bias="1HQK", options=dict(causal=True)),
    Case("varlen bias 11QK D64 window", lengths_q=(300, 1000, 17), lengths_k=(500, 904, 40),
         dqk=64, dv=64, bias="11QK", options=dict(window=(200, 10))),
    # a shared plane walked by position (hopper.packed_position_block): heads in groups,
    # the last one short, sequences without a block at most positions, an empty one
    Case("varlen bias 1HQK shared GQA bottom-right", heads=6, kv_heads=3,
         lengths_q=(300, 0, 1000, 1, 17), lengths_k=(500, 3, 904, 40, 40), dqk=128, dv=128,
         bias="1HQK", options=dict(causal=True, align="bottom_right")),
    Case("varlen key bias BH1K causal", lengths_q=(700, 0, 1300, 64),
         lengths_k=(700, 5, 1302, 64), dqk=128, dv=128, bias="BH1K", options=dict(causal=True)),
    Case("varlen dropout key bias GQA", heads=4, kv_heads=2, lengths_q=(300, 1000, 17),
         lengths_k=(500, 900, 40), dqk=64, dv=64, bias="B11K",
         options=dict(window=(200, 10), dropout_p=0.2)),
    # softcap (a cap of 2: tanh far from linear on these scores), capped before the bias
    # and ALiBi are added; three warpgroups at D=64, D=256's forward, packed sequences
    Case("softcap causal bottom-right GQA", heads=4, kv_heads=2, seqlen_q=777, seqlen_k=1030,
         dqk=128, dv=128, options=dict(causal=True, align="bottom_right", softcap=2.0)),
    Case("softcap D64 Sq=2100 alibi window", seqlen_q=2100, seqlen_k=900, dqk=64, dv=64,
         alibi="BH", options=dict(window=(300, 40), softcap=2.0)),
    Case("softcap D64 Sq=2048", seqlen_q=2048, seqlen_k=333, dqk=64, dv=64,
         options=dict(softcap=1.5)),
    Case("softcap bias BHQK", seqlen_q=600, seqlen_k=1000, dqk=128, dv=128,
         bias="BHQK", options=dict(softcap=2.0)),
    # beside a bias gradient (the backward's D 64/128 kernel): out before tanh's
    # derivative, summed over the batch, added by the packed sequences sharing a plane
    # (with dropout: the keep bits through dS's buffer), and a key row's
    Case("softcap bias 1HQK D64 causal GQA", batch=2, heads=4, kv_heads=2, seqlen_q=600,
         seqlen_k=904, dqk=64, dv=64, bias="1HQK", options=dict(causal=True, softcap=2.0)),
    Case("softcap varlen bias 1HQK shared dropout", lengths_q=(700, 0, 1300, 64),
         lengths_k=(700, 5, 1304, 64), dqk=128, dv=128, bias="1HQK",
         options=dict(causal=True, softcap=2.0, dropout_p=0.1)),
    Case("softcap key bias B11K window", seqlen_q=500, seqlen_k=712, dqk=128, dv=128,
         bias="B11K", options=dict(window=(200, 30), softcap=2.0)),
    Case("softcap D256", seqlen_q=600, seqlen_k=700, dqk=256, dv=256,
         options=dict(causal=True, softcap=2.0)),
    Case("softcap varlen dropout", heads=4, kv_heads=2, lengths_q=(700, 0, 1300, 64),
         lengths_k=(500, 5, 1304, 64), dqk=128, dv=128, options=dict(softcap=2.0,
                                                                     dropout_p=0.2)),
]


@pytest.mark.parametrize(
    "seqlen_q, seqlen_k, options, keys",
    [(4096, 4096, {}, 4096), (4096, 4096, dict(causal=True), 2048),
     (2048, 2048, dict(causal=True), 1024), (4096, 4096, dict(window=(1024, 0)), 1025),
     (100, 8192, dict(causal=True, align="bottom_right"), 4096),
     (4096, 300, dict(window=(5000, 7)), 300)],
)  # fmt: skip
def test_keys_per_query_estimate(seqlen_q, seqlen_k, options, keys):
    q = torch.empty(1, seqlen_q, 1, 64)
    k = torch.empty(1, seqlen_k, 1, 64)
    spec = memattn.spec.check_call(q, k, k, **options)
    assert forward_sm90.hopper.keys_per_query(spec) == keys


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
@pytest.mark.parametrize("case", HOPPER_CASES, ids=lambda c: c.name)
def test_hopper_kernel_gpu(case, dtype, monkeypatch):
    if not hopper_kernel_runs_here():
        pytest.skip("the Gluon kernels are built for Hopper (sm_90) and Triton 3.6")
    launched = []
    run = forward_sm90.forward
    monkeypatch.setattr(forward_sm90, "forward", lambda *a: launched.append(1) or run(*a))
    assert_results(check_forward(case, dtype, "cuda", seed=7))
    # forward.py runs by design: softcap at D=64 or beside a key row, which S starts from
    # before the cap (dispatch.gluon_forward)
    capped = case.options.get("softcap", 0) > 0
    tiles = capped and (case.dqk <= 64 or bias_row(case))
    assert bool(launched) != tiles, "the call fell back to forward.py, or ran Gluon by mistake"


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [128, 256])
def test_bias_tiles_are_read_before_their_slot_refills_gpu(head_dim, monkeypatch):
    """The softmax warpgroups read each bias tile from shared memory and release its slot
    to the TMA that brings the next tile: the reads must be done first (a fence between
    the two proxies). Without it a warp's reads could still be in flight when the refill
    landed, and a few rows took the next tile's bias: the lse of a few rows of the first
    warpgroup off by up to 0.1. RESCALE_THRESHOLD 0 takes out the lazy rescale's
    warpgroup barriers, which had kept the warps in step, and dropout's Philox work
    between the wgmmas widens the window. Thirty calls, each checked against one
    reference before the next: on the kernel before the fence this test failed three
    times in three at D=256 (6, 8 and 9 wrong calls of 30; H100)."""
    if not hopper_kernel_runs_here():
        pytest.skip("the Gluon kernels are built for Hopper (sm_90) and Triton 3.6")
    monkeypatch.setattr(forward_sm90, "RESCALE_THRESHOLD", 0.0)
    # The calls as an application makes them (no poison fill before each, launches by
    # the prepared path), as tools/stress.py found the race.
    monkeypatch.setattr(common, "POISON_OUTPUTS", False)
    monkeypatch.setattr(hopper, "CHECK_VARIANTS", False)
    hopper.forget_plans()
    try:
        case = Case("bias tiles in turn", batch=2, seqlen_q=333, seqlen_k=520,
                    dqk=head_dim, dv=head_dim, bias="1HQK", options=dict(dropout_p=0.1))
        x = make_inputs(case, torch.float16, "cuda", seed=7)
        runs = check_forward_repeated(case, torch.float16, x, calls=30)
    finally:
        hopper.forget_plans()  # the plans made with the knob above
    wrong = [results for results in runs if not all(r.passed for r in results)]
    assert not wrong, f"{len(wrong)} of {len(runs)} calls went wrong, the first: {wrong[0]}"


@cpu_only
@pytest.mark.parametrize("dropout_p", [0.0, 0.3])
def test_repeated_calls_are_each_checked(dropout_p, monkeypatch):
    """check_forward_repeated (the race tests' check) judges every call on its own: one
    call's lse moved by a few rows' worth fails that call alone; out is judged only
    without dropout (its mask changes between calls)."""
    from memattn import check

    case = Case("repeated", seqlen_q=19, seqlen_k=23, options=dict(dropout_p=dropout_p))
    x = make_inputs(case, torch.float32, DEVICE, seed=3)
    forward, calls = check.ops.forward, []

    def second_call_off(*args, **kwargs):
        out, lse, rng = forward(*args, **kwargs)
        calls.append(None)
        if len(calls) == 2:
            lse = lse.clone()
            lse[0, 0, 5] += 0.05
        return out, lse, rng

    monkeypatch.setattr(check.ops, "forward", second_call_off)
    runs = check_forward_repeated(case, torch.float32, x, calls=3)
    assert [all(r.passed for r in results) for results in runs] == [True, False, True]
    assert [r.what for r in runs[0]] == (["lse"] if dropout_p else ["lse", "out"])


def record_launches(monkeypatch, module, name: str) -> list:
    """Wraps ``module.name``, a hopper.Launcher, to keep each launch's (grid, keyword
    arguments: the constexprs); its fast path (launch_prepared, off in the suite) is
    left as it is."""
    launches = []
    launch = getattr(module, name)

    class Recording:
        launch_prepared = staticmethod(launch.launch_prepared)

        def __call__(self, grid, *args, **kwargs):
            launches.append((grid, kwargs))
            launch(grid, *args, **kwargs)

    monkeypatch.setattr(module, name, Recording())
    return launches


# Persistent programs: with five of them, each walks query blocks of every batch and
# head through its Q ring, folded (pairs of blocks, some across two heads) or not. Two
# Q buffers at D 64/128 without a bias, one with a bias, ALiBi per (batch, head),
# dropout, and O in Q's buffer at D=256 and 192/128.
PERSISTENT_CASES = ["D64 Sq=777 Sk=1030", "D64 Sq=2048 Sk=333", "D128 causal",
                    "bias BHQK window GQA", "dropout causal GQA", "alibi BH bias D64 window",
                    "D256 Sq=1100 Sk=130", "D256 causal GQA", "varlen D128 causal",
                    "varlen D256", "bias B11K causal GQA",
                    "varlen dropout key bias GQA", "Dqk192 Dv128 causal GQA"]  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("programs", [5, 132])
@pytest.mark.parametrize("name", ["varlen bias 1HQK shared causal", "varlen bias 11QK D64 window",
                                  "varlen bias 1HQK shared GQA bottom-right",
                                  "Dqk192 Dv128 varlen bias 1HQK shared causal"])  # fmt: skip
def test_hopper_kernel_packed_by_position_gpu(name, programs, monkeypatch):
    """Packed sequences sharing a bias plane under a right bound go by position
    (POSITION_HEADS, here groups of 4 heads), through few programs or many."""
    if not hopper_kernel_runs_here():
        pytest.skip("the Gluon kernels are built for Hopper (sm_90) and Triton 3.6")
    case = next(c for c in HOPPER_CASES if c.name == name)
    monkeypatch.setattr(forward_sm90, "POSITION_HEADS", 4)
    monkeypatch.setattr(hopper, "sm_count", lambda device_index: programs)
    launches = record_launches(monkeypatch, forward_sm90, "_launch_forward")
    assert_results(check_forward(case, torch.bfloat16, "cuda", seed=13))
    heads = [kwargs["POSITION_HEADS"] for _, kwargs in launches]
    assert heads and all(h == min(4, case.heads) for h in heads), heads


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
@pytest.mark.parametrize("fold", [False, True], ids=["strided", "folded"])
@pytest.mark.parametrize("name", PERSISTENT_CASES)
def test_hopper_kernel_persistent_gpu(name, fold, dtype, monkeypatch):
    if not hopper_kernel_runs_here():
        pytest.skip("the Gluon kernels are built for Hopper (sm_90) and Triton 3.6")
    case = next(c for c in HOPPER_CASES if c.name == name)
    monkeypatch.setattr(forward_sm90, "FOLD", fold)
    monkeypatch.setattr(forward_sm90, "PERSISTENT", True)
    monkeypatch.setattr(forward_sm90, "MASKED_PERSISTENT",
                        dict.fromkeys(forward_sm90.HEAD_DIMS, True))
    monkeypatch.setattr(forward_sm90, "MIN_BLOCKS_TO_FOLD",
                        dict.fromkeys(forward_sm90.HEAD_DIMS, 0))
    monkeypatch.setattr(hopper, "sm_count", lambda device_index: 5)
    launches = record_launches(monkeypatch, forward_sm90, "_launch_forward")
    assert_results(check_forward(case, dtype, "cuda", seed=11))
    grids = [grid for grid, _ in launches]
    assert grids and all(g == (5,) for g in grids), grids


# Causal heads go rank by rank in groups of heads (MASKED_BY_RANK_BLOCKS,
# hopper.rank_major_item): a program per block, or persistent programs walking the
# blocks the host dealt them (RANK_TABLE; five programs here, so that each walks blocks
# of several heads and batches). Here at every length, every head dim, in groups of 16
# blocks (two or three (batch, head)s of 6-12 blocks, the last group short), a bias
# plane's batches together, bottom-right, dropout.
BY_RANK_CASES = ["D128 causal", "D256 causal GQA", "bias 1HQK causal B3 GQA",
                 "causal bottom-right Sq>Sk", "dropout causal GQA", "Dqk64 Dv128 causal GQA",
                 "dropout keeping all D64 causal"]


@pytest.mark.gpu
@pytest.mark.parametrize("table", [False, True], ids=["per block", "host table"])
@pytest.mark.parametrize("name", BY_RANK_CASES)
def test_hopper_kernel_by_rank_gpu(name, table, monkeypatch):
    if not hopper_kernel_runs_here():
        pytest.skip("the Gluon kernels are built for Hopper (sm_90) and Triton 3.6")
    case = next(c for c in HOPPER_CASES if c.name == name)
    monkeypatch.setattr(forward_sm90, "MASKED_BY_RANK_BLOCKS",
                        dict.fromkeys(forward_sm90.HEAD_DIMS, 16))
    monkeypatch.setattr(forward_sm90, "MIN_BLOCKS_BY_RANK",
                        dict.fromkeys(forward_sm90.HEAD_DIMS, 1))
    monkeypatch.setattr(forward_sm90, "RANK_TABLE", table)
    monkeypatch.setattr(forward_sm90, "MASKED_PERSISTENT",
                        dict.fromkeys(forward_sm90.HEAD_DIMS, True))
    monkeypatch.setattr(hopper, "sm_count", lambda device_index: 5)
    hopper.forget_plans()
    launches = record_launches(monkeypatch, forward_sm90, "_launch_forward")
    assert_results(check_forward(case, torch.bfloat16, "cuda", seed=17))
    assert launches and all(c["BY_RANK"] == 16 and not c["FOLD"] and c["TABLE"] == table
                            for _, c in launches)  # fmt: skip
    if table:
        assert all(grid == (5,) for grid, _ in launches)
    hopper.forget_plans()


@pytest.mark.gpu
def test_hopper_kernel_host_table_under_cuda_graphs_gpu(monkeypatch):
    """A causal call whose first launch a CUDA graph captures takes the folded strides
    (the host's table cannot be copied to the device then) and replays them; an eager
    call then copies the table, and a graph captured after replays the table's
    schedule: all three within bf16's tolerance of the float64 reference (D=128's
    blocks dealt here, in groups of 16)."""
    if not hopper_kernel_runs_here():
        pytest.skip("the Gluon kernels are built for Hopper (sm_90) and Triton 3.6")
    case = next(c for c in HOPPER_CASES if c.name == "D128 causal")
    x = make_inputs(case, torch.bfloat16, "cuda", seed=23)
    ref, _, allowed, _ = repeated_forward_reference(x, torch.bfloat16)
    monkeypatch.setattr(forward_sm90, "MASKED_BY_RANK_BLOCKS",
                        {**forward_sm90.MASKED_BY_RANK_BLOCKS, 128: 16})
    launches = record_launches(monkeypatch, forward_sm90, "_launch_forward")
    hopper.forget_plans()
    with monkeypatch.context() as m:  # the folded strides' kernel, compiled before capture
        m.setattr(hopper, "schedule_on_device", lambda plan, device_index: None)
        memattn.attention(x.q, x.k, x.v, **x.kwargs)
    hopper.forget_plans()
    del launches[:]
    for name in ("captured first", "eager", "captured after"):
        if name == "eager":
            out = memattn.attention(x.q, x.k, x.v, **x.kwargs)
        else:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = memattn.attention(x.q, x.k, x.v, **x.kwargs)
            out.fill_(float("nan"))
            graph.replay()
        torch.cuda.synchronize()
        err = relative_error(out, ref)
        assert err <= allowed, f"{name}: error {err:.3g} > allowed {allowed:.3g}"
    assert [c["TABLE"] for _, c in launches] == [False, True, True]
    hopper.forget_plans()


# Three softmax warpgroups (192-row blocks) under masks, which take them from
# MIN_SEQLEN_Q_D64_MASKED on: the diagonal tiles' mask arithmetic spills there, and each
# warpgroup keeps to its own rows' key range (OWN_KEY_RANGES).
MASKED_THREE_PART_CASES = [
    Case("window (700, 0) Sq=2100", seqlen_q=2100, seqlen_k=2100, dqk=64, dv=64,
         options=dict(window=(700, 0))),
    Case("causal bottom-right Sq=2000 Sk=2500, key row", seqlen_q=2000, seqlen_k=2500,
         dqk=64, dv=64, bias="B11K", options=dict(causal=True, align="bottom_right")),
    # each warpgroup's own key range (OWN_KEY_RANGES): the tiles past its rows skipped,
    # their bias tiles released too
    Case("causal Sq=1904, bias", seqlen_q=1904, seqlen_k=1904, dqk=64, dv=64, bias="BHQK",
         options=dict(causal=True)),
    Case("window (-1, 100) Sq=1000 Sk=1200", seqlen_q=1000, seqlen_k=1200, dqk=64, dv=64,
         options=dict(window=(-1, 100))),
]  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
@pytest.mark.parametrize("case", MASKED_THREE_PART_CASES, ids=lambda c: c.name)
def test_hopper_kernel_three_parts_under_masks_gpu(case, dtype, monkeypatch):
    if not hopper_kernel_runs_here():
        pytest.skip("the Gluon kernels are built for Hopper (sm_90) and Triton 3.6")
    monkeypatch.setattr(forward_sm90, "MIN_SEQLEN_Q_D64_MASKED", 0)
    launches = record_launches(monkeypatch, forward_sm90, "_launch_forward")
    assert_results(check_forward(case, dtype, "cuda", seed=5))
    blocks = [constexprs["BLOCK_M"] for _, constexprs in launches]
    assert blocks and all(b == forward_sm90.BLOCK_M_D64 for b in blocks), blocks


@pytest.mark.parametrize(
    "dqk, dv, parts, bias, row, dropout, slots",
    [
        (64, 64, 2, False, False, False, (2, 0, False)),
        (64, 64, 3, True, False, False, (1, 2, False)),
        (64, 64, 2, True, False, False, (2, 2, False)),
        (64, 64, 2, False, True, True, (2, 0, False)),
        (64, 64, 2, True, False, True, (2, 2, False)),
        (128, 128, 2, False, False, False, (2, 0, False)),
        (128, 128, 2, True, False, False, (1, 1, False)),
        (128, 128, 2, True, False, True, (1, 1, True)),
        (128, 128, 2, False, True, False, (2, 0, False)),
        (128, 128, 2, False, False, True, (1, 0, False)),
        (256, 256, 2, False, False, False, (1, 0, True)),
        (256, 256, 2, False, False, True, (1, 0, True)),
        (256, 256, 2, True, False, False, (1, 1, True)),
        (256, 256, 2, True, False, True, (1, 1, True)),
        (128, 64, 2, False, False, False, (2, 0, False)),
        (128, 64, 2, True, False, False, (2, 1, False)),
        (128, 64, 2, True, False, True, (2, 1, False)),
        (64, 128, 2, True, False, True, (1, 2, False)),
        (192, 128, 2, False, False, False, (1, 0, True)),
        (192, 128, 2, False, True, False, (1, 0, True)),
        (192, 128, 2, True, False, False, (1, 2, True)),  # 64-key tiles (key_tile)
        (192, 128, 2, True, False, True, (1, 2, True)),
        (192, 128, 2, False, False, True, (1, 0, True)),
        (192, 128, 2, False, True, True, (1, 0, True)),
    ],
)  # fmt: skip
def test_buffers_fit_shared_memory(dqk, dv, parts, bias, row, dropout, slots):
    """(Q slots, bias slots, O in Q's buffer): two Q buffers where the K/V rings, O's and
    the bias's buffers (tiles or rows) leave room (227 KiB, less dropout's scratch); at
    D=256 and 192/128 O leaves through Q's buffer: one; beside bias tiles and dropout's
    scratch at D=128 too, where O's own leaves no room (192/128 beside bias tiles: its
    keys 64 a tile)."""
    assert forward_sm90.buffers(dqk, dv, parts, bias, row, dropout) == slots
    if slots[0]:  # what the kernel allocates fits (bytes as buffers counts them)
        n = forward_sm90.key_tile(dqk, dv, bias)
        q, b, with_o = slots
        used = (2 * n * (dqk + dv) * 2 + parts * 64 * (q * dqk + b * n) * 2
                + (0 if with_o else parts * 64 * dv * 2) + (2 * n * 4 if row else 0))
        scratch = forward_sm90.DROPOUT_SCRATCH if dropout else 0
        assert used + scratch <= forward_sm90.SHARED_MEMORY - 2048


@pytest.mark.gpu
def test_dqk_192_dv_128_gpu():
    case = Case("Dqk=192 Dv=128", seqlen_q=2048, seqlen_k=2048, dqk=192, dv=128,
                options=dict(causal=True))
    assert_results(check_forward(case, torch.bfloat16, "cuda", seed=3))


FLOAT32_CASES = [
    Case("fp32 D64", seqlen_q=777, seqlen_k=901, dqk=64, dv=64),
    Case("fp32 D128 causal GQA bias", seqlen_q=300, seqlen_k=421, dqk=128, dv=128,
         bias="1HQK", options=dict(causal=True, align="bottom_right")),
    Case("fp32 D256 window ALiBi dropout", seqlen_q=250, seqlen_k=333, dqk=256, dv=256,
         alibi="H", options=dict(window=(100, 20), dropout_p=0.1)),
    Case("fp32 D128 few queries (split-KV)", seqlen_q=3, seqlen_k=5000, dqk=128, dv=128,
         options=dict(causal=True, align="bottom_right")),
]  # fmt: skip


@pytest.mark.parametrize("allow_tf32", [False, True])
def test_float32_dots_are_3xtf32(allow_tf32):
    """float32's dots run as 3xTF32 (near float32) whatever allow_tf32 says, but in the
    backward past 128 columns (IEEE: its tiles ran faster so); 16-bit inputs' setting
    is unused (their dots take them as they are)."""
    from memattn.kernels.forward import dot_precision
    from memattn.spec import check_call

    def spec(dqk, dv, dtype=torch.float32):
        q, v = torch.empty(1, 8, 2, dqk, dtype=dtype), torch.empty(1, 8, 2, dv, dtype=dtype)
        return check_call(q, q, v)

    old = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = allow_tf32
        for dims in [(64, 64), (128, 128), (96, 96), (128, 64)]:
            assert dot_precision(spec(*dims)) == dot_precision(spec(*dims), "backward")
            assert dot_precision(spec(*dims)) == "tf32x3"
        for dims in [(256, 256), (192, 128), (128, 256), (160, 160)]:
            assert dot_precision(spec(*dims)) == "tf32x3"
            assert dot_precision(spec(*dims), "backward") == "ieee"
        for dims in [(64, 64), (256, 256)]:
            assert dot_precision(spec(*dims), "decode") == "tf32x3"
        assert dot_precision(spec(128, 128, torch.bfloat16)) == "tf32"
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old


@pytest.mark.gpu
@pytest.mark.parametrize("case", FLOAT32_CASES, ids=lambda c: c.name)
def test_float32_gpu(case):
    """float32 at every head dim (3xTF32 dots: forward.dot_precision) within float32's
    tolerance whatever allow_tf32 says: the reference follows it (without: plain
    float32's error), the kernels do not."""
    old = torch.backends.cuda.matmul.allow_tf32
    try:
        for allow in (False, True):
            torch.backends.cuda.matmul.allow_tf32 = allow
            assert_results(check_forward(case, torch.float32, "cuda", seed=2))
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old


@pytest.mark.gpu
def test_batch_heads_beyond_grid_limit_gpu():
    """batch * heads = 70,000 > 65,535: the 1-D grid has no such limit."""
    case = Case("B*H=70000", batch=7, heads=10_000, kv_heads=10_000, seqlen_q=16, seqlen_k=24,
                dqk=32, dv=32, options=dict(causal=True))
    assert_results(check_forward(case, torch.float16, "cuda", seed=4))


@pytest.mark.gpu
def test_offsets_beyond_int32_gpu():
    """q/k/v views whose batch stride puts elements past 2**31: offsets must be int64.
    One 6 GiB storage holds the three (the GPU suite's workers share the card)."""
    b, s, h, d = 3, 64, 2, 64
    stride = 2**30 + 4096  # batch 2 starts past element 2**31
    n = s * h * d
    base = torch.empty(b, stride, device="cuda", dtype=torch.float16)
    base[:, : 3 * n].normal_()
    q, k, v = (base[:, i * n: (i + 1) * n].view(b, s, h, d) for i in range(3))
    out, lse = memattn.attention(q, k, v, causal=True, return_lse=True)
    ref, ref_lse = memattn.reference.attention(q.double(), k.double(), v.double(),
                                               causal=True, return_lse=True)
    low = memattn.reference.attention(q, k, v, causal=True)
    from memattn.check import relative_error

    assert relative_error(out, ref) <= 2 * relative_error(low, ref) + 1e-4
    assert relative_error(out[2], ref[2]) <= 2 * relative_error(low[2], ref[2]) + 1e-4
