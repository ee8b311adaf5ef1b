"""Dropout's random state: where the seed and offset come from, and the keep mask a
call used.

A call with dropout draws ``rng_state``, an int64 tensor ``[seed, offset]`` on the
inputs' device, from PyTorch's generator for that device (``torch.randint``), so
``torch.manual_seed`` makes runs repeat and CUDA graph replays draw afresh. The kernels
derive each element's keep bit from it with counter-based Philox (see
``kernels/common.py: dropout_keep``); the backward pass regenerates the same bits.
"""

from __future__ import annotations

import torch

from .kernels import require_runnable

_OFFSET_LIMIT = 2**31  # the offset is one 32-bit Philox counter word


def new_rng_state(device: torch.device | str) -> torch.Tensor:
    """Draws a fresh ``[seed, offset]`` (int64, shape (2,)) from the device's generator."""
    seed = torch.randint(0, 2**62, (1,), device=device, dtype=torch.int64)
    offset = torch.randint(0, _OFFSET_LIMIT, (1,), device=device, dtype=torch.int64)
    return torch.cat([seed, offset])


def dropout_mask(
    rng_state: torch.Tensor,
    dropout_p: float,
    batch: int,
    heads: int,
    seqlen_q: int,
    seqlen_k: int,
) -> torch.Tensor:
    """The boolean keep mask, (B, H, Sq, Sk), that a call with this ``rng_state`` and
    ``dropout_p`` applied (True = kept). In varlen mode pass B and max_seqlen_q/k: the
    mask is indexed by positions inside each sequence.

    ``rng_state`` is what ``memattn.ops.forward`` returned, or, to reproduce a
    ``memattn.attention`` call, ``new_rng_state(device)`` drawn after the same
    ``torch.manual_seed``.
    """
    if not isinstance(rng_state, torch.Tensor) or rng_state.dtype != torch.int64:
        raise TypeError("rng_state must be an int64 tensor [seed, offset]")
    if tuple(rng_state.shape) != (2,):
        raise ValueError(f"rng_state must have shape (2,), got {tuple(rng_state.shape)}")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    for name, n in (("batch", batch), ("heads", heads), ("seqlen_q", seqlen_q),
                    ("seqlen_k", seqlen_k)):  # fmt: skip
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"{name} must be an int >= 0, got {n!r}")
    require_runnable(rng_state.device)
    from .kernels.dropout import keep_mask  # lazily: see memattn/kernels/__init__.py

    return keep_mask(rng_state, float(dropout_p), (batch, heads, seqlen_q, seqlen_k))
