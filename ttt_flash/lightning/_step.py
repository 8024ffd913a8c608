"""What every LightningModule of the package does around a training step: time it (and its
CUDA peak memory), and, under DDP, switch DDP's own gradient sync off and average the local
gradients explicitly (docs/distributed.md): DDP's hooks cannot reduce a backward through
``autograd.grad(create_graph=True)`` graphs correctly; and, with ``cuda_graph=True``, replay
the step captured as a CUDA graph (:class:`GraphedTraining`, docs/cuda-graphs.md).
"""

from __future__ import annotations

import contextlib
import time
import warnings
from typing import Any, Dict, Iterable, Optional

import torch

from ..distributed import average_gradients, disable_gradient_sync

__all__ = ["StepTimer", "LocalGradients", "GraphedTraining", "outside_autocast", "host_number", "LateHostValue",
           "write_grads", "backward_into_grads"]


def host_number(value) -> torch.Tensor:
    """``value`` (a Python number) as a 0-dim CPU tensor for ``LightningModule.log``, of the
    dtype Lightning gives a logged number (the default dtype, at least float32): the same
    logged value.

    Lightning turns a logged Python number into a tensor on the module's device; on CUDA that
    is a blocking copy from host memory, which waits for all the work queued on the stream (a
    replayed CUDA-graph step). A CPU tensor is logged where it is: no copy, no wait.
    """
    dtype = torch.get_default_dtype()
    return torch.tensor(value, dtype=dtype if dtype in (torch.float32, torch.float64) else torch.float32)


class LateHostValue:
    """A CUDA scalar read on the host one step late, so that the host never waits for the
    step that computes it: :meth:`push` queues a copy of this step's value into pinned host
    memory and returns the previous step's copy, waiting only for that copy (queued a step ago,
    normally complete already); None at the first push.

    Lightning turns every progress-bar metric into a Python number after each step; a CUDA
    tensor there waits for the step's work (a replayed graph) to finish.
    """

    def __init__(self):
        self._pending = None  # the previous push: (pinned host tensor, CUDA event after its copy)

    def reset(self) -> None:
        self._pending = None

    def push(self, value: torch.Tensor) -> Optional[torch.Tensor]:
        if value.is_cuda:
            host = torch.empty(value.shape, dtype=value.dtype, pin_memory=True)
            host.copy_(value.detach(), non_blocking=True)
            copied = torch.cuda.Event()
            copied.record()
        else:
            host, copied = value.detach().clone(), None
        previous, self._pending = self._pending, (host, copied)
        if previous is None:
            return None
        if previous[1] is not None:
            previous[1].synchronize()
        return previous[0]


class StepTimer:
    """Time and CUDA peak memory of one step: :meth:`start` before, :meth:`log` after.

    On the CPU, and on CUDA by default, the time is the wall clock of the step (on CUDA
    between two synchronisations). With ``events=True`` on CUDA it is the time between two
    CUDA events recorded at :meth:`start` and :meth:`log` (the step's span on the GPU
    stream), read one step late: :meth:`log` logs the previous step's time, whose events
    have normally completed, so the host never waits for the GPU (a replayed CUDA-graph
    step keeps running while the host prepares the next). The peak memory is the caching
    allocator's own count (no synchronisation either).
    """

    def __init__(self, events: bool = False):
        self.events = bool(events)
        self._start: Optional[float] = None
        self._events = None  # this step's (start, end) CUDA events
        self._pending = None  # the previous step's, read at the next log

    def start(self, cuda: bool) -> None:
        if cuda and not self.events:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        elif cuda:
            torch.cuda.reset_peak_memory_stats()
            self._events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            self._events[0].record()
        self._start = time.perf_counter()

    def log(self, module, cuda: bool, batch_size: int) -> Optional[float]:
        """Log ``train/step_time_s`` (and on CUDA ``train/peak_mem_gib``, once) on ``module`` as
        CPU tensors (:func:`host_number`); return the logged seconds (with ``events`` on CUDA the
        previous step's; None if there is none yet, or if :meth:`start` was not called)."""
        if cuda:
            if not self.events:
                torch.cuda.synchronize()  # the wall clock of the whole step
            module.log("train/peak_mem_gib", host_number(torch.cuda.max_memory_allocated() / 2**30), batch_size=batch_size)
        elapsed = self._elapsed(cuda)
        if elapsed is not None:
            module.log("train/step_time_s", host_number(elapsed), batch_size=batch_size)
        return elapsed

    def _elapsed(self, cuda: bool) -> Optional[float]:
        if cuda and self.events:
            if self._events is None:
                return None
            self._events[1].record()
            previous, self._pending, self._events = self._pending, self._events, None
            if previous is None:
                return None
            previous[1].synchronize()  # recorded a step ago: normally complete already
            return previous[0].elapsed_time(previous[1]) / 1e3
        if self._start is None:
            return None
        return time.perf_counter() - self._start


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


class GraphedZeroGrad:
    """Mixin for LightningModules with a ``_graphed`` :class:`GraphedTraining` and automatic
    optimization: after a replayed step the graph has already zeroed and written this step's
    gradients, and Lightning zeroes them after ``training_step``, so that zeroing is skipped."""

    def optimizer_zero_grad(self, epoch, batch_idx, optimizer) -> None:
        if self._graphed.differentiated:
            return
        super().optimizer_zero_grad(epoch, batch_idx, optimizer)


class GraphedTraining:
    """The ``cuda_graph`` option of the package's LightningModules (docs/cuda-graphs.md).

    :meth:`run` replays the training step captured as a CUDA graph for the batch's shapes
    (:class:`ttt_flash.cuda_graph.StepGraphs`: one graph per shape and ``kind`` of step, at
    most ``max_graphs`` each, then eager with one warning; eager with one warning if the step
    cannot be captured). The step function zeroes the gradients in place and runs the
    backward passes; with manual optimization it also steps the (capturable) optimizers.
    Under autocast (``precision="bf16-mixed"``) the step runs in an autocast region with its
    cast cache off, as capture requires. :meth:`usable` says whether the step can be graphed
    at all (not on the CPU, not under DDP / context parallelism, not with gradient
    accumulation: one warning, then eager). :meth:`reset` drops the graphs: after a checkpoint
    is loaded the optimizer state lives in new tensors, so the graphs are captured again.

    With automatic optimization the module's ``backward`` must skip the step that
    :meth:`run` already differentiated: :meth:`take_backward` says so once per step.
    """

    def __init__(self, enabled: bool, max_graphs: int = 4):
        self.enabled = bool(enabled)
        self.max_graphs = max_graphs
        self.graphs: Dict[str, Any] = {}
        self._warned = False
        self._differentiated = False
        self._grads: list = []

    def usable(self, cuda: bool, why_not: Optional[str] = None) -> bool:
        """Whether to graph this step: ``enabled``, ``cuda`` and no ``why_not`` (a reason the
        module found; warned once)."""
        if not self.enabled:
            return False
        reason = why_not if cuda else "the batch is not on a CUDA device"
        if reason is not None:
            if not self._warned:
                self._warned = True
                warnings.warn(f"cuda_graph=True: the training step runs eagerly: {reason}", RuntimeWarning, stacklevel=2)
            return False
        return True

    def run(self, fn, inputs, params, optimizers=(), name: str = "training_step", kind: str = "step",
            generators=()):
        from ..cuda_graph import StepGraphs

        graphs = self.graphs.get(kind)
        if graphs is None:
            graphs = self.graphs[kind] = StepGraphs(_autocast_free_cache(fn), max_graphs=self.max_graphs,
                                                    fallback=True, params=list(params),
                                                    optimizers=list(optimizers), generators=list(generators),
                                                    name=name)
        self._differentiated = True
        params = list(graphs.capture_kw["params"])
        out = graphs(*inputs)
        self._grads = [(p, p.grad) for p in params]
        return out

    @property
    def differentiated(self) -> bool:
        """Whether :meth:`run` computed this step's gradients (until :meth:`take_backward`):
        ``optimizer_zero_grad`` must then leave them alone."""
        return self._differentiated

    def take_backward(self) -> bool:
        """True once after :meth:`run`: the step's backward already ran in the graph. Points
        ``p.grad`` back at the step's gradients (Lightning's automatic optimization calls
        ``zero_grad()`` between the training step and the backward)."""
        done, self._differentiated = self._differentiated, False
        if done:
            for p, g in self._grads:
                if p.grad is not g:
                    p.grad = g
            self._grads = []
        return done

    def reset(self) -> None:
        self.graphs = {}
        self._differentiated = False


def write_grads(params, grads) -> None:
    """``p.grad = g`` for each parameter, copied into an existing ``p.grad`` (in place, with
    ``torch._foreach_copy_``: a few kernels, not one per parameter; a captured step keeps
    writing the same tensors); a parameter without a gradient keeps its ``p.grad`` (zeroed)."""
    with torch.no_grad():
        into, values = [], []
        for p, g in zip(params, grads):
            if g is None:
                if p.grad is not None:
                    p.grad.zero_()
            elif p.grad is None:
                p.grad = g.detach().clone()
            else:
                into.append(p.grad)
                values.append(g.detach())
        if into:
            torch._foreach_copy_(into, values)


def backward_into_grads(loss: torch.Tensor, params: Iterable[torch.Tensor]) -> None:
    """What ``zero_grad()`` then ``loss.backward()`` leave in ``p.grad``, written in place with
    :func:`write_grads`: the gradient step of a graphed training step."""
    params = [p for p in params if p.requires_grad]
    write_grads(params, torch.autograd.grad(loss, params, allow_unused=True))


def _autocast_free_cache(fn):
    """``fn`` run in the caller's CUDA autocast region with the cast cache off (a cached cast
    made during capture would be freed when the region exits; torch.cuda.graph's docs)."""

    def step(*args):
        if not torch.is_autocast_enabled("cuda"):
            return fn(*args)
        with torch.autocast("cuda", dtype=torch.get_autocast_dtype("cuda"), cache_enabled=False):
            return fn(*args)

    return step


def outside_autocast(t: torch.Tensor):
    """A region with autocast off on ``t``'s device (a no-op context when it is off already):
    the backward passes of a graphed step run there, as Lightning runs the eager backward after
    leaving the training step's autocast region."""
    if torch.is_autocast_enabled(t.device.type):
        return torch.autocast(t.device.type, enabled=False)
    return contextlib.nullcontext()
