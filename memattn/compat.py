"""Drop-in replacements for ``torch.nn.functional.scaled_dot_product_attention`` and for
FlashAttention 2's ``flash_attn_*func`` family, as thin wrappers over
:func:`memattn.attention`.

They only translate layouts (through views: memattn takes any strides) and argument
conventions; memattn's own validation names the argument for everything they do not
check themselves. Gradients flow to q, k, v (and to a float ``attn_mask``).

    from memattn.compat import scaled_dot_product_attention   # (..., H, L, E) layout
    from memattn.compat import flash_attn_func, flash_attn_varlen_func   # (B, S, H, D)

flash-attn's six ``flash_attn_*func`` functions are here with its 2.8 signatures;
``flash_attn_with_kvcache`` (a paged, in-place KV cache) is not.
"""

from __future__ import annotations

import math
import numbers

import torch

from . import reference
from .api import attention
from .dropout import dropout_mask
from .ops import forward

__all__ = [
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "scaled_dot_product_attention",
]


# ------------------------------------------------------------------------------ SDPA


def scaled_dot_product_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    *,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """``torch.nn.functional.scaled_dot_product_attention``, computed by memattn.

    Shapes as torch's: query (N, ..., Hq, L, E), key (N, ..., H, S, E), value
    (N, ..., H, S, Ev); returns (N, ..., Hq, L, Ev) in query's dtype. Any number of
    leading dimensions, 2-D (L, E) included; they broadcast against each other as in
    torch's math backend (H = 1 against Hq runs as multi-query attention without
    copies). One difference in layout: the output is a transposed view of memattn's
    (N, L, Hq, Ev)-contiguous result, where torch's is (N, Hq, L, Ev)-contiguous; the
    usual ``out.transpose(1, 2).reshape(N, L, Hq * Ev)`` is then free, and code that
    calls ``.view`` on the output itself needs ``.contiguous()`` first.

    attn_mask: broadcastable to (N, ..., Hq, L, S). A bool mask (True = attend) becomes
    an additive bias of 0/-inf in query's dtype (zero-stride dimensions stay
    broadcast); a float mask (query's dtype or float32) is the bias itself and gets a
    gradient. is_causal: key j visible from query i when j <= i (top-left aligned, as
    torch); not together with attn_mask. enable_gqa: key/value heads H divide Hq;
    query head h reads key/value head h // (Hq // H).

    Errors: what torch's math backend (the function's definition) refuses raises
    torch's exception type: RuntimeError for mismatched dtypes, devices, heads, batch
    dims or lengths, attn_mask together with is_causal, a mask of the wrong dtype or
    shape; IndexError for enable_gqa on 2-D inputs; TypeError for non-bool flags.
    Where torch's fused CPU kernel differs from its math backend, the math backend is
    followed: attn_mask with is_causal raises (the fused kernel applies both), and 0-D
    or 1-D masks broadcast (torch's dispatcher raises IndexError). Beyond torch's limits,
    memattn's validation raises ValueError/TypeError naming the argument: float64 and
    integer inputs (memattn takes float16, bfloat16, float32; ``memattn.reference``
    computes in float64), head dims outside [1, 256], a negative scale, dropout_p
    outside [0, 1) (torch also takes 1.0, giving zeros).

    A query row whose mask hides every key gives 0 (and zero gradients), as torch's
    math backend does since torch 2.5 (``_safe_softmax``); older torch gave NaN there.
    """
    _check_sdpa_inputs(query, key, value, attn_mask, is_causal, enable_gqa)
    L, E = query.shape[-2:]
    S, Ev = value.shape[-2:]
    if E != key.shape[-1]:
        raise RuntimeError(
            f"query and key must have the same embedding dim E, got {E} and {key.shape[-1]}"
        )
    if key.shape[-2] != S:
        raise RuntimeError(
            f"key and value must have the same length S, got {key.shape[-2]} and {S}"
        )

    batch = _broadcast("batch dims", query.shape[:-3], key.shape[:-3], value.shape[:-3])
    hq, hk, hv = (t.shape[-3] if t.dim() >= 3 else 1 for t in (query, key, value))
    if enable_gqa:
        if min(query.dim(), key.dim(), value.dim()) < 3:
            raise IndexError("enable_gqa=True needs query, key and value of at least 3 dims")
        if hk == 0 or hv == 0 or hq % hk != 0 or hq % hv != 0:
            raise RuntimeError(
                f"Number of heads in key and value must divide the number of heads in "
                f"query, got query {hq}, key {hk}, value {hv}"
            )
        heads = hq
        if hk != hv:  # each repeated to Hq heads, as torch's definition does
            key = key.repeat_interleave(hq // hk, dim=-3)
            value = value.repeat_interleave(hq // hv, dim=-3)
            hk = hv = hq
        kv_heads = hk
    else:
        sizes = {hq, hk, hv} - {1}
        if len(sizes) > 1:
            raise RuntimeError(
                f"query, key and value heads must be equal or 1 (broadcast), got {hq}, {hk}, "
                f"{hv}; pass enable_gqa=True for grouped-query attention"
            )
        heads = sizes.pop() if sizes else 1
        kv_heads = 1 if hk == hv == 1 else heads  # H = 1 keys/values run as MQA
    lead = (*batch, heads) if max(query.dim(), key.dim(), value.dim()) >= 3 else ()

    bias = None
    if attn_mask is not None:
        bias = _mask_to_bias(attn_mask, query.dtype, (*lead, L, S), batch)

    out = attention(
        _to_memattn(query, batch, heads),
        _to_memattn(key, batch, kv_heads),
        _to_memattn(value, batch, kv_heads),
        causal=is_causal,
        bias=bias,
        scale=scale,
        dropout_p=dropout_p,
    )  # (B, L, Hq, Ev)
    return out.transpose(1, 2).reshape(*lead, L, Ev)


def _check_sdpa_inputs(query, key, value, attn_mask, is_causal, enable_gqa) -> None:
    """The checks torch's function makes before any computation, with its exception types."""
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    for name, flag in (("is_causal", is_causal), ("enable_gqa", enable_gqa)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
    if min(query.dim(), key.dim(), value.dim()) < 2:
        raise RuntimeError(
            f"query, key and value must be at least 2-D, got {query.dim()}, {key.dim()}, "
            f"{value.dim()} dims"
        )
    if not query.dtype == key.dtype == value.dtype:
        raise RuntimeError(
            f"query, key and value must have the same dtype, got {query.dtype}, {key.dtype}, "
            f"{value.dtype}"
        )
    if not query.device == key.device == value.device:
        raise RuntimeError(
            f"query, key and value must be on one device, got {query.device}, {key.device}, "
            f"{value.device}"
        )
    if attn_mask is not None:
        if is_causal:
            raise RuntimeError("attn_mask must not be given together with is_causal=True")
        if not isinstance(attn_mask, torch.Tensor):
            raise TypeError(f"attn_mask must be a torch.Tensor, got {type(attn_mask).__name__}")
        if attn_mask.dtype not in (torch.bool, torch.float32, query.dtype):
            raise RuntimeError(
                f"attn_mask must have dtype bool, float32 or query's dtype ({query.dtype}), "
                f"got {attn_mask.dtype}"
            )


def _broadcast(what: str, *shapes: torch.Size) -> torch.Size:
    try:
        return torch.broadcast_shapes(*shapes)
    except RuntimeError:
        listed = ", ".join(str(tuple(s)) for s in shapes)
        raise RuntimeError(f"query, key and value {what} must broadcast, got {listed}") from None


def _to_memattn(t: torch.Tensor, batch: torch.Size, heads: int) -> torch.Tensor:
    """(..., h, S, D) or (S, D), h in (1, heads) -> memattn's (B, S, heads, D), B =
    prod(batch). A view unless broadcast leading dims must be flattened together."""
    S, D = t.shape[-2:]
    t = t.expand(*batch, heads, S, D).reshape(math.prod(batch), heads, S, D)
    return t.transpose(1, 2)


def _mask_to_bias(mask, dtype, score_shape, batch) -> torch.Tensor:
    """attn_mask broadcastable to score_shape (..., Hq, L, S) -> a bias broadcastable to
    memattn's (B, Hq, L, S): bool becomes 0/-inf in ``dtype``, float passes through."""
    shape = tuple(mask.shape)
    if len(shape) > len(score_shape) or any(
        m not in (1, s) for m, s in zip(shape[::-1], score_shape[::-1], strict=False)
    ):
        raise RuntimeError(
            f"attn_mask of shape {shape} must broadcast to the attention weights' shape "
            f"{tuple(score_shape)}"
        )
    if mask.dtype == torch.bool:
        # Convert only one element along each broadcast (zero-stride) dim, expand back.
        narrow = tuple(slice(0, 1) if st == 0 else slice(None) for st in mask.stride())
        small = mask[narrow]
        from .kernels.common import new_bias  # (importing memattn imports no Triton)

        bias = new_bias(small.shape, dtype, mask.device)  # rows read without a copy
        mask = bias.masked_fill_(small.logical_not(), float("-inf")).expand(shape)
    if len(shape) <= 3:
        return mask  # broadcasts against (B, Hq, L, S) as it does against score_shape
    head_dims = shape[-3:]
    if all(n == 1 for n in shape[:-3]):
        return mask.reshape(head_dims)
    return mask.expand(*batch, *head_dims).reshape(math.prod(batch), *head_dims)


# ----------------------------------------------------------------- FlashAttention 2

def _as_int(w) -> int | None:
    """w as a Python int if it is an integer (Python, numpy, a 0-d integer tensor or
    array; bools are not), else None."""
    if isinstance(w, torch.Tensor):
        integral = not (w.dtype.is_floating_point or w.dtype.is_complex or w.dtype == torch.bool)
        return int(w.item()) if w.dim() == 0 and integral else None
    if getattr(getattr(w, "dtype", None), "kind", None) in ("i", "u") and w.shape == ():
        return int(w)  # a numpy integer, or a 0-d integer array
    if isinstance(w, numbers.Integral) and not isinstance(w, bool):
        return int(w)
    return None


def _window_pair(window_size) -> tuple[int, int]:
    """window_size in any form flash-attn takes: a tuple or list of two integers, or a
    1-D integer tensor or numpy array of two (flash-attn's tests sample it with
    torch.randint)."""
    pair = window_size
    if hasattr(pair, "dtype") and getattr(pair, "shape", None) == (2,):  # tensor, ndarray
        pair = list(pair)
    if isinstance(pair, (tuple, list)) and len(pair) == 2:
        left, right = map(_as_int, pair)
        if left is not None and right is not None:
            return left, right
    raise TypeError(
        "window_size must be a pair (left, right) of integers (a tuple or list of ints, or "
        f"an integer tensor or array of 2 elements; -1 = unbounded), got {window_size!r}"
    )


def _flash_window(window_size, seqlen_k) -> tuple[int, int]:
    """window_size as memattn's window. FlashAttention's kernels read a side >= seqlen_k
    as unbounded (-1). For the right side this is not the documented formula when
    Sq > Sk; mirrored here so that results match flash-attn's. A side below -1 is left to
    memattn's validation."""
    sides = _window_pair(window_size)
    if isinstance(seqlen_k, bool) or not isinstance(seqlen_k, numbers.Integral):
        return sides
    left, right = (-1 if w >= seqlen_k else w for w in sides)
    return left, right


def _flash_call(q, k, v, return_attn_probs, **options):
    """memattn.attention with flash-attn's arguments already translated into
    ``options``; with ``return_attn_probs``, (out, softmax_lse, S_dmask) as flash-attn."""
    if not return_attn_probs:
        return attention(q, k, v, **options)
    out, lse, rng_state = forward(q, k, v, **options)
    dropout_p = options.pop("dropout_p")
    del options["deterministic"]
    with torch.no_grad():  # S_dmask is a debugging aid: no gradient flows through it
        probs = reference.probabilities(q.detach(), k.detach(), **options)
        if dropout_p > 0:  # flash-attn's sign convention; -0.0 where a hidden key was dropped
            keep = dropout_mask(rng_state, dropout_p, *probs.shape)
            probs = torch.where(keep, probs, -probs)
    return out, lse, probs


def flash_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
):
    """``flash_attn.flash_attn_func`` (flash-attn 2.8), computed by memattn: the same
    arguments in the same order, with the same defaults.

    q (B, Sq, H, D), k (B, Sk, Hkv, D), v (B, Sk, Hkv, Dv), H a multiple of Hkv (query
    head h reads key/value head h // (H // Hkv)); returns out (B, Sq, H, Dv). Causal
    masks, windows and ALiBi are aligned bottom-right: with off = Sk - Sq, key j is
    visible from query i when j <= i + off (causal) and i + off - left <= j <= i + off
    + right for window_size = (left, right), -1 unbounded; ALiBi adds
    -slope * |i + off - j| (alibi_slopes float32 (H,) or (B, H)). softcap > 0 caps the
    scaled score; softmax_scale defaults to 1/sqrt(D). A row with no visible key gives
    0. As in flash-attn, a window side >= Sk counts as unbounded; window_size may be a
    tuple or list of ints or a 1-D integer tensor of 2 elements.

    return_attn_probs=True returns (out, softmax_lse, S_dmask): softmax_lse float32
    (B, H, Sq), natural log; S_dmask (B, H, Sq, Sk) in q's dtype, the probabilities,
    with the sign bit set where dropout dropped the element (``S_dmask.signbit()`` is
    ``~memattn.dropout_mask(...)``). It is computed in plain PyTorch and costs
    O(Sq * Sk) memory: a debugging aid. Gradients flow through out (and softmax_lse).

    Where memattn differs from flash-attn: softcap combines with dropout, Dv may differ
    from D, any D in [1, 256] and float32 are accepted; S_dmask is returned without
    dropout too (flash-attn returns an empty tensor), unpadded and normalised (flash-
    attn's is padded to its tiles and "possibly with different scaling"); softmax_lse is
    -inf for a row with no visible key (flash-attn: +inf).
    """
    seqlen_k = k.shape[1] if isinstance(k, torch.Tensor) and k.dim() == 4 else None
    return _flash_call(
        q, k, v, return_attn_probs, causal=causal,
        window=_flash_window(window_size, seqlen_k), align="bottom_right",
        alibi_slopes=alibi_slopes, softcap=softcap, scale=softmax_scale, dropout_p=dropout_p,
        deterministic=deterministic,
    )  # fmt: skip


def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    block_table: torch.Tensor | None = None,
):
    """``flash_attn.flash_attn_varlen_func`` (flash-attn 2.8), computed by memattn: the
    same arguments in the same order, with the same defaults.

    Packed sequences: q (Tq, H, D), k (Tk, Hkv, D), v (Tk, Hkv, Dv); cu_seqlens_q/k
    int32 (B+1,), from 0, non-decreasing (sequences may be empty); max_seqlen_q/k the
    longest (or larger). Returns out (Tq, H, Dv). Masks, windows and ALiBi as in
    :func:`flash_attn_func`, aligned bottom-right per sequence (off = Sk_b - Sq_b);
    alibi_slopes (H,) or (B, H). As in flash-attn, a window side >= max_seqlen_k counts
    as unbounded.

    return_attn_probs=True returns (out, softmax_lse, S_dmask): softmax_lse float32
    (H, Tq); S_dmask (B, H, max_seqlen_q, max_seqlen_k), indexed by positions inside each
    sequence, 0 past its lengths; otherwise as :func:`flash_attn_func`.

    Where memattn differs: as :func:`flash_attn_func`; and block_table (a paged KV
    cache) raises NotImplementedError: gather the pages into packed k/v and pass
    cu_seqlens_k.
    """
    if block_table is not None:
        raise NotImplementedError(
            "block_table (a paged KV cache) is not supported: gather each sequence's pages "
            "into packed k/v of shape (Tk, Hkv, D) and pass cu_seqlens_k instead"
        )
    return _flash_call(
        q, k, v, return_attn_probs, causal=causal,
        window=_flash_window(window_size, max_seqlen_k), align="bottom_right",
        alibi_slopes=alibi_slopes, softcap=softcap, scale=softmax_scale, dropout_p=dropout_p,
        cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k, deterministic=deterministic,
    )  # fmt: skip


def _unpack(name: str, packed, n: int, ndim: int, layout: str) -> tuple[torch.Tensor, ...]:
    """Splits ``packed`` along its dim -3 (of size n) into n views."""
    if not isinstance(packed, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(packed).__name__}")
    if packed.dim() != ndim or packed.shape[-3] != n:
        raise ValueError(f"{name} must have shape {layout}, got {tuple(packed.shape)}")
    return packed.unbind(dim=-3)


def flash_attn_qkvpacked_func(
    qkv: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
):
    """``flash_attn.flash_attn_qkvpacked_func``: qkv (B, S, 3, H, D) -> out (B, S, H, D),
    the gradient in qkv's layout. Arguments, order, defaults, return_attn_probs and the
    differences from flash-attn as :func:`flash_attn_func`."""
    q, k, v = _unpack("qkv", qkv, 3, 5, "(B, S, 3, H, D)")
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                           alibi_slopes, deterministic, return_attn_probs)  # fmt: skip


def flash_attn_kvpacked_func(
    q: torch.Tensor,
    kv: torch.Tensor,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
):
    """``flash_attn.flash_attn_kvpacked_func``: q (B, Sq, H, D), kv (B, Sk, 2, Hkv, D) ->
    out (B, Sq, H, D). Arguments, order, defaults, return_attn_probs and the differences
    from flash-attn as :func:`flash_attn_func`."""
    k, v = _unpack("kv", kv, 2, 5, "(B, Sk, 2, Hkv, D)")
    return flash_attn_func(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
                           alibi_slopes, deterministic, return_attn_probs)  # fmt: skip


def flash_attn_varlen_qkvpacked_func(
    qkv: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
):
    """``flash_attn.flash_attn_varlen_qkvpacked_func``: qkv (T, 3, H, D), cu_seqlens int32
    (B+1,) -> out (T, H, D). Arguments, order, defaults, return_attn_probs and the
    differences from flash-attn as :func:`flash_attn_varlen_func`."""
    q, k, v = _unpack("qkv", qkv, 3, 4, "(T, 3, H, D)")
    return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                  dropout_p, softmax_scale, causal, window_size, softcap,
                                  alibi_slopes, deterministic, return_attn_probs)  # fmt: skip


def flash_attn_varlen_kvpacked_func(
    q: torch.Tensor,
    kv: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
):
    """``flash_attn.flash_attn_varlen_kvpacked_func``: q (Tq, H, D), kv (Tk, 2, Hkv, D) ->
    out (Tq, H, D). Arguments, order, defaults, return_attn_probs and the differences
    from flash-attn as :func:`flash_attn_varlen_func`."""
    k, v = _unpack("kv", kv, 2, 4, "(Tk, 2, Hkv, D)")
    return flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                  max_seqlen_k, dropout_p, softmax_scale, causal, window_size,
                                  softcap, alibi_slopes, deterministic,
                                  return_attn_probs)  # fmt: skip
