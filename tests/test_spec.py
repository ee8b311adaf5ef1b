"""Bad input: every invalid call is refused by ``spec.check_call`` before any kernel runs.

Each invalid call must raise ``ValueError`` or ``TypeError`` whose message names the
offending argument, through every entry point (``memattn.attention``,
``memattn.ops.forward``, ``memattn.reference.attention`` and ``check_call`` itself),
and must leave every input untouched (same values, same version counter). The kernel
launch, ``memattn.kernels.dispatch.forward``, is replaced by a stub that records calls, so "raised
before any kernel runs" is checked directly, not inferred. Valid calls are checked for
the normalised fields of the returned :class:`AttentionSpec`, by hand and by fuzzing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import memattn
import memattn.kernels.dispatch
from memattn import ops
from memattn.spec import (
    KERNEL_DTYPES,
    MAX_HEAD_DIM,
    REFERENCE_DTYPES,
    AttentionSpec,
    check_call,
)

# Dense defaults: B=2, Sq=5, Sk=7, H=4, Hkv=2, Dqk=6, Dv=3 (odd, all different).
B, SQ, SK, H, HKV, DQK, DV = 2, 5, 7, 4, 2, 6, 3
# Varlen defaults: three sequences, one of them empty on the query side.
LENS_Q, LENS_K = (3, 0, 4), (2, 5, 1)
TQ, TK = sum(LENS_Q), sum(LENS_K)
MAXQ, MAXK = max(LENS_Q), max(LENS_K)


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _rand(*shape, dtype=torch.float32, gen=None):
    gen = gen if gen is not None else _gen()
    if dtype.is_floating_point:
        return torch.randn(shape, generator=gen).to(dtype)
    if dtype == torch.bool:
        return torch.rand(shape, generator=gen) < 0.5
    return torch.randint(-3, 4, shape, generator=gen).to(dtype)


def _cu(lengths, dtype=torch.int32):
    return torch.tensor([0, *np.cumsum(lengths).tolist()], dtype=dtype)


def dense(b=B, sq=SQ, sk=SK, h=H, hkv=HKV, dqk=DQK, dv=DV, dtype=torch.float32,
          kb=None, vb=None, sv=None, dk=None, hv=None, seed=0):  # fmt: skip
    """q, k, v in dense layout; the k*/v* overrides make one tensor disagree."""
    g = _gen(seed)
    q = _rand(b, sq, h, dqk, dtype=dtype, gen=g)
    k = _rand(b if kb is None else kb, sk, hkv, dqk if dk is None else dk, dtype=dtype, gen=g)
    v = _rand(b if vb is None else vb, sk if sv is None else sv, hkv if hv is None else hv, dv,
              dtype=dtype, gen=g)  # fmt: skip
    return q, k, v


def varlen(h=H, hkv=HKV, dqk=DQK, dv=DV, dtype=torch.float32, seed=0):
    """q, k, v and varlen kwargs (cu_seqlens only) for LENS_Q / LENS_K."""
    g = _gen(seed)
    q = _rand(TQ, h, dqk, dtype=dtype, gen=g)
    k = _rand(TK, hkv, dqk, dtype=dtype, gen=g)
    v = _rand(TK, hkv, dv, dtype=dtype, gen=g)
    return (q, k, v), dict(cu_seqlens_q=_cu(LENS_Q), cu_seqlens_k=_cu(LENS_K))


# ----------------------------------------------------------------------------------------
# The table of invalid calls.


@dataclass
class Bad:
    id: str
    make: object  # () -> (args, kwargs)
    match: str  # regex on the message: names the argument
    kernel_only: bool = False  # the reference (float64 admitted) accepts it


def _d(**kwargs):
    """A dense call with these kwargs."""
    return lambda: (dense(), dict(kwargs))


def _dt(**sizes):
    """A dense call with these tensor overrides."""
    return lambda: (dense(**sizes), {})


def _v(**kwargs):
    """A varlen call, kwargs override the cu_seqlens/max_seqlen ones."""

    def make():
        args, kw = varlen()
        kw.update(kwargs)
        return args, kw

    return make


def _with(i, fn):
    """Dense q, k, v with tensor i replaced by fn(tensor)."""

    def make():
        args = list(dense())
        args[i] = fn(args[i])
        return tuple(args), {}

    return make


def _with_varlen(i, fn):
    def make():
        args, kw = varlen()
        args = list(args)
        args[i] = fn(args[i])
        return tuple(args), kw

    return make


def _bias(shape, dtype=torch.float32, device="cpu"):
    return _d(bias=_rand(*shape, dtype=dtype).to(device))


def _alibi(shape, dtype=torch.float32, device="cpu"):
    return _d(alibi_slopes=(torch.rand(shape, generator=_gen()) + 0.1).to(dtype).to(device))


BAD = [
    # shapes
    Bad("batch k", _dt(kb=3), r"^q, k and v must have the same batch size"),
    Bad("batch v", _dt(vb=1), r"^q, k and v must have the same batch size"),
    Bad("k/v keys", _dt(sv=SK + 1), r"^k and v must have the same number of keys"),
    Bad(
        "k/v keys varlen",
        _with_varlen(2, lambda v: v[:-1]),
        r"^k and v must have the same number of keys",
    ),  # fmt: skip
    Bad("k/v heads", _dt(hv=1), r"^k and v must have the same heads"),
    Bad("H % Hkv", _dt(h=5, hkv=2), r"^q's heads \(5\) must be a positive multiple of k/v's"),
    Bad("Hkv > H", _dt(h=2, hkv=4), r"^q's heads \(2\) must be a positive multiple of k/v's"),
    Bad("Hkv = 0", _dt(h=4, hkv=0), r"q's heads .* k/v's heads \(0\)"),
    Bad("Dq != Dk", _dt(dk=DQK + 1), r"^q and k must have the same head dim"),
    Bad("Dqk 0", _dt(dqk=0), r"^q/k head dim must be in \[1, 256\], got 0"),
    Bad("Dqk 257", _dt(dqk=257), r"^q/k head dim must be in \[1, 256\], got 257"),
    Bad("Dv 0", _dt(dv=0), r"^v head dim must be in \[1, 256\], got 0"),
    Bad("Dv 257", _dt(dv=257), r"^v head dim must be in \[1, 256\], got 257"),
    Bad("Dqk 257 varlen", lambda: varlen(dqk=257), r"^q/k head dim"),
    Bad("Dv 0 varlen", lambda: varlen(dv=0), r"^v head dim"),
    # dtypes and devices
    Bad("k float16", _with(1, lambda t: t.half()), r"^q, k and v must share a dtype"),
    Bad("v bfloat16", _with(2, lambda t: t.bfloat16()), r"^q, k and v must share a dtype"),
    Bad("k meta", _with(1, lambda t: t.to("meta")), r"^q, k and v must be on one device"),
    Bad("v meta", _with(2, lambda t: t.to("meta")), r"^q, k and v must be on one device"),
    Bad("q int32", _with(0, lambda t: t.int()), r"^q must have dtype in"),
    Bad("k int64", _with(1, lambda t: t.long()), r"^k must have dtype in"),
    Bad("v int16", _with(2, lambda t: t.short()), r"^v must have dtype in"),
    Bad("q bool", _with(0, lambda t: t > 0), r"^q must have dtype in"),
    Bad("q complex64", _with(0, lambda t: t.to(torch.complex64)), r"^q must have dtype in"),
    Bad(
        "float64",
        lambda: (dense(dtype=torch.float64), {}),
        r"^q must have dtype in",
        kernel_only=True,
    ),  # fmt: skip
    Bad("q list", _with(0, lambda t: t.tolist()), r"^q must be a torch\.Tensor, got list"),
    Bad("q ndarray", _with(0, lambda t: t.numpy()), r"^q must be a torch\.Tensor, got ndarray"),
    Bad("q None", _with(0, lambda t: None), r"^q must be a torch\.Tensor, got NoneType"),
    Bad("v float", _with(2, lambda t: 1.0), r"^v must be a torch\.Tensor, got float"),
    # layout
    Bad("q 3-D dense", _with(0, lambda t: t[0]), r"^q must be 4-D \(B, S, H, D\) in dense mode"),
    Bad("k 3-D dense", _with(1, lambda t: t[0]), r"^k must be 4-D"),
    Bad("v 5-D dense", _with(2, lambda t: t[None]), r"^v must be 4-D"),
    Bad(
        "q 4-D varlen",
        _with_varlen(0, lambda t: t[None]),
        r"^q must be 3-D \(T, H, D\) in varlen mode",
    ),  # fmt: skip
    Bad("k 4-D varlen", _with_varlen(1, lambda t: t[None]), r"^k must be 3-D"),
    Bad("v 2-D varlen", _with_varlen(2, lambda t: t[:, 0]), r"^v must be 3-D"),
    # bias (target (B, H, Sq, Sk) = (2, 4, 5, 7))
    Bad("bias Sk-1", _bias((B, H, SQ, SK - 1)), r"^bias must be broadcastable to"),
    Bad("bias B+1", _bias((B + 1, H, SQ, SK)), r"^bias must be broadcastable to"),
    Bad("bias Hkv", _bias((B, HKV, SQ, SK)), r"^bias must be broadcastable to"),
    Bad("bias transposed", _bias((SK, SQ)), r"^bias must be broadcastable to"),
    Bad("bias Sq only", _bias((SQ,)), r"^bias must be broadcastable to"),
    Bad("bias 1H1(K+1)", _bias((1, H, 1, SK + 1)), r"^bias must be broadcastable to"),
    Bad("bias 5-D", _bias((1, B, H, SQ, SK)), r"^bias must be broadcastable to"),
    Bad("bias 5-D ones", _bias((1, 1, 1, 1, 1)), r"^bias must be broadcastable to"),
    Bad("bias int32", _bias((B, H, SQ, SK), torch.int32), r"^bias must have a floating dtype"),
    Bad("bias bool", _bias((SQ, SK), torch.bool), r"^bias must have a floating dtype"),
    Bad("bias list", _d(bias=[[0.0] * SK] * SQ), r"^bias must be a torch\.Tensor"),
    Bad("bias meta", _bias((SQ, SK), device="meta"), r"^bias must be on cpu"),
    Bad(
        "bias varlen packed",
        _v(bias=torch.zeros(1, H, TQ, TK)),
        r"^bias must be broadcastable to \(B, H, max_seqlen_q, max_seqlen_k\)",
    ),  # fmt: skip
    # cu_seqlens
    Bad(
        "cu_q int64",
        _v(cu_seqlens_q=_cu(LENS_Q, torch.int64)),
        r"^cu_seqlens_q must have dtype torch\.int32",
    ),  # fmt: skip
    Bad(
        "cu_k int64",
        _v(cu_seqlens_k=_cu(LENS_K, torch.int64)),
        r"^cu_seqlens_k must have dtype torch\.int32",
    ),  # fmt: skip
    Bad("cu_q float", _v(cu_seqlens_q=_cu(LENS_Q, torch.float32)), r"^cu_seqlens_q must have"),
    Bad("cu_q list", _v(cu_seqlens_q=[0, 3, 3, 7]), r"^cu_seqlens_q must be a torch\.Tensor"),
    Bad(
        "cu B+1 mismatch",
        _v(cu_seqlens_k=_cu((7, 1))),
        r"^cu_seqlens_q and cu_seqlens_k must have the same length",
    ),  # fmt: skip
    Bad(
        "cu_q start",
        _v(cu_seqlens_q=torch.tensor([1, 3, 3, 7], dtype=torch.int32)),
        r"^cu_seqlens_q must start at 0",
    ),  # fmt: skip
    Bad(
        "cu_k start",
        _v(cu_seqlens_k=torch.tensor([-1, 2, 7, 8], dtype=torch.int32)),
        r"^cu_seqlens_k must start at 0",
    ),  # fmt: skip
    Bad(
        "cu_q decreasing",
        _v(cu_seqlens_q=torch.tensor([0, 5, 3, 7], dtype=torch.int32)),
        r"^cu_seqlens_q must be non-decreasing",
    ),  # fmt: skip
    Bad(
        "cu_k decreasing",
        _v(cu_seqlens_k=torch.tensor([0, 5, 2, 8], dtype=torch.int32)),
        r"^cu_seqlens_k must be non-decreasing",
    ),  # fmt: skip
    Bad(
        "cu_q last < T",
        _v(cu_seqlens_q=_cu((3, 0, 3))),
        r"^cu_seqlens_q\[-1\] must equal q\.shape\[0\] = 7",
    ),  # fmt: skip
    Bad(
        "cu_k last > T",
        _v(cu_seqlens_k=_cu((2, 5, 2))),
        r"^cu_seqlens_k\[-1\] must equal k\.shape\[0\] = 8",
    ),  # fmt: skip
    Bad("cu_q 2-D", _v(cu_seqlens_q=_cu((3, 4)).view(1, 3)), r"^cu_seqlens_q must be 1-D"),
    Bad("cu_k 2-D", _v(cu_seqlens_k=_cu((2, 5, 1)).view(2, 2)), r"^cu_seqlens_k must be 1-D"),
    Bad(
        "cu_q length 1",
        _v(cu_seqlens_q=torch.zeros(1, dtype=torch.int32)),
        r"^cu_seqlens_q must be 1-D of length B\+1 >= 2",
    ),  # fmt: skip
    Bad("cu_k meta", _v(cu_seqlens_k=_cu(LENS_K).to("meta")), r"^cu_seqlens_k must be on cpu"),
    Bad(
        "only cu_q", _v(cu_seqlens_k=None), r"^cu_seqlens_q and cu_seqlens_k must be given together"
    ),  # fmt: skip
    Bad(
        "only cu_k",
        lambda: (dense(), dict(cu_seqlens_k=_cu((SK,) * B))),
        r"^cu_seqlens_q and cu_seqlens_k must be given together",
    ),  # fmt: skip
    # max_seqlen
    Bad("max_seqlen_q dense", _d(max_seqlen_q=SQ), r"^max_seqlen_q/max_seqlen_k are only"),
    Bad("max_seqlen_k dense", _d(max_seqlen_k=SK), r"^max_seqlen_q/max_seqlen_k are only"),
    Bad(
        "max_seqlen_q small",
        _v(max_seqlen_q=MAXQ - 1),
        r"^max_seqlen_q must be >= the longest sequence in cu_seqlens_q \(4\)",
    ),  # fmt: skip
    Bad(
        "max_seqlen_k small",
        _v(max_seqlen_k=MAXK - 1),
        r"^max_seqlen_k must be >= the longest sequence in cu_seqlens_k \(5\)",
    ),  # fmt: skip
    Bad("max_seqlen_k negative", _v(max_seqlen_k=-1), r"^max_seqlen_k must be >="),
    Bad("max_seqlen_q float", _v(max_seqlen_q=4.0), r"^max_seqlen_q must be an int"),
    Bad("max_seqlen_k bool", _v(max_seqlen_k=True), r"^max_seqlen_k must be an int"),
    # dropout_p
    Bad("dropout 1.0", _d(dropout_p=1.0), r"^dropout_p must be in \[0, 1\)"),
    Bad("dropout 1", _d(dropout_p=1), r"^dropout_p must be in \[0, 1\)"),
    Bad("dropout 1.5", _d(dropout_p=1.5), r"^dropout_p must be in \[0, 1\)"),
    Bad("dropout -0.1", _d(dropout_p=-0.1), r"^dropout_p must be a finite number >= 0"),
    Bad("dropout nan", _d(dropout_p=float("nan")), r"^dropout_p must be a finite number"),
    Bad("dropout inf", _d(dropout_p=float("inf")), r"^dropout_p must be a finite number"),
    Bad("dropout str", _d(dropout_p="0.1"), r"^dropout_p must be a real number, got str"),
    Bad("dropout None", _d(dropout_p=None), r"^dropout_p must be a real number"),
    Bad("dropout bool", _d(dropout_p=True), r"^dropout_p must be a real number, got bool"),
    Bad("dropout tensor", _d(dropout_p=torch.tensor(0.1)), r"^dropout_p must be a real number"),
    # scale
    Bad("scale negative", _d(scale=-0.5), r"^scale must be a finite number >= 0"),
    Bad("scale -tiny", _d(scale=-1e-300), r"^scale must be a finite number >= 0"),
    Bad("scale inf", _d(scale=float("inf")), r"^scale must be a finite number"),
    Bad("scale -inf", _d(scale=float("-inf")), r"^scale must be a finite number"),
    Bad("scale nan", _d(scale=float("nan")), r"^scale must be a finite number"),
    Bad("scale str", _d(scale="1"), r"^scale must be a real number, got str"),
    Bad("scale bool", _d(scale=True), r"^scale must be a real number, got bool"),
    Bad("scale complex", _d(scale=1 + 0j), r"^scale must be a real number, got complex"),
    # softcap
    Bad("softcap negative", _d(softcap=-1.0), r"^softcap must be a finite number >= 0"),
    Bad("softcap inf", _d(softcap=float("inf")), r"^softcap must be a finite number"),
    Bad("softcap nan", _d(softcap=float("nan")), r"^softcap must be a finite number"),
    Bad("softcap None", _d(softcap=None), r"^softcap must be a real number"),
    # window
    Bad("window (-2, 0)", _d(window=(-2, 0)), r"^window\[0\] must be >= -1"),
    Bad("window (0, -2)", _d(window=(0, -2)), r"^window\[1\] must be >= -1"),
    Bad("window (-5, -7)", _d(window=(-5, -7)), r"^window\[0\] must be >= -1"),
    Bad("window [3, -100]", _d(window=[3, -100]), r"^window\[1\] must be >= -1"),
    Bad("window length 3", _d(window=(1, 2, 3)), r"^window must be None or a pair"),
    Bad("window length 1", _d(window=(1,)), r"^window must be None or a pair"),
    Bad("window length 0", _d(window=()), r"^window must be None or a pair"),
    Bad("window int", _d(window=3), r"^window must be None or a pair"),
    Bad("window str", _d(window="ab"), r"^window must be None or a pair"),
    Bad("window bytes", _d(window=b"\x01\x02"), r"^window must be None or a pair"),
    Bad("window generator", _d(window=(i for i in (1, 2))), r"^window must be None or a pair"),
    Bad("window bool left", _d(window=(True, 0)), r"^window\[0\] must be an int, got bool"),
    Bad("window bool right", _d(window=(0, False)), r"^window\[1\] must be an int, got bool"),
    Bad("window float left", _d(window=(1.0, 2)), r"^window\[0\] must be an int, got float"),
    Bad("window float right", _d(window=(1, 2.5)), r"^window\[1\] must be an int, got float"),
    Bad("window None entry", _d(window=(None, 1)), r"^window\[0\] must be an int"),
    Bad("window tensor", _d(window=torch.tensor([1, 2])), r"^window must be None or a pair"),
    # align
    Bad("align dash", _d(align="bottom-right"), r"^align must be one of"),
    Bad("align upper", _d(align="TOP_LEFT"), r"^align must be one of"),
    Bad("align empty", _d(align=""), r"^align must be one of"),
    Bad("align None", _d(align=None), r"^align must be one of"),
    # alibi_slopes
    Bad("alibi (H+1,)", _alibi((H + 1,)), r"^alibi_slopes must have shape \(H,\)"),
    Bad("alibi (Hkv,)", _alibi((HKV,)), r"^alibi_slopes must have shape"),
    Bad("alibi (B, H, 1)", _alibi((B, H, 1)), r"^alibi_slopes must have shape"),
    Bad("alibi (B+1, H)", _alibi((B + 1, H)), r"^alibi_slopes must have shape"),
    Bad("alibi (H, B)", _alibi((H, B)), r"^alibi_slopes must have shape"),
    Bad("alibi ()", _alibi(()), r"^alibi_slopes must have shape"),
    Bad(
        "alibi float16",
        _alibi((H,), torch.float16),
        r"^alibi_slopes must have dtype torch\.float32, got torch\.float16",
    ),  # fmt: skip
    Bad("alibi float64", _alibi((B, H), torch.float64), r"^alibi_slopes must have dtype"),
    Bad("alibi int32", _alibi((H,), torch.int32), r"^alibi_slopes must have dtype"),
    Bad("alibi list", _d(alibi_slopes=[0.5] * H), r"^alibi_slopes must be a torch\.Tensor"),
    Bad("alibi meta", _alibi((H,), device="meta"), r"^alibi_slopes must be on cpu"),
    # causal / deterministic
    Bad("causal 1", _d(causal=1), r"^causal must be a bool, got int"),
    Bad("causal 0", _d(causal=0), r"^causal must be a bool, got int"),
    Bad("causal str", _d(causal="True"), r"^causal must be a bool, got str"),
    Bad("causal None", _d(causal=None), r"^causal must be a bool"),
    Bad("causal tensor", _d(causal=torch.tensor(True)), r"^causal must be a bool, got Tensor"),
    Bad("causal np.bool_", _d(causal=np.bool_(True)), r"^causal must be a bool"),
    Bad("deterministic 1", _d(deterministic=1), r"^deterministic must be a bool"),
]
assert len({b.id for b in BAD}) == len(BAD)


# ----------------------------------------------------------------------------------------
# Helpers: the kernel stub and the "inputs untouched" snapshot.


class KernelReached(Exception):
    """Raised by the stub that replaces the kernel launch."""


@pytest.fixture
def kernel_calls(monkeypatch):
    """Replaces the forward launcher (the one path to the forward kernel, behind the
    custom op); records its calls."""
    calls = []

    def stub(spec, *args):
        calls.append(spec)
        raise KernelReached

    monkeypatch.setattr(memattn.kernels.dispatch, "forward", stub)
    return calls


def _tensors(args, kwargs):
    for i, a in enumerate(args):
        yield f"args[{i}]", a
    for name, a in kwargs.items():
        yield name, a


def snapshot(args, kwargs):
    """Copies of every tensor input and its metadata (meta tensors: metadata only)."""
    snap = {}
    for name, t in _tensors(args, kwargs):
        if isinstance(t, torch.Tensor):
            copy = None if t.device.type == "meta" else t.clone()
            snap[name] = (t, copy, t.shape, t.stride(), t.dtype, t.device, t._version)
    return snap


def assert_unchanged(snap):
    for name, (t, copy, shape, stride, dtype, device, version) in snap.items():
        assert (t.shape, t.stride(), t.dtype, t.device) == (shape, stride, dtype, device), name
        assert t._version == version, f"{name} was modified in place"
        if copy is not None:
            assert torch.equal(t, copy), f"{name} changed"


def _check_kwargs(kwargs):
    return {k: v for k, v in kwargs.items() if k not in ("return_lse", "dropout_keep")}


ENTRY_POINTS = {
    "attention": lambda a, kw: memattn.attention(*a, **kw),
    "attention lse": lambda a, kw: memattn.attention(*a, return_lse=True, **kw),
    "ops.forward": lambda a, kw: ops.forward(*a, **kw),
    "check_call": lambda a, kw: check_call(*a, **_check_kwargs(kw)),
    "check_call ref dtypes": lambda a, kw: check_call(
        *a, dtypes=REFERENCE_DTYPES, **_check_kwargs(kw)
    ),
    "reference": lambda a, kw: memattn.reference.attention(*a, **kw),
}
REFERENCE_ENTRY_POINTS = ("check_call ref dtypes", "reference")


# ----------------------------------------------------------------------------------------
# Invalid calls.


@pytest.mark.parametrize(
    "case, entry",
    [pytest.param(c, e, id=f"{c.id}-{e}") for c in BAD for e in ENTRY_POINTS
     if not (c.kernel_only and e in REFERENCE_ENTRY_POINTS)],  # float64: see below
)  # fmt: skip
def test_invalid_call_rejected_before_kernel(case, entry, kernel_calls):
    args, kwargs = case.make()
    snap = snapshot(args, kwargs)
    with pytest.raises((ValueError, TypeError), match=case.match):
        ENTRY_POINTS[entry](args, kwargs)
    assert kernel_calls == [], "the kernel launch was reached"
    assert_unchanged(snap)


# Regressions: bugs this suite found in spec.py, now fixed.


@pytest.mark.parametrize("name", ["scale", "softcap", "dropout_p"])
def test_huge_int_option_rejected(name, kernel_calls):
    args = dense()
    snap = snapshot(args, {})
    for call in (check_call, memattn.attention):
        with pytest.raises((ValueError, TypeError), match=rf"^{name} must be"):
            call(*args, **{name: 10**400})
    assert kernel_calls == []
    assert_unchanged(snap)


@pytest.mark.parametrize("window", [{5, 2}, {0: 4, 1: 2}], ids=["set", "dict"])
def test_unordered_window_rejected(window, kernel_calls):
    args = dense()
    for call in (check_call, memattn.attention):
        with pytest.raises(TypeError, match=r"^window must be None or a pair"):
            call(*args, window=window)
    assert kernel_calls == []


def test_float64_reference_only(kernel_calls):
    """float64 q/k/v: refused by the kernel path, admitted by the reference."""
    q, k, v = dense(dtype=torch.float64)
    snap = snapshot((q, k, v), {})
    for call in (memattn.attention, ops.forward, check_call):
        with pytest.raises(TypeError, match=r"^q must have dtype in \(.*float32\), got .*64"):
            call(q, k, v)
    assert kernel_calls == []
    spec = check_call(q, k, v, dtypes=REFERENCE_DTYPES)
    assert spec.dtype == torch.float64
    out, lse = memattn.reference.attention(q, k, v, return_lse=True)
    assert out.dtype == lse.dtype == torch.float64
    assert out.shape == (B, SQ, H, DV) and lse.shape == (B, H, SQ)
    assert_unchanged(snap)


def test_dtypes_argument_restricts():
    q, k, v = dense(dtype=torch.float16)
    with pytest.raises(TypeError, match=r"^q must have dtype in \(torch\.float32\)"):
        check_call(q, k, v, dtypes=(torch.float32,))
    assert check_call(q, k, v, dtypes=(torch.float16,)).dtype == torch.float16


def test_reference_dropout_keep_checked():
    q, k, v = dense(dtype=torch.float64)
    keep = torch.ones(B, H, SQ, SK, dtype=torch.bool)
    for bad in (None, keep.float(), keep[..., :-1], keep[None]):
        with pytest.raises(ValueError, match=r"^dropout_keep"):
            memattn.reference.attention(q, k, v, dropout_p=0.5, dropout_keep=bad)


def test_several_errors_at_once(kernel_calls):
    """Several problems in one call: one of them is reported (which one is not pinned)."""
    q, k, v = dense()
    either = r"^(k must be a torch\.Tensor|v must have dtype|causal must be a bool|window\[0\])"
    for call in (check_call, memattn.attention):
        with pytest.raises((TypeError, ValueError), match=either):
            call(q, None, v.int(), causal="x", window=(-9, 0))
        with pytest.raises((TypeError, ValueError), match=either):
            call(q, k, v, causal="x", window=(-9, 0))
    assert kernel_calls == []


# ----------------------------------------------------------------------------------------
# Valid calls: reach the kernel launch with the spec check_call returns; inputs untouched.


def _full_dense_call(dtype=torch.float32):
    g = _gen(3)
    q, k, v = dense(dtype=dtype, seed=3)
    kw = dict(
        causal=True, window=(2, 5), align="bottom_right", bias=_rand(1, H, 1, SK, gen=g),
        alibi_slopes=torch.rand(B, H, generator=g), softcap=3.5, scale=0.25, dropout_p=0.2,
        deterministic=True,
    )  # fmt: skip
    return (q, k, v), kw


def test_valid_call_reaches_kernel_with_checked_spec(kernel_calls):
    args, kw = _full_dense_call()
    snap = snapshot(args, kw)
    with pytest.raises(KernelReached):
        memattn.attention(*args, return_lse=True, **kw)
    assert kernel_calls == [check_call(*args, **kw)]
    assert_unchanged(snap)


def test_valid_varlen_call_reaches_kernel(kernel_calls):
    args, kw = varlen()
    snap = snapshot(args, kw)
    with pytest.raises(KernelReached):
        memattn.attention(*args, causal=True, max_seqlen_k=MAXK + 2, **kw)
    (spec,) = kernel_calls
    assert (spec.varlen, spec.seqlen_q, spec.seqlen_k) == (True, MAXQ, MAXK + 2)
    assert_unchanged(snap)


def test_reference_does_not_modify_inputs():
    """A successful reference call, every option on, float64, dense and varlen."""
    g = _gen(11)
    q, k, v = dense(dtype=torch.float64, seed=11)
    kw = dict(
        causal=True, window=(3, -1), align="bottom_right",
        bias=_rand(B, 1, SQ, SK, dtype=torch.float64, gen=g),
        alibi_slopes=torch.rand(H, generator=g), softcap=2.0, scale=0.3, dropout_p=0.25,
        dropout_keep=torch.rand(B, H, SQ, SK, generator=g) > 0.25,
    )  # fmt: skip
    snap = snapshot((q, k, v), kw)
    out, lse = memattn.reference.attention(q, k, v, return_lse=True, **kw)
    assert torch.isfinite(out).all()
    assert_unchanged(snap)

    (q, k, v), vkw = varlen(dtype=torch.float64, seed=12)
    vkw.update(
        bias=_rand(len(LENS_Q), H, MAXQ, MAXK, dtype=torch.float64, gen=g),
        alibi_slopes=torch.rand(len(LENS_Q), H, generator=g), align="bottom_right",
        dropout_p=0.5, dropout_keep=torch.rand(len(LENS_Q), H, MAXQ, MAXK, generator=g) > 0.5,
    )  # fmt: skip
    snap = snapshot((q, k, v), vkw)
    out, lse = memattn.reference.attention(q, k, v, return_lse=True, **vkw)
    assert out.shape == (TQ, H, DV) and lse.shape == (H, TQ)
    assert_unchanged(snap)


def test_check_call_does_not_modify_inputs():
    args, kw = _full_dense_call()
    snap = snapshot(args, kw)
    check_call(*args, **kw)
    assert_unchanged(snap)
    args, kw = varlen()
    snap = snapshot(args, kw)
    check_call(*args, max_seqlen_q=9, **kw)
    assert_unchanged(snap)


# ----------------------------------------------------------------------------------------
# Normalised fields.


def test_spec_defaults_dense():
    q, k, v = dense()
    spec = check_call(q, k, v)
    assert isinstance(spec, AttentionSpec)
    assert (spec.batch, spec.heads, spec.kv_heads) == (B, H, HKV)
    assert (spec.seqlen_q, spec.seqlen_k, spec.head_dim_qk, spec.head_dim_v) == (SQ, SK, DQK, DV)
    assert spec.group == H // HKV == 2
    assert spec.bias_shape == (B, H, SQ, SK)
    assert not spec.varlen and not spec.bottom_right
    assert (spec.window_left, spec.window_right) == (-1, -1)
    assert spec.scale == pytest.approx(1 / math.sqrt(DQK), rel=1e-15)  # Dqk, not Dv
    assert isinstance(spec.scale, float)
    assert (spec.softcap, spec.dropout_p) == (0.0, 0.0)
    assert not (spec.has_bias or spec.has_alibi or spec.deterministic)
    assert spec.dtype == torch.float32 and spec.device == torch.device("cpu")


@pytest.mark.parametrize(
    "causal, window, expected",
    [
        (False, None, (-1, -1)),
        (True, None, (-1, 0)),
        (False, (3, 5), (3, 5)),
        (True, (3, 5), (3, 0)),
        (True, (3, -1), (3, 0)),
        (True, (-1, -1), (-1, 0)),
        (False, [0, 0], (0, 0)),
        (False, (-1, 2), (-1, 2)),
        (True, (0, 0), (0, 0)),
        (False, (np.int64(4), np.int32(-1)), (4, -1)),
    ],
)
def test_causal_folds_into_window(causal, window, expected):
    spec = check_call(*dense(), causal=causal, window=window)
    assert (spec.window_left, spec.window_right) == expected
    assert all(type(w) is int for w in (spec.window_left, spec.window_right))


def test_spec_options():
    args, kw = _full_dense_call()
    spec = check_call(*args, **kw)
    assert spec.bottom_right and spec.window_right == 0 and spec.deterministic
    assert (spec.window_left, spec.window_right) == (2, 0)
    assert (spec.scale, spec.softcap, spec.dropout_p) == (0.25, 3.5, 0.2)
    assert spec.has_bias and spec.has_alibi
    assert not check_call(*args, align="top_left").bottom_right
    ints = check_call(*args, scale=2, softcap=1, dropout_p=0)
    assert (ints.scale, ints.softcap, ints.dropout_p) == (2.0, 1.0, 0.0)
    assert all(type(x) is float for x in (ints.scale, ints.softcap, ints.dropout_p))
    assert check_call(*args, scale=0.0).scale == 0.0  # zero is admitted
    assert check_call(*args, scale=np.float32(0.5)).scale == 0.5


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
def test_kernel_dtypes_accepted(dtype):
    assert check_call(*dense(dtype=dtype)).dtype == dtype


@pytest.mark.parametrize("dqk, dv", [(1, 1), (MAX_HEAD_DIM, MAX_HEAD_DIM), (1, 256), (256, 7)])
def test_head_dim_bounds_accepted(dqk, dv):
    spec = check_call(*dense(b=1, sq=1, sk=1, h=1, hkv=1, dqk=dqk, dv=dv))
    assert (spec.head_dim_qk, spec.head_dim_v) == (dqk, dv)


@pytest.mark.parametrize("h, hkv", [(4, 4), (4, 2), (4, 1), (6, 3), (1, 1)])
def test_group(h, hkv):
    spec = check_call(*dense(h=h, hkv=hkv))
    assert (spec.heads, spec.kv_heads, spec.group) == (h, hkv, h // hkv)


def test_spec_varlen_seqlens():
    args, kw = varlen()
    spec = check_call(*args, **kw)
    assert spec.varlen and spec.batch == len(LENS_Q)
    assert (spec.seqlen_q, spec.seqlen_k) == (MAXQ, MAXK)  # read from cu_seqlens
    assert spec.bias_shape == (len(LENS_Q), H, MAXQ, MAXK)
    spec = check_call(*args, max_seqlen_q=11, max_seqlen_k=MAXK, **kw)
    assert (spec.seqlen_q, spec.seqlen_k) == (11, MAXK)  # from max_seqlen_q
    spec = check_call(*args, max_seqlen_q=np.int64(MAXQ), **kw)
    assert spec.seqlen_q == MAXQ and type(spec.seqlen_q) is int
    # The bias broadcasts to (B, H, max_seqlen_q, max_seqlen_k).
    bias = torch.zeros(len(LENS_Q), 1, 11, MAXK)
    assert check_call(*args, bias=bias, max_seqlen_q=11, **kw).has_bias
    with pytest.raises(ValueError, match=r"^bias must be broadcastable"):
        check_call(*args, bias=bias, **kw)


def test_cu_seqlens_values_are_read_once_per_tensor(monkeypatch):
    """Reading cu_seqlens is a host sync: a tensor's values are read and checked once,
    then reused while it lives unmodified (a model's layers and its backward pass the
    same one). An in-place change is read and checked again; another tensor of equal
    values is read too."""
    import memattn.spec as spec_module

    reads = []
    real = spec_module._values
    monkeypatch.setattr(spec_module, "_values", lambda cu: reads.append(cu) or real(cu))
    args, kw = varlen()
    for _ in range(3):
        check_call(*args, **kw)
    assert len(reads) == 2  # q's and k's, once
    cu_q = kw["cu_seqlens_q"]
    cu_q[1] = 4  # (3, 0, 4) -> (4, -1, 4): decreasing
    with pytest.raises(ValueError, match=r"^cu_seqlens_q must be non-decreasing"):
        check_call(*args, **kw)
    with pytest.raises(ValueError, match=r"^cu_seqlens_q must be non-decreasing"):
        check_call(*args, **kw)  # a failed check is never kept
    cu_q[1] = 3
    check_call(*args, **kw)
    fresh = dict(kw, cu_seqlens_k=kw["cu_seqlens_k"].clone())
    before = len(reads)
    check_call(*args, **fresh)
    assert reads[before:] == [fresh["cu_seqlens_k"]]
    with torch.inference_mode():  # no version counter: read every time
        cu = kw["cu_seqlens_q"].clone()
    before = len(reads)
    check_call(*args, **dict(kw, cu_seqlens_q=cu))
    check_call(*args, **dict(kw, cu_seqlens_q=cu))
    assert sum(r is cu for r in reads[before:]) == 2


def test_spec_varlen_empty_sequences():
    q, k, v = torch.zeros(0, 2, 3), torch.zeros(0, 1, 3), torch.zeros(0, 1, 5)
    cu = torch.zeros(3, dtype=torch.int32)
    spec = check_call(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu)
    assert (spec.batch, spec.seqlen_q, spec.seqlen_k) == (2, 0, 0)


@pytest.mark.parametrize(
    "shape",
    [
        (),
        (1,),
        (SK,),
        (SQ, 1),
        (SQ, SK),
        (H, SQ, SK),
        (1, 1, 1, 1),
        (B, 1, 1, SK),
        (1, H, SQ, 1),
        (B, H, SQ, SK),
    ],  # fmt: skip
)
def test_bias_broadcastable_accepted(shape):
    spec = check_call(*dense(), bias=torch.zeros(shape, dtype=torch.float16))
    assert spec.has_bias


@pytest.mark.parametrize("shape", [(H,), (B, H)])
def test_alibi_shapes_accepted(shape):
    assert check_call(*dense(), alibi_slopes=torch.ones(shape)).has_alibi


def test_dense_empty_sequences_accepted():
    spec = check_call(*dense(sq=0, sk=0))
    assert (spec.seqlen_q, spec.seqlen_k) == (0, 0)


# ----------------------------------------------------------------------------------------
# Fuzzing.


def _bias_shape(draw, target):
    nd = draw(st.integers(0, 4))
    full = draw(st.lists(st.booleans(), min_size=nd, max_size=nd))
    return tuple(t if f else 1 for t, f in zip(target[4 - nd :], full, strict=True))


@st.composite
def valid_calls(draw):
    is_varlen = draw(st.booleans())
    b = draw(st.integers(1, 3))
    hkv = draw(st.integers(1, 3))
    h = hkv * draw(st.integers(1, 3))
    dqk, dv = draw(st.integers(1, 20)), draw(st.integers(1, 20))
    dtype = draw(st.sampled_from(KERNEL_DTYPES))
    kw = {}
    if is_varlen:
        lq = draw(st.lists(st.integers(0, 9), min_size=b, max_size=b))
        lk = draw(st.lists(st.integers(0, 9), min_size=b, max_size=b))
        q = torch.zeros(sum(lq), h, dqk, dtype=dtype)
        k = torch.zeros(sum(lk), hkv, dqk, dtype=dtype)
        v = torch.zeros(sum(lk), hkv, dv, dtype=dtype)
        kw.update(cu_seqlens_q=_cu(lq), cu_seqlens_k=_cu(lk))
        seqlen_q, seqlen_k = max(lq), max(lk)
        if draw(st.booleans()):
            seqlen_q += draw(st.integers(0, 3))
            kw["max_seqlen_q"] = seqlen_q
        if draw(st.booleans()):
            seqlen_k += draw(st.integers(0, 3))
            kw["max_seqlen_k"] = seqlen_k
    else:
        seqlen_q, seqlen_k = draw(st.integers(0, 9)), draw(st.integers(0, 9))
        q = torch.zeros(b, seqlen_q, h, dqk, dtype=dtype)
        k = torch.zeros(b, seqlen_k, hkv, dqk, dtype=dtype)
        v = torch.zeros(b, seqlen_k, hkv, dv, dtype=dtype)
    side = st.integers(-1, 12)
    window = draw(st.one_of(st.none(), st.tuples(side, side), st.lists(side, min_size=2,
                                                                        max_size=2)))  # fmt: skip
    if window is not None:
        kw["window"] = window
    kw["causal"] = draw(st.booleans())
    kw["align"] = draw(st.sampled_from(["top_left", "bottom_right"]))
    kw["softcap"] = draw(st.one_of(st.just(0), st.floats(0, 50)))
    kw["scale"] = draw(st.one_of(st.none(), st.floats(0, 10), st.integers(0, 3)))
    kw["dropout_p"] = draw(st.floats(0, 1, exclude_max=True))
    kw["deterministic"] = draw(st.booleans())
    target = (b, h, seqlen_q, seqlen_k)
    if draw(st.booleans()):
        bias_dtype = draw(st.sampled_from(REFERENCE_DTYPES))
        kw["bias"] = torch.zeros(_bias_shape(draw, target), dtype=bias_dtype)
    alibi = draw(st.sampled_from([None, (h,), (b, h)]))
    if alibi is not None:
        kw["alibi_slopes"] = torch.zeros(alibi)
    expected = dict(
        batch=b, heads=h, kv_heads=hkv, seqlen_q=seqlen_q, seqlen_k=seqlen_k, head_dim_qk=dqk,
        head_dim_v=dv, varlen=is_varlen,
        window_left=-1 if window is None else window[0],
        window_right=0 if kw["causal"] else (-1 if window is None else window[1]),
        bottom_right=kw["align"] == "bottom_right",
        scale=1 / math.sqrt(dqk) if kw["scale"] is None else float(kw["scale"]),
        softcap=float(kw["softcap"]), dropout_p=float(kw["dropout_p"]),
        has_bias="bias" in kw, has_alibi="alibi_slopes" in kw,
        deterministic=kw["deterministic"], dtype=dtype, device=torch.device("cpu"),
    )  # fmt: skip
    return (q, k, v), kw, expected


@settings(max_examples=50, deadline=None)
@given(valid_calls())
def test_fuzz_valid_calls_accepted(call):
    args, kw, expected = call
    snap = snapshot(args, kw)
    spec = check_call(*args, **kw)
    got = {name: getattr(spec, name) for name in expected}
    assert got == expected, (got, expected)
    assert spec.group * spec.kv_heads == spec.heads
    assert spec.bias_shape == (spec.batch, spec.heads, spec.seqlen_q, spec.seqlen_k)
    assert check_call(*args, **kw) == spec  # deterministic
    if spec.dtype != torch.float64:  # the reference admits everything the kernels do
        assert check_call(*args, dtypes=REFERENCE_DTYPES, **kw) == spec
    assert_unchanged(snap)


_side = st.one_of(st.integers(-4, 4), st.integers(-(10**9), 10**9))


@settings(max_examples=50, deadline=None)
@given(left=_side, right=_side, causal=st.booleans(), as_list=st.booleans())
def test_fuzz_window_values(left, right, causal, as_list):
    q, k, v = dense(b=1, sq=3, sk=4, h=1, hkv=1, dqk=2, dv=2)
    window = [left, right] if as_list else (left, right)
    if left < -1 or right < -1:
        bad = 0 if left < -1 else 1
        with pytest.raises(ValueError, match=rf"^window\[{bad}\] must be >= -1"):
            check_call(q, k, v, window=window, causal=causal)
    else:
        spec = check_call(q, k, v, window=window, causal=causal)
        assert spec.window_left == left
        assert spec.window_right == (0 if causal else right)
