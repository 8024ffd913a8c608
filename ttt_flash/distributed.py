"""Data-parallel averaging for second-order training, with plain :mod:`torch.distributed`.

PyTorch's ``DistributedDataParallel`` (DDP) averages gradients with hooks on the
parameters' gradient accumulators. Second-order training does not fit those hooks:

* ``loss.backward(create_graph=True)`` under DDP is refused or wrong (pytorch issues 63812,
  47562): the reducer's hooks fire while the double-backward graph is being built, and a
  later Hessian-vector product through ``p.grad`` is not reduced at all;
* ``torch.autograd.grad(loss, params)`` (the inner loops of MAML and of gradient-written
  memory) never runs the accumulators, so DDP silently skips it; a second backward
  through such a graph may fire the hooks twice.

The route taken here: turn DDP's gradient synchronisation off (:func:`disable_gradient_sync`),
let every process compute its gradients (and Hutchinson estimates) *locally*, exactly as one
process would on its shard, and average them explicitly before the optimizer step
(:func:`average_gradients`, :func:`all_reduce_mean_`), each process weighted by its share of
the global batch. The average of local means weighted by local counts is the mean over the
global batch, so the result equals one process on the global batch (to rounding).

Every function is a no-op when :mod:`torch.distributed` is not initialised or has one
process.

Context parallelism (one sequence across processes, exact to second order) lives in
:mod:`ttt_flash.context_parallel` and is re-exported here: :func:`context_parallel_attention`,
:func:`context_parallel_attention_varlen`, :func:`all_reduce_sum`, :func:`shard_sequence`,
:func:`block_bounds`, :func:`sequence_offset`, :func:`context_parallel_groups`, :func:`reduce_gradients`.
"""

from __future__ import annotations

from typing import Iterable, List, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

from .context_parallel import (
    all_reduce_sum,
    block_bounds,
    context_parallel_attention,
    context_parallel_attention_varlen,
    context_parallel_groups,
    local_gradients,
    reduce_gradients,
    sequence_offset,
    shard_sequence,
)

__all__ = [
    "context_parallel_attention",
    "context_parallel_attention_varlen",
    "context_parallel_groups",
    "reduce_gradients",
    "all_reduce_sum",
    "shard_sequence",
    "block_bounds",
    "sequence_offset",
    "world_size",
    "is_distributed",
    "disable_gradient_sync",
    "all_reduce_mean_",
    "average_gradients",
    "broadcast_",
]


def world_size() -> int:
    """Number of processes of the default group (1 when not initialised)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def is_distributed() -> bool:
    """Whether :mod:`torch.distributed` is initialised with more than one process."""
    return world_size() > 1


def disable_gradient_sync(module: nn.Module) -> bool:
    """Switch off DDP's own gradient all-reduce on ``module`` if it is a
    ``DistributedDataParallel`` wrapper (for good: the same as staying inside its
    ``no_sync()``); returns whether it was one.

    DDP then neither prepares its reducer in the forward pass nor reduces in the backward
    pass; gradients stay local until :func:`average_gradients`. Parameters are still
    broadcast from rank 0 when DDP wraps the module, so all processes start equal and stay
    equal as long as they apply the same averaged update.
    """
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(module, DistributedDataParallel):
        module.require_backward_grad_sync = False
        return True
    return False


def all_reduce_mean_(tensors: Iterable[Tensor], weight: Optional[float] = None) -> List[Tensor]:
    """Replace each tensor, in place, by the weighted mean over processes
    ``Σ_r w_r t_r / Σ_r w_r`` (``w_r`` = this process's ``weight``; ``None``: 1, a plain
    mean). Returns the tensors. A no-op without several processes.

    All processes must pass tensors of the same shapes, dtypes and order. Tensors are
    flattened into one buffer per dtype and device (one collective each).
    """
    tensors = list(tensors)
    if not is_distributed() or not tensors:
        return tensors
    w = 1.0 if weight is None else float(weight)
    if not w >= 0:
        raise ValueError(f"weight must be >= 0, got {weight}")
    groups = {}
    for t in tensors:
        groups.setdefault((t.dtype, t.device), []).append(t)
    for (dtype, device), ts in groups.items():
        # The weight travels in the same buffer (last element), so one collective gives both sums.
        flat = torch.cat([t.detach().reshape(-1) * w for t in ts] + [torch.full((1,), w, dtype=dtype, device=device)])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        total = flat[-1]
        if not total > 0:
            raise ValueError("all_reduce_mean_: the weights of all processes sum to 0")
        flat = flat[:-1] / total
        offset = 0
        with torch.no_grad():
            for t in ts:
                n = t.numel()
                t.copy_(flat[offset:offset + n].view_as(t))
                offset += n
    return tensors


def average_gradients(params: Iterable[Tensor], weight: Optional[float] = None) -> None:
    """Average ``p.grad`` over processes with :func:`all_reduce_mean_` (weight: this
    process's share of the global batch, e.g. its number of tasks, queries or tokens).

    A parameter without a gradient on this process takes part with a zero gradient, so
    that all processes reduce the same tensors; its gradient is then set. Gradients that
    carry a graph (``create_graph=True``) are detached first: take Hessian-vector products
    before averaging. A no-op without several processes.
    """
    if not is_distributed():
        return
    params = local_gradients(params)
    all_reduce_mean_([p.grad for p in params], weight)


def broadcast_(tensors: Iterable[Tensor], src: int = 0) -> List[Tensor]:
    """Overwrite each tensor, in place, with process ``src``'s (e.g. Hutchinson probes, so
    that every process estimates with the same ones). A no-op without several processes."""
    tensors = list(tensors)
    if is_distributed():
        for t in tensors:
            dist.broadcast(t, src=src)
    return tensors
