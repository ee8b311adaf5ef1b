"""Triton kernels. Imported lazily by memattn.ops: Triton decides at decoration time
whether a kernel runs compiled or in its interpreter (TRITON_INTERPRET=1), so this
package's own module imports none of them. dispatch.py says which kernel runs a call."""

from __future__ import annotations

import torch

from .tuning import interpreting


def require_runnable(device: torch.device) -> None:
    """CPU tensors run through Triton's interpreter, which is chosen when Triton
    decorates a kernel: TRITON_INTERPRET=1 must be set before memattn's kernels load."""
    if device.type == "cpu" and not interpreting():
        raise RuntimeError(
            "memattn runs CPU tensors through Triton's interpreter: set TRITON_INTERPRET=1 "
            "in the environment before importing memattn, or use CUDA tensors"
        )
