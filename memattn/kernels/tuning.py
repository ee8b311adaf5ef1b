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


def padded_width(spec: AttentionSpec) -> int:
    """The padded head dim the tile kernels' tables are keyed by: q·k's or V's, the wider."""
    return max(padded_head_dim(spec.head_dim_qk), padded_head_dim(spec.head_dim_v))


# Under the interpreter: small tiles, so that tests at odd sizes cross several.
INTERPRETER_FORWARD = Config(32, 16, 1, 1)

# Set by tools and benchmarks to try other configurations; None uses the table.
forward_override: Config | None = None


def forward_config(spec: AttentionSpec) -> Config:
    if forward_override is not None:
        return forward_override
    if interpreting():
        return INTERPRETER_FORWARD
    d = padded_width(spec)
    wide = spec.dtype == torch.float32  # twice the shared memory per tile
    # H100 sweeps (tools/sweep.py): the best correct configuration per head
    # dim. Bias tiles are pipelined with K and V, so a bias needs smaller tiles to fit
    # the 227 KiB of shared memory (tools/compile_sm90.py checks every variant).
    # float32 (3xTF32 dots; tools/sweep.py --dtype float32, B4 S4096, plain / causal
    # TFLOP/s): D=64 128x64 8 warps 54 / 50 (64x64 48 / 45); D=128 128x32 8 warps 2
    # stages 40 / 38 (32x64, swept for IEEE dots, 31 / 29); D=256 64x32 4 warps 21 / 19
    # (32x32 8 warps 16 / 16; 64x64 does not fit).
    if d <= 64:
        if wide:
            return Config(128, 64, 8, 2)
        return Config(128, 64, 4, 3) if spec.has_bias else Config(128, 64, 8, 3)
    if d <= 128:
        if wide:
            return Config(128, 32, 8, 2)
        if spec.has_bias:
            return Config(128, 64, 8, 4)
        if spec.dropout_p > 0:  # the keep tile's reshape takes shared memory too
            return Config(128, 64, 8, 3)
        return Config(128, 128, 8, 3)
    if wide:
        return Config(64, 32, 4, 1)
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
    # H100 sweeps (tools/sweep.py), every candidate checked against the
    # reference first: Triton 3.6 miscompiled dK/dV (old orientation) at 32x128/8 warps/
    # 2 stages and 16x128/4/2. dq_atomic lost everywhere (pointer atomics: 130-240
    # against 310-386 TFLOP/s at D=128), so the table leaves it off.
    d = padded_width(spec)
    causal = spec.window_right >= 0
    # float32 (tools/sweep.py --dtype float32 --tf32x3, B4 S4096, plain / causal
    # TFLOP/s): D=64 64x128 8 warps 33 / 33 (32x64, swept for IEEE dots, 17 / 15); D=128
    # 32x64 4 warps 2 stages 17 / 16 (32x64 8 warps 1 stage 14 / 11; two stages of 64x64
    # at 8 warps do not fit); D=256 keeps IEEE dots (forward.dot_precision): 32x32 8
    # warps 4 / 4 against 3xTF32's 1 / 1 at every candidate.
    if spec.dtype == torch.float32:
        if d <= 64:
            return BackwardConfig(64, 128, 8, 1, 128, 64, 8, 1)
        if d <= 128:
            return BackwardConfig(32, 64, 4, 2, 64, 32, 4, 2)
        return BackwardConfig(32, 32, 8, 1, 32, 32, 8, 1)
    if d <= 64:
        if causal or spec.has_bias:
            return BackwardConfig(64, 64, 4, 1, 64, 64, 4, 2)
        return BackwardConfig(64, 128, 8, 3, 128, 64, 8, 3)
    if d <= 128:
        if spec.has_bias or spec.dropout_p > 0:  # dropout: 231 against 192 TFLOP/s
            return BackwardConfig(32, 128, 8, 3, 128, 64, 8, 3)
        return BackwardConfig(64, 128, 8, 3, 128, 64, 8, 3)
    return BackwardConfig(64, 64, 8, 2, 128, 32, 8, 2)


# The table is tuned on an H100 (227 KiB of shared memory per block). An A100 has 163,
# consumer GPUs 99: where a table entry does not fit, these are tried in order.
FORWARD_FALLBACKS = (Config(64, 64, 4, 2), Config(64, 32, 4, 1), Config(32, 16, 4, 1))
BACKWARD_FALLBACKS = (
    BackwardConfig(64, 64, 4, 1, 64, 64, 4, 1),
    BackwardConfig(32, 32, 4, 1, 32, 32, 4, 1),
    BackwardConfig(16, 32, 4, 1, 32, 16, 4, 1),
)


def forward_configs(spec: AttentionSpec) -> tuple[Config, ...]:
    """The table's configuration, then smaller ones for GPUs it does not fit."""
    return _with_fallbacks(forward_config(spec), forward_override, FORWARD_FALLBACKS)


# forward.rescored_lse's tile (float32 past 128 columns, IEEE dots, no P·V); an sm_90
# compile at D 256/128 and 192/128: 32x64 8 warps 120 registers, 32x32 8 warps 146, no
# spills (but softcap's: 2.5 KB at 128 registers); 64-row tiles spill 2.5-23 KB. H200,
# causal B2 S2048 H16, the backward without it / with 32x64 / 32x32: D 256/128 31.2 /
# 36.7 / 41.0 ms, 256/256 41.4 / 47.1 / 51.3.
RESCORE_CONFIG = Config(32, 64, 8, 1)


def rescore_configs(spec: AttentionSpec) -> tuple[Config, ...]:
    """forward.rescored_lse's configuration, then a smaller one for GPUs it does not fit."""
    if interpreting():
        return (INTERPRETER_FORWARD,)
    return (RESCORE_CONFIG, Config(32, 16, 4, 1))


def backward_configs(spec: AttentionSpec) -> tuple[BackwardConfig, ...]:
    """The table's configuration, then smaller ones for GPUs it does not fit."""
    return _with_fallbacks(backward_config(spec), backward_override, BACKWARD_FALLBACKS)


def _with_fallbacks(first, override, fallbacks) -> tuple:
    # An override (a sweep, a benchmark) must see its own config fail, not a fallback.
    if override is not None or interpreting():
        return (first,)
    return (first, *(c for c in fallbacks if c != first))


_too_big: set[tuple] = set()  # (kernel, spec, config) that raised OutOfResources


def launch_fitting(kernel: str, spec: AttentionSpec, configs, launch):
    """Calls ``launch(config)`` with the first of ``configs`` the GPU can run, and
    returns that config. Triton raises OutOfResources before launching a kernel that
    needs more shared memory (or registers) than the device has; such a config is
    remembered for this spec and kernel and skipped from then on. The last config is
    always tried, so that a call nothing fits raises Triton's own error."""
    from triton.runtime.errors import OutOfResources

    for i, config in enumerate(configs):
        key = (kernel, spec, config)
        if key in _too_big and i < len(configs) - 1:
            continue
        try:
            launch(config)
            return config
        except OutOfResources:
            if i == len(configs) - 1:
                raise
            _too_big.add(key)
    raise AssertionError("unreachable: the last config returns or raises")
