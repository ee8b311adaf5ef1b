"""The drop-in APIs of memattn.compat.

scaled_dot_product_attention against torch.nn.functional.scaled_dot_product_attention on
the same inputs (outputs, gradients, exception types; listed cases and random calls
drawn by hypothesis); the flash-attn 2 wrappers against
the float64 reference with bottom-right alignment. CPU (CI): Triton's interpreter at
small odd sizes in float32. GPU (`pytest -m gpu`): bfloat16 at real sizes, with the
project's tolerance (2x plain PyTorch's error in bfloat16 + 1e-4).
"""

import inspect

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn.attention import SDPBackend, sdpa_kernel

import memattn
from memattn import compat
from memattn.check import relative_error
from memattn.kernels.common import TILE_BIAS_ALIGNMENT, rows_aligned

from .conftest import DEVICE, cpu_only

B, H, L, S, E = 2, 2, 13, 19, 16  # CPU sizes: small, odd where it matters
NAMES = ("out", "dq", "dk", "dv")


def randn(*shape, seed, dtype=torch.float32, device=DEVICE):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)


def run_with_grads(fn, tensors, grad_out, **kwargs):
    """fn(*tensors, **kwargs) on fresh leaf copies; returns out and the gradients of the
    floating-point tensors among them (q, k, v and a float mask), in order."""
    leaves = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in tensors]
    out = fn(*leaves, **kwargs)
    grads = torch.autograd.grad(out, [t for t in leaves if t.requires_grad], grad_out)
    return out, list(grads)


def close(x, ref, what, tol=1e-5):
    torch.testing.assert_close(x, ref, atol=tol, rtol=tol, msg=lambda m: f"{what}: {m}")


# ----------------------------------------------------------------------------- SDPA


def torch_sdpa(*args, **kwargs):
    """torch's scaled_dot_product_attention on its math backend: the definition. (On CPU
    torch may pick a fused kernel that, e.g., takes attn_mask with is_causal.)"""
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(*args, **kwargs)


def bool_mask(*shape, seed):
    return randn(*shape, seed=seed) > -0.5  # ~70% True: no row of 19 keys all False


# (name, q shape, k shape, v shape, attn_mask or None, keyword arguments)
SDPA_CASES = [
    ("plain", (B, H, L, E), (B, H, S, E), (B, H, S, E), None, {}),
    ("scale 0.3, Ev 8", (B, H, L, E), (B, H, S, E), (B, H, S, 8), None, dict(scale=0.3)),
    ("causal L<S", (B, H, L, E), (B, H, S, E), (B, H, S, E), None, dict(is_causal=True)),
    ("causal L>S", (B, H, S, E), (B, H, L, E), (B, H, L, E), None, dict(is_causal=True)),
    ("bool (L, S)", (B, H, L, E), (B, H, S, E), (B, H, S, E), bool_mask(L, S, seed=1), {}),
    ("bool (B, H, L, S)", (B, H, L, E), (B, H, S, E), (B, H, S, E),
     bool_mask(B, H, L, S, seed=2), {}),
    ("bool key padding, expanded", (B, H, L, E), (B, H, S, E), (B, H, S, E),
     bool_mask(B, 1, 1, S, seed=3).expand(B, H, L, S), {}),
    ("float (B, H, L, S)", (B, H, L, E), (B, H, S, E), (B, H, S, E), randn(B, H, L, S, seed=4),
     {}),
    ("float (H, 1, S), scale", (B, H, L, E), (B, H, S, E), (B, H, S, E), randn(H, 1, S, seed=5),
     dict(scale=0.2)),
    ("enable_gqa 4/2 causal", (B, 4, L, E), (B, 2, S, E), (B, 2, S, E), None,
     dict(enable_gqa=True, is_causal=True)),
    ("MQA by broadcast, 1-D mask", (B, 3, L, E), (B, 1, S, E), (B, 1, S, E),
     bool_mask(S, seed=6), {}),
    ("3-D (H, L, E)", (3, L, E), (3, S, E), (3, S, E), randn(L, S, seed=7), {}),
    ("5-D, broadcast batch", (2, 2, H, L, E), (1, 2, H, S, E), (2, 1, H, S, E),
     bool_mask(2, 1, 1, L, S, seed=8), {}),
]  # fmt: skip


@cpu_only
@pytest.mark.parametrize("case", SDPA_CASES, ids=lambda c: c[0])
def test_sdpa_matches_torch(case):
    """Outputs and gradients (q, k, v, float mask) match torch's math backend in float32
    to 1e-5, and lie as close to torch's float64 result as twice torch's float32 error
    (+2e-6)."""
    _, q_shape, k_shape, v_shape, mask, kwargs = case
    tensors = [randn(*q_shape, seed=10), randn(*k_shape, seed=11), randn(*v_shape, seed=12)]
    tensors += [mask] if mask is not None else []
    grad = randn(*torch_sdpa(*tensors, **kwargs).shape, seed=13)
    ref, ref_grads = run_with_grads(torch_sdpa, tensors, grad, **kwargs)
    out, grads = run_with_grads(compat.scaled_dot_product_attention, tensors, grad, **kwargs)
    tensors64 = [t.double() if t.is_floating_point() else t for t in tensors]
    exact, exact_grads = run_with_grads(torch_sdpa, tensors64, grad.double(), **kwargs)

    has_float_mask = mask is not None and mask.is_floating_point()
    assert len(grads) == len(ref_grads) == 3 + has_float_mask
    assert out.shape == ref.shape and out.dtype == ref.dtype
    names = ("out", "dq", "dk", "dv", "dmask")[: 1 + len(grads)]
    for what, x, x_ref, x_exact in zip(names, [out, *grads], [ref, *ref_grads],
                                       [exact, *exact_grads], strict=True):  # fmt: skip
        assert x.shape == x_ref.shape, what
        close(x, x_ref, what)
        err, torch_err = relative_error(x, x_exact), relative_error(x_ref, x_exact)
        assert err <= 2 * torch_err + 2e-6, f"{what}: {err:.3g} > 2 * {torch_err:.3g} + 2e-6"


@st.composite
def sdpa_calls(draw):
    """(q, k, v, attn_mask or None, keyword arguments, a seed for the gradient) of a call
    torch's function takes:
    leading batch dims that k and v may broadcast, heads grouped (enable_gqa) or
    broadcast, masks bool or float of any shape that broadcasts, is_causal, scale."""
    lead = draw(st.lists(st.integers(1, 2), max_size=2))
    kv_heads = draw(st.sampled_from([1, 2]))
    gqa = draw(st.booleans())
    heads = kv_heads * draw(st.sampled_from([1, 2, 3])) if gqa else kv_heads
    if not gqa and draw(st.booleans()):  # one K/V head broadcast over q's
        heads, kv_heads = draw(st.sampled_from([2, 3])), 1
    sq, sk = draw(st.integers(1, 12)), draw(st.integers(1, 12))
    e, ev = draw(st.sampled_from([4, 8, 16])), draw(st.sampled_from([8, 16]))
    seed = draw(st.integers(0, 2**16))

    def broadcast(dims):  # each dim kept or 1
        return [d if draw(st.booleans()) else 1 for d in dims]

    q = randn(*lead, heads, sq, e, seed=seed)
    k = randn(*broadcast(lead), kv_heads, sk, e, seed=seed + 1)
    v = randn(*broadcast(lead), kv_heads, sk, ev, seed=seed + 2)
    kwargs = {"enable_gqa": True} if gqa else {}
    mask = None
    kind = draw(st.sampled_from([None, "bool", "float"]))
    if kind is not None:
        full = [*lead, heads, sq, sk]
        shape = broadcast(full[len(full) - draw(st.integers(1, len(full))):])
        mask = (randn(*shape, seed=seed + 3) > -0.5 if kind == "bool"
                else randn(*shape, seed=seed + 3))  # fmt: skip
    elif draw(st.booleans()):
        kwargs["is_causal"] = True
    if draw(st.booleans()):
        kwargs["scale"] = draw(st.floats(0.1, 1.0))
    return q, k, v, mask, kwargs, seed + 4


def sdpa_unnormalised(q, k, v, attn_mask=None, is_causal=False, scale=None,
                      enable_gqa=False):  # fmt: skip
    """SDPA with softmax's normaliser held constant (exp(s - lse), lse detached): its
    gradients are the P * dP terms alone, before the normaliser's terms cancel them."""
    if enable_gqa:
        group = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(group, -3), v.repeat_interleave(group, -3)
    s = q @ k.transpose(-1, -2) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if is_causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    if attn_mask is not None:
        s = s.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool \
            else s + attn_mask  # fmt: skip
    p = torch.exp(s - torch.logsumexp(s, -1, keepdim=True).detach())
    return torch.nan_to_num(p, nan=0.0) @ v  # rows with no key: 0, as torch's


@cpu_only
@settings(max_examples=20, deadline=None)
@given(sdpa_calls())
def test_random_sdpa_calls_match_torch(call):
    """Random calls: out and every gradient as close to torch's float64 result as twice
    torch's float32 error (+2e-6), the project's tolerance; gradients whose terms cancel
    (a row that sees one key has dS = 0) measured against the size of what was summed."""
    q, k, v, mask, kwargs, grad_seed = call
    tensors = [q, k, v] + ([mask] if mask is not None else [])
    grad = randn(*torch_sdpa(*tensors, **kwargs).shape, seed=grad_seed)
    ref, ref_grads = run_with_grads(torch_sdpa, tensors, grad, **kwargs)
    out, grads = run_with_grads(compat.scaled_dot_product_attention, tensors, grad, **kwargs)
    tensors64 = [t.double() if t.is_floating_point() else t for t in tensors]
    exact, exact_grads = run_with_grads(torch_sdpa, tensors64, grad.double(), **kwargs)
    _, terms = run_with_grads(sdpa_unnormalised, tensors64, grad.double(), **kwargs)
    assert out.shape == ref.shape and len(grads) == len(ref_grads)
    names = ("out", "dq", "dk", "dv", "dmask")
    for what, x, x_ref, x_exact, term in zip(names, [out, *grads], [ref, *ref_grads],
                                             [exact, *exact_grads], [None, *terms]):  # fmt: skip
        assert x.shape == x_ref.shape, what
        scale = 0.0 if what in ("out", "dv") else max(term.norm(), (term - x_exact).norm())
        err = relative_error(x, x_exact, float(scale))
        torch_err = relative_error(x_ref, x_exact, float(scale))
        assert err <= 2 * torch_err + 2e-6, f"{what}: {err:.3g} > 2 * {torch_err:.3g} + 2e-6"


@cpu_only
def test_sdpa_fully_masked_rows_give_zero_like_torch():
    """A row whose mask hides every key: out 0 and zero gradients, as torch 2.5+'s math
    backend (_safe_softmax); a bool mask and an all -inf float mask agree."""
    q, k, v = randn(1, H, L, E, seed=1), randn(1, H, S, E, seed=2), randn(1, H, S, E, seed=3)
    keep = bool_mask(1, H, L, S, seed=4)
    keep[:, :, 3] = False
    keep[:, 1, 7] = False
    grad = randn(1, H, L, E, seed=5)
    ref, ref_grads = run_with_grads(torch_sdpa, [q, k, v, keep], grad)
    out, grads = run_with_grads(compat.scaled_dot_product_attention, [q, k, v, keep], grad)
    assert torch.isfinite(ref).all(), "this torch gives NaN for empty rows: update the docs"
    assert torch.equal(out[:, :, 3], torch.zeros_like(out[:, :, 3]))
    assert torch.equal(grads[0][:, :, 3], torch.zeros_like(grads[0][:, :, 3]))
    for what, x, x_ref in zip(NAMES, [out, *grads], [ref, *ref_grads], strict=True):
        close(x, x_ref, what)
    bias = torch.zeros(1, H, L, S, device=DEVICE).masked_fill(~keep, float("-inf"))
    out_f, grads_f = run_with_grads(compat.scaled_dot_product_attention, [q, k, v, bias], grad)
    for what, x, x_ref in zip(NAMES, [out_f, *grads_f[:3]], [out, *grads], strict=True):
        close(x, x_ref, f"float mask {what}")
    assert torch.isfinite(grads_f[3]).all() and not grads_f[3][:, :, 3].any()


@cpu_only
def test_sdpa_is_a_view_of_memattn_attention():
    """Same numbers as memattn.attention on the (B, L, H, E) views, bit for bit, and the
    output is a transposed view of a (B, L, H, Ev)-contiguous tensor (no copies)."""
    q, k, v = randn(B, L, H, E, seed=1), randn(B, S, H, E, seed=2), randn(B, S, H, 8, seed=3)
    out = compat.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                              v.transpose(1, 2), is_causal=True)  # fmt: skip
    direct = memattn.attention(q, k, v, causal=True)
    assert out.shape == (B, H, L, 8) and out.transpose(1, 2).is_contiguous()
    assert torch.equal(out.transpose(1, 2), direct)


@cpu_only
@pytest.mark.parametrize("mask_shape", [(B, H, L, S), (L, S), (B, 1, 1, S)], ids=str)
def test_sdpa_boolean_masks_reach_memattn_over_aligned_rows(mask_shape, monkeypatch):
    """A boolean attn_mask becomes a bias every kernel family reads as it is
    (common.new_bias): memattn copies nothing, and the output is torch's."""
    q, k, v = _qkv()
    mask = torch.rand(*mask_shape, generator=torch.Generator().manual_seed(4)) > 0.3
    mask[..., 0] = True
    biases = []
    attention = compat.attention

    def spy(*args, bias=None, **kwargs):
        biases.append(bias)
        return attention(*args, bias=bias, **kwargs)

    monkeypatch.setattr(compat, "attention", spy)
    out = compat.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert len(biases) == 1 and rows_aligned(biases[0], TILE_BIAS_ALIGNMENT)
    assert relative_error(out, F.scaled_dot_product_attention(q, k, v, attn_mask=mask)) <= 1e-5


@cpu_only
def test_sdpa_dropout_repeats_under_manual_seed():
    """Dropout draws from torch's generator: the same seed repeats the call, and equals
    memattn.attention under that seed; another seed drops other elements."""
    q, k, v = randn(B, H, L, E, seed=1), randn(B, H, S, E, seed=2), randn(B, H, S, E, seed=3)
    mask = randn(H, L, S, seed=4)
    outs = []
    for seed in (7, 7, 8):
        torch.manual_seed(seed)
        outs.append(compat.scaled_dot_product_attention(q, k, v, mask, dropout_p=0.3))
    torch.manual_seed(7)
    direct = memattn.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                               bias=mask, dropout_p=0.3)  # fmt: skip
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(outs[0], direct.transpose(1, 2))
    assert not torch.equal(outs[0], outs[2])
    assert not torch.equal(outs[0], compat.scaled_dot_product_attention(q, k, v, mask))


def _qkv(q_shape=(B, H, L, E), k_shape=(B, H, S, E), v_shape=(B, H, S, E), dtype=torch.float32):
    return randn(*q_shape, seed=1, dtype=dtype), randn(*k_shape, seed=2, dtype=dtype), \
        randn(*v_shape, seed=3, dtype=dtype)  # fmt: skip


# (name, () -> (args, kwargs)): calls that torch's function refuses.
SDPA_ERRORS = [
    ("attn_mask with is_causal", lambda: (_qkv(), dict(attn_mask=bool_mask(L, S, seed=4),
                                                       is_causal=True))),
    ("heads 4 vs 2 without enable_gqa", lambda: (_qkv((B, 4, L, E), (B, 2, S, E),
                                                      (B, 2, S, E)), {})),
    ("heads 4 vs 3 with enable_gqa", lambda: (_qkv((B, 4, L, E), (B, 3, S, E), (B, 3, S, E)),
                                              dict(enable_gqa=True))),
    ("query 6, key 2, value 4 heads, enable_gqa", lambda: (_qkv((B, 6, L, E), (B, 2, S, E),
                                                           (B, 4, S, E)), dict(enable_gqa=True))),
    ("enable_gqa on 2-D query", lambda: (_qkv((L, E), (2, S, E), (2, S, E)),
                                         dict(enable_gqa=True))),
    ("dtype mismatch", lambda: ((*_qkv()[:2], _qkv()[2].double()), {})),
    ("device mismatch", lambda: ((*_qkv()[:2], _qkv()[2].to("meta")), {})),
    ("1-D inputs", lambda: (_qkv((E,), (E,), (E,)), {})),
    ("E mismatch", lambda: (_qkv(k_shape=(B, H, S, E + 1)), {})),
    ("S mismatch", lambda: (_qkv(v_shape=(B, H, S + 1, E)), {})),
    ("batch 2 vs 3", lambda: (_qkv(k_shape=(3, H, S, E), v_shape=(3, H, S, E)), {})),
    ("float64 mask, float32 query", lambda: (_qkv(), dict(attn_mask=randn(L, S, seed=4,
                                                                           dtype=torch.float64)))),
    ("int mask", lambda: (_qkv(), dict(attn_mask=torch.ones(L, S, dtype=torch.int64)))),
    ("mask not broadcastable", lambda: (_qkv(), dict(attn_mask=randn(L + 1, S, seed=4)))),
    ("mask with more dims than scores", lambda: (_qkv(), dict(attn_mask=randn(1, B, H, L, S,
                                                                              seed=4)))),
    ("is_causal not a bool", lambda: (_qkv(), dict(is_causal=1))),
    ("enable_gqa not a bool", lambda: (_qkv(), dict(enable_gqa=1))),
    ("scale positional", lambda: ((*_qkv(), None, 0.0, False, 0.5), {})),
    ("query not a tensor", lambda: (([[1.0]], *_qkv()[1:]), {})),
]  # fmt: skip


@cpu_only
@pytest.mark.parametrize("case", SDPA_ERRORS, ids=lambda c: c[0])
def test_sdpa_raises_like_torch(case):
    args, kwargs = case[1]()
    with pytest.raises(Exception) as theirs:
        torch_sdpa(*args, **kwargs)
    with pytest.raises(Exception) as ours:
        compat.scaled_dot_product_attention(*args, **kwargs)
    assert type(ours.value) is type(theirs.value), (
        f"torch raised {type(theirs.value).__name__}: {theirs.value}; "
        f"memattn raised {type(ours.value).__name__}: {ours.value}"
    )
    assert str(ours.value)


# (name, () -> (args, kwargs), exception, words its message must contain): calls torch
# takes but memattn's kernels do not; memattn's validation names the argument.
SDPA_BEYOND_MEMATTN = [
    ("float64", lambda: (_qkv(dtype=torch.float64), {}), TypeError, "dtype"),
    ("dropout_p 1.0", lambda: (_qkv(), dict(dropout_p=1.0)), ValueError, "dropout_p"),
    ("negative scale", lambda: (_qkv(), dict(scale=-0.5)), ValueError, "scale"),
    ("head dim 300", lambda: (_qkv((1, 1, 3, 300), (1, 1, 4, 300), (1, 1, 4, 8)), {}),
     ValueError, "head dim"),
]  # fmt: skip


@cpu_only
@pytest.mark.parametrize("case", SDPA_BEYOND_MEMATTN, ids=lambda c: c[0])
def test_sdpa_refuses_what_memattn_cannot_run(case):
    _, make, error, words = case
    args, kwargs = make()
    torch_sdpa(*args, **kwargs)  # torch takes it
    with pytest.raises(error, match=words):
        compat.scaled_dot_product_attention(*args, **kwargs)


# ------------------------------------------------------------------- flash-attn 2


def reference64(q, k, v, grad=None, **kwargs):
    """The float64 reference with flash-attn's alignment; with grad, also (dq, dk, dv)."""
    leaves = [t.detach().double().requires_grad_(grad is not None) for t in (q, k, v)]
    out = memattn.reference.attention(*leaves, align="bottom_right", **kwargs)
    if grad is None:
        return out
    return out, list(torch.autograd.grad(out, leaves, grad.double()))


def flash_qkv(sq, sk, heads=H, kv_heads=H, dv=E, batch=B):
    return (randn(batch, sq, heads, E, seed=21), randn(batch, sk, kv_heads, E, seed=22),
            randn(batch, sk, kv_heads, dv, seed=23))  # fmt: skip


def slopes(*shape):
    return torch.rand(*shape, generator=torch.Generator().manual_seed(24)).to(DEVICE) * 0.5


# (name, Sq, Sk, H, Hkv, flash-attn keyword arguments, the reference's keyword arguments)
FLASH_CASES = [
    ("causal Sq<Sk", L, S, H, H, dict(causal=True), dict(causal=True)),
    ("causal Sq>Sk (empty rows)", S, L, H, H, dict(causal=True), dict(causal=True)),
    ("window (3, 2)", L, S, H, H, dict(window_size=(3, 2)), dict(window=(3, 2))),
    ("window (4, 7) causal Sq>Sk", S, L, H, H, dict(window_size=(4, 7), causal=True),
     dict(window=(4, 7), causal=True)),
    ("softcap, softmax_scale", L, S, H, H, dict(softcap=2.0, softmax_scale=0.3),
     dict(softcap=2.0, scale=0.3)),
    ("alibi (H,) causal", L, S, H, H, dict(alibi_slopes=slopes(H), causal=True),
     dict(alibi_slopes=slopes(H), causal=True)),
    ("alibi (B, H) Sq>Sk", S, L, H, H, dict(alibi_slopes=slopes(B, H)),
     dict(alibi_slopes=slopes(B, H))),
    ("GQA 4/2 causal deterministic", L, S, 4, 2, dict(causal=True, deterministic=True),
     dict(causal=True)),
]  # fmt: skip


@cpu_only
@pytest.mark.parametrize("case", FLASH_CASES, ids=lambda c: c[0])
def test_flash_attn_func_matches_reference(case):
    _, sq, sk, heads, kv_heads, flash_kwargs, ref_kwargs = case
    q, k, v = flash_qkv(sq, sk, heads, kv_heads)
    out = compat.flash_attn_func(q, k, v, **flash_kwargs)
    assert out.shape == (B, sq, heads, E)
    close(out.double(), reference64(q, k, v, **ref_kwargs), "out")


@cpu_only
def test_flash_attn_window_beyond_seqlen_k_is_unbounded_like_flash_attn():
    """flash-attn reads a window side >= Sk as -1. With Sq > Sk the documented formula
    would hide keys right of i + Sk - Sq + right; the kernels (and memattn.compat) don't."""
    q, k, v = flash_qkv(S, L)
    out = compat.flash_attn_func(q, k, v, window_size=(2, L))
    close(out.double(), reference64(q, k, v, window=(2, -1)), "out")
    assert not torch.allclose(out.double(), reference64(q, k, v, window=(2, L)), atol=1e-3)


@cpu_only
def test_flash_attn_func_gradients():
    """Everything at once (GQA, causal Sq>Sk, window, alibi, softcap): dq, dk, dv against
    float64 autograd through the reference."""
    q, k, v = flash_qkv(S, L, heads=4, kv_heads=2, dv=8)
    kwargs = dict(causal=True, window_size=(5, 0), alibi_slopes=slopes(4), softcap=3.0)
    grad = randn(B, S, 4, 8, seed=25)
    out, grads = run_with_grads(compat.flash_attn_func, [q, k, v], grad, **kwargs)
    ref, ref_grads = reference64(q, k, v, grad, causal=True, window=(5, 0),
                                 alibi_slopes=slopes(4), softcap=3.0)  # fmt: skip
    for what, x, x_ref in zip(NAMES, [out, *grads], [ref, *ref_grads], strict=True):
        close(x.double(), x_ref, what, tol=2e-5)


LENS_Q, LENS_K = (5, 0, 11, 3, 4), (7, 4, 9, 0, 4)  # an empty query side, an empty key side


def cu_seqlens(lengths):
    return torch.tensor([0, *lengths], dtype=torch.int64).cumsum(0).to(torch.int32).to(DEVICE)


def varlen_qkv(heads=H, kv_heads=H):
    tq, tk = sum(LENS_Q), sum(LENS_K)
    return (randn(tq, heads, E, seed=31), randn(tk, kv_heads, E, seed=32),
            randn(tk, kv_heads, E, seed=33))  # fmt: skip


# (name, flash-attn keyword arguments, the reference's keyword arguments, max_seqlen extra)
VARLEN_CASES = [
    ("causal", dict(causal=True), dict(causal=True), 0),
    ("window (3, 1), alibi (B, H), softcap, max_seqlen padded",
     dict(window_size=(3, 1), alibi_slopes=slopes(len(LENS_Q), H), softcap=2.5),
     dict(window=(3, 1), alibi_slopes=slopes(len(LENS_Q), H), softcap=2.5), 6),
]  # fmt: skip


@cpu_only
@pytest.mark.parametrize("case", VARLEN_CASES, ids=lambda c: c[0])
def test_flash_attn_varlen_func_matches_reference(case):
    """Several sequences, one without queries and one without keys (its rows give 0);
    alignment per sequence."""
    _, flash_kwargs, ref_kwargs, extra = case
    q, k, v = varlen_qkv()
    cu_q, cu_k = cu_seqlens(LENS_Q), cu_seqlens(LENS_K)
    max_q, max_k = max(LENS_Q) + extra, max(LENS_K) + extra
    out = compat.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, **flash_kwargs)
    ref = reference64(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q,
                      max_seqlen_k=max_k, **ref_kwargs)  # fmt: skip
    assert out.shape == q.shape
    close(out.double(), ref, "out")
    empty_keys = slice(sum(LENS_Q[:3]), sum(LENS_Q[:4]))  # sequence 3 has no keys
    assert not out[empty_keys].any()


@cpu_only
def test_flash_attn_packed_variants():
    """qkvpacked (B, S, 3, H, D) with its gradient in the packed layout, kvpacked
    (B, Sk, 2, Hkv, D) with GQA, and their varlen forms, against the reference."""
    qkv = randn(B, L, 3, H, E, seed=41)
    grad = randn(B, L, H, E, seed=42)
    out, (dqkv,) = run_with_grads(compat.flash_attn_qkvpacked_func, [qkv], grad, causal=True)
    ref, ref_grads = reference64(*qkv.unbind(2), grad, causal=True)
    close(out.double(), ref, "qkvpacked out")
    assert dqkv.shape == qkv.shape
    close(dqkv.double(), torch.stack(ref_grads, dim=2), "dqkv", tol=2e-5)

    q, kv = randn(B, L, 4, E, seed=43), randn(B, S, 2, 2, E, seed=44)
    out = compat.flash_attn_kvpacked_func(q, kv, causal=True, window_size=(6, -1))
    close(out.double(), reference64(q, *kv.unbind(2), causal=True, window=(6, -1)),
          "kvpacked out")  # fmt: skip

    cu = cu_seqlens(LENS_Q)
    qkv = randn(sum(LENS_Q), 3, H, E, seed=45)
    out = compat.flash_attn_varlen_qkvpacked_func(qkv, cu, max(LENS_Q), causal=True)
    ref = reference64(*qkv.unbind(1), cu_seqlens_q=cu, cu_seqlens_k=cu, causal=True)
    close(out.double(), ref, "varlen qkvpacked out")

    q, k, v = varlen_qkv(heads=4, kv_heads=2)
    cu_q, cu_k = cu_seqlens(LENS_Q), cu_seqlens(LENS_K)
    out = compat.flash_attn_varlen_kvpacked_func(
        q, torch.stack([k, v], dim=1), cu_q, cu_k, max(LENS_Q), max(LENS_K), causal=True
    )
    ref = reference64(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal=True)
    close(out.double(), ref, "varlen kvpacked out")


def _varlen_call(fn, **kwargs):
    q, k, v = varlen_qkv()
    cu_q, cu_k = cu_seqlens(LENS_Q), cu_seqlens(LENS_K)
    return lambda: fn(q, k, v, cu_q, cu_k, max(LENS_Q), max(LENS_K), **kwargs)


# (name, the call, exception, words its message must contain)
FLASH_REFUSALS = [
    ("block_table",
     lambda: _varlen_call(compat.flash_attn_varlen_func,
                          block_table=torch.zeros(5, 1, dtype=torch.int32))(),
     NotImplementedError, "cu_seqlens_k"),
    ("qkv not (B, S, 3, H, D)",
     lambda: compat.flash_attn_qkvpacked_func(randn(B, L, 2, H, E, seed=1)),
     ValueError, "qkv"),
    ("kv not (B, Sk, 2, Hkv, D)",
     lambda: compat.flash_attn_kvpacked_func(randn(B, L, H, E, seed=1),
                                             randn(B, S, 3, H, E, seed=2)),
     ValueError, "kv"),
    ("memattn's validation: window_size (-2, 0)",
     lambda: compat.flash_attn_func(*flash_qkv(L, S), window_size=(-2, 0)),
     ValueError, "window"),
    *[(f"window_size {w!r}", lambda w=w: compat.flash_attn_func(*flash_qkv(L, S), window_size=w),
       TypeError, "window_size must be a pair")
      for w in (3, (3,), (1, 2, 3), (1.0, 2), (True, 2), "ab", None, torch.tensor([1.0, 2.0]),
                torch.tensor([1, 2, 3]), torch.tensor([[1, 2]]), torch.tensor([True, False]),
                np.array([1.5, 2.0]), np.array([[1, 2]]), (torch.tensor([1]), 2))],
]  # fmt: skip


@cpu_only
@pytest.mark.parametrize("case", FLASH_REFUSALS, ids=lambda c: c[0])
def test_flash_attn_refusals(case):
    _, call, error, words = case
    with pytest.raises(error, match=words):
        call()


# window_size in each form flash-attn accepts: all mean (3, 1)
WINDOW_FORMS = [
    (3, 1), [3, 1], torch.tensor([3, 1]), torch.tensor([3, 1], dtype=torch.int32),
    np.array([3, 1]), np.array([3, 1], dtype=np.uint8), (np.int64(3), np.int32(1)),
    (torch.tensor(3), torch.tensor(1, dtype=torch.int16)), (np.array(3), 1),
]  # fmt: skip


@cpu_only
@pytest.mark.parametrize("window_size", WINDOW_FORMS, ids=lambda w: type(w).__name__)
def test_flash_attn_window_size_forms(window_size):
    """flash-attn's own tests pass window_size as torch.randint(0, seqlen_k, (2,)): every
    integer pair form gives the tuple's result, and a side >= Sk still reads as -1."""
    q, k, v = flash_qkv(L, S)
    out = compat.flash_attn_func(q, k, v, window_size=window_size)
    close(out.double(), reference64(q, k, v, window=(3, 1)), "out")
    if isinstance(window_size, (torch.Tensor, np.ndarray)):
        wide = window_size.clone() if isinstance(window_size, torch.Tensor) else window_size.copy()
        wide[1] = S
    else:
        wide = (3, S)
    out = compat.flash_attn_func(q, k, v, window_size=wide)
    close(out.double(), reference64(q, k, v, window=(3, -1)), "out, right side >= Sk")


@cpu_only
@pytest.mark.parametrize("dropout_p", [0.0, 0.3])
def test_flash_attn_return_attn_probs_dense(dropout_p):
    """(out, softmax_lse, S_dmask): out equal to the plain call's (same seed), lse
    (B, H, Sq) and the probabilities (B, H, Sq, Sk) against the float64 reference;
    S_dmask's sign bit is the dropout mask's complement; gradients flow through out."""
    q, k, v = flash_qkv(S, L, heads=4, kv_heads=2)
    kwargs = dict(causal=True, window_size=(4, 0), softcap=2.0, alibi_slopes=slopes(4))
    ref_kwargs = dict(causal=True, window=(4, 0), softcap=2.0, alibi_slopes=slopes(4))
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    torch.manual_seed(7)
    out, lse, s_dmask = compat.flash_attn_func(*leaves, dropout_p, **kwargs,
                                               return_attn_probs=True)  # fmt: skip
    torch.manual_seed(7)
    plain = compat.flash_attn_func(q, k, v, dropout_p, **kwargs)
    assert torch.equal(out.detach(), plain)
    assert lse.shape == (B, 4, S) and lse.dtype == torch.float32
    assert s_dmask.shape == (B, 4, S, L) and s_dmask.dtype == q.dtype
    assert not s_dmask.requires_grad

    q64, k64 = q.double(), k.double()
    _, lse_ref = memattn.reference.attention(q64, k64, v.double(), align="bottom_right",
                                             return_lse=True, **ref_kwargs)  # fmt: skip
    probs = memattn.reference.probabilities(q64, k64, align="bottom_right", **ref_kwargs)
    close(lse.double(), lse_ref, "softmax_lse")
    close(s_dmask.abs().double(), probs, "|S_dmask|")
    assert torch.isneginf(lse[:, :, : S - L]).all()  # causal Sq > Sk: the first rows see nothing
    if dropout_p > 0:
        torch.manual_seed(7)
        keep = memattn.dropout_mask(memattn.dropout.new_rng_state(DEVICE), dropout_p, B, 4, S, L)
        assert torch.equal(s_dmask.signbit(), ~keep)
        assert 0 < (~keep).float().mean() < 0.6
    else:
        assert not s_dmask.signbit().any()

    grad = randn(*out.shape, seed=8)
    grads = torch.autograd.grad(out, leaves, grad)
    torch.manual_seed(7)
    plain_grads = run_with_grads(compat.flash_attn_func, [q, k, v], grad, dropout_p=dropout_p,
                                 **kwargs)[1]  # fmt: skip
    for what, g, g_plain in zip(NAMES[1:], grads, plain_grads, strict=True):
        assert torch.equal(g, g_plain), what


@cpu_only
def test_flash_attn_return_attn_probs_varlen_and_packed():
    """varlen: softmax_lse (H, Tq), S_dmask (B, H, max_seqlen_q, max_seqlen_k) by
    positions inside each sequence, 0 past its lengths; the packed variants return the
    same triple in flash-attn's positional order."""
    q, k, v = varlen_qkv()
    cu_q, cu_k = cu_seqlens(LENS_Q), cu_seqlens(LENS_K)
    max_q, max_k = max(LENS_Q) + 2, max(LENS_K) + 1
    torch.manual_seed(5)
    out, lse, s_dmask = compat.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, 0.25,
                                                      None, True, (-1, -1), 0.0, None, False,
                                                      True)  # fmt: skip
    assert lse.shape == (H, sum(LENS_Q)) and s_dmask.shape == (len(LENS_Q), H, max_q, max_k)
    varlen = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k,
                  causal=True, align="bottom_right")  # fmt: skip
    _, lse_ref = memattn.reference.attention(q.double(), k.double(), v.double(), **varlen,
                                             return_lse=True)  # fmt: skip
    close(lse.double(), lse_ref, "softmax_lse")
    probs = memattn.reference.probabilities(q.double(), k.double(), **varlen)
    close(s_dmask.abs().double(), probs, "|S_dmask|")
    for b, (n_q, n_k) in enumerate(zip(LENS_Q, LENS_K, strict=True)):
        assert not s_dmask[b, :, n_q:].any() and not s_dmask[b, :, :, n_k:].any()
        rows = probs[b, :, :n_q, :n_k].sum(-1)  # 1, or 0 for a row that sees no key
        assert torch.allclose(rows, (rows > 0).double())
    torch.manual_seed(5)
    keep = memattn.dropout_mask(memattn.dropout.new_rng_state(DEVICE), 0.25, len(LENS_Q), H,
                                max_q, max_k)  # fmt: skip
    assert torch.equal(s_dmask.signbit(), ~keep)

    qkv = randn(B, L, 3, H, E, seed=41)
    packed = compat.flash_attn_qkvpacked_func(qkv, 0.0, None, True, (-1, -1), 0.0, None, False,
                                              True)  # fmt: skip
    direct = compat.flash_attn_func(*qkv.unbind(2), causal=True, return_attn_probs=True)
    kv_packed = compat.flash_attn_kvpacked_func(qkv[:, :, 0], qkv[:, :, 1:], 0.0, None, True,
                                                (-1, -1), 0.0, None, False, True)  # fmt: skip
    for triple in (packed, kv_packed):
        assert len(triple) == 3
        for x, y in zip(triple, direct, strict=True):
            assert torch.equal(x.detach(), y.detach())
    qkv = randn(sum(LENS_Q), 3, H, E, seed=45)
    cu = cu_seqlens(LENS_Q)
    packed = compat.flash_attn_varlen_qkvpacked_func(qkv, cu, max(LENS_Q), 0.0, None, True,
                                                     (-1, -1), 0.0, None, False, True)
    kv_packed = compat.flash_attn_varlen_kvpacked_func(qkv[:, 0], qkv[:, 1:], cu, cu,
                                                       max(LENS_Q), max(LENS_Q), 0.0, None,
                                                       True, (-1, -1), 0.0, None, False, True)
    direct = compat.flash_attn_varlen_func(*qkv.unbind(1), cu, cu, max(LENS_Q), max(LENS_Q),
                                           causal=True, return_attn_probs=True)  # fmt: skip
    for triple in (packed, kv_packed):
        for x, y in zip(triple, direct, strict=True):
            assert torch.equal(x.detach(), y.detach())


@cpu_only
def test_flash_attn_positional_order():
    """Every argument positionally, in flash-attn 2.8's order, means what its name says."""
    q, k, v = flash_qkv(L, S, heads=4, kv_heads=2)
    alibi = slopes(4)
    out = compat.flash_attn_func(q, k, v, 0.0, 0.3, True, (5, 2), 2.0, alibi, True, False)
    ref = reference64(q, k, v, scale=0.3, causal=True, window=(5, 2), softcap=2.0,
                      alibi_slopes=alibi)  # fmt: skip
    close(out.double(), ref, "flash_attn_func positional")
    vq, vk, vv = varlen_qkv()
    cu_q, cu_k = cu_seqlens(LENS_Q), cu_seqlens(LENS_K)
    alibi = slopes(len(LENS_Q), H)
    out = compat.flash_attn_varlen_func(vq, vk, vv, cu_q, cu_k, max(LENS_Q), max(LENS_K), 0.0,
                                        0.4, False, (2, 3), 1.5, alibi, True, False, None)
    ref = reference64(vq, vk, vv, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, scale=0.4,
                      window=(2, 3), softcap=1.5, alibi_slopes=alibi)  # fmt: skip
    close(out.double(), ref, "flash_attn_varlen_func positional")
    names = {
        compat.flash_attn_func: ["q", "k", "v"],
        compat.flash_attn_qkvpacked_func: ["qkv"],
        compat.flash_attn_kvpacked_func: ["q", "kv"],
        compat.flash_attn_varlen_func: ["q", "k", "v", "cu_seqlens_q", "cu_seqlens_k",
                                        "max_seqlen_q", "max_seqlen_k"],
        compat.flash_attn_varlen_qkvpacked_func: ["qkv", "cu_seqlens", "max_seqlen"],
        compat.flash_attn_varlen_kvpacked_func: ["q", "kv", "cu_seqlens_q", "cu_seqlens_k",
                                                 "max_seqlen_q", "max_seqlen_k"],
    }  # fmt: skip
    options = [("dropout_p", 0.0), ("softmax_scale", None), ("causal", False),
               ("window_size", (-1, -1)), ("softcap", 0.0), ("alibi_slopes", None),
               ("deterministic", False), ("return_attn_probs", False)]  # fmt: skip
    for fn, inputs in names.items():
        params = inspect.signature(fn).parameters
        expect = [(n, inspect.Parameter.empty) for n in inputs] + options
        if fn is compat.flash_attn_varlen_func:
            expect.append(("block_table", None))
        assert [(n, p.default) for n, p in params.items()] == expect, fn.__name__


@cpu_only
def test_flash_attn_dropout_repeats_under_manual_seed():
    q, k, v = flash_qkv(L, S)
    outs = []
    for seed in (3, 3):
        torch.manual_seed(seed)
        outs.append(compat.flash_attn_func(q, k, v, dropout_p=0.2, causal=True))
    torch.manual_seed(3)
    direct = memattn.attention(q, k, v, dropout_p=0.2, causal=True, align="bottom_right")
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], direct)


# -------------------------------------------------------------- GPU, real sizes

GPU_B, GPU_H, GPU_L, GPU_E = 2, 8, 1024, 128


def assert_within(x, ref, low, what):
    """The project's tolerance: relative error at most twice plain PyTorch's in the same
    precision, plus 1e-4."""
    err, base = relative_error(x, ref), relative_error(low, ref)
    assert err <= 2 * base + 1e-4, f"{what}: error {err:.3g} > 2 * {base:.3g} + 1e-4"


@pytest.mark.gpu
@pytest.mark.parametrize("mask_kind", ["causal", "bool key padding", "float (1, H, L, S)"])
def test_sdpa_bf16_gpu(mask_kind):
    """bfloat16 on CUDA against the float64 reference; torch's own bfloat16 SDPA sets the
    tolerance for the output and every gradient (dmask included)."""
    dt, shape = torch.bfloat16, (GPU_B, GPU_H, GPU_L, GPU_E)
    tensors = [randn(*shape, seed=s, dtype=dt, device="cuda") for s in (1, 2, 3)]
    kwargs, ref_kwargs = {}, {}
    if mask_kind == "causal":
        kwargs, ref_kwargs = dict(is_causal=True), dict(causal=True)
    elif mask_kind == "bool key padding":
        lengths = torch.tensor([GPU_L, 700], device="cuda")
        keep = (torch.arange(GPU_L, device="cuda") < lengths[:, None])[:, None, None, :]
        tensors.append(keep.expand(GPU_B, GPU_H, GPU_L, GPU_L))
        bias = torch.zeros(keep.shape, dtype=torch.float64, device="cuda")
        ref_kwargs = dict(bias=bias.masked_fill(~keep, float("-inf")))
    else:
        tensors.append(randn(1, GPU_H, GPU_L, GPU_L, seed=4, dtype=dt, device="cuda"))
    grad = randn(*shape, seed=5, dtype=dt, device="cuda")
    out, grads = run_with_grads(compat.scaled_dot_product_attention, tensors, grad, **kwargs)
    low, low_grads = run_with_grads(F.scaled_dot_product_attention, tensors, grad, **kwargs)

    # The float64 reference on (B, L, H, E) views; a float mask is its bias.
    leaves = [t.detach().double().requires_grad_(True) for t in tensors if t.is_floating_point()]
    if len(leaves) == 4:
        ref_kwargs = dict(bias=leaves[3])
    q, k, v = (t.transpose(1, 2) for t in leaves[:3])
    ref = memattn.reference.attention(q, k, v, **ref_kwargs).transpose(1, 2)
    ref_grads = torch.autograd.grad(ref, leaves, grad.double())
    names = ("out", "dq", "dk", "dv", "dmask")[: 1 + len(grads)]
    for what, x, x_ref, x_low in zip(names, [out, *grads], [ref, *ref_grads],
                                     [low, *low_grads], strict=True):  # fmt: skip
        assert_within(x, x_ref, x_low, what)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "kwargs",
    [dict(causal=True), dict(causal=True, window_size=(256, 0)), dict(alibi_slopes=True),
     dict(softcap=30.0, causal=True)],
    ids=["causal", "window", "alibi", "softcap"],
)  # fmt: skip
def test_flash_attn_bf16_gpu(kwargs):
    """flash_attn_func in bfloat16 (GQA 8/2, Sq = 1024 < Sk = 1536, bottom-right) against
    the float64 reference; the reference run in bfloat16 sets the tolerance."""
    dt, sq, sk = torch.bfloat16, GPU_L, 1536
    q = randn(GPU_B, sq, GPU_H, GPU_E, seed=1, dtype=dt, device="cuda")
    k, v = (randn(GPU_B, sk, 2, GPU_E, seed=s, dtype=dt, device="cuda") for s in (2, 3))
    if kwargs.get("alibi_slopes"):
        kwargs = dict(alibi_slopes=torch.rand(GPU_H, device="cuda") * 0.1)
    ref_kwargs = {("window" if n == "window_size" else n): x for n, x in kwargs.items()}
    grad = randn(GPU_B, sq, GPU_H, GPU_E, seed=4, dtype=dt, device="cuda")
    out, grads = run_with_grads(compat.flash_attn_func, [q, k, v], grad, **kwargs)
    ref, ref_grads = reference64(q, k, v, grad, **ref_kwargs)
    low, low_grads = run_with_grads(
        lambda *t, **kw: memattn.reference.attention(*t, align="bottom_right", **kw),
        [q, k, v], grad, **ref_kwargs)  # fmt: skip
    for what, x, x_ref, x_low in zip(NAMES, [out, *grads], [ref, *ref_grads],
                                     [low, *low_grads], strict=True):  # fmt: skip
        assert_within(x, x_ref, x_low, what)


@pytest.mark.gpu
def test_flash_attn_varlen_bf16_gpu():
    dt = torch.bfloat16
    lens_q, lens_k = (1000, 0, 317, 1024), (1200, 64, 300, 1024)
    cu_q = torch.tensor([0, *lens_q], device="cuda").cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0, *lens_k], device="cuda").cumsum(0).to(torch.int32)
    q = randn(sum(lens_q), GPU_H, GPU_E, seed=1, dtype=dt, device="cuda")
    k, v = (randn(sum(lens_k), 2, GPU_E, seed=s, dtype=dt, device="cuda") for s in (2, 3))
    varlen = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal=True)
    out = compat.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k),
                                        causal=True)  # fmt: skip
    ref = reference64(q, k, v, **varlen)
    low = memattn.reference.attention(q, k, v, align="bottom_right", **varlen)
    assert_within(out, ref, low, "out")


@pytest.mark.gpu
@pytest.mark.parametrize("dropout_p", [0.0, 0.17])
def test_flash_attn_return_attn_probs_bf16_gpu(dropout_p):
    """return_attn_probs in bfloat16 (GQA 8/2, causal, Sq < Sk): out bit-identical to the
    plain call's under the same seed; softmax_lse and |S_dmask| against the float64
    reference (tolerance from the reference run in bfloat16 and from rounding the exact
    probabilities to bfloat16); S_dmask's sign bits are the dropout mask's complement."""
    dt, sq, sk = torch.bfloat16, GPU_L, 1536
    q = randn(GPU_B, sq, GPU_H, GPU_E, seed=1, dtype=dt, device="cuda")
    k, v = (randn(GPU_B, sk, 2, GPU_E, seed=s, dtype=dt, device="cuda") for s in (2, 3))
    torch.manual_seed(3)
    out, lse, s_dmask = compat.flash_attn_func(q, k, v, dropout_p, causal=True,
                                               return_attn_probs=True)  # fmt: skip
    torch.manual_seed(3)
    assert torch.equal(out, compat.flash_attn_func(q, k, v, dropout_p, causal=True))
    assert lse.shape == (GPU_B, GPU_H, sq) and s_dmask.shape == (GPU_B, GPU_H, sq, sk)

    kw = dict(causal=True, align="bottom_right")
    _, lse_ref = memattn.reference.attention(q.double(), k.double(), v.double(), **kw,
                                             return_lse=True)  # fmt: skip
    _, lse_low = memattn.reference.attention(q, k, v, **kw, return_lse=True)
    assert_within(lse, lse_ref, lse_low, "softmax_lse")
    probs = memattn.reference.probabilities(q.double(), k.double(), **kw)
    assert_within(s_dmask.abs(), probs, probs.to(dt), "|S_dmask|")
    if dropout_p > 0:
        torch.manual_seed(3)
        rng_state = memattn.dropout.new_rng_state("cuda")
        keep = memattn.dropout_mask(rng_state, dropout_p, GPU_B, GPU_H, sq, sk)
        assert torch.equal(s_dmask.signbit(), ~keep)
    else:
        assert not s_dmask.signbit().any()
