"""Tile shapes, warps and pipeline depth per head dim and device.

A table, not a search: the launchers ask for a config and get one. Under Triton's
interpreter (CPU) tiles are small so that tests at small, odd sizes cross several tiles.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from ..spec import AttentionSpec


@dataclass(frozen=True)
class Config:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def padded_head_dim(d: int) -> int:
    """Head dims are padded to a power of two, at least 16 (tl.dot's minimum)."""
    return max(16, 1 << (d - 1).bit_length())  # plain Python: this runs on every call


# Set by tools and benchmarks to try other configurations; None uses the table.
forward_override: Config | None = None


def forward_config(spec: AttentionSpec) -> Config:
    if forward_override is not None:
        return forward_override
    if interpreting():
        return Config(block_m=32, block_n=16, num_warps=1, num_stages=1)
    d = max(padded_head_dim(spec.head_dim_qk), padded_head_dim(spec.head_dim_v))
    wide = spec.dtype == torch.float32  # twice the shared memory per tile
    # H100 sweeps (PERFORMANCE.md, v2 and v3): the best correct configuration per head
    # dim. Bias tiles are pipelined with K and V, so a bias needs smaller tiles to fit
    # the 227 KiB of shared memory (tools/compile_sm90.py checks every variant).
    if d <= 64:
        if wide:
            return Config(128, 64, 8, 2)
        return Config(128, 64, 4, 3) if spec.has_bias else Config(128, 64, 8, 3)
    if d <= 128:
        if wide:
            return Config(128, 64, 8, 2)
        if spec.has_bias:
            return Config(128, 64, 8, 4)
        if spec.dropout_p > 0:  # the keep tile's reshape takes shared memory too
            return Config(128, 64, 8, 3)
        return Config(128, 128, 8, 3)
    if wide:
        return Config(64, 32, 4, 2)
    return Config(128, 32, 8, 3)


@dataclass(frozen=True)
class BackwardConfig:
    block_m_dkdv: int  # query tile walked by the dK/dV kernel
    block_n_dkdv: int  # key block it holds
    num_warps_dkdv: int
    num_stages_dkdv: int
    block_m_dq: int  # query block the dQ kernel holds
    block_n_dq: int  # key tile it walks
    num_warps_dq: int
    num_stages_dq: int
    # dQ by fp32 atomics inside the dK/dV kernel (the dQ kernel is then skipped, except
    # in deterministic mode); block_m_dq etc. still configure that fallback.
    dq_atomic: bool = False


# Under the interpreter: small tiles, so that tests at odd sizes cross several.
INTERPRETER_BACKWARD = BackwardConfig(16, 32, 1, 1, 32, 16, 1, 1)

# Set by tools and benchmarks to try other configurations; None uses the table.
backward_override: BackwardConfig | None = None


def backward_config(spec: AttentionSpec) -> BackwardConfig:
    if backward_override is not None:
        return backward_override
    if interpreting():
        return INTERPRETER_BACKWARD
    # H100 sweeps (PERFORMANCE.md, v2 and v3), every candidate checked against the
    # reference first: Triton 3.6 miscompiled dK/dV (old orientation) at 32x128/8 warps/
    # 2 stages and 16x128/4/2. dq_atomic lost everywhere (pointer atomics: 130-240
    # against 310-386 TFLOP/s at D=128), so the table leaves it off.
    d = max(padded_head_dim(spec.head_dim_qk), padded_head_dim(spec.head_dim_v))
    causal = spec.window_right >= 0
    if spec.dtype == torch.float32:
        if d <= 128:
            return BackwardConfig(64, 64, 4, 1, 64, 64, 4, 1)
        return BackwardConfig(32, 32, 4, 1, 32, 32, 4, 1)
    if d <= 64:
        if causal or spec.has_bias:
            return BackwardConfig(64, 64, 4, 1, 64, 64, 4, 2)
        return BackwardConfig(64, 128, 8, 3, 128, 64, 8, 3)
    if d <= 128:
        if spec.has_bias:
            return BackwardConfig(32, 128, 8, 3, 128, 64, 8, 3)
        return BackwardConfig(64, 128, 8, 3, 128, 64, 8, 3)
    return BackwardConfig(64, 64, 8, 2, 128, 32, 8, 2)
