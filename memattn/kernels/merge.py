"""The ring's merge (memattn.distributed): one partial result over some keys added, in
place and exactly, into the running result over the keys before them, through their
lse. One pass over out, where the same in torch ops took fourteen kernels and six passes
(PERFORMANCE.md, "Context parallel"). decode.py's _merge_kernel merges every split of a
call at once from its partial buffer instead."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import cdiv

BLOCK_ROWS = 16  # rows of one (batch, head) a program: 8 KiB of out at Dv = 128


@triton.jit
def _merge_into_kernel(
    Out, Lse, Part, PartLse, rows, H, DV, stride_ob, stride_om, stride_oh, stride_lb,
    stride_lh, stride_lm, stride_pb, stride_pm, stride_ph, stride_qb, stride_qh, stride_qm,
    BLOCK_ROWS: tl.constexpr, BLOCK_DV: tl.constexpr,
):  # fmt: skip
    """BLOCK_ROWS rows of one (batch, head): lse' = log(e^lse + e^lse_p),
    out' = e^(lse - lse') out + e^(lse_p - lse') out_p; a row neither saw keeps out
    (0 where nothing was merged yet) and lse = -inf."""
    pid = tl.program_id(0)
    blocks = tl.cdiv(rows, BLOCK_ROWS)
    bh = pid // blocks
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    m = (pid % blocks) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_ok = m < rows
    m = m.to(tl.int64)
    lse_at = Lse + b * stride_lb + h * stride_lh + m * stride_lm
    lse = tl.load(lse_at, mask=row_ok, other=float("-inf"))
    part_lse = tl.load(PartLse + b * stride_qb + h * stride_qh + m * stride_qm, mask=row_ok,
                       other=float("-inf"))  # fmt: skip
    top = tl.maximum(lse, part_lse)
    top = tl.where(top == float("-inf"), 0.0, top)
    w_old = tl.exp(lse - top)  # 0 for a side that saw no key
    w_new = tl.exp(part_lse - top)
    total = w_old + w_new
    seen = total > 0.0
    total = tl.where(seen, total, 1.0)
    d = tl.arange(0, BLOCK_DV)
    mask = row_ok[:, None] & (d < DV)[None, :]
    out_at = Out + b * stride_ob + h * stride_oh + m[:, None] * stride_om + d[None, :]
    out = tl.load(out_at, mask=mask, other=0.0)
    part = tl.load(Part + b * stride_pb + h * stride_ph + m[:, None] * stride_pm + d[None, :],
                   mask=mask, other=0.0).to(tl.float32)  # fmt: skip
    merged = (out * w_old[:, None] + part * w_new[:, None]) / total[:, None]
    tl.store(out_at, tl.where(seen[:, None], merged, out), mask=mask)
    tl.store(lse_at, tl.where(seen, top + tl.log(total), float("-inf")), mask=row_ok)


def merge_into(out: torch.Tensor, lse: torch.Tensor, part_out: torch.Tensor,
               part_lse: torch.Tensor) -> None:  # fmt: skip
    """Merges (part_out, part_lse) into (out, lse), in place. out float32 (B, S, H, Dv)
    and part_out (B, S, H, Dv) in any float dtype, each with its last dim contiguous;
    lse and part_lse float32 (B, H, S); any other strides (views of a larger result)."""
    b, rows, h, dv = out.shape
    if out.stride(-1) != 1 or part_out.stride(-1) != 1:
        raise ValueError("merge_into: out and part_out need their last dim contiguous")
    grid = (b * h * cdiv(rows, BLOCK_ROWS),)
    if grid[0] == 0:
        return
    _merge_into_kernel[grid](
        out, lse, part_out, part_lse, rows, h, dv, out.stride(0), out.stride(1), out.stride(2),
        *lse.stride(), part_out.stride(0), part_out.stride(1), part_out.stride(2),
        *part_lse.stride(), BLOCK_ROWS=BLOCK_ROWS, BLOCK_DV=triton.next_power_of_2(dv),
        num_warps=4,
    )  # fmt: skip
