"""The low-level ops: ``forward`` (and, with the backward pass, ``backward``).

Each op checks its call through ``spec.check_call`` and launches the kernels. They take
the same options as ``memattn.attention`` and return everything a caller needs to
differentiate later: out, lse and the dropout rng state.
"""

from __future__ import annotations

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
