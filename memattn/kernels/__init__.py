"""Triton kernels. Imported lazily by memattn.ops: Triton decides at decoration time
whether a kernel runs compiled or in its interpreter (TRITON_INTERPRET=1), so this
package's own module imports none of them. dispatch.py says which kernel runs a call."""

from __future__ import annotations

import contextlib
import contextvars

import torch

from .tuning import interpreting

_SHARING_SMS = contextvars.ContextVar("memattn_sharing_sms", default=False)


@contextlib.contextmanager
def sharing_sms():
    """Kernels launched inside run beside other kernels, such as the NCCL transfers of
    overlapped communication: where a Hopper kernel would run one persistent program
    per SM, each taking a fixed share of the blocks, it launches a program per block
    instead, so that the SMs another kernel holds delay only the blocks that wait for
    them, not a fixed share of the call (PERFORMANCE.md, "Context parallel"). The
    deterministic backward's ordered programs keep theirs: their order of adds is what
    makes the gradients bit for bit the same."""
    token = _SHARING_SMS.set(True)
    try:
        yield
    finally:
        _SHARING_SMS.reset(token)


def shares_sms() -> bool:
    """Whether this call runs inside :func:`sharing_sms`."""
    return _SHARING_SMS.get()


def require_runnable(device: torch.device) -> None:
    """CPU tensors run through Triton's interpreter, which is chosen when Triton
    decorates a kernel: TRITON_INTERPRET=1 must be set before memattn's kernels load."""
    if device.type == "cpu" and not interpreting():
        raise RuntimeError(
            "memattn runs CPU tensors through Triton's interpreter: set TRITON_INTERPRET=1 "
            "in the environment before importing memattn, or use CUDA tensors"
        )
