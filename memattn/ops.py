"""The low-level ops, ``forward`` and ``backward``, and the autograd Function that
joins them behind ``memattn.attention``.

Each op checks its call through ``spec.check_call`` and launches the kernels. They take
the same options as ``memattn.attention`` and return everything a caller needs to
differentiate later: out, lse and the dropout rng state.
"""

from __future__ import annotations

import dataclasses

import torch

from . import dropout as _dropout
from .spec import AttentionSpec, check_call


def require_runnable(device: torch.device) -> None:
    """CPU tensors run through Triton's interpreter, which is chosen when Triton
    decorates a kernel: TRITON_INTERPRET=1 must be set before memattn's kernels load."""
    from .kernels.tuning import interpreting

    if device.type == "cpu" and not interpreting():
        raise RuntimeError(
            "memattn runs CPU tensors through Triton's interpreter: set TRITON_INTERPRET=1 "
            "in the environment before importing memattn, or use CUDA tensors"
        )


def _check_rng_state(rng_state, spec: AttentionSpec) -> torch.Tensor:
    if rng_state is None:
        return _dropout.new_rng_state(spec.device)
    if not isinstance(rng_state, torch.Tensor):
        raise TypeError(f"rng_state must be a torch.Tensor, got {type(rng_state).__name__}")
    if rng_state.dtype != torch.int64 or tuple(rng_state.shape) != (2,):
        raise ValueError(
            f"rng_state must be an int64 tensor of shape (2,) [seed, offset], got "
            f"{rng_state.dtype} {tuple(rng_state.shape)}"
        )
    if rng_state.device != spec.device:
        raise ValueError(f"rng_state must be on {spec.device} like q, got {rng_state.device}")
    return rng_state


def forward(
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
    deterministic: bool = False,
    rng_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Attention forward. Same options as :func:`memattn.attention`.

    ``rng_state``: an int64 ``[seed, offset]`` tensor to replay a dropout mask; drawn
    from PyTorch's generator when None and ``dropout_p > 0``.

    Returns ``(out, lse, rng_state)``: out (B, Sq, H, Dv) or (Tq, H, Dv) in q's dtype;
    lse float32 (B, H, Sq) or (H, Tq), natural log, -inf for rows with no visible key;
    rng_state the ``[seed, offset]`` used (an empty tensor without dropout).
    """
    spec = check_call(
        q, k, v, causal=causal, window=window, align=align, bias=bias,
        alibi_slopes=alibi_slopes, softcap=softcap, scale=scale, dropout_p=dropout_p,
        cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k, deterministic=deterministic,
    )  # fmt: skip
    if spec.dropout_p > 0:
        rng_state = _check_rng_state(rng_state, spec)
    else:
        rng_state = torch.empty(0, dtype=torch.int64, device=spec.device)
    out, lse = forward_checked(spec, q, k, v, bias, alibi_slopes, cu_seqlens_q, cu_seqlens_k,
                               rng_state)  # fmt: skip
    return out, lse, rng_state


def forward_checked(spec, q, k, v, bias, alibi_slopes, cu_seqlens_q, cu_seqlens_k, rng_state):
    """forward() after check_call: the launch, for callers that already hold a spec."""
    require_runnable(spec.device)
    from .kernels import forward as _fwd

    return _fwd.forward(spec, q, k, v, bias, alibi_slopes, cu_seqlens_q, cu_seqlens_k,
                        rng_state if spec.dropout_p > 0 else None)  # fmt: skip


def backward(
    grad_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
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
    deterministic: bool = False,
    rng_state: torch.Tensor | None = None,
    needs: tuple[bool, bool, bool, bool] = (True, True, True, False),
) -> tuple[torch.Tensor | None, ...]:
    """Attention backward: the gradients of out with respect to q, k, v and bias.

    ``out``/``lse`` are what :func:`forward` returned, or any pair a caller combines
    itself (context-parallel attention passes the merged lse); ``rng_state`` the
    forward's dropout state. ``needs`` = (dq, dk, dv, dbias) selects what is computed.
    Returns (dq, dk, dv, dbias), None for what was not asked; dbias in the bias's own
    shape and dtype. deterministic=True (or torch.use_deterministic_algorithms) makes
    every gradient bit-identical across runs.
    """
    spec = check_call(
        q, k, v, causal=causal, window=window, align=align, bias=bias,
        alibi_slopes=alibi_slopes, softcap=softcap, scale=scale, dropout_p=dropout_p,
        cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k, deterministic=deterministic,
    )  # fmt: skip
    out_shape = q.shape[:-1] + (spec.head_dim_v,)
    for name, t in (("grad_out", grad_out), ("out", out)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if tuple(t.shape) != tuple(out_shape) or t.dtype != q.dtype or t.device != q.device:
            raise ValueError(
                f"{name} must be a {q.dtype} tensor of shape {tuple(out_shape)} on {q.device}, "
                f"got {t.dtype} {tuple(t.shape)} on {t.device}"
            )
    lse_shape = (spec.heads, q.shape[0]) if spec.varlen else spec.bias_shape[:3]
    if not isinstance(lse, torch.Tensor) or lse.dtype != torch.float32 or \
            tuple(lse.shape) != tuple(lse_shape) or lse.device != q.device:  # fmt: skip
        raise ValueError(f"lse must be a float32 tensor of shape {tuple(lse_shape)} on {q.device}")
    if not (isinstance(needs, tuple) and len(needs) == 4 and all(isinstance(n, bool) for n in needs)):
        raise TypeError(f"needs must be a tuple of 4 bools (dq, dk, dv, dbias), got {needs!r}")
    if spec.dropout_p > 0:
        if rng_state is None:
            raise ValueError("rng_state (the forward's [seed, offset]) is required with dropout_p > 0")
        rng_state = _check_rng_state(rng_state, spec)
    return backward_checked(spec, grad_out, q, k, v, out, lse, bias, alibi_slopes,
                            cu_seqlens_q, cu_seqlens_k, rng_state, needs)  # fmt: skip


def backward_checked(spec, grad_out, q, k, v, out, lse, bias, alibi_slopes, cu_seqlens_q,
                     cu_seqlens_k, rng_state, needs):  # fmt: skip
    """backward() after check_call: the launch, for callers that already hold a spec."""
    require_runnable(spec.device)
    from .kernels import backward as _bwd

    if torch.are_deterministic_algorithms_enabled() and not spec.deterministic:
        spec = dataclasses.replace(spec, deterministic=True)
    return _bwd.backward(spec, grad_out, q, k, v, out, lse, bias, alibi_slopes, cu_seqlens_q,
                         cu_seqlens_k, rng_state, needs)  # fmt: skip


class Attention(torch.autograd.Function):
    """memattn.attention's autograd: saves q, k, v, out, lse and the rng state, memory
    O(B * H * S), and recomputes the rest in the backward kernels."""

    @staticmethod
    def forward(ctx, q, k, v, bias, alibi_slopes, cu_seqlens_q, cu_seqlens_k, spec):
        rng_state = torch.empty(0, dtype=torch.int64, device=spec.device)
        if spec.dropout_p > 0:
            rng_state = _dropout.new_rng_state(spec.device)
        out, lse = forward_checked(spec, q, k, v, bias, alibi_slopes, cu_seqlens_q,
                                   cu_seqlens_k, rng_state)  # fmt: skip
        ctx.save_for_backward(q, k, v, out, lse, bias, alibi_slopes, cu_seqlens_q,
                              cu_seqlens_k, rng_state)  # fmt: skip
        ctx.spec = spec
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, _grad_lse):
        q, k, v, out, lse, bias, alibi, cu_q, cu_k, rng_state = ctx.saved_tensors
        needs = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2],
                 ctx.needs_input_grad[3])  # fmt: skip
        dq, dk, dv, dbias = backward_checked(ctx.spec, grad_out, q, k, v, out, lse, bias, alibi,
                                             cu_q, cu_k, rng_state, needs)  # fmt: skip
        return dq, dk, dv, dbias, None, None, None, None
