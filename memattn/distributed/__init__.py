"""memattn across GPUs on torch.distributed: ``context_parallel_attention`` splits one
sequence over the ranks of a process group (ring attention); ``shard``/``unshard`` cut
and rebuild the sequence in its layouts. Imported on its own: ``import memattn`` does
not need torch.distributed."""

from .context_parallel import LAYOUTS, context_parallel_attention, shard, unshard

__all__ = ["LAYOUTS", "context_parallel_attention", "shard", "unshard"]
