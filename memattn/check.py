"""Checking the kernels against the float64 reference: the cases, the inputs, the
tolerance. ``memattn check`` and the test suites both run through here.

The tolerance is relative to what plain PyTorch achieves in the same precision: the
kernel's error against the float64 reference, ``|x - ref| / |ref|`` in the Frobenius
norm, may be at most twice the error of ``memattn.reference`` run in the inputs' own
dtype, plus a small floor.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import torch

from . import ops, reference
from .api import attention
from .dropout import dropout_mask, new_rng_state
from .spec import check_call

FLOOR = {torch.float32: 2e-6, torch.float16: 1e-4, torch.bfloat16: 1e-4}


@dataclass(frozen=True)
class Case:
    """One configuration to check. Sizes are per sequence; ``lengths_q``/``lengths_k``
    switch to varlen mode with those sequence lengths.

    ``bias`` spells the bias's shape with the letters B, H, Q, K (sizes B, H, Sq, Sk)
    and 1 (broadcast), e.g. "BHQK", "1H1K", "QK". ``alibi`` is "H" or "BH".
    ``layout`` is "contiguous", "transposed" (q/k/v as (B, H, S, D).transpose, a bias
    with its last two dimensions swapped) or "strided" (last-dim stride 2, nothing
    contiguous; a bias's too).
    """

    name: str
    batch: int = 2
    seqlen_q: int = 37
    seqlen_k: int = 53
    heads: int = 4
    kv_heads: int = 2
    dqk: int = 40
    dv: int = 24
    lengths_q: tuple[int, ...] | None = None
    lengths_k: tuple[int, ...] | None = None
    bias: str | None = None
    alibi: str | None = None
    layout: str = "contiguous"
    options: dict = field(default_factory=dict)

    @property
    def varlen(self) -> bool:
        return self.lengths_q is not None

    def scaled(self, **sizes) -> Case:
        return replace(self, **sizes)

    def describe(self) -> str:
        if self.varlen:
            shape = f"varlen q{list(self.lengths_q)} k{list(self.lengths_k)}"
        else:
            shape = f"B{self.batch} Sq{self.seqlen_q} Sk{self.seqlen_k}"
        extras = [f"bias {self.bias}"] * (self.bias is not None)
        extras += [f"alibi {self.alibi}"] * (self.alibi is not None)
        extras += [self.layout] * (self.layout != "contiguous")
        extras += [f"{k}={v}" for k, v in self.options.items()]
        return " ".join([f"{shape} H{self.heads}/{self.kv_heads} D{self.dqk}/{self.dv}",
                         *extras])


@dataclass
class Inputs:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    kwargs: dict  # bias, alibi_slopes, cu_seqlens, options


def make_inputs(case: Case, dtype: torch.dtype, device, seed: int = 0) -> Inputs:
    """Fresh random inputs for a case (normal q/k/v, bias and slopes; never zeros)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(device)

    if case.varlen:  # a bias spans max_seqlen_q/k, which a call may give longer
        batch = len(case.lengths_q)
        tq, tk = sum(case.lengths_q), sum(case.lengths_k)
        sq = case.options.get("max_seqlen_q", max(case.lengths_q, default=0))
        sk = case.options.get("max_seqlen_k", max(case.lengths_k, default=0))
        tokens_q, tokens_k = (tq,), (tk,)
    else:
        batch, sq, sk = case.batch, case.seqlen_q, case.seqlen_k
        tokens_q, tokens_k = (batch, sq), (batch, sk)

    def tensor(tokens, heads, dim):
        if case.layout == "transposed":
            return randn(*tokens[:-1], heads, tokens[-1], dim).to(dtype).transpose(-2, -3)
        if case.layout == "strided":
            return randn(*tokens, heads, 2 * dim).to(dtype)[..., ::2]
        return randn(*tokens, heads, dim).to(dtype)

    kwargs = dict(case.options)
    q = tensor(tokens_q, case.heads, case.dqk)
    k = tensor(tokens_k, case.kv_heads, case.dqk)
    v = tensor(tokens_k, case.kv_heads, case.dv)
    if case.varlen:
        for name, lengths in (("q", case.lengths_q), ("k", case.lengths_k)):
            cu = torch.tensor([0, *lengths], dtype=torch.int64).cumsum(0).to(torch.int32)
            kwargs[f"cu_seqlens_{name}"] = cu.to(device)
    if case.bias is not None:  # laid out as q, k and v are: keys strided, not innermost
        sizes = {"B": batch, "H": case.heads, "Q": sq, "K": sk, "1": 1}
        shape = [sizes[c] for c in case.bias]
        if case.layout == "transposed" and len(shape) >= 2:
            bias = randn(*shape[:-2], shape[-1], shape[-2]).to(dtype).transpose(-1, -2)
        elif case.layout == "strided":
            bias = randn(*shape[:-1], 2 * shape[-1]).to(dtype)[..., ::2]
        else:
            bias = randn(*shape).to(dtype)
        kwargs["bias"] = bias
    if case.alibi is not None:
        shape = (case.heads,) if case.alibi == "H" else (batch, case.heads)
        kwargs["alibi_slopes"] = torch.rand(*shape, generator=gen).to(device) * 0.5
    return Inputs(q, k, v, kwargs)


def relative_error(x: torch.Tensor, ref: torch.Tensor, scale: float = 0.0) -> float:
    """|x - ref| / max(|ref|, scale) in the Frobenius norm, in float64; NaN anywhere
    gives NaN."""
    x, ref = x.double(), ref.double()
    denom = max(ref.norm().item(), scale)
    err = (x - ref).norm().item()
    if denom == 0.0:
        return err
    return err / denom


def lse_error(lse: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest |lse - ref| where ref is finite; inf if the -inf patterns differ."""
    lse, ref = lse.double(), ref.double()
    if not torch.equal(torch.isneginf(lse), torch.isneginf(ref)):
        return math.inf
    finite = torch.isfinite(ref)
    if not finite.any():
        return 0.0
    return (lse[finite] - ref[finite]).abs().max().item()


@dataclass
class Result:
    case: Case
    dtype: torch.dtype
    what: str  # "out", "lse", "dq", ...
    error: float
    allowed: float

    @property
    def passed(self) -> bool:
        return self.error <= self.allowed  # False for NaN


def _to64(kwargs: dict) -> dict:
    return {
        k: (v.double() if isinstance(v, torch.Tensor) and v.is_floating_point()
            and k != "alibi_slopes" else v)
        for k, v in kwargs.items()
    }  # fmt: skip


def check_forward(case: Case, dtype: torch.dtype, device, seed: int = 0) -> list[Result]:
    """Runs the forward kernel on fresh inputs and compares out and lse with the float64
    reference, against the tolerance set by the reference in ``dtype``."""
    return check_forward_on(case, dtype, make_inputs(case, dtype, device, seed))


def check_forward_on(case: Case, dtype: torch.dtype, x: Inputs) -> list[Result]:
    """check_forward on inputs made elsewhere (values make_inputs would not draw);
    ``case`` names them."""
    before = [t.clone() for t in (x.q, x.k, x.v)]
    out, lse, rng_state = ops.forward(x.q, x.k, x.v, **x.kwargs)
    for t, t0 in zip((x.q, x.k, x.v), before):
        if not torch.equal(t, t0):
            raise AssertionError(f"{case.name}: the kernel modified its inputs")
    keep = None
    if x.kwargs.get("dropout_p", 0.0) > 0:
        spec = reference_spec(x)
        keep = dropout_mask(rng_state, x.kwargs["dropout_p"], *spec.bias_shape)
    ref, ref_lse = reference.attention(
        x.q.double(), x.k.double(), x.v.double(), **_to64(x.kwargs), dropout_keep=keep,
        return_lse=True,
    )  # fmt: skip
    low, low_lse = reference.attention(x.q, x.k, x.v, **x.kwargs, dropout_keep=keep,
                                       return_lse=True)  # fmt: skip
    out_allowed, lse_allowed = _forward_allowances(low, low_lse, ref, ref_lse, dtype)
    return [Result(case, dtype, "out", relative_error(out, ref), out_allowed),
            Result(case, dtype, "lse", lse_error(lse, ref_lse), lse_allowed)]


def _forward_allowances(low, low_lse, ref, ref_lse, dtype: torch.dtype) -> tuple[float, float]:
    """out's and lse's allowances: twice the error of the reference run in ``dtype``
    (low, low_lse) against the float64 one, plus a floor."""
    floor = FLOOR[dtype]
    return (2 * relative_error(low, ref) + floor,
            2 * lse_error(low_lse, ref_lse) + 10 * floor)


def repeated_forward_reference(
    x: Inputs, dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, float | None, float]:  # fmt: skip
    """For a call made many times on the same inputs: the float64 reference's out and
    lse, and check_forward_on's allowances for them. out's is None with dropout, which
    draws another mask each call; the lse sees no dropout."""
    plain = {k: v for k, v in x.kwargs.items() if k != "dropout_p"}
    ref, ref_lse = reference.attention(x.q.double(), x.k.double(), x.v.double(),
                                       **_to64(plain), return_lse=True)  # fmt: skip
    low, low_lse = reference.attention(x.q, x.k, x.v, **plain, return_lse=True)
    out_allowed, lse_allowed = _forward_allowances(low, low_lse, ref, ref_lse, dtype)
    if x.kwargs.get("dropout_p", 0.0) > 0:
        out_allowed = None
    return ref, ref_lse, out_allowed, lse_allowed


def check_forward_repeated(case: Case, dtype: torch.dtype, x: Inputs,
                           calls: int) -> list[list[Result]]:  # fmt: skip
    """The forward made ``calls`` times on the same inputs, each call's lse (and out,
    without dropout) against one float64 reference: a race between warps or proxies
    goes wrong in some calls only. Each call is checked before the next is made, so
    each runs on an idle GPU: the Gluon forward's bias race went wrong in 6-9 of 30
    calls so, in 0-1 of 30 queued back to back. One list of results per call."""
    ref, ref_lse, out_allowed, lse_allowed = repeated_forward_reference(x, dtype)
    results = []
    for _ in range(calls):
        out, lse, _ = ops.forward(x.q, x.k, x.v, **x.kwargs)
        found = [Result(case, dtype, "lse", lse_error(lse, ref_lse), lse_allowed)]
        if out_allowed is not None:
            found.append(Result(case, dtype, "out", relative_error(out, ref), out_allowed))
        results.append(found)
    return results


def reference_spec(x: Inputs):
    return check_call(x.q, x.k, x.v, **x.kwargs)


def check_backward(case: Case, dtype: torch.dtype, device, seed: int = 0,
                   bias_grad: bool = True, lse_grad: bool = False,
                   frozen: tuple[str, ...] = ()) -> list[Result]:  # fmt: skip
    """Runs forward and backward through memattn.attention's autograd on fresh inputs
    and compares dq, dk, dv (and dbias when the case has a bias and ``bias_grad``: a
    bias that asks none is only read) with float64 autograd through the reference,
    against the tolerance set by the reference in ``dtype``. ``lse_grad``: the call
    returns lse too and a gradient flows into it as well as into out. ``frozen``: of
    "q", "k", "v", those that ask no gradient. Dropout is checked with the keep mask
    the call used (same torch seed)."""
    x = make_inputs(case, dtype, device, seed)
    inputs = {"dq": x.q, "dk": x.k, "dv": x.v}
    leaves = {n: t for n, t in inputs.items() if n[1:] not in frozen}
    if "bias" in x.kwargs and bias_grad:
        leaves["dbias"] = x.kwargs["bias"]
    for t in leaves.values():
        t.requires_grad_(True)
    gen = torch.Generator(device="cpu").manual_seed(seed + 1)
    torch.manual_seed(seed)  # the dropout state the call draws, drawn again below
    outputs = attention(x.q, x.k, x.v, **x.kwargs, return_lse=lse_grad)
    out, lse = outputs if lse_grad else (outputs, None)
    grad = torch.randn(out.shape, generator=gen).to(device=out.device, dtype=out.dtype)
    grad_lse = None
    if lse_grad:
        grad_lse = torch.randn(lse.shape, generator=gen).to(lse.device)
        grads = torch.autograd.grad((out, lse), list(leaves.values()), (grad, grad_lse))
        # lse is -inf on a row that sees no key, whatever the inputs: what flows in
        # there goes nowhere (the reference's autograd would make it NaN)
        grad_lse = grad_lse.masked_fill(torch.isneginf(lse), 0.0)
    else:
        grads = torch.autograd.grad(out, list(leaves.values()), grad)
    keep = None
    if x.kwargs.get("dropout_p", 0.0) > 0:
        torch.manual_seed(seed)
        rng_state = new_rng_state(x.q.device)
        keep = dropout_mask(rng_state, x.kwargs["dropout_p"], *reference_spec(x).bias_shape)

    def reference_grads(to, expand_bias=False):
        ls = {n: t.detach().to(to).requires_grad_(n in leaves) for n, t in inputs.items()}
        kw = {k: (v.detach().to(to) if k == "bias" else v) for k, v in x.kwargs.items()}
        if "dbias" in leaves:
            if expand_bias:  # differentiate dS itself; reduced to the bias's shape below
                kw["bias"] = kw["bias"].expand(reference_spec(x).bias_shape).clone()
            ls["dbias"] = kw["bias"].requires_grad_(True)
        o, lse_ref = reference.attention(ls["dq"], ls["dk"], ls["dv"], **kw,
                                         dropout_keep=keep, return_lse=True)  # fmt: skip
        wanted = [ls[n] for n in leaves]
        if grad_lse is None or not lse_ref.requires_grad:  # (lse does not depend on v)
            return list(torch.autograd.grad(o, wanted, grad.to(to)))
        return list(torch.autograd.grad((o, lse_ref), wanted,
                                        (grad.to(to), grad_lse.to(lse_ref.dtype))))

    exact = reference_grads(torch.float64, expand_bias=True)
    low = reference_grads(dtype)
    # Where a gradient's terms cancel, only their rounding remains, so errors are
    # measured against the size of what was summed (relative_error's scale): dS =
    # P * (dP - delta) is 0 exactly along a row that sees one key, and dbias sums dS
    # over the broadcast dimensions (a bias broadcast over keys shifts whole rows,
    # which softmax ignores: its gradient is 0). And the kernels take delta from the
    # out they stored, rounded to ``dtype``, as every memory-efficient backward does:
    # the reference's autograd takes it from P, exactly where P is 1; what that rounding
    # adds is allowed besides (twice, as the reference's error).
    terms = _softmax_terms(x, grad.double(), keep, dtype,
                           None if grad_lse is None else grad_lse.double())  # fmt: skip
    names = [{"dbias": "ds"}.get(n, n) for n in leaves]  # the terms each is made of
    if "dbias" in leaves:
        d_s = exact[-1]
        exact[-1] = _reduce_to(d_s, leaves["dbias"].shape)
        size, rounding = terms["ds"]
        terms["ds"] = (max(size, d_s.norm().item()), rounding)
    floor = FLOOR[dtype]
    results = []
    for name, term, g, ref, g_low in zip(leaves, names, grads, exact, low):
        scale, rounding = terms.get(term, (0.0, 0.0))
        denom = max(ref.double().norm().item(), scale)
        allowed = 2 * relative_error(g_low, ref, scale) + floor
        if denom > 0:
            allowed += 2 * rounding / denom
        results.append(Result(case, dtype, name, relative_error(g, ref, scale), allowed))
    return results


def _softmax_terms(x: Inputs, grad: torch.Tensor, keep, dtype: torch.dtype,
                   grad_lse: torch.Tensor | None) -> dict[str, tuple[float, float]]:  # fmt: skip
    """For dS = P * dP - P * delta (+ P * grad_lse) and the dq and dk made of it (dk per
    query head), in float64: (the norm of the largest of what the terms make alone,
    before they cancel; the norm of what delta taken from out rounded to ``dtype``
    changes)."""
    spec = reference_spec(x)
    q, k, v = (t.detach().double() for t in (x.q, x.k, x.v))
    bias = x.kwargs.get("bias")
    bias = None if bias is None else bias.detach().double()
    cu = x.kwargs.get("cu_seqlens_q"), x.kwargs.get("cu_seqlens_k")
    # grad_lse ((B, H, Sq) or (H, tokens)) rides as grad's last column, cut alike
    lse_column = torch.zeros_like(grad[..., :1]) if grad_lse is None else (
        grad_lse.movedim(-2, -1)[..., None])  # fmt: skip
    pieces = zip(
        reference._sequences(spec, q, k, v, bias, x.kwargs.get("alibi_slopes"), keep, *cu),
        reference._sequences(spec, torch.cat([grad, lse_column], -1), k, v, None, None, None,
                             *cu),
    )  # fmt: skip
    sums = {name: [0.0, 0.0, 0.0, 0.0] for name in ("dq", "dk", "ds")}
    for (_, q_b, k_b, v_b, bias_b, slopes_b, keep_b), (_, g_b, *_) in pieces:
        p, _ = reference._softmax(reference._scores(spec, q_b, k_b, bias_b, slopes_b))
        kept = 1.0 if keep_b is None else keep_b / (1.0 - spec.dropout_p)
        g_t, g_lse = g_b.transpose(1, 2).split([g_b.shape[-1] - 1, 1], -1)  # (B, H, Sq, Dv)
        v_t = v_b.permute(0, 2, 3, 1)  # (B, Hkv, Dv, Sk)
        d_p = reference._grouped(g_t, v_t) * kept
        out = reference._grouped(p * kept, v_t.transpose(-1, -2))
        delta_shift = (g_t * (out - out.to(dtype).double())).sum(-1, keepdim=True)
        p_dp = p * d_p
        factor = 1.0
        if spec.softcap > 0:  # dS is times tanh's derivative
            raw = reference._grouped(q_b.transpose(1, 2), k_b.permute(0, 2, 3, 1)) * spec.scale
            factor = 1.0 - torch.tanh(raw / spec.softcap).square()
        terms = (p_dp, p * p_dp.sum(-1, keepdim=True), p * g_lse, p * delta_shift)
        for i, term in enumerate(terms):
            term = term * factor
            sums["ds"][i] += term.square().sum().item()
            dq = reference._grouped(term, k_b.transpose(1, 2)) * spec.scale
            dk = term.transpose(-1, -2) @ q_b.transpose(1, 2) * spec.scale
            sums["dq"][i] += dq.square().sum().item()
            sums["dk"][i] += dk.square().sum().item()
    return {name: (math.sqrt(max(sizes)), math.sqrt(rounding))
            for name, (*sizes, rounding) in sums.items()}


def _reduce_to(full: torch.Tensor, shape) -> torch.Tensor:
    """Sums a (B, H, Sq, Sk) gradient over the dimensions a bias of `shape` broadcasts."""
    padded = (1,) * (4 - len(shape)) + tuple(shape)
    dims = [d for d in range(4) if padded[d] == 1 and full.shape[d] != 1]
    return full.sum(dim=dims, keepdim=True).reshape(shape) if dims else full.reshape(shape)


# The feature grid. Sizes are small and odd (the CPU interpreter runs them); GPU runs
# scale them with Case.scaled.
FEATURE_CASES = [
    Case("plain"),
    Case("causal", options=dict(causal=True)),
    Case("causal bottom-right", options=dict(causal=True, align="bottom_right")),
    Case("causal Sq>Sk bottom-right", seqlen_q=53, seqlen_k=37,
         options=dict(causal=True, align="bottom_right")),
    Case("window (7, 3)", options=dict(window=(7, 3))),
    Case("window (-1, 5) bottom-right", options=dict(window=(-1, 5), align="bottom_right")),
    Case("window (6, 0) causal", options=dict(window=(6, 0), causal=True)),
    Case("bias BHQK", bias="BHQK"),
    Case("bias 1H1K", bias="1H1K"),
    Case("bias QK", bias="QK"),
    Case("bias B1Q1", bias="B1Q1"),
    Case("alibi H", alibi="H"),
    Case("alibi BH causal bottom-right", alibi="BH",
         options=dict(causal=True, align="bottom_right")),
    Case("softcap", options=dict(softcap=3.0)),
    Case("scale 0.3", options=dict(scale=0.3)),
    Case("dropout 0.25", options=dict(dropout_p=0.25)),
    Case("MQA", heads=3, kv_heads=1),
    Case("MHA Dqk=Dv", kv_heads=4, dv=40),
    Case("head dims 1/17", dqk=1, dv=17),
    Case("transposed layout", layout="transposed", bias="QK", options=dict(causal=True)),
    Case("strided layout", layout="strided", bias="1HQK"),
    Case("varlen", lengths_q=(5, 0, 37, 12), lengths_k=(9, 3, 53, 0)),
    Case("varlen causal bottom-right window", lengths_q=(5, 19, 1), lengths_k=(9, 7, 30),
         options=dict(causal=True, align="bottom_right", window=(4, -1))),
    Case("varlen+causal+bias+GQA+dropout", lengths_q=(5, 0, 37, 12), lengths_k=(9, 3, 53, 0),
         bias="BHQK", options=dict(causal=True, dropout_p=0.2)),
    Case("varlen+alibi+softcap+window", lengths_q=(21, 8), lengths_k=(17, 33), alibi="BH",
         options=dict(softcap=2.0, window=(5, 9))),
    Case("everything dense", bias="1HQK", alibi="H",
         options=dict(causal=True, align="bottom_right", window=(20, 0), softcap=4.0,
                      dropout_p=0.1, scale=0.2)),
]


def gpu_sized(case: Case, tokens: int = 1024, head_dim: int = 128) -> Case:
    """The same case at GPU sizes: sequence lengths scaled ~tokens/53, the default head
    dims (40/24) replaced by head_dim."""
    f = tokens / 53
    if case.varlen:
        sizes = dict(lengths_q=tuple(round(n * f) for n in case.lengths_q),
                     lengths_k=tuple(round(n * f) for n in case.lengths_k))
    else:
        sizes = dict(seqlen_q=round(case.seqlen_q * f), seqlen_k=round(case.seqlen_k * f))
    dims = dict(dqk=head_dim, dv=head_dim) if (case.dqk, case.dv) == (40, 24) else {}
    return case.scaled(**sizes, **dims)


# What `memattn check` runs for each case and dtype.
RUNS = [check_forward, check_backward]


class RandomCall(NamedTuple):
    case: Case
    dtype: torch.dtype
    bias_grad: bool  # whether the bias asks for its gradient (check_backward's)
    lse_grad: bool  # whether a gradient flows into lse too (check_backward's)
    frozen: tuple[str, ...]  # of "q", "k", "v", those asking no gradient (check_backward's)


# Head dims (Dqk, Dv) random calls draw: on the GPU those the Hopper kernels take
# (twice as often), the pairs they pad and the tile kernels' odd ones; on the CPU the
# interpreter's small sizes.
_GPU_HEAD_DIMS = [(64, 64), (128, 128), (256, 256), (192, 128), (128, 64)] * 2 + [
    (64, 128), (128, 256), (96, 96), (80, 48), (32, 32)]
_CPU_HEAD_DIMS = [(16, 16), (40, 24), (8, 32), (17, 5), (32, 32)]


def random_call(seed: int, gpu: bool) -> RandomCall:
    """A call with options drawn together at random (shapes, packing, GQA, head dims,
    masks in both alignments, windows, every bias shape, ALiBi, softcap, scale, dropout,
    determinism, layouts, max_seqlen given, a gradient into lse, inputs that ask no
    gradient), so that combinations the feature grid does not spell out get checked
    too. The same seed gives the same call. ``gpu``: sizes that fill a GPU's tiles (up
    to ~1100 tokens a sequence, few-query calls against 4k+ keys for the split-KV
    forward, mostly bf16/fp16 and the Hopper kernels' head dims); otherwise the
    interpreter's small odd sizes in float32/float16."""
    rng = random.Random(seed)
    chance = rng.random
    longest = 1100 if gpu else 40
    dqk, dv = rng.choice(_GPU_HEAD_DIMS if gpu else _CPU_HEAD_DIMS)
    if gpu:
        dtype = rng.choice([torch.bfloat16] * 6 + [torch.float16] * 6 + [torch.float32])
    else:
        dtype = rng.choice([torch.float32, torch.float16])
    kv_heads = rng.choice([1, 2, 3])
    sizes = dict(heads=kv_heads * rng.choice([1, 2, 4]), kv_heads=kv_heads, dqk=dqk, dv=dv)

    def length():
        return 0 if chance() < 0.15 else rng.randint(1, longest)

    if chance() < 0.3:
        lengths_q = [length() for _ in range(rng.randint(1, 5))]
        lengths_k = lengths_q if chance() < 0.5 else [length() for _ in lengths_q]
        for lengths in (lengths_q, lengths_k):
            if not any(lengths):  # something to check
                lengths[0] = rng.randint(1, longest)
        sizes.update(lengths_q=tuple(lengths_q), lengths_k=tuple(lengths_k))
        batch = len(lengths_q)
    elif gpu and chance() < 0.15:  # few queries, long keys: the split-KV forward
        batch = rng.randint(1, 2)
        sizes.update(batch=batch, seqlen_q=rng.randint(1, 64), seqlen_k=rng.randint(4096, 5000))
    else:
        batch = rng.randint(1, 3)
        seqlen_q = rng.randint(1, longest)
        seqlen_k = seqlen_q if chance() < 0.5 else rng.randint(1, longest)
        sizes.update(batch=batch, seqlen_q=seqlen_q, seqlen_k=seqlen_k)

    options = {}
    if chance() < 0.4:
        options["causal"] = True
    if chance() < 0.25:
        def side():
            return rng.choice([-1, 0, rng.randint(1, longest // 2)])
        options["window"] = (side(), side())
    if options and chance() < 0.5:
        options["align"] = "bottom_right"
    if chance() < 0.2:
        options["softcap"] = round(rng.uniform(1.0, 30.0), 2)
    if chance() < 0.15:
        options["scale"] = round(rng.uniform(0.05, 0.5), 3)
    if chance() < 0.2:
        options["dropout_p"] = rng.choice([0.1, 0.25])
    if chance() < 0.2:
        options["deterministic"] = True
    bias = None
    if chance() < 0.35:  # each dimension kept or broadcast, leading ones maybe left off
        bias = "".join(c if chance() < 0.5 else "1" for c in "BHQK")
        for _ in range(rng.randint(0, 2)):
            bias = bias.removeprefix("1") or bias
    alibi = rng.choice(["H", "BH"]) if chance() < 0.2 else None
    layout = rng.choices(["contiguous", "transposed", "strided"], [16, 2, 1])[0]
    bias_grad = bias is not None and chance() < 0.7
    # Drawn last, so that the earlier draws, and a seed's call without these, stay
    # as they were.
    lse_grad = chance() < 0.25
    if "lengths_q" in sizes and chance() < 0.3:  # max_seqlen given, maybe past the longest
        for name in ("q", "k"):
            longest_here = max(sizes[f"lengths_{name}"])
            options[f"max_seqlen_{name}"] = longest_here + rng.choice([0, rng.randint(1, 40)])
    frozen = ()
    if chance() < 0.2:  # some of q, k and v ask no gradient (a frozen prefix or cache)
        frozen = rng.choice([("q",), ("k",), ("v",), ("k", "v"), ("q", "k"), ("q", "v")]
                            + [("q", "k", "v")] * (3 * bias_grad))  # fmt: skip
    name = (f"random {seed}" + " (gradient into lse too)" * lse_grad
            + f" ({', '.join(frozen)} frozen)" * bool(frozen))  # as the table shows it
    case = Case(name, **sizes, bias=bias, alibi=alibi, layout=layout, options=options)
    return RandomCall(case, dtype, bias_grad, lse_grad, frozen)
