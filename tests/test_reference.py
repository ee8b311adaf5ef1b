"""The float64 reference (``memattn.reference.attention``) against independent formulations.

The reference is the spec in code: the kernels are only as right as it is. Here it is
checked, in float64 on the CPU (no Triton), against
  (a) ``torch.nn.functional.scaled_dot_product_attention`` where that can express the call;
  (b) a naive per-element Python loop written from the docstring, for many option
      combinations, out and lse;
  (c) rows with no visible key: out = 0 and lse = -inf, never NaN (gradients too);
  (d) varlen mode against dense mode run per sequence (and against the naive loop);
  (e) ``torch.autograd.gradcheck`` for q, k, v and bias.
"""

from __future__ import annotations

import itertools
import math
import zlib

import pytest
import torch
import torch.nn.functional as F

import memattn
from memattn.reference import attention as ref_attention

F64 = torch.float64
RTOL, ATOL = 1e-10, 1e-12  # float64, values O(1)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny tensors: intra-op threads only add wake-up latency, which grows to milliseconds
    per op when the (2) cores are busy; restored after this module."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def close(actual, expected, rtol=RTOL, atol=ATOL):
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol)


def randn(gen, *shape, dtype=F64):
    return torch.randn(shape, generator=gen, dtype=F64).to(dtype)


def qkv(gen, b, sq, sk, h, hkv, dqk, dv, dtype=F64):
    return (randn(gen, b, sq, h, dqk, dtype=dtype), randn(gen, b, sk, hkv, dqk, dtype=dtype),
            randn(gen, b, sk, hkv, dv, dtype=dtype))  # fmt: skip


def slopes(gen, *shape):
    return (torch.rand(shape, generator=gen) * 0.9 + 0.1).float()  # float32, as the spec asks


# ----------------------------------------------------------------------------------------
# The naive loop: one query, one key at a time, in Python floats.


def naive_attention(q, k, v, *, causal=False, window=None, align="top_left", bias=None,
                    alibi_slopes=None, softcap=0.0, scale=None, dropout_p=0.0,
                    dropout_keep=None):  # fmt: skip
    """Dense only. Returns out (B, Sq, H, Dv) and lse (B, H, Sq), float64."""
    b_, sq, h_, dqk = q.shape
    _, sk, hkv, dv = v.shape
    group = h_ // hkv
    scale = 1.0 / math.sqrt(dqk) if scale is None else scale
    left, right = (-1, -1) if window is None else window
    off = sk - sq if align == "bottom_right" else 0
    Q, K, V = q.tolist(), k.tolist(), v.tolist()
    if bias is not None:
        bshape = (1,) * (4 - bias.dim()) + tuple(bias.shape)
        BIAS = bias.reshape(bshape).tolist()
    if alibi_slopes is not None:
        SLOPES = alibi_slopes.tolist()
    if dropout_p > 0:
        KEEP = dropout_keep.tolist()

    out = [[[[0.0] * dv for _ in range(h_)] for _ in range(sq)] for _ in range(b_)]
    lse = [[[-math.inf] * sq for _ in range(h_)] for _ in range(b_)]
    for b in range(b_):
        for h in range(h_):
            hk = h // group  # query head h reads key/value head h // group
            for i in range(sq):
                pos = i + off
                scores = {}
                for j in range(sk):
                    if causal and j > pos:
                        continue
                    if left >= 0 and j < pos - left:
                        continue
                    if right >= 0 and j > pos + right:
                        continue
                    s = scale * sum(Q[b][i][h][d] * K[b][j][hk][d] for d in range(dqk))
                    if softcap > 0:
                        s = softcap * math.tanh(s / softcap)
                    if bias is not None:
                        idx = [x if n > 1 else 0 for x, n in zip((b, h, i, j), bshape, strict=True)]
                        s += BIAS[idx[0]][idx[1]][idx[2]][idx[3]]
                    if alibi_slopes is not None:
                        slope = SLOPES[h] if alibi_slopes.dim() == 1 else SLOPES[b][h]
                        s -= slope * abs(pos - j)
                    if s != -math.inf:
                        scores[j] = s
                if not scores:
                    continue
                m = max(scores.values())
                row_lse = m + math.log(sum(math.exp(s - m) for s in scores.values()))
                lse[b][h][i] = row_lse
                for j, s in scores.items():
                    p = math.exp(s - row_lse)
                    if dropout_p > 0:
                        p = p * KEEP[b][h][i][j] / (1.0 - dropout_p)
                    for d in range(dv):
                        out[b][i][h][d] += p * V[b][j][hk][d]
    return torch.tensor(out, dtype=F64).reshape(b_, sq, h_, dv), torch.tensor(
        lse, dtype=F64
    ).reshape(b_, h_, sq)


def test_naive_loop_sanity():
    """The naive loop itself on a case done by hand: one key gets all the weight."""
    q = torch.tensor([[[[1.0]], [[2.0]]]], dtype=F64)  # B=1, Sq=2, H=1, D=1
    k = torch.tensor([[[[1.0]], [[-1.0]]]], dtype=F64)
    v = torch.tensor([[[[3.0]], [[5.0]]]], dtype=F64)
    out, lse = naive_attention(q, k, v, causal=True, scale=1.0)
    # row 0 sees key 0 only; row 1: scores 2 and -2
    w = math.exp(2) / (math.exp(2) + math.exp(-2))
    close(out.flatten(), torch.tensor([3.0, 3 * w + 5 * (1 - w)], dtype=F64))
    close(lse.flatten(), torch.tensor([1.0, math.log(math.exp(2) + math.exp(-2))], dtype=F64))


# ----------------------------------------------------------------------------------------
# (a) Against scaled_dot_product_attention.


def sdpa(q, k, v, **kwargs):
    """SDPA on our (B, S, H, D) layout, GQA by repeating k/v heads ourselves."""
    group = q.shape[2] // k.shape[2]
    k = k.repeat_interleave(group, dim=2)
    v = v.repeat_interleave(group, dim=2)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         **kwargs)  # fmt: skip
    return out.transpose(1, 2)


def explicit_lse(q, k, scale, mask=None):
    group = q.shape[2] // k.shape[2]
    k = k.repeat_interleave(group, dim=2)
    s = torch.einsum("bihd,bjhd->bhij", q, k) * scale
    if mask is not None:
        s = s + mask
    return torch.logsumexp(s, dim=-1)


SDPA_CASES = {
    # name: (B, Sq, Sk, H, Hkv, Dqk, Dv)
    "plain": (2, 5, 7, 3, 3, 5, 5),
    "Sq>Sk": (1, 9, 4, 2, 2, 3, 3),
    "GQA": (2, 7, 5, 6, 2, 4, 4),
    "MQA": (1, 6, 9, 5, 1, 3, 3),
    "Dqk!=Dv": (2, 5, 7, 2, 1, 7, 3),
    "Dv>Dqk": (1, 3, 11, 4, 2, 2, 9),
}


@pytest.mark.parametrize("sizes", SDPA_CASES.values(), ids=SDPA_CASES.keys())
@pytest.mark.parametrize("scale", [None, 0.41])
def test_sdpa_plain(sizes, scale):
    gen = torch.Generator().manual_seed(1)
    q, k, v = qkv(gen, *sizes)
    out, lse = ref_attention(q, k, v, scale=scale, return_lse=True)
    close(out, sdpa(q, k, v, scale=scale))
    close(lse, explicit_lse(q, k, 1 / math.sqrt(q.shape[-1]) if scale is None else scale))
    assert out.dtype == lse.dtype == F64
    assert out.shape == (*q.shape[:3], v.shape[-1]) and lse.shape == (q.shape[0], q.shape[2],
                                                                     q.shape[1])  # fmt: skip


@pytest.mark.parametrize("sizes", SDPA_CASES.values(), ids=SDPA_CASES.keys())
def test_sdpa_causal_top_left(sizes):
    """SDPA's is_causal is top-left aligned, like align='top_left', for Sq == Sk and not."""
    gen = torch.Generator().manual_seed(2)
    q, k, v = qkv(gen, *sizes)
    close(ref_attention(q, k, v, causal=True), sdpa(q, k, v, is_causal=True))
    close(ref_attention(q, k, v, causal=True, align="top_left"), sdpa(q, k, v, is_causal=True))


@pytest.mark.parametrize("sq, sk", [(6, 6), (5, 9), (1, 8), (4, 4)])
def test_sdpa_causal_bottom_right(sq, sk):
    """Bottom-right causal is a lower-triangular mask shifted by Sk - Sq (Sq <= Sk)."""
    gen = torch.Generator().manual_seed(3)
    q, k, v = qkv(gen, 2, sq, sk, 4, 2, 5, 3)
    mask = torch.ones(sq, sk, dtype=torch.bool).tril(diagonal=sk - sq)
    close(ref_attention(q, k, v, causal=True, align="bottom_right"), sdpa(q, k, v, attn_mask=mask))
    if sq == sk:  # both alignments agree on square problems
        close(ref_attention(q, k, v, causal=True, align="bottom_right"),
              ref_attention(q, k, v, causal=True))  # fmt: skip


@pytest.mark.parametrize("window", [(2, 1), (0, 3), (-1, 1), (3, -1), (0, 0)])
@pytest.mark.parametrize("align", ["top_left", "bottom_right"])
def test_sdpa_window(window, align):
    gen = torch.Generator().manual_seed(4)
    sq, sk = 6, 8
    q, k, v = qkv(gen, 1, sq, sk, 2, 1, 4, 3)
    off = sk - sq if align == "bottom_right" else 0
    i = torch.arange(sq)[:, None] + off
    j = torch.arange(sk)[None, :]
    left, right = window
    mask = torch.ones(sq, sk, dtype=torch.bool)
    if left >= 0:
        mask &= j >= i - left
    if right >= 0:
        mask &= j <= i + right
    assert mask.any(-1).all()  # SDPA gives NaN on empty rows: keep these cases full
    close(ref_attention(q, k, v, window=window, align=align), sdpa(q, k, v, attn_mask=mask))


@pytest.mark.parametrize("bias_shape", ["BHQK", "QK", "1H1K", "B1Q1", "K"])
@pytest.mark.parametrize("causal", [False, True])
def test_sdpa_float_bias(bias_shape, causal):
    gen = torch.Generator().manual_seed(5)
    b, sq, sk, h = 2, 5, 7, 4
    q, k, v = qkv(gen, b, sq, sk, h, 2, 3, 6)
    sizes = dict(B=b, H=h, Q=sq, K=sk, **{"1": 1})
    bias = randn(gen, *(sizes[c] for c in bias_shape))
    mask = bias
    if causal:  # SDPA can't combine is_causal and attn_mask: fold causal into the mask
        mask = bias.masked_fill(~torch.ones(sq, sk, dtype=torch.bool).tril(), float("-inf"))
    out, lse = ref_attention(q, k, v, bias=bias, causal=causal, return_lse=True)
    mask = mask.reshape((1,) * (4 - mask.dim()) + mask.shape)  # SDPA wants >= 2-D masks
    close(out, sdpa(q, k, v, attn_mask=mask))
    close(lse, explicit_lse(q, k, 1 / math.sqrt(3), mask))


def test_sdpa_float_bias_float32_bias_on_float64_inputs():
    """A float32 bias on float64 inputs is added in float64."""
    gen = torch.Generator().manual_seed(6)
    q, k, v = qkv(gen, 1, 4, 5, 2, 2, 3, 3)
    bias = randn(gen, 2, 4, 5, dtype=torch.float32)
    close(ref_attention(q, k, v, bias=bias), sdpa(q, k, v, attn_mask=bias.double()))


def test_any_strides():
    """Non-contiguous inputs (transposed views, strided last dim) give the same result."""
    gen = torch.Generator().manual_seed(7)
    q, k, v = qkv(gen, 2, 5, 7, 4, 2, 3, 5)
    qt = q.transpose(1, 2).contiguous().transpose(1, 2)
    kt = torch.stack([k, k], dim=-1)[..., 0]  # last-dim stride 2
    vt = v.permute(3, 0, 1, 2).contiguous().permute(1, 2, 3, 0)
    assert not (qt.is_contiguous() or kt.is_contiguous() or vt.is_contiguous())
    close(ref_attention(qt, kt, vt, causal=True), ref_attention(q, k, v, causal=True))


# ----------------------------------------------------------------------------------------
# (b) Against the naive loop, many option combinations.

MASKS = {
    "none": {},
    "causal": dict(causal=True),
    "win(2,1)": dict(window=(2, 1)),
    "win(0,0)": dict(window=(0, 0)),
    "win(-1,2)": dict(window=(-1, 2)),
    "win(3,-1)": dict(window=(3, -1)),
    "causal+win(2,-1)": dict(causal=True, window=(2, -1)),
    "causal+win(1,3)": dict(causal=True, window=(1, 3)),
}
MODS = ["none", "softcap", "bias", "bias1H1K", "alibiH", "alibiBH", "scale", "all"]
B_, H_, HKV_, DQK_, DV_ = 2, 4, 2, 3, 4
SIZES = [(5, 7), (7, 5), (6, 6)]


def _mod_kwargs(mod, gen, sq, sk):
    kw = {}
    if mod in ("softcap", "all"):
        kw["softcap"] = 0.8  # strongly active: |scale * q.k| is often > 0.8
    if mod == "bias":
        kw["bias"] = randn(gen, B_, H_, sq, sk)
    if mod in ("bias1H1K", "all"):
        kw["bias"] = randn(gen, 1, H_, 1, sk)
    if mod == "alibiH":
        kw["alibi_slopes"] = slopes(gen, H_)
    if mod in ("alibiBH", "all"):
        kw["alibi_slopes"] = slopes(gen, B_, H_)
    if mod in ("scale", "all"):
        kw["scale"] = 0.37
    return kw


@pytest.mark.parametrize("dropout_p", [0.0, 0.3])
@pytest.mark.parametrize("mod", MODS)
@pytest.mark.parametrize("align", ["top_left", "bottom_right"])
@pytest.mark.parametrize("mask", MASKS.values(), ids=MASKS.keys())
def test_against_naive_loop(mask, align, mod, dropout_p):
    gen = torch.Generator().manual_seed(zlib.crc32(f"{mask}{align}{mod}{dropout_p}".encode()))
    for sq, sk in SIZES:
        q, k, v = qkv(gen, B_, sq, sk, H_, HKV_, DQK_, DV_)
        kw = dict(mask, align=align, **_mod_kwargs(mod, gen, sq, sk))
        if dropout_p > 0:
            kw.update(
                dropout_p=dropout_p,
                dropout_keep=torch.rand(B_, H_, sq, sk, generator=gen) >= dropout_p,
            )
        out, lse = ref_attention(q, k, v, return_lse=True, **kw)
        out_n, lse_n = naive_attention(q, k, v, **kw)
        assert not out.isnan().any() and not lse.isnan().any()
        close(out, out_n)
        close(lse, lse_n)


def test_dropout_scaling_exact():
    """All kept: out scaled by exactly 1 / (1 - p); none kept: out 0, lse unchanged."""
    gen = torch.Generator().manual_seed(8)
    q, k, v = qkv(gen, 1, 4, 6, 2, 1, 3, 3)
    base, lse = ref_attention(q, k, v, return_lse=True)
    keep = torch.ones(1, 2, 4, 6, dtype=torch.bool)
    out, lse_d = ref_attention(q, k, v, dropout_p=0.25, dropout_keep=keep, return_lse=True)
    close(out, base / 0.75)
    close(lse_d, lse)
    out, lse_d = ref_attention(q, k, v, dropout_p=0.25, dropout_keep=~keep, return_lse=True)
    assert torch.equal(out, torch.zeros_like(out))
    close(lse_d, lse)


def test_softcap_large_is_identity_and_small_saturates():
    gen = torch.Generator().manual_seed(9)
    q, k, v = qkv(gen, 1, 5, 7, 2, 2, 4, 4)
    close(ref_attention(q, k, v, softcap=1e8), ref_attention(q, k, v), rtol=1e-9, atol=1e-12)
    # A tiny cap squashes every score to ~0: uniform weights over the keys.
    expected = v.mean(dim=1, keepdim=True).expand(1, 5, 2, 4)
    close(ref_attention(q, k, v, softcap=1e-9), expected, rtol=1e-8, atol=1e-8)


def test_alibi_equals_its_bias():
    """ALiBi is the bias -slope * |i + off - j|, per sequence alignment."""
    gen = torch.Generator().manual_seed(10)
    sq, sk = 4, 9
    q, k, v = qkv(gen, 2, sq, sk, 3, 3, 2, 2)
    sl = slopes(gen, 2, 3)
    for align, off in (("top_left", 0), ("bottom_right", sk - sq)):
        dist = (torch.arange(sq)[:, None] + off - torch.arange(sk)[None, :]).abs().double()
        bias = -sl.double()[:, :, None, None] * dist
        close(ref_attention(q, k, v, alibi_slopes=sl, align=align),
              ref_attention(q, k, v, bias=bias, align=align))  # fmt: skip


def test_lower_precision_dtypes():
    """float32/float16 inputs: out in q's dtype, lse float32, close to float64."""
    gen = torch.Generator().manual_seed(11)
    q, k, v = qkv(gen, 2, 5, 7, 4, 2, 8, 8)
    bias = randn(gen, 5, 7)
    ref, ref_lse = ref_attention(q, k, v, bias=bias, causal=True, return_lse=True)
    for dtype, tol in ((torch.float32, 1e-5), (torch.float16, 2e-2)):
        out, lse = ref_attention(q.to(dtype), k.to(dtype), v.to(dtype), bias=bias.to(dtype),
                                 causal=True, return_lse=True)  # fmt: skip
        assert out.dtype == dtype and lse.dtype == torch.float32
        close(out.double(), ref, rtol=tol, atol=tol)
        close(lse.double(), ref_lse, rtol=tol, atol=tol)


# ----------------------------------------------------------------------------------------
# (c) Rows with no visible key.


def _empty_rows_check(out, lse, empty):
    """empty: (Sq,) or (B, H, Sq) bool of rows with no visible key."""
    empty = empty.expand(lse.shape)
    assert not out.isnan().any() and not lse.isnan().any()
    assert torch.isneginf(lse[empty]).all()
    assert torch.isfinite(lse[~empty]).all()
    out_rows = out.transpose(1, 2)  # (B, H, Sq, Dv)
    assert torch.equal(out_rows[empty], torch.zeros_like(out_rows[empty]))
    assert torch.isfinite(out).all()


EMPTY_CASES = {
    # name: (Sq, Sk, kwargs, number of leading empty rows or a callable)
    "window(0,0) bottom_right Sk<Sq": (7, 4, dict(window=(0, 0), align="bottom_right"), 3),
    "causal bottom_right Sk<Sq": (7, 4, dict(causal=True, align="bottom_right"), 3),
    "causal+window bottom_right": (
        6,
        2,
        dict(causal=True, window=(1, 5), align="bottom_right"),
        4,
    ),  # fmt: skip
    "window(2,-1) top_left Sq>Sk": (9, 4, dict(window=(2, -1)), None),
    "window(-1,0) bottom_right": (5, 3, dict(window=(-1, 0), align="bottom_right"), 2),
    "Sk=0": (5, 0, {}, 5),
    "Sk=0 causal": (3, 0, dict(causal=True), 3),
}


@pytest.mark.parametrize("mods", ["none", "all"])
@pytest.mark.parametrize("case", EMPTY_CASES.values(), ids=EMPTY_CASES.keys())
def test_rows_without_keys(case, mods):
    sq, sk, kw, n_empty = case
    gen = torch.Generator().manual_seed(12)
    q, k, v = qkv(gen, 2, sq, sk, 4, 2, 3, 5)
    if mods == "all":
        kw = dict(
            kw,
            bias=randn(gen, 2, 1, sq, sk),
            alibi_slopes=slopes(gen, 4),
            softcap=2.0,
            dropout_p=0.2,
            dropout_keep=torch.rand(2, 4, sq, sk, generator=gen) > 0.2,
        )
    out, lse = ref_attention(q, k, v, return_lse=True, **kw)
    if n_empty is None:  # window (2, -1), top-left: row i sees j >= i - 2, so i >= Sk + 2 empty
        empty = torch.arange(sq) >= sk + 2
    else:
        empty = torch.arange(sq) < n_empty
    assert empty.any() and out.shape == (2, sq, 4, 5)
    _empty_rows_check(out, lse, empty)
    out_n, lse_n = naive_attention(q, k, v, **kw)
    close(out, out_n)
    close(lse, lse_n)


def test_window_zero_zero_picks_the_diagonal_value():
    """window (0, 0): each non-empty row sees one key, gets exactly its value; lse = score."""
    gen = torch.Generator().manual_seed(13)
    sq, sk = 7, 4
    q, k, v = qkv(gen, 1, sq, sk, 2, 2, 3, 3)
    out, lse = ref_attention(q, k, v, window=(0, 0), align="bottom_right", return_lse=True)
    off = sk - sq
    for i in range(sq):
        if i + off < 0:
            assert torch.equal(out[0, i], torch.zeros(2, 3, dtype=F64))
            assert torch.isneginf(lse[0, :, i]).all()
        else:
            close(out[0, i], v[0, i + off])
            score = (q[0, i] * k[0, i + off]).sum(-1) / math.sqrt(3)
            close(lse[0, :, i], score)


def test_bias_minus_inf_masks_rows():
    gen = torch.Generator().manual_seed(14)
    q, k, v = qkv(gen, 1, 6, 5, 2, 1, 3, 3)
    bias = randn(gen, 1, 2, 6, 5)
    bias[:, :, 2] = float("-inf")  # row 2, both heads
    bias[:, 1, 4] = float("-inf")  # row 4, head 1
    bias[:, 0, :, 3:] = float("-inf")  # head 0: keys 3, 4 hidden (rows keep keys 0..2)
    out, lse = ref_attention(q, k, v, bias=bias, return_lse=True)
    empty = torch.zeros(1, 2, 6, dtype=torch.bool)
    empty[:, :, 2] = True
    empty[:, 1, 4] = True
    _empty_rows_check(out, lse, empty)
    close(out, naive_attention(q, k, v, bias=bias)[0])
    close(out[:, :, 0], ref_attention(q[:, :, :1], k[:, :3], v[:, :3], bias=bias[:, :1, :, :3],
                                      scale=1 / math.sqrt(3))[:, :, 0])  # fmt: skip


def test_rows_without_keys_have_finite_zero_gradients():
    gen = torch.Generator().manual_seed(15)
    q, k, v = (t.requires_grad_() for t in qkv(gen, 1, 7, 4, 2, 1, 3, 3))
    bias = randn(gen, 1, 2, 7, 4).requires_grad_()
    out, lse = ref_attention(q, k, v, bias=bias, causal=True, align="bottom_right",
                             return_lse=True)  # fmt: skip
    (out * randn(gen, *out.shape)).sum().backward()
    for t in (q, k, v, bias):
        assert torch.isfinite(t.grad).all()
    assert torch.equal(q.grad[:, :3], torch.zeros_like(q.grad[:, :3]))  # rows 0..2 see nothing
    assert torch.equal(bias.grad[:, :, :3], torch.zeros_like(bias.grad[:, :, :3]))


# ----------------------------------------------------------------------------------------
# (d) Varlen equals dense per sequence.

LENGTHS = [
    ((3, 0, 5, 1, 4), (4, 2, 0, 6, 4)),  # an empty query side, an empty key side
    ((2, 6), (7, 3)),
    ((0, 0), (0, 0)),  # all empty
    ((0, 3), (5, 0)),  # keys but no queries; queries but no keys
]
VARLEN_OPTIONS = {
    "plain": {},
    "causal bottom_right": dict(causal=True, align="bottom_right"),
    "causal top_left": dict(causal=True),
    "window": dict(window=(1, 2), align="bottom_right"),
    "bias": dict(bias="BHQK"),
    "bias QK": dict(bias="QK"),
    "alibi H": dict(alibi="H", align="bottom_right"),
    "alibi BH": dict(alibi="BH"),
    "softcap+scale": dict(softcap=1.3, scale=0.6),
    "dropout": dict(dropout=0.35),
    "everything": dict(
        causal=True,
        window=(2, -1),
        align="bottom_right",
        bias="BHQK",
        alibi="BH",
        softcap=1.5,
        dropout=0.2,
    ),  # fmt: skip
}


def _cu(lengths):
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)


@pytest.mark.parametrize("extra", [0, 2], ids=["max_seqlen=None", "max_seqlen+2"])
@pytest.mark.parametrize("options", VARLEN_OPTIONS.values(), ids=VARLEN_OPTIONS.keys())
@pytest.mark.parametrize("lengths", LENGTHS, ids=[str(x) for x in range(len(LENGTHS))])
def test_varlen_equals_dense_per_sequence(lengths, options, extra):
    lq, lk = lengths
    b, h, hkv, dqk, dv = len(lq), 4, 2, 5, 3
    gen = torch.Generator().manual_seed(16)
    q = randn(gen, sum(lq), h, dqk)
    k = randn(gen, sum(lk), hkv, dqk)
    v = randn(gen, sum(lk), hkv, dv)
    mq, mk = max(lq) + extra, max(lk) + extra
    opts = dict(options)
    kw = {key: opts.pop(key) for key in ("causal", "window", "align", "softcap", "scale")
          if key in opts}  # fmt: skip
    dense_extra = [{} for _ in range(b)]
    if "bias" in opts:
        bias = randn(gen, b, h, mq, mk) if opts["bias"] == "BHQK" else randn(gen, mq, mk)
        kw["bias"] = bias
        for i in range(b):  # indexed by position inside each sequence
            full = bias.expand(b, h, mq, mk)
            dense_extra[i]["bias"] = full[i : i + 1, :, : lq[i], : lk[i]]
    if "alibi" in opts:
        sl = slopes(gen, h) if opts["alibi"] == "H" else slopes(gen, b, h)
        kw["alibi_slopes"] = sl
        for i in range(b):
            dense_extra[i]["alibi_slopes"] = sl if sl.dim() == 1 else sl[i : i + 1]
    if "dropout" in opts:
        p = opts["dropout"]
        keep = torch.rand(b, h, mq, mk, generator=gen) >= p
        kw.update(dropout_p=p, dropout_keep=keep)
        for i in range(b):
            dense_extra[i].update(dropout_p=p, dropout_keep=keep[i : i + 1, :, : lq[i], : lk[i]])
    if extra:
        kw.update(max_seqlen_q=mq, max_seqlen_k=mk)

    out, lse = ref_attention(q, k, v, cu_seqlens_q=_cu(lq), cu_seqlens_k=_cu(lk),
                             return_lse=True, **kw)  # fmt: skip
    assert out.shape == (sum(lq), h, dv) and lse.shape == (h, sum(lq))
    assert out.dtype == lse.dtype == F64
    assert not out.isnan().any() and not lse.isnan().any()
    cq, ck = _cu(lq).tolist(), _cu(lk).tolist()
    for i in range(b):
        sl_q, sl_k = slice(cq[i], cq[i + 1]), slice(ck[i], ck[i + 1])
        qi, ki, vi = q[None, sl_q], k[None, sl_k], v[None, sl_k]
        dense_kw = {key: kw[key] for key in ("causal", "window", "align", "softcap", "scale")
                    if key in kw}  # fmt: skip
        dense_kw.update(dense_extra[i])
        out_d, lse_d = ref_attention(qi, ki, vi, return_lse=True, **dense_kw)
        close(out[sl_q], out_d[0])
        close(lse[:, sl_q], lse_d[0])
        if lq[i] and not lk[i]:
            assert torch.isneginf(lse_d).all() and torch.equal(out_d, torch.zeros_like(out_d))
        out_n, lse_n = naive_attention(qi, ki, vi, **dense_kw)
        close(out[sl_q], out_n[0])
        close(lse[:, sl_q], lse_n[0])


def test_varlen_single_sequence_equals_dense():
    gen = torch.Generator().manual_seed(17)
    q, k, v = qkv(gen, 1, 6, 9, 2, 1, 4, 4)
    bias = randn(gen, 1, 2, 6, 9)
    kw = dict(causal=True, align="bottom_right", bias=bias, alibi_slopes=slopes(gen, 2))
    out, lse = ref_attention(q, k, v, return_lse=True, **kw)
    out_v, lse_v = ref_attention(q[0], k[0], v[0], cu_seqlens_q=_cu([6]), cu_seqlens_k=_cu([9]),
                                 return_lse=True, **kw)  # fmt: skip
    close(out_v, out[0])
    close(lse_v, lse[0])


@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
def test_probabilities_are_the_weights_of_out(varlen):
    """probabilities(): rows sum to 1 (0 for a row that sees no key), 0 on hidden keys,
    and p @ v is attention()'s output; varlen's (B, H, max_q, max_k) is indexed by
    positions inside each sequence, 0 past its lengths."""
    gen = torch.Generator().manual_seed(19)
    h, hkv, d = 4, 2, 3
    kw = dict(causal=True, window=(3, -1), align="bottom_right", softcap=1.3,
              alibi_slopes=slopes(gen, h))  # fmt: skip
    if varlen:
        lq, lk = (4, 0, 6, 3), (5, 2, 4, 0)
        q = randn(gen, sum(lq), h, d)
        k, v = randn(gen, sum(lk), hkv, d), randn(gen, sum(lk), hkv, d)
        kw.update(cu_seqlens_q=_cu(lq), cu_seqlens_k=_cu(lk), max_seqlen_q=7, max_seqlen_k=6,
                  bias=randn(gen, 1, h, 7, 6))  # fmt: skip
        pieces = [(q[a:b][None], k[c:e][None], v[c:e][None])
                  for a, b, c, e in zip(_cu(lq)[:-1].tolist(), _cu(lq)[1:].tolist(),
                                        _cu(lk)[:-1].tolist(), _cu(lk)[1:].tolist())]  # fmt: skip
    else:
        q, k, v = qkv(gen, 2, 6, 4, h, hkv, d, d)
        kw["bias"] = randn(gen, 2, 1, 6, 4)
        pieces = [(q, k, v)]
    p = memattn.reference.probabilities(q, k, **kw)
    out = ref_attention(q, k, v, **kw)
    assert p.dtype == F64 and p.shape == ((4, h, 7, 6) if varlen else (2, h, 6, 4))
    sums = p.sum(-1)
    assert torch.allclose(sums, (sums > 0.5).to(F64)) and (p >= 0).all()
    for b, (qb, kb, vb) in enumerate(pieces):
        pb = p[b : b + 1, :, : qb.shape[1], : kb.shape[1]] if varlen else p
        if varlen:
            assert not p[b, :, qb.shape[1] :].any() and not p[b, :, :, kb.shape[1] :].any()
        vb = vb.transpose(1, 2).repeat_interleave(h // hkv, dim=1)
        expect = (pb @ vb).transpose(1, 2)
        got = out[_cu(lq)[b] : _cu(lq)[b + 1]][None] if varlen else out
        close(got, expect)
    if not varlen:  # bottom-right, off = -2: query i sees keys i - 5 ..= i - 2
        i, j = torch.arange(6)[:, None], torch.arange(4)[None, :]
        assert not p[..., (j > i - 2) | (j < i - 5)].any()


# ----------------------------------------------------------------------------------------
# (e) gradcheck.

GRAD_CASES = {
    "bias": dict(),
    "softcap": dict(softcap=0.7),
    "alibi": dict(alibi_slopes="BH", scale=0.9),
    "causal+window bottom_right": dict(causal=True, window=(1, 2), align="bottom_right"),
    "window top_left": dict(window=(0, 1)),
    "dropout": dict(dropout_p=0.4),
    "everything": dict(
        causal=True,
        window=(2, -1),
        align="bottom_right",
        softcap=1.1,
        alibi_slopes="H",
        dropout_p=0.3,
    ),  # fmt: skip
}


@pytest.mark.parametrize("options", GRAD_CASES.values(), ids=GRAD_CASES.keys())
def test_gradcheck_dense(options):
    gen = torch.Generator().manual_seed(18)
    b, sq, sk, h, hkv, dqk, dv = 1, 3, 4, 2, 1, 2, 3
    q, k, v = (t.requires_grad_() for t in qkv(gen, b, sq, sk, h, hkv, dqk, dv))
    bias = randn(gen, b, h, sq, sk).requires_grad_()
    kw = dict(options)
    if kw.get("alibi_slopes") == "H":
        kw["alibi_slopes"] = slopes(gen, h)
    elif kw.get("alibi_slopes") == "BH":
        kw["alibi_slopes"] = slopes(gen, b, h)
    if "dropout_p" in kw:  # a fixed keep mask with some dropped, some kept
        keep = torch.rand(b, h, sq, sk, generator=gen) >= kw["dropout_p"]
        keep[..., 0, 0], keep[..., 0, 1] = True, False
        kw["dropout_keep"] = keep
    out, lse = ref_attention(q, k, v, bias=bias, return_lse=True, **kw)
    assert torch.isfinite(lse).all()  # no empty rows here: lse is differentiable too

    def fn(q, k, v, bias):
        return ref_attention(q, k, v, bias=bias, return_lse=True, **kw)

    assert torch.autograd.gradcheck(fn, (q, k, v, bias), eps=1e-6, atol=1e-8, rtol=1e-6)


def test_gradcheck_with_empty_rows():
    """Empty rows (out only: lse is -inf there): gradients are exact elsewhere."""
    gen = torch.Generator().manual_seed(19)
    q, k, v = (t.requires_grad_() for t in qkv(gen, 1, 4, 2, 2, 2, 2, 2))
    bias = randn(gen, 2, 4, 2).requires_grad_()  # broadcast over B

    def fn(q, k, v, bias):
        return ref_attention(q, k, v, bias=bias, causal=True, align="bottom_right",
                             softcap=0.9)  # fmt: skip

    assert torch.autograd.gradcheck(fn, (q, k, v, bias), eps=1e-6, atol=1e-8, rtol=1e-6)


def test_gradcheck_varlen():
    gen = torch.Generator().manual_seed(20)
    lq, lk = (2, 0, 3), (3, 2, 1)
    q = randn(gen, sum(lq), 2, 2).requires_grad_()
    k = randn(gen, sum(lk), 1, 2).requires_grad_()
    v = randn(gen, sum(lk), 1, 3).requires_grad_()
    bias = randn(gen, 3, 2, 3, 3).requires_grad_()
    kw = dict(cu_seqlens_q=_cu(lq), cu_seqlens_k=_cu(lk), alibi_slopes=slopes(gen, 2),
              window=(2, 1))  # fmt: skip

    def fn(q, k, v, bias):
        return ref_attention(q, k, v, bias=bias, return_lse=True, **kw)

    assert torch.isfinite(fn(q, k, v, bias)[1]).all()
    assert torch.autograd.gradcheck(fn, (q, k, v, bias), eps=1e-6, atol=1e-8, rtol=1e-6)


def test_public_reference_is_memattn_reference():
    assert memattn.reference.attention is ref_attention
