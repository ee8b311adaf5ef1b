"""One place that checks and normalises an attention call.

Every entry point (``memattn.attention``, ``memattn.ops.forward``/``backward``,
``memattn.reference.attention``) calls :func:`check_call` first. It raises a
``TypeError`` or ``ValueError`` naming the argument and what was expected, before any
kernel runs, and never modifies its inputs. What it returns, :class:`AttentionSpec`,
is all the launchers need to know about shapes and options.
"""

from __future__ import annotations

import math
import numbers
import weakref
from dataclasses import dataclass

import torch

KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
REFERENCE_DTYPES = KERNEL_DTYPES + (torch.float64,)
MAX_HEAD_DIM = 256
ALIGNS = ("top_left", "bottom_right")


@dataclass(frozen=True)
class AttentionSpec:
    """Shapes and options of one call, normalised.

    ``seqlen_q``/``seqlen_k`` are the padded lengths: Sq/Sk in dense mode,
    max_seqlen_q/max_seqlen_k in varlen mode. Causal masking is folded into the
    window (``window_right == 0`` when causal), so the spec has no causal flag of its
    own. ``-1`` means an unbounded side.
    """

    batch: int
    heads: int
    kv_heads: int
    seqlen_q: int
    seqlen_k: int
    head_dim_qk: int
    head_dim_v: int
    varlen: bool
    window_left: int
    window_right: int
    bottom_right: bool
    scale: float
    softcap: float
    dropout_p: float
    has_bias: bool
    has_alibi: bool
    deterministic: bool
    dtype: torch.dtype
    device: torch.device
    # Global positions of this call's first query and first key, for ALiBi's distance
    # and dropout's Philox counters only (masks stay in the call's own positions): a
    # block of a longer sequence (context parallelism) then draws the whole call's.
    position_q: int = 0
    position_k: int = 0

    @property
    def group(self) -> int:
        """Query heads per key/value head (1 for MHA, H for MQA)."""
        return self.heads // self.kv_heads

    @property
    def positioned(self) -> bool:
        """Whether the global positions change the result: ALiBi or dropout away from
        position (0, 0). Only the tile kernels take them."""
        return bool(self.position_q or self.position_k) and (self.has_alibi
                                                            or self.dropout_p > 0)

    @property
    def bias_shape(self) -> tuple[int, int, int, int]:
        """The shape a bias must broadcast to: (B, H, Sq, Sk), padded lengths in varlen mode."""
        return (self.batch, self.heads, self.seqlen_q, self.seqlen_k)


def _is_number(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _check_real(name: str, value, *, minimum: float = 0.0) -> float:
    if not _is_number(value):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    try:
        value = float(value)
    except OverflowError:  # an int too large for a float
        value = math.inf
    if not math.isfinite(value) or value < minimum:
        raise ValueError(f"{name} must be a finite number >= {minimum}, got {value}")
    return value


def _check_bool(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return value


def _check_window(window) -> tuple[int, int]:
    if window is None:
        return (-1, -1)
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise TypeError(f"window must be None or a pair (left, right) of ints, got {window!r}")
    sides = []
    for i, w in enumerate(window):
        if isinstance(w, bool) or not isinstance(w, numbers.Integral):
            raise TypeError(f"window[{i}] must be an int, got {type(w).__name__}")
        if w < -1:
            raise ValueError(f"window[{i}] must be >= -1 (-1 = unbounded), got {w}")
        sides.append(int(w))
    return sides[0], sides[1]


def _check_positions(positions, varlen: bool, dropout_p: float) -> tuple[int, int]:
    if positions is None:
        return 0, 0
    if (not isinstance(positions, (tuple, list)) or len(positions) != 2
            or any(isinstance(p, bool) or not isinstance(p, numbers.Integral)
                   for p in positions)):  # fmt: skip
        raise TypeError(
            f"positions must be a pair of ints (first query, first key), got {positions!r}"
        )
    position_q, position_k = (int(p) for p in positions)
    if position_q < 0 or position_k < 0:
        raise ValueError(f"positions must be >= 0, got {positions!r}")
    if varlen and (position_q or position_k):
        raise ValueError("positions are for dense calls; packed (varlen) calls take none")
    if dropout_p > 0 and position_k % 8:
        raise ValueError(
            "positions[1] must be a multiple of 8 with dropout (its Philox draws eight "
            f"keys at a time), got {position_k}"
        )
    return position_q, position_k


def _seqlens(
    name: str, cu: torch.Tensor, total: int, total_name: str, device, read_values: bool
) -> list[int]:
    """Checks one cu_seqlens tensor and returns the per-sequence lengths ([] when its
    values are not read)."""
    if not isinstance(cu, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(cu).__name__}")
    if cu.dtype != torch.int32:
        raise TypeError(f"{name} must have dtype torch.int32, got {cu.dtype}")
    if cu.dim() != 1 or cu.numel() < 2:
        raise ValueError(f"{name} must be 1-D of length B+1 >= 2, got shape {tuple(cu.shape)}")
    if cu.device != device:
        raise ValueError(f"{name} must be on {device} like q, got {cu.device}")
    if not read_values or _cannot_read_values():
        return []
    try:
        version = cu._version
    except RuntimeError:  # an inference-mode tensor keeps no version: read every time
        return _lengths(name, _values(cu), total, total_name)
    seen = _SEEN_SEQLENS.get(id(cu))
    if seen is not None and seen[0]() is cu and seen[1:3] == (version, total):
        return seen[3]
    lengths = _lengths(name, _values(cu), total, total_name)
    if len(_SEEN_SEQLENS) >= 1024:  # many live cu_seqlens tensors: start over
        _SEEN_SEQLENS.clear()
    key = id(cu)
    ref = weakref.ref(cu, lambda _, key=key: _SEEN_SEQLENS.pop(key, None))
    _SEEN_SEQLENS[key] = (ref, version, total, lengths)
    return lengths


# Reading cu_seqlens' values is a host sync (the GPU finishes its queue first). A model
# passes the same tensor to every layer and to the backward: the values are read and
# checked once per tensor and version (an in-place change bumps it), keyed by id and
# dropped with the tensor.
_SEEN_SEQLENS: dict[int, tuple] = {}  # id -> (weakref, version, total, lengths)


def _values(cu: torch.Tensor) -> list[int]:
    return cu.tolist()


def _lengths(name: str, values: list[int], total: int, total_name: str) -> list[int]:
    """The per-sequence lengths of cu_seqlens ``values``, checked."""
    if values[0] != 0:
        raise ValueError(f"{name} must start at 0, got {values[0]}")
    lengths = [b - a for a, b in zip(values[:-1], values[1:])]
    if any(n < 0 for n in lengths):
        raise ValueError(f"{name} must be non-decreasing, got {values}")
    if values[-1] != total:
        raise ValueError(
            f"{name}[-1] must equal {total_name} = {total} (the packed token count), "
            f"got {values[-1]}"
        )
    return lengths


def _cannot_read_values() -> bool:
    """While capturing a CUDA graph or tracing for torch.compile, tensor values are not
    readable; value checks of cu_seqlens are skipped there and max_seqlen_* is required."""
    if torch.compiler.is_compiling():
        return True
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _check_max_seqlen(name: str, value, lengths: list[int], cu_name: str) -> int:
    actual = max(lengths, default=0)
    if value is None:
        if not lengths:
            raise ValueError(
                f"{name} is required where values of {cu_name} cannot be read (under "
                f"torch.compile or CUDA graph capture)"
            )
        return actual
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < actual:
        raise ValueError(
            f"{name} must be >= the longest sequence in {cu_name} ({actual}), got {value}"
        )
    return int(value)


def check_call(
    q,
    k,
    v,
    *,
    causal=False,
    window=None,
    align="top_left",
    bias=None,
    alibi_slopes=None,
    softcap=0.0,
    scale=None,
    dropout_p=0.0,
    cu_seqlens_q=None,
    cu_seqlens_k=None,
    max_seqlen_q=None,
    max_seqlen_k=None,
    deterministic=False,
    positions=None,
    dtypes=KERNEL_DTYPES,
    read_cu_seqlens=True,
) -> AttentionSpec:
    """Validates an attention call and returns its normalised :class:`AttentionSpec`.

    ``positions``: (first query, first key) positions of this call inside a longer
    sequence, for ALiBi's distance and dropout's counters (AttentionSpec.position_q/k).

    ``dtypes`` is the set of admitted q/k/v dtypes: the kernels take float16,
    bfloat16 and float32; the reference also takes float64. ``read_cu_seqlens=False``
    skips the checks of cu_seqlens values (a host sync): the custom ops use it, since
    their Python callers have checked them already; max_seqlen_q/k are then required.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in dtypes:
            allowed = ", ".join(str(d) for d in dtypes)
            raise TypeError(f"{name} must have dtype in ({allowed}), got {t.dtype}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k and v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if k.device != q.device or v.device != q.device:
        raise ValueError(
            f"q, k and v must be on one device, got {q.device}, {k.device}, {v.device}"
        )

    if (cu_seqlens_q is None) != (cu_seqlens_k is None):
        raise ValueError("cu_seqlens_q and cu_seqlens_k must be given together (varlen mode)")
    varlen = cu_seqlens_q is not None
    if not varlen and (max_seqlen_q is not None or max_seqlen_k is not None):
        raise ValueError("max_seqlen_q/max_seqlen_k are only meaningful with cu_seqlens_q/k")

    ndim = 3 if varlen else 4
    layout = "(T, H, D)" if varlen else "(B, S, H, D)"
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != ndim:
            mode = "varlen" if varlen else "dense"
            raise ValueError(
                f"{name} must be {ndim}-D {layout} in {mode} mode, got shape {tuple(t.shape)}"
            )
    *_, heads, dqk = q.shape
    *_, kv_heads, dqk_k = k.shape
    *_, kv_heads_v, dv = v.shape
    if k.shape[-3] != v.shape[-3]:
        raise ValueError(
            f"k and v must have the same number of keys, got {k.shape[-3]} and {v.shape[-3]}"
        )
    if not varlen and not (q.shape[0] == k.shape[0] == v.shape[0]):
        raise ValueError(
            f"q, k and v must have the same batch size, got {q.shape[0]}, {k.shape[0]}, "
            f"{v.shape[0]}"
        )
    if kv_heads != kv_heads_v:
        raise ValueError(f"k and v must have the same heads, got {kv_heads} and {kv_heads_v}")
    if kv_heads < 1 or heads % kv_heads != 0:
        raise ValueError(
            f"q's heads ({heads}) must be a positive multiple of k/v's heads ({kv_heads})"
        )
    if dqk_k != dqk:
        raise ValueError(f"q and k must have the same head dim, got {dqk} and {dqk_k}")
    for name, d in (("q/k head dim", dqk), ("v head dim", dv)):
        if not 1 <= d <= MAX_HEAD_DIM:
            raise ValueError(f"{name} must be in [1, {MAX_HEAD_DIM}], got {d}")

    if varlen:
        lengths_q = _seqlens("cu_seqlens_q", cu_seqlens_q, q.shape[0], "q.shape[0]", q.device,
                             read_cu_seqlens)  # fmt: skip
        lengths_k = _seqlens("cu_seqlens_k", cu_seqlens_k, k.shape[0], "k.shape[0]", q.device,
                             read_cu_seqlens)  # fmt: skip
        if cu_seqlens_q.numel() != cu_seqlens_k.numel():
            raise ValueError(
                f"cu_seqlens_q and cu_seqlens_k must have the same length B+1, got "
                f"{cu_seqlens_q.numel()} and {cu_seqlens_k.numel()}"
            )
        batch = cu_seqlens_q.numel() - 1
        seqlen_q = _check_max_seqlen("max_seqlen_q", max_seqlen_q, lengths_q, "cu_seqlens_q")
        seqlen_k = _check_max_seqlen("max_seqlen_k", max_seqlen_k, lengths_k, "cu_seqlens_k")
    else:
        batch, seqlen_q, seqlen_k = q.shape[0], q.shape[1], k.shape[1]

    causal = _check_bool("causal", causal)
    deterministic = _check_bool("deterministic", deterministic)
    window_left, window_right = _check_window(window)
    if causal:
        window_right = 0  # causal is the window's right side closed at the diagonal
    if align not in ALIGNS:
        raise ValueError(f"align must be one of {ALIGNS}, got {align!r}")
    softcap = _check_real("softcap", softcap)
    scale = 1.0 / math.sqrt(dqk) if scale is None else _check_real("scale", scale)
    dropout_p = _check_real("dropout_p", dropout_p)
    if dropout_p >= 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    position_q, position_k = _check_positions(positions, varlen, dropout_p)

    target = (batch, heads, seqlen_q, seqlen_k)
    if bias is not None:
        if not isinstance(bias, torch.Tensor):
            raise TypeError(f"bias must be a torch.Tensor, got {type(bias).__name__}")
        if not bias.is_floating_point():
            raise TypeError(f"bias must have a floating dtype, got {bias.dtype}")
        if bias.device != q.device:
            raise ValueError(f"bias must be on {q.device} like q, got {bias.device}")
        if not _broadcasts_to(tuple(bias.shape), target):
            names = "(B, H, max_seqlen_q, max_seqlen_k)" if varlen else "(B, H, Sq, Sk)"
            raise ValueError(
                f"bias must be broadcastable to {names} = {target}, got {tuple(bias.shape)}"
            )
    if alibi_slopes is not None:
        if not isinstance(alibi_slopes, torch.Tensor):
            raise TypeError(
                f"alibi_slopes must be a torch.Tensor, got {type(alibi_slopes).__name__}"
            )
        if alibi_slopes.dtype != torch.float32:
            raise TypeError(f"alibi_slopes must have dtype torch.float32, got {alibi_slopes.dtype}")
        if tuple(alibi_slopes.shape) not in ((heads,), (batch, heads)):
            raise ValueError(
                f"alibi_slopes must have shape (H,) = ({heads},) or (B, H) = ({batch}, {heads}), "
                f"got {tuple(alibi_slopes.shape)}"
            )
        if alibi_slopes.device != q.device:
            raise ValueError(
                f"alibi_slopes must be on {q.device} like q, got {alibi_slopes.device}"
            )

    return AttentionSpec(
        batch=batch,
        heads=heads,
        kv_heads=kv_heads,
        seqlen_q=seqlen_q,
        seqlen_k=seqlen_k,
        head_dim_qk=dqk,
        head_dim_v=dv,
        varlen=varlen,
        window_left=window_left,
        window_right=window_right,
        bottom_right=align == "bottom_right",
        scale=scale,
        softcap=softcap,
        dropout_p=dropout_p,
        has_bias=bias is not None,
        has_alibi=alibi_slopes is not None,
        deterministic=deterministic,
        dtype=q.dtype,
        device=q.device,
        position_q=position_q,
        position_k=position_k,
    )


def output_shapes(spec: AttentionSpec, q: torch.Tensor) -> tuple[tuple, tuple]:
    """Shapes of out and lse: (B, Sq, H, Dv) and (B, H, Sq) dense, (Tq, H, Dv) and
    (H, Tq) varlen."""
    out = tuple(q.shape[:-1]) + (spec.head_dim_v,)
    lse = (spec.heads, q.shape[0]) if spec.varlen else spec.bias_shape[:3]
    return out, tuple(lse)


def _broadcasts_to(shape: tuple[int, ...], target: tuple[int, ...]) -> bool:
    if len(shape) > len(target):
        return False
    return all(s in (1, t) for s, t in zip(shape[::-1], target[::-1]))
