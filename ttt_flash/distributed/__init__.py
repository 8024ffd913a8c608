"""Training across processes, exact to second order, with plain :mod:`torch.distributed`.

* ``data_parallel.py``: data parallelism for second-order training: DDP's synchronisation
  off, gradients and Hessian estimates averaged explicitly (:func:`average_gradients`,
  :func:`all_reduce_mean_`, :func:`disable_gradient_sync`).
* ``context_parallel.py``: one sequence across processes (Ulysses):
  :func:`context_parallel_attention`, :func:`context_parallel_attention_varlen`, the
  differentiable :func:`all_reduce_sum`, sharding (:func:`shard_sequence`,
  :func:`block_bounds`, :func:`sequence_offset`), :func:`context_parallel_groups` and
  :func:`reduce_gradients`.

The guide: docs/distributed.md.
"""

from .context_parallel import (
    all_reduce_sum,
    block_bounds,
    context_parallel_attention,
    context_parallel_attention_varlen,
    context_parallel_groups,
    head_plan,
    reduce_gradients,
    sequence_offset,
    shard_sequence,
)
from .data_parallel import (all_reduce_mean_, average_gradients, broadcast_, disable_gradient_sync, is_distributed,
                            world_size)

__all__ = [
    # context parallelism
    "context_parallel_attention", "context_parallel_attention_varlen", "context_parallel_groups",
    "reduce_gradients", "all_reduce_sum", "shard_sequence", "block_bounds", "sequence_offset", "head_plan",
    # data parallelism
    "world_size", "is_distributed", "disable_gradient_sync", "all_reduce_mean_", "average_gradients", "broadcast_",
]
