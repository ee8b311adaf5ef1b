"""memattn: exact, memory-efficient attention for PyTorch, in Triton."""

from . import compat, ops, reference
from .api import attention
from .compat import scaled_dot_product_attention
from .dropout import dropout_mask
from .kernels import sharing_sms

__version__ = "0.1.0"
__all__ = [
    "attention",
    "compat",
    "dropout_mask",
    "ops",
    "reference",
    "scaled_dot_product_attention",
    "sharing_sms",
    "__version__",
]
