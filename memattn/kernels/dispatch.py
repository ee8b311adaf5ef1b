"""Which kernel family runs a call: the one place that decides, for the forward and the
backward alike.

- The Gluon kernels (forward_sm90.py, backward_sm90/): Hopper GPUs (sm_90) with
  Triton 3.6's Gluon, bf16/fp16, head dims the kernels are built for (64, 128, 192 or
  256 for q·k, 64, 128 or 256 for v, any pair) or that run as the next wider of them
  (kernel_spec: D=96 as 128), where shared memory holds the forward's buffers
  (forward_sm90.takes_head_dims and backward_sm90.takes_head_dims), tensors TMA can
  read, and for the backward at D=64 enough keys per query to beat the tile kernels
  (backward_sm90.MIN_KEYS_PER_QUERY). Options: causal masks either way, windows, GQA,
  ALiBi, softcap (the forward not at D=64 nor with a key row, the backward not with a
  bias gradient past 128 columns), dropout, packed (varlen) batches, and a bias:
  one constant along queries ((B or 1, H or 1, 1, Sk): key padding) as a row of keys,
  any other by TMA tiles (beside dropout's scratch where shared memory holds both:
  forward_sm90.buffers; the backward at every pair, backward_sm90.keeps_bits_in_shared).
  The backward computes a bias gradient of a key row (summed in registers) or of a bias
  read by tiles (dS stored, or added up across the batch or heads it broadcasts over:
  past 128 columns, D=256, Dqk=192, V of 256, by atomics from registers); deterministic
  mode only where dQ is not added up in fp32 across programs, or is in a fixed order
  (backward_sm90.narrow.ORDERED_DQ; a bias gradient summed over batch or heads then in
  one too), or comes from dS stored whole (a full bias gradient) by one matmul
  (backward_sm90.dq_from_full_bias).
  Neither takes global positions for ALiBi or dropout (AttentionSpec.positioned).
- The split-KV forward (decode.py), before either: few queries a sequence (Sq <= 64)
  against many keys (Sk >= 4096), every option but global positions; the query heads
  of a GQA group share each K/V tile read and the keys spread over the SMs. Its
  backward is the others'.
- The Triton tile kernels (forward.py, backward.py): every call, on any GPU Triton
  compiles for and on the CPU through Triton's interpreter (``require_runnable`` in
  this package's __init__ checks it is on).

``forward`` and ``backward`` here are what memattn.ops calls: they allocate the
outputs, answer empty calls without a launch, and hand the call to one family, with a
bias copied over aligned rows where that family would not read it at full width
(common.aligned_bias).
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from ..spec import AttentionSpec, output_shapes
from . import backward as tiles_backward
from . import decode
from . import forward as tiles_forward
from .common import TILE_BIAS_ALIGNMENT, aligned_bias, new_output, sum_to_bias

try:  # Gluon's Hopper API (Triton 3.6); without it every call runs the tile kernels
    from . import backward_sm90, forward_sm90, hopper
except ImportError:
    backward_sm90 = forward_sm90 = hopper = None


@functools.cache
def _major(device_index: int) -> int:
    return torch.cuda.get_device_capability(device_index)[0]


def _gluon_takes(spec: AttentionSpec, q, k, v, bias) -> bool:
    """The calls both Gluon kernels take, head dims aside (see the module's docstring)."""
    if hopper is None or not (hopper.enabled and q.is_cuda and _major(q.device.index) == 9):
        return False  # no Gluon, or not a Hopper GPU
    if spec.dtype not in (torch.bfloat16, torch.float16) or spec.seqlen_k == 0:
        return False
    if spec.positioned:  # not built: ALiBi and dropout at global positions
        return False
    if bias is not None and not hopper.bias_row(spec, bias):  # else by TMA tiles
        if not hopper.bias_readable(spec, bias):
            return False
    return all(hopper.tma_readable(t) for t in (q, k, v))


# Each family reads a bias's rows at full width only where they are aligned, and
# dispatch copies one whose rows are not (common.aligned_bias): TMA reads rows of whole
# 16 bytes (hopper.TMA_BIAS_ALIGNMENT); the tile kernels load 16 bytes at a time where
# Triton knows that 16 divides the strides (it specialises an integer argument so;
# common.TILE_BIAS_ALIGNMENT), else element by element. Most often Sk is not a multiple
# of 8 or 16: a padded batch's mask (the transformers integration makes its biases
# aligned: common.new_bias). H200, tools/ab.py, B4 S4095 H16 (D=64: H32), bias
# without its gradient, TFLOP/s fwd / bwd, before (the tile kernels over the bias as
# given) -> the Gluon kernels over a copy: D128 (B, 1, Sq, Sk) 49 / 139 -> 448 / 471
# (S4096, no copy: 495 / 498), causal 43 / 122 -> 391 / 417, (B, H, Sq, Sk) 46 / 135 ->
# 157 / 274; D64 (1, H, Sq, Sk) 60 / 117 -> 197 / 283. The tile kernels over a copy,
# D128 (1, H, Sq, Sk): 264 / 225 (their unmasked tiles load it without the key mask,
# from a first key Triton is told is aligned: common.tile_start). Its gradient the
# Gluon backward writes over padded rows too (backward_sm90._launch_all), backward,
# tile -> Gluon: BHQK 123 -> 233 (S4096 456: two copies, 1.8 and 1.4 ms, beside a
# 2.6 ms kernel), 1HQK causal 103 -> 262 (S4096 321), B1QK 148 -> 387, D64 1HQK 53 ->
# 193.


def _gluon_bias(spec: AttentionSpec, bias):
    """The bias the Gluon kernels read: over rows TMA reads, but a key row (read by
    pointer in any layout, the forward's from an fp32 copy of its own)."""
    if hopper.bias_row(spec, bias):
        return bias
    return aligned_bias(bias, hopper.TMA_BIAS_ALIGNMENT)


# Head dims the Gluon kernels are not built for run as the next wider ones where that
# takes at most this many times the matmuls' work (kernel_spec: the wider dims over the
# call's). H100, tools/ab.py, B4 S4096 (16k tokens, H = 2048 / D), tile kernels ->
# Gluon, TFLOP/s of the call's own work, fwd / bwd: D=96 causal 320 -> 473 / 238 -> 402,
# not causal 373 -> 493 / 303 -> 447; D=80 causal 268 -> 383 / 200 -> 342; D=40 causal
# 85 -> 263 / 70 -> 292; Dqk=160 / Dv=128 causal 264 -> 577 / 137 -> 341; D=200 causal
# 54 -> 468 / 14 -> 279; D=32 causal (as 64: twice the work) 241 -> 226 / 197 -> 239,
# where the forward keeps the tile kernel. Read once per head dims (kernel_head_dims is
# cached).
MAX_PADDED_WORK = {"forward": 1.75, "backward": 2.0}


@functools.cache  # asked twice a call, forward and backward: host time
def kernel_head_dims(head_dim_qk: int, head_dim_v: int, which: str) -> tuple[int, int]:
    """The (q·k, V) head dims the Gluon ``which`` ("forward" or "backward") runs a
    call's as: its own where its kernels are built for them (forward_sm90.HEAD_DIMS,
    backward_sm90.HEAD_DIMS; forward_sm90.HEAD_DIMS_V), else the next wider within
    MAX_PADDED_WORK (D=96 as 128, 160 as 192, 80/256 as 128/256); its own otherwise
    (which no kernel takes then)."""
    qk_dims = (forward_sm90 if which == "forward" else backward_sm90).HEAD_DIMS
    wider = (next((n for n in qk_dims if n >= head_dim_qk), head_dim_qk),
             next((n for n in forward_sm90.HEAD_DIMS_V if n >= head_dim_v), head_dim_v))
    if max(wider[0] / head_dim_qk, wider[1] / head_dim_v) > MAX_PADDED_WORK[which]:
        return head_dim_qk, head_dim_v
    return wider


def kernel_spec(spec: AttentionSpec, which: str) -> AttentionSpec:
    """The call as the Gluon ``which`` runs it, head dims by kernel_head_dims. The
    kernels' TMA boxes then span the wider dims: loads zero-fill the columns past the
    tensors' own, which add nothing to Q Kᵀ or P V, and stores clip them (pointer stores
    mask them); the scale stays the call's."""
    dqk, dv = kernel_head_dims(spec.head_dim_qk, spec.head_dim_v, which)
    if (dqk, dv) == (spec.head_dim_qk, spec.head_dim_v):
        return spec
    return dataclasses.replace(spec, head_dim_qk=dqk, head_dim_v=dv)


def gluon_forward(spec: AttentionSpec, q, k, v, bias) -> bool:
    """Whether the Gluon forward runs this call (else forward.py's tile kernel)."""
    bias_row = hopper.bias_row(spec, bias)
    if bias_row and (spec.scale == 0 or spec.softcap > 0):  # the key row goes in Q K^T's
        return False  # units (b / scale), where S starts: before softcap's cap
    if spec.softcap > 0 and spec.head_dim_qk <= 64:  # two MUFU ops a score (the exp2,
        return False  # tanh.approx) against D=64's matmuls: both kernels ran 337-345
    return _gluon_takes(spec, q, k, v, bias) and forward_sm90.takes_head_dims(
        kernel_spec(spec, "forward"), bias_row)


def gluon_backward_computes(spec: AttentionSpec, bias, need_dbias: bool) -> bool:
    """Whether the Gluon backward for this head dim computes these features, whatever the
    device: a bias gradient of a bias constant along queries (summed in registers), or
    of one read by tiles (every query and key; dS stored, or added up by TMA where the
    bias broadcasts over batch or heads, into buffers over rows TMA writes);
    with a head dim past 128 (D=256, Dqk=192, V of 256 columns) those gradients from
    registers (stored, or added by atomics: no shared memory for tiles beside D=256's);
    bias tiles beside dropout (backward_sm90.keeps_bits_in_shared where shared memory is
    short); softcap with a bias gradient up to 128 columns (the gradient leaves before
    tanh's derivative, which dK's and dQ's dS carry: past 128 the kernels have no
    room for both)."""
    if spec.softcap > 0 and need_dbias and backward_sm90.is_wide(spec):
        return False
    if not need_dbias or hopper.bias_row(spec, bias):
        return True
    return hopper.bias_readable(spec, bias)


def _gluon_deterministic(spec: AttentionSpec, bias, need_dbias: bool) -> bool:
    """Whether the Gluon backward makes this deterministic call's gradients in a fixed
    order: where dQ is not added up in fp32 across programs (but for a bias gradient
    added by atomics there), is added in a fixed order, or comes from a full bias
    gradient by one matmul."""
    kind = backward_sm90.dbias_kind_of(spec, bias) if need_dbias else None
    if not backward_sm90.dq_in_fp32(spec):  # the wide kernels
        return kind != "summed"
    return backward_sm90.orders_dq(spec, kind) or backward_sm90.dq_from_full_bias(spec, kind)


def gluon_backward(spec: AttentionSpec, q, k, v, grad_out, bias, alibi_slopes, needs) -> bool:
    """Whether the Gluon backward runs this call (else backward.py's tile kernels): it
    computes dQ, dK and dV together, so a call that needs dQ and dK or dV."""
    need_dq, need_dk, need_dv, need_dbias = needs
    if not (need_dq and (need_dk or need_dv) and _gluon_takes(spec, q, k, v, bias)):
        return False
    spec = kernel_spec(spec, "backward")
    return (backward_sm90.takes_head_dims(spec)
            and gluon_backward_computes(spec, bias, need_dbias)
            and (not spec.deterministic or _gluon_deterministic(spec, bias, need_dbias))
            and hopper.keys_per_query(spec) >= backward_sm90.MIN_KEYS_PER_QUERY[spec.head_dim_qk]
            and hopper.tma_readable(grad_out))  # fmt: skip


def forward(spec: AttentionSpec, q, k, v, bias, alibi_slopes, cu_seqlens_q, cu_seqlens_k,
            rng_state) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The forward: out (q's layout, Dv) and lse (float32). rng_state: dropout's
    [seed, offset] (ignored without dropout)."""
    out_shape, lse_shape = output_shapes(spec, q)
    out = new_output(out_shape, q.dtype, q.device)
    lse = new_output(lse_shape, torch.float32, q.device)
    if out.numel() == 0 or spec.seqlen_q == 0:
        return out, lse.fill_(float("-inf"))
    rng_state = rng_state if spec.dropout_p > 0 else None
    if decode.takes(spec):
        run = decode.forward
    elif gluon_forward(spec, q, k, v, bias):
        run, bias = forward_sm90.forward, _gluon_bias(spec, bias)
        spec = kernel_spec(spec, "forward")
    else:
        run, bias = tiles_forward.forward, aligned_bias(bias, TILE_BIAS_ALIGNMENT)
    run(spec, q, k, v, bias, alibi_slopes, rng_state, cu_seqlens_q, cu_seqlens_k, out, lse)
    return out, lse


def backward(spec: AttentionSpec, grad_out, grad_lse, q, k, v, out, lse, bias, alibi_slopes,
             cu_seqlens_q, cu_seqlens_k, rng_state, needs: tuple[bool, bool, bool, bool]):
    """The gradients in ``needs`` (dq, dk, dv, dbias): (dq, dk, dv, dbias), None for
    those not needed. ``grad_lse``: a gradient flowing into lse, or None."""
    needs = (*needs[:3], needs[3] and bias is not None)
    if not any(needs):  # (a bias constant along the keys, alone asking, comes here)
        return None, None, None, None
    if q.shape[0] == 0 or spec.heads == 0 or spec.seqlen_q == 0 or spec.seqlen_k == 0:
        return tuple(torch.zeros(t.shape, dtype=t.dtype, device=t.device) if need else None
                     for t, need in zip((q, k, v, bias), needs))  # fmt: skip
    if needs[3] and (bias.dim() == 0 or bias.shape[-1] == 1):
        dq, dk, dv, _ = backward(spec, grad_out, grad_lse, q, k, v, out, lse, bias,
                                 alibi_slopes, cu_seqlens_q, cu_seqlens_k, rng_state,
                                 (*needs[:3], False))  # fmt: skip
        return dq, dk, dv, _row_bias_gradient(spec, bias, lse, grad_lse, cu_seqlens_q)
    rng_state = rng_state if spec.dropout_p > 0 else None
    if gluon_backward(spec, q, k, v, grad_out, bias, alibi_slopes, needs):
        run, bias = backward_sm90.run, _gluon_bias(spec, bias)
        spec = kernel_spec(spec, "backward")
    else:
        run, bias = tiles_backward.backward, aligned_bias(bias, TILE_BIAS_ALIGNMENT)
    return run(spec, grad_out, grad_lse, q, k, v, out, lse, bias, alibi_slopes, cu_seqlens_q,
               cu_seqlens_k, rng_state, needs)  # fmt: skip


def _row_bias_gradient(spec: AttentionSpec, bias, lse, grad_lse, cu_seqlens_q):
    """The gradient of a bias constant along the keys, exactly. It shifts a row's scores
    alike: softmax ignores that (out's part is 0; the kernels' would be the rounding of
    dS's row sums, delta taken from the stored out) and lse moves with it (lse's part
    is grad_lse, where the row sees a key), summed over what the bias broadcasts."""
    if grad_lse is None:
        return torch.zeros(bias.shape, dtype=bias.dtype, device=bias.device)
    rows = grad_lse.float().masked_fill(torch.isneginf(lse), 0.0)
    if spec.varlen:  # (H, tokens) to (B, H, max_seqlen_q), by position in the sequence
        token = torch.arange(rows.shape[1], device=rows.device)
        starts = cu_seqlens_q.long()
        sequence = torch.searchsorted(starts[1:], token, right=True)
        full = rows.new_zeros(spec.batch, spec.seqlen_q, spec.heads)
        full[sequence, token - starts[sequence]] = rows.T
        rows = full.transpose(1, 2)
    return sum_to_bias(rows[..., None], bias)
