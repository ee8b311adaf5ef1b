"""``memattn bench``: memattn against torch's attention backends, same inputs, one process.

Times are medians from triton.testing.do_bench. TFLOP/s count 4*B*H*Sq*Sk*D for the
forward (halved for causal) and 2.5x that for the backward.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

import torch

import memattn


@dataclass(frozen=True)
class Shape:
    batch: int
    heads: int
    seqlen: int
    head_dim: int
    causal: bool
    feature: str = ""  # "bias_grad" for a full (B, H, S, S) bias that needs a gradient

    def flops_fwd(self) -> float:
        f = 4.0 * self.batch * self.heads * self.seqlen**2 * self.head_dim
        return f / 2 if self.causal else f


def shapes(quick: bool) -> list[Shape]:
    if quick:
        return [Shape(4, 16, 4096, 128, c) for c in (False, True)] + [
            Shape(4, 16, 4096, 128, False, "bias_grad")
        ]
    out = []
    for d, h in ((64, 32), (128, 16), (256, 8)):
        for s in (512, 1024, 2048, 4096, 8192, 16384):
            for c in (False, True):
                out.append(Shape(16384 // s, h, s, d, c))
    out += [Shape(4, 16, 4096, 128, c, "bias_grad") for c in (False, True)]
    return out


def _sdpa(backend):
    from torch.nn.attention import sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention

    def run(q, k, v, causal, bias):  # q (B, S, H, D): SDPA wants (B, H, S, D)
        with sdpa_kernel(backend):
            o = scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                attn_mask=bias, is_causal=causal and bias is None,
            )  # fmt: skip
        return o.transpose(1, 2)

    return run


def _memattn(q, k, v, causal, bias):
    return memattn.attention(q, k, v, causal=causal, bias=bias)


def implementations(quick: bool) -> dict:
    from torch.nn.attention import SDPBackend

    impls = {
        "memattn": _memattn,
        "sdpa_flash": _sdpa(SDPBackend.FLASH_ATTENTION),
        "sdpa_efficient": _sdpa(SDPBackend.EFFICIENT_ATTENTION),
        "sdpa_cudnn": _sdpa(SDPBackend.CUDNN_ATTENTION),
    }
    if quick:  # the floor: materialises (S, S) per head
        impls["sdpa_math"] = _sdpa(SDPBackend.MATH)
    return impls


def time_one(fn, shape: Shape, backward: bool) -> float | None:
    """Median milliseconds of one forward (or backward) call; None if it cannot run."""
    from triton.testing import do_bench

    b, h, s, d = shape.batch, shape.heads, shape.seqlen, shape.head_dim
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16,
                           requires_grad=backward) for _ in range(3))  # fmt: skip
    bias = None
    if shape.feature == "bias_grad":
        bias = torch.randn(b, h, s, s, device="cuda", dtype=torch.bfloat16,
                           requires_grad=backward)  # fmt: skip
        if shape.causal:  # SDPA takes no is_causal with a mask: fold causal into the bias
            with torch.no_grad():
                bias.masked_fill_(torch.ones(s, s, device="cuda", dtype=torch.bool).triu(1),
                                  float("-inf"))  # fmt: skip
    causal = shape.causal and bias is None
    try:
        if not backward:
            return do_bench(lambda: fn(q, k, v, causal, bias), return_mode="median")
        out = fn(q, k, v, causal, bias)
        grad = torch.randn_like(out)
        leaves = [t for t in (q, k, v, bias) if t is not None]
        return do_bench(lambda: out.backward(grad, retain_graph=True), grad_to_none=leaves,
                        return_mode="median")  # fmt: skip
    except (RuntimeError, NotImplementedError):
        return None
    finally:
        torch.cuda.synchronize()


def main(args) -> int:
    from rich.console import Console
    from rich.progress import track
    from rich.table import Table

    if not torch.cuda.is_available():
        print("memattn bench needs a CUDA GPU")
        return 1
    impls = implementations(args.quick)
    rows = []
    todo = [(s, name) for s in shapes(args.quick) for name in impls]
    for shape, name in track(todo, description="timing"):
        row = dict(impl=name, **asdict(shape))
        for pass_, backward in (("fwd", False), ("bwd", True)):
            ms = time_one(impls[name], shape, backward)
            flops = shape.flops_fwd() * (2.5 if backward else 1.0)
            row[f"{pass_}_ms"] = ms
            row[f"{pass_}_tflops"] = None if ms is None else flops / ms / 1e9
        rows.append(row)
    with open(args.json, "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                       rows=rows), f, indent=1)  # fmt: skip

    table = Table(title=f"TFLOP/s on {torch.cuda.get_device_name()} (bf16, fwd / bwd)")
    for col in ("B", "H", "S", "D", "causal", "feature", *impls):
        table.add_column(col)
    for shape in shapes(args.quick):
        cells = []
        for name in impls:
            r = next(r for r in rows if r["impl"] == name and r["seqlen"] == shape.seqlen
                     and r["head_dim"] == shape.head_dim and r["causal"] == shape.causal
                     and r["feature"] == shape.feature)  # fmt: skip
            cells.append(" / ".join("-" if r[k] is None else f"{r[k]:.0f}"
                                    for k in ("fwd_tflops", "bwd_tflops")))  # fmt: skip
        table.add_row(str(shape.batch), str(shape.heads), str(shape.seqlen),
                      str(shape.head_dim), str(shape.causal), shape.feature, *cells)  # fmt: skip
    Console(width=200).print(table)
    return 0
