"""The public attention function: thin, documented, everything else lives below it."""

from __future__ import annotations

import torch

from . import ops


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
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    return_lse: bool = False,
    deterministic: bool = False,
):
    """Exact attention, memory O(S) per head: softmax(scale * q @ k^T + mods) @ v.

    Layout, dense mode: q (B, Sq, H, Dqk), k (B, Sk, Hkv, Dqk), v (B, Sk, Hkv, Dv);
    returns out (B, Sq, H, Dv) in q's dtype. Varlen mode (cu_seqlens_q/k given, int32,
    (B+1,), starting at 0, non-decreasing): q (Tq, H, Dqk), k (Tk, Hkv, Dqk),
    v (Tk, Hkv, Dv), out (Tq, H, Dv); masks, ALiBi and alignment apply per sequence.
    H must be a multiple of Hkv (GQA/MQA); Dqk and Dv in [1, 256]. dtypes: float16,
    bfloat16, float32 (its dots as 3xTF32, near float32, as PyTorch's memory-efficient
    kernel does, whatever allow_tf32 says). Any strides.

    Options (``off`` = 0 for align="top_left", Sk - Sq for "bottom_right", per sequence):
      causal:       key j visible from query i only when j <= i + off.
      window:       (left, right): j visible when i + off - left <= j <= i + off + right;
                    -1 leaves a side unbounded. Combines with causal.
      bias:         additive float tensor broadcastable to (B, H, Sq, Sk); in varlen
                    mode to (B, H, max_seqlen_q, max_seqlen_k), indexed by positions
                    inside each sequence. Read through zero strides, never expanded;
                    rows not aligned (a row stride 8 does not divide on Hopper, 16
                    elsewhere; keys strided) from an aligned copy, as SDPA does.
      alibi_slopes: float32 (H,) or (B, H): adds -slope * |i + off - j|.
      softcap:      > 0: s = softcap * tanh(s / softcap) on the scaled score, before
                    bias, ALiBi and masks.
      scale:        score scale, default 1 / sqrt(Dqk).
      dropout_p:    drops probabilities with Philox keyed by a seed/offset drawn from
                    PyTorch's generator (``torch.manual_seed`` repeats runs); see
                    ``memattn.dropout_mask`` and ``memattn.ops.forward``.
      max_seqlen_q/k: longest sequence (varlen); read from cu_seqlens when None.
      return_lse:   also return lse, float32, natural log, (B, H, Sq) or (H, Tq);
                    -inf (and out = 0) for a query row with no visible key.
      deterministic: bit-identical gradients across runs (the forward always is);
                    also on under torch.use_deterministic_algorithms(True).

    Differentiable with respect to q, k, v and bias (dbias is reduced over the bias's
    broadcast dimensions), and through lse; alibi_slopes and softcap are constants.
    The autograd saves q, k, v, out, lse and the dropout state: memory O(B * H * S),
    never O(S^2). Runs as the custom op torch.ops.memattn.forward: torch.compile
    traces through it (fullgraph), CUDA graphs capture it (dropout included).
    """
    out, lse, _ = ops.forward_call(
        q, k, v, bias, alibi_slopes, cu_seqlens_q, cu_seqlens_k, None,
        (causal, window, align, softcap, scale, dropout_p, max_seqlen_q, max_seqlen_k,
         deterministic, None),
    )  # fmt: skip
    return (out, lse) if return_lse else out
