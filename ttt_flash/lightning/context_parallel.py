"""Context parallelism under Lightning's DDP: ranks grouped into context-parallel groups of
``size`` consecutive ranks (one sequence per group, each rank one block of it), data
parallel across the groups (docs/distributed.md).

:class:`ContextParallelPlan` is what :class:`~ttt_flash.lightning.lm.LanguageModel` uses for
its ``context_parallel`` argument:

* :meth:`~ContextParallelPlan.setup` (every rank, once the process group exists) creates the
  groups and switches the GPT (or a memory model, through its ``set_context_parallel``) to
  context parallelism over its group;
* :meth:`~ContextParallelPlan.shard` gives every rank of a group the batch of the group's
  first rank (broadcast) and keeps this rank's block of the tokens (global RoPE positions
  come from the GPT);
* :meth:`~ContextParallelPlan.loss` returns this rank's part of ``P × (the group's mean
  loss)``: the backward started on every rank from its part leaves on each rank its share of
  the gradient of ``P · ℓ_g``; the existing explicit averaging over all W ranks with weight
  ``n_g`` (the group's token count) on every rank of group g then gives
  ``Σ_g n_g ℓ_g' / Σ_g n_g``, the gradient of the mean loss over all the groups' tokens. The
  Hutchinson Hessian estimate of the second-order optimizers (same probes on every rank)
  averages the same way, so nothing else changes.

The other ranks' batches of a group are not used (each group draws P batches per step and
trains on one).

The memory modules (:mod:`ttt_flash.lightning.memory`: ``GradMemKV``, ``TTTE2EMQAR``) use
:meth:`~ContextParallelPlan.setup` and :meth:`~ContextParallelPlan.broadcast` only: their
models take the whole batch on every rank and cut the written sequence themselves, and their
outer loss is the same on every rank of a group, so the explicit averaging with the batch's
query-target count as weight already gives each group's gradient its weight.
"""

from __future__ import annotations

import numbers
from typing import List, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from ..distributed import context_parallel_groups, shard_sequence

__all__ = ["ContextParallelPlan"]


class ContextParallelPlan:
    """Context parallelism of one LightningModule's GPT over groups of ``size`` ranks
    (``size`` 1: off, every method a pass-through)."""

    def __init__(self, size: int = 1):
        if isinstance(size, bool) or not isinstance(size, numbers.Integral) or size < 1:
            raise ValueError(f"context_parallel must be an int >= 1 (ranks per sequence), got {size!r}")
        self.size = int(size)
        self.cp_group = None
        self.dp_group = None
        self._leader = 0

    @property
    def active(self) -> bool:
        """Whether groups were set up (``size`` > 1 under torch.distributed)."""
        return self.cp_group is not None

    def setup(self, model) -> None:
        """Create the groups (every rank must call this) and switch ``model`` (anything with
        ``set_context_parallel(group)``: a GPT, :class:`~ttt_flash.memory.GradMem`,
        :class:`~ttt_flash.memory.FastWeightTTT`) to context parallelism over this rank's group."""
        if self.size == 1 or self.active:
            return
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() % self.size:
            world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
            raise ValueError(
                f"context_parallel={self.size} needs a multiple of {self.size} processes "
                f"(--trainer.strategy=ddp --trainer.devices=N with N divisible by {self.size}); "
                f"this run has {world}"
            )
        self.cp_group, self.dp_group = context_parallel_groups(self.size)
        self._leader = dist.get_rank() // self.size * self.size
        model.set_context_parallel(self.cp_group)

    def broadcast(self, *tensors: Tensor) -> List[Tensor]:
        """The group's first rank's ``tensors`` on every rank of the group (every rank passes
        tensors of the same shapes and dtypes; one collective per dtype). Pass-through when
        inactive."""
        if not self.active:
            return list(tensors)
        out = list(tensors)
        by_dtype = {}
        for i, t in enumerate(tensors):
            by_dtype.setdefault(t.dtype, []).append(i)
        for idx in by_dtype.values():
            flat = torch.cat([tensors[i].reshape(-1) for i in idx])
            dist.broadcast(flat, src=self._leader, group=self.cp_group)
            for i, part in zip(idx, flat.split([tensors[i].numel() for i in idx])):
                out[i] = part.view_as(tensors[i])
        return out

    def shard(self, x: Tensor, y: Tensor, ignore_index: int = -100) -> Tuple[Tensor, Tensor, int]:
        """(B, N) inputs and targets → this rank's (B, N_local) block of the group leader's,
        and ``n_group``: the number of scored targets (not ``ignore_index``) of the whole batch."""
        if self.active:
            xy = torch.stack([x, y]).contiguous()
            dist.broadcast(xy, src=self._leader, group=self.cp_group)
            x, y = xy[0], xy[1]
        n_group = int((y != ignore_index).sum())
        if not self.active:
            return x, y, n_group
        return shard_sequence(x, 1, group=self.cp_group), shard_sequence(y, 1, group=self.cp_group), n_group

    def loss(self, logits: Tensor, y: Tensor, n_group: int, ignore_index: int = -100) -> Tuple[Tensor, Tensor]:
        """``(part, mean)``: this rank's part of ``P · ℓ_g`` (to backpropagate) and the
        group's mean loss ℓ_g (detached, the same on every rank of the group, to log).
        ``logits`` (B, N_local, V), ``y`` (B, N_local), ``n_group`` from :meth:`shard`."""
        if logits.dtype in (torch.float16, torch.bfloat16):
            logits = logits.float()
        total = F.cross_entropy(logits.flatten(0, -2), y.flatten(), ignore_index=ignore_index, reduction="sum")
        n_group = max(n_group, 1)
        part = total * (self.size / n_group)
        mean = total.detach() / n_group
        if self.active:
            dist.all_reduce(mean, group=self.cp_group)
        return part, mean

    def __repr__(self) -> str:
        return f"ContextParallelPlan(size={self.size}, active={self.active})"
