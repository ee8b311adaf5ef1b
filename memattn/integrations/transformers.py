"""memattn as a Hugging Face transformers attention implementation: ``"memattn"``.

Importing this module calls :func:`register` (idempotent), after which any model whose
attention goes through ``ALL_ATTENTION_FUNCTIONS`` (Llama, Mistral, Qwen, Gemma, ... i.e.
the models that support ``attn_implementation="sdpa"``) runs its attention on memattn::

    import memattn.integrations.transformers  # registers "memattn"

    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="memattn")
    model = LlamaForCausalLM(config)   # with config._attn_implementation = "memattn"
    model.set_attn_implementation("memattn")

The contract, as read from transformers 5.17's ``integrations/sdpa_attention.py``,
``masking_utils.py`` and ``modeling_utils.py`` (it also holds for 4.51 to 4.52, which
have no mask registry and hand a custom implementation an eager-style float mask):

* Masks. transformers only builds a mask for implementations registered with its
  ``AttentionMaskInterface``; an unregistered custom implementation gets ``None`` even
  with padding. :func:`register` therefore also registers transformers' own ``sdpa_mask``
  under "memattn", so this function sees exactly the masks ``sdpa`` sees: ``None`` where
  a plain causal (or full) mask suffices, else a boolean (B or 1, 1, L, S) mask, True =
  attend, already containing causality, padding, sliding windows, packed sequences.
  Boolean masks become memattn's additive ``bias`` (0 / -inf, zero-stride dims kept
  broadcast); float masks (user-made 4-D masks, eager-style finfo.min masks) are the
  bias as they are (the kernels keep finfo.min finite). A row that a boolean or -inf mask hides
  everywhere gives 0 (as ``sdpa`` does in torch >= 2.5); one that a finite float mask
  hides everywhere averages every value (as ``sdpa`` and eager do).
* Causality without a mask, as ``sdpa_attention_forward``: only when the module is causal
  (``is_causal`` kwarg, else ``module.is_causal``). For L > 1 queries the causal mask is
  aligned top-left: ``sdpa_mask`` returns ``None`` with S > L only for a prefill into an
  empty static cache, whose keys past L are unwritten slots (``sdpa`` crops them; the
  top-left mask hides them). For L == 1 (decoding) every key is visible; memattn gets
  ``causal=True, align="bottom_right"``, which for one query is the same thing and lets a
  sliding window apply to the last position.
* ``sliding_window`` (Mistral, Gemma, ...): encoded in the mask whenever one is given; with
  no mask it becomes ``window=(sliding_window - 1, 0)`` with the causal mask (a query sees
  itself and the sliding_window - 1 keys before it: transformers' ``kv > q - window``),
  ``(sliding_window - 1, sliding_window - 1)`` for non-causal modules (as flash attention).
* ``softcap``, ``scaling`` (None: 1/sqrt(D)), ``position_bias`` (added to the bias, with a
  gradient), ``dropout`` (applied only while ``module.training``, as eager does),
  ``deterministic``. GQA/MQA run natively: no ``repeat_kv`` copies. ``s_aux``
  (attention sinks) is not supported and raises.
* Inputs query (B, H, L, D), key/value (B, Hkv, S, D|Dv); returns
  ``(attn_output (B, L, H, Dv), None)``: no attention weights.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.utils import logging

from ..api import attention

try:  # transformers >= 4.53: masks are built through a registry of mask functions
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
except ImportError:  # older: models build an eager-style float mask for custom implementations
    AttentionMaskInterface = sdpa_mask = None

__all__ = ["NAME", "memattn_attention_forward", "register"]

NAME = "memattn"

logger = logging.get_logger(__name__)


def _mask_to_bias(mask: torch.Tensor, dtype: torch.dtype, kv_length: int) -> torch.Tensor:
    """A boolean (True = attend) or additive float mask as an additive bias, broadcast dims
    (stride 0) kept of size 1 so memattn reads them through zero strides."""
    if mask.shape[-1] > kv_length:  # a mask made for a longer (static) cache
        mask = mask[..., :kv_length]
    for dim in range(mask.dim()):
        if mask.stride(dim) == 0 and mask.shape[dim] > 1:
            mask = mask.narrow(dim, 0, 1)
    if mask.dtype == torch.bool:  # over rows memattn reads without a copy of its own
        from ..kernels.common import new_bias  # (importing memattn imports no Triton)

        bias = new_bias(mask.shape, dtype, mask.device)
        return bias.masked_fill_(mask.logical_not(), float("-inf"))
    if not mask.is_floating_point():
        raise TypeError(f"attention_mask must be boolean or floating, got {mask.dtype}")
    return mask


def memattn_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    *,
    is_causal: bool | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    position_bias: torch.Tensor | None = None,
    s_aux: torch.Tensor | None = None,
    deterministic: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' AttentionInterface function for memattn (see the module docstring).

    query (B, H, L, D), key (B, Hkv, S, D), value (B, Hkv, S, Dv), H a multiple of Hkv;
    attention_mask None, or broadcastable to (B, H, L, S), boolean (True = attend) or
    additive float. Returns (attn_output (B, L, H, Dv), None).
    """
    if kwargs.get("output_attentions", False):
        logger.warning_once(
            "memattn does not return attention weights (output_attentions=True); "
            "use attn_implementation='eager' to get them"
        )
    if s_aux is not None:
        raise NotImplementedError("memattn does not support attention sinks (s_aux)")

    q_length, kv_length = query.shape[2], key.shape[2]
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)

    bias = None
    if attention_mask is not None:
        bias = _mask_to_bias(attention_mask, query.dtype, kv_length)
    if position_bias is not None:
        if bias is None:
            bias = position_bias
        else:
            bias = position_bias + bias.to(position_bias.dtype)

    options = {}
    if attention_mask is None:
        # See the module docstring: top-left for a prefill (sdpa's is_causal with its crop
        # of unwritten static-cache slots), bottom-right (= all keys) for one query.
        if is_causal:
            options["causal"] = True
            options["align"] = "top_left" if q_length > 1 else "bottom_right"
            if sliding_window is not None and sliding_window > 0:
                options["window"] = (sliding_window - 1, 0)
        elif sliding_window is not None and sliding_window > 0:
            options["window"] = (sliding_window - 1, sliding_window - 1)
            options["align"] = "bottom_right"
    if softcap is not None and softcap > 0:
        options["softcap"] = float(softcap)
    if dropout and getattr(module, "training", True):
        options["dropout_p"] = float(dropout)
    if deterministic:
        options["deterministic"] = True

    out = attention(
        query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
        bias=bias, scale=scaling, **options,
    )  # fmt: skip
    return out, None


def register() -> None:
    """Register ``"memattn"`` with transformers' ``AttentionInterface`` and, where transformers
    has one, its ``AttentionMaskInterface`` (with ``sdpa_mask``: memattn takes the same
    masks as sdpa). Idempotent; called when this module is imported."""
    AttentionInterface.register(NAME, memattn_attention_forward)
    if AttentionMaskInterface is not None:
        AttentionMaskInterface.register(NAME, sdpa_mask)


register()
