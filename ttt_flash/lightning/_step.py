"""What every LightningModule of the package does around a training step: time it (and its
CUDA peak memory), and, under DDP, switch DDP's own gradient sync off and average the local
gradients explicitly (docs/distributed.md): DDP's hooks cannot reduce a backward through
``autograd.grad(create_graph=True)`` graphs correctly.
"""

from __future__ import annotations

import time
from typing import Iterable, Optional

import torch

from ..distributed import average_gradients, disable_gradient_sync

__all__ = ["StepTimer", "LocalGradients"]


class StepTimer:
    """Wall clock and CUDA peak memory of one step: :meth:`start` before, :meth:`log` after."""

    def __init__(self):
        self._start: Optional[float] = None

    def start(self, cuda: bool) -> None:
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        self._start = time.perf_counter()

    def log(self, module, cuda: bool, batch_size: int) -> Optional[float]:
        """Log ``train/step_time_s`` (and on CUDA ``train/peak_mem_gib``) on ``module``; return
        the step's seconds (None if :meth:`start` was not called)."""
        if cuda:
            torch.cuda.synchronize()
            module.log("train/peak_mem_gib", torch.cuda.max_memory_allocated() / 2**30, batch_size=batch_size)
        if self._start is None:
            return None
        elapsed = time.perf_counter() - self._start
        module.log("train/step_time_s", elapsed, batch_size=batch_size)
        return elapsed


class LocalGradients:
    """DDP's gradient sync off, gradients averaged by hand, weighted by each process's share.

    :meth:`begin` in ``on_train_start``; :meth:`add` the step's weight (tasks, tokens, query
    targets); :meth:`average` before the optimizer step. Without DDP (or with ``local=False``)
    :attr:`active` is False and :meth:`average` does nothing.
    """

    def __init__(self):
        self.active = False
        self.weight = 0

    def begin(self, trainer, local: bool = True) -> None:
        self.active = bool(local and disable_gradient_sync(trainer.strategy.model))
        self.weight = 0

    def keep_off(self, trainer) -> None:
        """Switch DDP's sync off again: Lightning switches it back on after every
        manual-optimization forward (its ``_DDPForwardRedirection``)."""
        if self.active:
            disable_gradient_sync(trainer.strategy.model)

    def add(self, weight) -> None:
        self.weight += weight

    def average(self, params: Iterable[torch.Tensor]) -> None:
        if self.active:
            average_gradients(params, weight=self.weight)
        self.weight = 0
