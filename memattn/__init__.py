"""memattn: exact, memory-efficient attention for PyTorch, in Triton."""

from . import ops, reference
from .api import attention
from .dropout import dropout_mask

__version__ = "0.1.0"
__all__ = ["attention", "dropout_mask", "ops", "reference", "__version__"]
