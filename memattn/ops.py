"""The low-level ops, ``forward`` and ``backward``, as PyTorch custom ops.

Two layers. The Python functions ``forward``/``backward`` are what users call: they
validate through ``spec.check_call`` (every user-facing error, raised before any
kernel) and call the custom ops ``torch.ops.memattn.forward``/``backward`` with the
normalised options of the spec, the forward through an autograd.Function. The custom
ops (torch.library, with fake implementations for torch.compile) re-check shapes and
launch the kernels. Eager calls on plain tensors skip the dispatcher and run the ops'
bodies directly with the spec already checked (``_skips_dispatcher``): the same code,
less host time per call (PERFORMANCE.md). Dropout's rng state is drawn in Python,
before the op, so that an op's result depends on its inputs alone.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from . import dropout as _dropout
from .kernels import require_runnable
from .spec import AttentionSpec, check_call, output_shapes


def _check_rng_state(rng_state, spec: AttentionSpec) -> Tensor:
    if rng_state is None:
        return _dropout.new_rng_state(spec.device)
    if not isinstance(rng_state, Tensor):
        raise TypeError(f"rng_state must be a torch.Tensor, got {type(rng_state).__name__}")
    if rng_state.dtype != torch.int64 or tuple(rng_state.shape) != (2,):
        raise ValueError(
            f"rng_state must be an int64 tensor of shape (2,) [seed, offset], got "
            f"{rng_state.dtype} {tuple(rng_state.shape)}"
        )
    if rng_state.device != spec.device:
        raise ValueError(f"rng_state must be on {spec.device} like q, got {rng_state.device}")
    return rng_state


# ------------------------------------------------------------------ the custom ops


def _op_options(spec: AttentionSpec) -> tuple:
    """The normalised options a custom op takes, in its schema's order."""
    return (
        spec.window_left, spec.window_right, spec.bottom_right, spec.softcap, spec.scale,
        spec.dropout_p, spec.seqlen_q if spec.varlen else 0,
        spec.seqlen_k if spec.varlen else 0, spec.position_q, spec.position_k,
        spec.deterministic,
    )  # fmt: skip


_SPEC_CACHE: dict[tuple, AttentionSpec] = {}


def _metadata(t: Tensor | None):
    if t is None:
        return None
    return (t.shape, t.stride(), t.dtype, t.device)


def _memoised(tensors: tuple, options: tuple, check) -> AttentionSpec:
    """check(), memoised on the tensors' metadata and the options, which are all a check
    of a dense call reads: a full check costs a tenth of a small call's host time, all
    of it before the kernel launches. Traced calls (torch.compile, export: symbolic
    shapes), tensor subclasses and unhashable options are checked every time."""
    if torch.compiler.is_compiling() or not all(t is None or type(t) is Tensor
                                                for t in tensors):  # fmt: skip
        return check()
    key = (*map(_metadata, tensors), *options)
    try:
        spec = _SPEC_CACHE.get(key)
    except TypeError:  # an unhashable option (a list for window, say)
        return check()
    if spec is None:
        spec = check()
        if len(_SPEC_CACHE) >= 256:  # many distinct shapes: start over
            _SPEC_CACHE.clear()
        _SPEC_CACHE[key] = spec
    return spec


def _op_spec(q, k, v, bias, alibi_slopes, cu_seqlens_q, cu_seqlens_k, *options) -> AttentionSpec:
    """The spec of an op call: shapes re-checked, cu_seqlens values not read again."""
    tensors = (q, k, v, bias, alibi_slopes, cu_seqlens_q, cu_seqlens_k)
    return _memoised(tensors, ("op", *options), lambda: _check_op_call(*tensors, *options))


# The options of the Python entry points, in the order _check_user_call takes them.
_USER_OPTIONS = ("causal", "window", "align", "softcap", "scale", "dropout_p", "max_seqlen_q",
                 "max_seqlen_k", "deterministic", "positions")


def _check_user_call(q, k, v, bias, alibi_slopes, cu_seqlens_q, cu_seqlens_k,
                     options: tuple) -> AttentionSpec:  # fmt: skip
    """check_call for the Python entry points, ``options`` their values in _USER_OPTIONS'
    order. Dense calls are memoised (_memoised); the key holds each option's type beside
    its value, so that True does not pass for 1 nor 1 for 1.0 (nor inside window's
    tuple). Varlen calls read cu_seqlens' values every time."""

    def check():
        return check_call(q, k, v, bias=bias, alibi_slopes=alibi_slopes,
                          cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                          **dict(zip(_USER_OPTIONS, options)))  # fmt: skip

    if cu_seqlens_q is not None or cu_seqlens_k is not None:
        return check()
    window, positions = options[1], options[9]
    types = (*map(type, options), *(tuple(map(type, x)) if type(x) is tuple else None
                                    for x in (window, positions)))
    return _memoised((q, k, v, bias, alibi_slopes), ("user", *options, *types), check)


def _check_op_call(q, k, v, bias, alibi_slopes, cu_seqlens_q, cu_seqlens_k, window_left,
                   window_right, bottom_right, softcap, scale, dropout_p, max_seqlen_q,
                   max_seqlen_k, position_q, position_k,
                   deterministic) -> AttentionSpec:  # fmt: skip
    varlen = cu_seqlens_q is not None
    return check_call(
        q, k, v, window=(window_left, window_right),
        align="bottom_right" if bottom_right else "top_left", bias=bias,
        alibi_slopes=alibi_slopes, softcap=softcap, scale=scale, dropout_p=dropout_p,
        cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
        max_seqlen_q=max_seqlen_q if varlen else None,
        max_seqlen_k=max_seqlen_k if varlen else None,
        deterministic=deterministic, positions=(position_q, position_k),
        read_cu_seqlens=False,
    )  # fmt: skip


@torch.library.custom_op("memattn::forward", mutates_args=())
def _forward_op(
    q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, alibi_slopes: Tensor | None,
    cu_seqlens_q: Tensor | None, cu_seqlens_k: Tensor | None, rng_state: Tensor | None,
    window_left: int, window_right: int, bottom_right: bool, softcap: float, scale: float,
    dropout_p: float, max_seqlen_q: int, max_seqlen_k: int, position_q: int, position_k: int,
    deterministic: bool,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    spec = _op_spec(q, k, v, bias, alibi_slopes, cu_seqlens_q, cu_seqlens_k, window_left,
                    window_right, bottom_right, softcap, scale, dropout_p, max_seqlen_q,
                    max_seqlen_k, position_q, position_k, deterministic)  # fmt: skip
    return _run_forward(spec, q, k, v, bias, alibi_slopes, cu_seqlens_q, cu_seqlens_k,
                        rng_state)  # fmt: skip


def _run_forward(spec, q, k, v, bias, alibi_slopes, cu_seqlens_q, cu_seqlens_k, rng_state):
    """The forward op's body, given its checked spec."""
    require_runnable(spec.device)
    from .kernels import dispatch

    return dispatch.forward(spec, q, k, v, bias, alibi_slopes, cu_seqlens_q, cu_seqlens_k,
                            rng_state)


@_forward_op.register_fake
def _forward_fake(q, k, v, bias, alibi_slopes, cu_seqlens_q, cu_seqlens_k, rng_state,
                  *options):  # fmt: skip
    spec = _op_spec(q, k, v, bias, alibi_slopes, cu_seqlens_q, cu_seqlens_k, *options)
    out_shape, lse_shape = output_shapes(spec, q)
    out = q.new_empty(out_shape)
    lse = q.new_empty(lse_shape, dtype=torch.float32)
    return out, lse


@torch.library.custom_op("memattn::backward", mutates_args=())
def _backward_op(
    grad_out: Tensor, grad_lse: Tensor | None, q: Tensor, k: Tensor, v: Tensor,
    out: Tensor, lse: Tensor, bias: Tensor | None, alibi_slopes: Tensor | None,
    cu_seqlens_q: Tensor | None, cu_seqlens_k: Tensor | None, rng_state: Tensor | None,
    window_left: int, window_right: int, bottom_right: bool, softcap: float, scale: float,
    dropout_p: float, max_seqlen_q: int, max_seqlen_k: int, position_q: int, position_k: int,
    deterministic: bool, needs: list[bool],
) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """Returns (dq, dk, dv, dbias), an empty tensor for each gradient not needed."""
    spec = _op_spec(q, k, v, bias, alibi_slopes, cu_seqlens_q, cu_seqlens_k, window_left,
                    window_right, bottom_right, softcap, scale, dropout_p, max_seqlen_q,
                    max_seqlen_k, position_q, position_k, deterministic)  # fmt: skip
    grads = _run_backward(spec, grad_out, grad_lse, q, k, v, out, lse, bias, alibi_slopes,
                          cu_seqlens_q, cu_seqlens_k, rng_state, needs)  # fmt: skip
    return tuple(q.new_empty(0) if g is None else g for g in grads)


def _run_backward(spec, grad_out, grad_lse, q, k, v, out, lse, bias, alibi_slopes,
                  cu_seqlens_q, cu_seqlens_k, rng_state, needs) -> tuple:  # fmt: skip
    """The backward op's body, given its checked spec: (dq, dk, dv, dbias), None for a
    gradient not needed, each contiguous whatever its input's layout, as the fake
    declares (Inductor checks a custom op's strides against its fake's)."""
    require_runnable(spec.device)
    from .kernels import dispatch

    grads = dispatch.backward(spec, grad_out, grad_lse, q, k, v, out, lse, bias, alibi_slopes,
                              cu_seqlens_q, cu_seqlens_k, rng_state, tuple(needs))  # fmt: skip
    return tuple(None if g is None else g.contiguous() for g in grads)


def _skips_dispatcher(tensors) -> bool:
    """Whether a call may run the op bodies directly instead of through PyTorch's
    dispatcher: plain tensors, nothing tracing (torch.compile, export), no functorch
    transform (vmap, grad) and no dispatch or torch-function mode (FakeTensorMode,
    DeviceContext, ...) to honour.
    The dispatcher's Python layers (autograd key, redispatch, backend wrapper, dynamo's
    disable guard) cost more host time per call than a small shape's kernels."""
    return (not torch.compiler.is_compiling()
            and not torch._C._len_torch_dispatch_stack()
            and not torch._C._is_torch_function_mode_enabled()
            and not torch._C._are_functorch_transforms_active()
            and all(t is None or type(t) is Tensor for t in tensors))  # fmt: skip


@_backward_op.register_fake
def _backward_fake(grad_out, grad_lse, q, k, v, out, lse, bias, alibi_slopes, cu_seqlens_q,
                   cu_seqlens_k, rng_state, *options_and_needs):  # fmt: skip
    *options, needs = options_and_needs
    _op_spec(q, k, v, bias, alibi_slopes, cu_seqlens_q, cu_seqlens_k, *options)
    like = (q, k, v, bias)
    return tuple(
        t.new_empty(t.shape) if need and t is not None else q.new_empty(0)
        for t, need in zip(like, needs)
    )


class _Attention(torch.autograd.Function):
    """Autograd for the forward op, as a Function around the two custom ops (the pattern
    flash-attn uses). torch.compile traces through it into the ops. Registering autograd
    on the op itself (torch.library's register_autograd) cost ~150 us of host time per
    call (measured on the CPU) in torch's argument re-binding, more than the whole
    kernel at small shapes.

    Inputs: the op's tensors with repeats replaced by None, then one tuple (one
    argument: each costs host time in Function.apply) of ``same_as`` (for each tensor,
    the index of the earlier identical tensor, or -1), the checked spec where the call
    may skip the dispatcher (None: go through the ops), the op's options, and
    (out, lse) where the forward has already run (`forward`), None otherwise. Dynamo rejects
    a Function given one tensor twice (cu_seqlens_q is cu_seqlens_k in self-attention,
    q is k is v in some tests); the repeats' gradients are summed into the first."""

    @staticmethod
    def forward(ctx, q, k, v, bias, alibi, cu_q, cu_k, rng_state, call):
        same_as, spec, options, outputs = call
        tensors = [q, k, v, bias, alibi, cu_q, cu_k, rng_state]
        tensors = [t if j < 0 else tensors[j] for t, j in zip(tensors, same_as)]
        out, lse = outputs or torch.ops.memattn.forward(*tensors, *options)
        ctx.save_for_backward(*tensors, out, lse)
        ctx.set_materialize_grads(False)  # an unused lse gets None, not a zero-filled tensor
        ctx.call = (same_as, spec, options)  # not the outputs: saved above
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        q, k, v, bias, alibi, cu_q, cu_k, rng_state, out, lse = ctx.saved_tensors
        same_as, spec, options = ctx.call
        needs_input_grad = ctx.needs_input_grad  # a new tuple on each read
        needs = [bool(needs_input_grad[i if same_as[i] < 0 else same_as[i]])
                 for i in range(4)]  # fmt: skip
        *options, deterministic = options
        deterministic = deterministic or torch.are_deterministic_algorithms_enabled()
        if grad_out is None:
            grad_out = torch.zeros_like(out)
        args = (grad_out, grad_lse, q, k, v, out, lse, bias, alibi, cu_q, cu_k, rng_state)
        grads = _call_backward(spec, args, options, deterministic, needs)
        grads = [g if need else None for g, need in zip(grads, needs)]
        for i in range(4):
            if same_as[i] >= 0 and grads[i] is not None:
                grads[same_as[i]] = grads[same_as[i]] + grads[i]
                grads[i] = None
        return (*grads, None, None, None, None, None)  # alibi, cu_q, cu_k, rng_state, call


def _call_backward(spec, args, options, deterministic: bool, needs) -> tuple:
    """The backward op on ``args`` (its tensors, in schema order): its body directly
    when the call may skip the dispatcher and ``spec`` (the checked call) is given,
    the custom op otherwise. Gradients not needed are None or empty."""
    if spec is not None and _skips_dispatcher(args):
        if deterministic != spec.deterministic:  # torch.use_deterministic_algorithms
            spec = dataclasses.replace(spec, deterministic=deterministic)
        return _run_backward(spec, *args, needs)
    return torch.ops.memattn.backward(*args, *options, deterministic, list(needs))


def _records_autograd(q, k, v, bias) -> bool:
    """Whether autograd has anything to record for a call: a gradient asked of an
    input, or forward-mode AD on (a dual level open: the Function then says it has no
    jvp, where a bare call would drop the tangents)."""
    return (torch.autograd.forward_ad._current_level >= 0
            or (torch.is_grad_enabled()
                and (q.requires_grad or k.requires_grad or v.requires_grad
                     or (bias is not None and bias.requires_grad))))  # fmt: skip


def _without_repeats(tensors: list) -> tuple[list, tuple[int, ...]]:
    """``tensors`` with each repeat of an earlier tensor replaced by None, and for each
    the index of that earlier tensor (-1 for a first occurrence or None)."""
    same_as = [-1] * len(tensors)
    for i in range(1, len(tensors)):  # `is`, not id(): dynamo cannot trace id() of a tensor
        t = tensors[i]
        if t is not None:
            for j in range(i):
                if tensors[j] is t:
                    same_as[i] = j
                    break
    same_as = tuple(same_as)
    return [None if j >= 0 else t for t, j in zip(tensors, same_as)], same_as


# ------------------------------------------------------------------ the Python entry points


def forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = False,
    window: tuple[int, int] | None = None,
    align: str = "top_left",
    bias: Tensor | None = None,
    alibi_slopes: Tensor | None = None,
    softcap: float = 0.0,
    scale: float | None = None,
    dropout_p: float = 0.0,
    cu_seqlens_q: Tensor | None = None,
    cu_seqlens_k: Tensor | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    deterministic: bool = False,
    rng_state: Tensor | None = None,
    positions: tuple[int, int] | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Attention forward. Same options as :func:`memattn.attention`; differentiable
    with respect to q, k, v and bias (and out's lse).

    ``rng_state``: an int64 ``[seed, offset]`` tensor to replay a dropout mask; drawn
    from PyTorch's generator when None and ``dropout_p > 0``.
    ``positions``: (first query, first key) positions of this call inside a longer
    sequence (dense calls; the key's a multiple of 8 with dropout). ALiBi's distance and
    dropout's mask then are those of the whole sequence's call at those positions, so
    that blocks of one sequence (memattn.distributed) add up to it; masks (causal,
    window) stay in this call's own positions. Default (0, 0).

    Returns ``(out, lse, rng_state)``: out (B, Sq, H, Dv) or (Tq, H, Dv) in q's dtype;
    lse float32 (B, H, Sq) or (H, Tq), natural log, -inf for rows with no visible key;
    rng_state the ``[seed, offset]`` used (an empty tensor without dropout).
    """
    out, lse, rng = forward_call(q, k, v, bias, alibi_slopes, cu_seqlens_q, cu_seqlens_k,
                                 rng_state, (causal, window, align, softcap, scale, dropout_p,
                                             max_seqlen_q, max_seqlen_k, deterministic,
                                             positions))
    if rng is None:
        rng = torch.empty(0, dtype=torch.int64, device=out.device)
    return out, lse, rng


def forward_call(q, k, v, bias, alibi_slopes, cu_seqlens_q, cu_seqlens_k, rng_state,
                 options: tuple) -> tuple[Tensor, Tensor, Tensor | None]:
    """`forward` with its options as one tuple in _USER_OPTIONS' order, and None for
    rng_state without dropout: memattn.attention calls this, sparing a small call the
    keyword binding and an empty tensor it drops."""
    spec = _check_user_call(q, k, v, bias, alibi_slopes, cu_seqlens_q, cu_seqlens_k, options)
    rng = _check_rng_state(rng_state, spec) if spec.dropout_p > 0 else None
    inputs = [q, k, v, bias, alibi_slopes, cu_seqlens_q, cu_seqlens_k, rng]
    direct = spec if _skips_dispatcher(inputs) else None
    # Where the call may skip the dispatcher, the kernels launch before the Function
    # records the call: its bookkeeping then runs while they do, not before (PERFORMANCE.md:
    # the host time before a launch is what a small call waits for).
    outputs = _run_forward(spec, *inputs) if direct is not None else None
    if outputs is not None and not _records_autograd(q, k, v, bias):
        return (*outputs, rng)  # inference: the Function would record nothing
    tensors, same_as = _without_repeats(inputs)
    out, lse = _Attention.apply(*tensors, (same_as, direct, _op_options(spec), outputs))
    return out, lse, rng


def backward(
    grad_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    *,
    causal: bool = False,
    window: tuple[int, int] | None = None,
    align: str = "top_left",
    bias: Tensor | None = None,
    alibi_slopes: Tensor | None = None,
    softcap: float = 0.0,
    scale: float | None = None,
    dropout_p: float = 0.0,
    cu_seqlens_q: Tensor | None = None,
    cu_seqlens_k: Tensor | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    deterministic: bool = False,
    rng_state: Tensor | None = None,
    grad_lse: Tensor | None = None,
    needs: tuple[bool, bool, bool, bool] = (True, True, True, False),
    positions: tuple[int, int] | None = None,
) -> tuple[Tensor | None, ...]:
    """Attention backward: the gradients with respect to q, k, v and bias.

    ``out``/``lse`` are what :func:`forward` returned, or any pair a caller combines
    itself (context-parallel attention passes the merged lse); ``rng_state`` the
    forward's dropout state; ``grad_lse`` an optional gradient flowing into lse.
    ``needs`` = (dq, dk, dv, dbias) selects what is computed. Returns
    (dq, dk, dv, dbias), None for what was not asked; dbias in the bias's own shape and
    dtype. ``positions`` as in :func:`forward`. deterministic=True (or
    torch.use_deterministic_algorithms(True)) makes every gradient bit-identical across
    runs.
    """
    spec = _check_user_call(q, k, v, bias, alibi_slopes, cu_seqlens_q, cu_seqlens_k,
                            (causal, window, align, softcap, scale, dropout_p, max_seqlen_q,
                             max_seqlen_k, deterministic, positions))  # fmt: skip
    out_shape, lse_shape = output_shapes(spec, q)
    for name, t in (("grad_out", grad_out), ("out", out)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if tuple(t.shape) != out_shape or t.dtype != q.dtype or t.device != q.device:
            raise ValueError(
                f"{name} must be a {q.dtype} tensor of shape {out_shape} on {q.device}, "
                f"got {t.dtype} {tuple(t.shape)} on {t.device}"
            )
    for name, t in (("lse", lse), ("grad_lse", grad_lse)):
        if t is None and name == "grad_lse":
            continue
        if not isinstance(t, Tensor) or t.dtype != torch.float32 or \
                tuple(t.shape) != lse_shape or t.device != q.device:  # fmt: skip
            raise ValueError(f"{name} must be a float32 tensor of shape {lse_shape} "
                             f"on {q.device}")  # fmt: skip
    if not (isinstance(needs, tuple) and len(needs) == 4
            and all(isinstance(n, bool) for n in needs)):  # fmt: skip
        raise TypeError(f"needs must be a tuple of 4 bools (dq, dk, dv, dbias), got {needs!r}")
    if needs[3] and bias is None:
        raise ValueError("needs[3] (dbias) asks for a bias gradient, but bias is None")
    rng = None
    if spec.dropout_p > 0:
        if rng_state is None:
            raise ValueError("rng_state (the forward's [seed, offset]) is required with "
                             "dropout_p > 0")  # fmt: skip
        rng = _check_rng_state(rng_state, spec)
    *options, det = _op_options(spec)
    det = det or torch.are_deterministic_algorithms_enabled()
    args = (grad_out, grad_lse, q, k, v, out, lse, bias, alibi_slopes, cu_seqlens_q,
            cu_seqlens_k, rng)  # fmt: skip
    grads = _call_backward(spec, args, options, det, needs)
    return tuple(g if need else None for g, need in zip(grads, needs))
