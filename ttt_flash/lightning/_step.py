"""What every LightningModule of the package does around a training step: time it (and its
CUDA peak memory), and, under DDP, switch DDP's own gradient sync off and average the local
gradients explicitly (docs/distributed.md): DDP's hooks cannot reduce a backward through
``autograd.grad(create_graph=True)`` graphs correctly.
"""

from __future__ import annotations

import time
import warnings
from typing import Iterable, Optional

import torch

from ..distributed import average_gradients, disable_gradient_sync

__all__ = ["StepTimer", "LocalGradients", "GraphedTraining"]


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


class GraphedTraining:
    """The ``cuda_graph`` option of the package's LightningModules (docs/cuda-graphs.md).

    :meth:`run` replays the training step captured as a CUDA graph for the batch's shapes
    (:class:`ttt_flash.cuda_graph.StepGraphs`: one graph per shape, at most ``max_graphs``,
    then eager with one warning; eager with one warning if the step cannot be captured). The
    step function must zero the gradients in place, run the backward passes and step the
    (capturable) optimizers itself. :meth:`usable` says whether the step can be graphed at
    all: not on the CPU and not under DDP (one warning each, then eager). :meth:`reset` drops
    the graphs: after a checkpoint is loaded the optimizer state lives in new tensors, so the
    graphs are captured again (exact resume).
    """

    def __init__(self, enabled: bool, max_graphs: int = 4):
        self.enabled = bool(enabled)
        self.max_graphs = max_graphs
        self.graphs = None
        self._warned = False

    def usable(self, cuda: bool, ddp: bool = False) -> bool:
        if not self.enabled:
            return False
        reason = None if cuda else "the batch is not on a CUDA device"
        if cuda and ddp:
            reason = "DDP with explicit gradient averaging is not captured"
        if reason is not None:
            if not self._warned:
                self._warned = True
                warnings.warn(f"cuda_graph=True: the training step runs eagerly: {reason}", RuntimeWarning, stacklevel=3)
            return False
        return True

    def run(self, fn, inputs, params, optimizers, name: str):
        from ..cuda_graph import StepGraphs

        if self.graphs is None:
            self.graphs = StepGraphs(fn, max_graphs=self.max_graphs, fallback=True, params=list(params),
                                     optimizers=list(optimizers), name=name)
        return self.graphs(*inputs)

    def reset(self) -> None:
        self.graphs = None
