"""The definition of memattn's attention in plain PyTorch: the spec in code.

Readable first, fast never. It computes in the inputs' own dtype (float64 included), on
any device, materialising the (Sq, Sk) score matrix. Tests compare the kernels with it
in float64; computed in float16/bfloat16 it is also the "plain PyTorch implementation in
the same precision" whose error sets the kernels' tolerance.

For query i and key j of one sequence (off = 0 for align="top_left", Sk - Sq for
"bottom_right"):

    s    = scale * q_i . k_j
    s    = softcap * tanh(s / softcap)          if softcap > 0
    s    = s + bias[b, h, i, j]                  if bias is given
    s    = s - slope[b, h] * |i + off - j|       if alibi_slopes is given
    s    = -inf  unless j is visible from i:     j <= i + off              (causal)
                                                 i + off - left <= j <= i + off + right  (window)
    p    = softmax_j(s)                          a row with no visible key gives p = 0
    lse  = logsumexp_j(s)                        -inf for such a row
    out  = (p * keep / (1 - dropout_p)) @ v      keep: the dropout keep mask, if any
"""

from __future__ import annotations

import torch

from .spec import REFERENCE_DTYPES, AttentionSpec, check_call


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    window: tuple[int, int] | None = None,
    align: str = "top_left",
    bias: torch.Tensor | None = None,
    alibi_slopes: torch.Tensor | None = None,
    softcap: float = 0.0,
    scale: float | None = None,
    dropout_p: float = 0.0,
    dropout_keep: torch.Tensor | None = None,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    return_lse: bool = False,
    deterministic: bool = False,
):
    """Reference attention with the same arguments as :func:`memattn.attention`.

    ``dropout_keep`` is the boolean keep mask, (B, H, Sq, Sk), or (B, H, max_seqlen_q,
    max_seqlen_k) in varlen mode, indexed by positions inside each sequence; required
    when ``dropout_p > 0`` (get the mask a kernel call used from ``memattn.dropout_mask``).
    Returns out, or (out, lse) with ``return_lse``; lse is float32, or float64 for
    float64 inputs.
    """
    spec = check_call(
        q, k, v, causal=causal, window=window, align=align, bias=bias,
        alibi_slopes=alibi_slopes, softcap=softcap, scale=scale, dropout_p=dropout_p,
        cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k, deterministic=deterministic, dtypes=REFERENCE_DTYPES,
    )  # fmt: skip
    if spec.dropout_p > 0:
        if dropout_keep is None:
            raise ValueError("dropout_keep (the keep mask) is required when dropout_p > 0")
        if tuple(dropout_keep.shape) != spec.bias_shape or dropout_keep.dtype != torch.bool:
            raise ValueError(
                f"dropout_keep must be a bool tensor of shape {spec.bias_shape}, got "
                f"{dropout_keep.dtype} {tuple(dropout_keep.shape)}"
            )
    parts = [_attention_dense(spec, *args)
             for _, *args in _sequences(spec, q, k, v, bias, alibi_slopes, dropout_keep,
                                        cu_seqlens_q, cu_seqlens_k)]  # fmt: skip
    if not spec.varlen:
        out, lse = parts[0]
    elif parts:
        out = torch.cat([o[0] for o, _ in parts], dim=0)
        lse = torch.cat([s[0] for _, s in parts], dim=1)
    else:
        out, lse = q.new_zeros(0, spec.heads, spec.head_dim_v), q.new_zeros(spec.heads, 0)
    lse = lse.to(torch.float64 if q.dtype == torch.float64 else torch.float32)
    return (out, lse) if return_lse else out


def probabilities(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    causal: bool = False,
    window: tuple[int, int] | None = None,
    align: str = "top_left",
    bias: torch.Tensor | None = None,
    alibi_slopes: torch.Tensor | None = None,
    softcap: float = 0.0,
    scale: float | None = None,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
) -> torch.Tensor:
    """The probabilities p = softmax_j(s) of :func:`attention` with the same options,
    before dropout: (B, H, Sq, Sk), or (B, H, max_seqlen_q, max_seqlen_k) in varlen mode,
    indexed by positions inside each sequence and 0 past its lengths. 0 for a key the
    query does not see and along a row with no visible key. Computed in float32
    (float64 for float64 inputs), returned in q's dtype; O(Sq * Sk) memory, a debugging
    aid (``memattn.compat``'s ``return_attn_probs``)."""
    spec = check_call(
        q, k, k, causal=causal, window=window, align=align, bias=bias,  # k stands in for v
        alibi_slopes=alibi_slopes, softcap=softcap, scale=scale, cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
        dtypes=REFERENCE_DTYPES,
    )  # fmt: skip
    wide = torch.float64 if q.dtype == torch.float64 else torch.float32
    probs = torch.zeros(spec.bias_shape, dtype=wide, device=q.device)
    for rows, q_b, k_b, _, bias_b, slopes_b, _ in _sequences(
        spec, q, k, k, bias, alibi_slopes, None, cu_seqlens_q, cu_seqlens_k
    ):
        p, _ = _softmax(_scores(spec, q_b.to(wide), k_b.to(wide), bias_b, slopes_b))
        probs[rows, :, : p.shape[2], : p.shape[3]] = p
    return probs.to(q.dtype)


def _sequences(spec, q, k, v, bias, alibi_slopes, keep, cu_seqlens_q, cu_seqlens_k):
    """Yields (batch rows, q, k, v, bias, slopes, keep) in the dense layout: the whole
    batch once in dense mode, each sequence as a batch of one in varlen mode (bias and
    keep cut to its lengths). bias and slopes come expanded to (B, H, ...)."""
    bias_full = None if bias is None else bias.expand(spec.bias_shape)
    slopes = None if alibi_slopes is None else alibi_slopes.expand(spec.batch, spec.heads)
    if not spec.varlen:
        yield slice(None), q, k, v, bias_full, slopes, keep
        return
    starts_q, starts_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for b in range(spec.batch):
        sq = slice(starts_q[b], starts_q[b + 1])
        sk = slice(starts_k[b], starts_k[b + 1])
        n_q, n_k = sq.stop - sq.start, sk.stop - sk.start
        yield (
            slice(b, b + 1), q[None, sq], k[None, sk], v[None, sk],
            None if bias_full is None else bias_full[b : b + 1, :, :n_q, :n_k],
            None if slopes is None else slopes[b : b + 1],
            None if keep is None else keep[b : b + 1, :, :n_q, :n_k],
        )  # fmt: skip


def visible_mask(spec: AttentionSpec, n_q: int, n_k: int, device) -> torch.Tensor:
    """(n_q, n_k) bool: key j visible from query i, for one sequence of n_q queries, n_k keys."""
    off = n_k - n_q if spec.bottom_right else 0
    i = torch.arange(n_q, device=device)[:, None] + off
    j = torch.arange(n_k, device=device)[None, :]
    mask = torch.ones(n_q, n_k, dtype=torch.bool, device=device)
    if spec.window_right >= 0:
        mask &= j <= i + spec.window_right
    if spec.window_left >= 0:
        mask &= j >= i - spec.window_left
    return mask


def _scores(spec, q, k, bias, slopes):
    """s for q (B, Sq, H, Dqk), k (B, Sk, Hkv, Dqk): (B, H, Sq, Sk), -inf where hidden."""
    n_q, n_k = q.shape[1], k.shape[1]
    s = _grouped(q.transpose(1, 2), k.transpose(1, 2).transpose(-1, -2)) * spec.scale
    if spec.softcap > 0:
        s = spec.softcap * torch.tanh(s / spec.softcap)
    if bias is not None:
        s = s + bias.to(s.dtype)
    if slopes is not None:
        off = n_k - n_q if spec.bottom_right else 0
        i = torch.arange(n_q, device=q.device)[:, None] + off
        j = torch.arange(n_k, device=q.device)[None, :]
        s = s - slopes.to(s.dtype)[:, :, None, None] * (i - j).abs().to(s.dtype)
    return s.masked_fill(~visible_mask(spec, n_q, n_k, q.device), float("-inf"))


def _softmax(s):
    """(p, lse) of scores s along the keys; lse at least float32."""
    lse = torch.logsumexp(s.float() if s.dtype != torch.float64 else s, dim=-1)
    # A row with no visible key has lse = -inf; softmax would give NaN there, we give 0.
    empty_row = torch.isneginf(lse)[..., None]
    p = torch.softmax(s.masked_fill(empty_row, 0.0), dim=-1).masked_fill(empty_row, 0.0)
    return p, lse


def _attention_dense(spec, q, k, v, bias, slopes, keep):
    """Dense attention: q (B, Sq, H, Dqk), k (B, Sk, Hkv, Dqk), v (B, Sk, Hkv, Dv)."""
    p, lse = _softmax(_scores(spec, q, k, bias, slopes))
    if spec.dropout_p > 0:
        p = p * keep.to(p.dtype) / (1.0 - spec.dropout_p)
    out = _grouped(p.to(v.dtype), v.transpose(1, 2))  # (B, H, Sq, Dv)
    return out.transpose(1, 2), lse


def _grouped(x, y):
    """x (B, H, M, K) @ y (B, Hkv, K, N) -> (B, H, M, N), query head h against kv head
    h // (H / Hkv): each kv head's query heads as one matmul, so that K and V are not
    copied per query head (a float64 decode reference at Sk=32768 would take 17 GB)."""
    b, h, m, _ = x.shape
    hkv = y.shape[1]
    out = x.reshape(b, hkv, (h // hkv) * m, x.shape[-1]) @ y
    return out.view(b, h, m, y.shape[-1])
