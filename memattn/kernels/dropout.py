"""A kernel that writes out the dropout keep mask, from the same jit helper the
attention kernels use, so the mask it returns is the one a call applied."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import cdiv, dropout_keep


@triton.jit
def _keep_mask_kernel(
    Rng, Mask, H, seqlen_q, seqlen_k, num_m_blocks, num_n_blocks, dropout_p,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    bh = pid // (num_m_blocks * num_n_blocks)
    rest = pid % (num_m_blocks * num_n_blocks)
    offs_m = (rest // num_n_blocks) * BLOCK_M + tl.arange(0, BLOCK_M)
    start_n = (rest % num_n_blocks) * BLOCK_N
    offs_n = start_n + tl.arange(0, BLOCK_N)
    keep = dropout_keep(tl.load(Rng), tl.load(Rng + 1), bh, offs_m, start_n, dropout_p, BLOCK_N)
    base = Mask + tl.cast(bh, tl.int64) * seqlen_q * seqlen_k
    ptrs = base + offs_m[:, None].to(tl.int64) * seqlen_k + offs_n[None, :]
    ok = (offs_m[:, None] < seqlen_q) & (offs_n[None, :] < seqlen_k)
    tl.store(ptrs, keep.to(tl.int8), mask=ok)


def keep_mask(rng_state: torch.Tensor, dropout_p: float, shape: tuple[int, int, int, int]):
    batch, heads, seqlen_q, seqlen_k = shape
    mask = torch.empty(shape, dtype=torch.int8, device=rng_state.device)
    if mask.numel() == 0:
        return mask.bool()
    block_m, block_n = 32, 32
    num_m, num_n = cdiv(seqlen_q, block_m), cdiv(seqlen_k, block_n)
    grid = (batch * heads * num_m * num_n,)
    _keep_mask_kernel[grid](
        rng_state, mask, heads, seqlen_q, seqlen_k, num_m, num_n, dropout_p,
        BLOCK_M=block_m, BLOCK_N=block_n,
    )  # fmt: skip
    return mask.bool()
