"""Second-order steps captured once as CUDA graphs and replayed (docs/cuda-graphs.md).

At short context a second-order step (a forward, a ``create_graph`` backward, the outer
backward, an optimizer step) launches hundreds of small kernels, and the host time to enqueue
them exceeds the GPU time to run them. Captured as a CUDA graph the whole step is replayed by
one launch. This module turns a step function over static input buffers into such a graph with
PyTorch's own machinery (:class:`torch.cuda.CUDAGraph`, :class:`torch.cuda.graph`):

* :class:`CapturedStep`: warm-up on a side stream (the first run compiles and tunes the Triton
  kernels; the later runs are checked for host synchronisations under
  ``torch.cuda.set_sync_debug_mode("error")``), the state the warm-up touched restored
  (parameters, gradients, optimizer state, random generators), gradients allocated before
  capture, the capture into a private memory pool, and replay after copying new data into the
  static inputs.
* :class:`StepGraphs`: one :class:`CapturedStep` per input shape (a small cache), with an
  eager fallback and one warning when the cache is full or a step cannot be captured.
* :func:`graph_safe_generator`: a CUDA generator whose draws advance on every replay (the
  Hutchinson / Sophia-H probes of :mod:`ttt_flash.second_order` take it as ``generator``).

What cannot be captured raises :class:`GraphCaptureError` naming the operation: a host
synchronisation (``.item()``, ``.tolist()``, ``.cpu()``, ``torch.cuda.synchronize()``, a
data-dependent shape), a CPU tensor, a non-capturable optimizer, a changed input shape, and
any use on a machine without CUDA.

Example (on a GPU)::

    model = ...cuda(); opt = torch.optim.Adam(model.parameters(), capturable=True)

    def step(x, y):                              # x, y: the static input buffers
        opt.zero_grad(set_to_none=False)
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        return loss

    graphed = CapturedStep(step, (x0, y0), params=model.parameters(), optimizers=[opt])
    for x, y in data:
        loss = graphed(x, y)                     # copy into the buffers, replay
"""

from __future__ import annotations

import traceback
import warnings
from typing import Any, Callable, Dict, Hashable, Iterable, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

__all__ = [
    "GraphCaptureError",
    "CapturedStep",
    "StepGraphs",
    "graph_safe_generator",
    "check_graphable",
    "shape_key",
]

_THIS_FILE = __file__


class GraphCaptureError(RuntimeError):
    """A step cannot be captured as (or replayed from) a CUDA graph; the message names the
    operation or argument and the fix."""


def _require_cuda(what: str) -> None:
    if not torch.cuda.is_available():
        raise GraphCaptureError(
            f"{what}: CUDA graphs need an NVIDIA GPU and a CUDA build of torch; this machine has "
            "none (torch.cuda.is_available() is False). Run the step eagerly (e.g. cuda_graph=False)"
        )


def graph_safe_generator(device: Any = "cuda", seed: Optional[int] = None) -> torch.Generator:
    """A CUDA ``torch.Generator`` for random numbers drawn inside a captured step.

    Pass it to :class:`CapturedStep` (``generators=[g]``): it is registered with each graph, so
    every replay draws fresh numbers (the philox offset advances on the device), exactly as the
    same sequence of eager calls would. The default CUDA generator is registered by PyTorch
    itself; a generator that is used in a step but not registered raises at capture.

    Args:
        device: a CUDA device.
        seed: its seed (None: ``torch.initial_seed()``).
    """
    _require_cuda("graph_safe_generator")
    device = torch.device(device)
    if device.type != "cuda":
        raise GraphCaptureError(f"graph_safe_generator: device must be a CUDA device, got {device}")
    g = torch.Generator(device=device)
    g.manual_seed(torch.initial_seed() if seed is None else int(seed))
    return g


def shape_key(inputs: Sequence[Any]) -> Tuple[Hashable, ...]:
    """The cache key of a step's inputs: (shape, dtype, device) of each tensor, the value of
    anything else (None, ints)."""
    return tuple(
        (tuple(x.shape), x.dtype, x.device) if isinstance(x, Tensor) else ("value", x) for x in inputs
    )


def check_graphable(named: Iterable[Tuple[str, Any]], what: str = "CapturedStep") -> None:
    """Raise :class:`GraphCaptureError` unless every tensor in ``named`` (name, tensor) pairs
    lives on a CUDA device."""
    for name, x in named:
        if isinstance(x, Tensor) and x.device.type != "cuda":
            raise GraphCaptureError(
                f"{what}: {name} is a {x.device.type} tensor (shape {tuple(x.shape)}); a CUDA graph "
                f"only captures work on the GPU: move it with .cuda() before capture"
            )


def _where(exc: BaseException) -> str:
    """The innermost frame of ``exc``'s traceback outside this module, as 'file:line in
    function: code'."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename != _THIS_FILE]
    if not frames:
        return "an unknown operation"
    f = frames[-1]
    return f"{f.filename}:{f.lineno} in {f.name}: {(f.line or '').strip()}"


def _explain(exc: BaseException, name: str, phase: str) -> GraphCaptureError:
    msg = str(exc)
    where = _where(exc)
    low = msg.lower()
    if "synchroniz" in low or "stream is capturing" in low or "not permitted" in low:
        kind = (
            "a host synchronisation (e.g. .item(), .tolist(), .cpu(), torch.cuda.synchronize(), a "
            "data-dependent shape such as nonzero or boolean indexing) or a host<->device copy"
        )
        fix = "move it out of the step, or keep the value on the device"
    elif "expected all tensors to be on the same device" in low or "cpu" in low:
        kind = "a CPU tensor"
        fix = "create every tensor the step uses on the GPU"
    elif "generator" in low or "rng" in low or "seed" in low:
        kind = "random numbers from an unregistered generator"
        fix = "pass the generator in generators=[...] (ttt_flash.cuda_graph.graph_safe_generator)"
    elif "capturable" in low:
        kind = "a non-capturable optimizer"
        fix = "construct it with capturable=True"
    else:
        kind = "an operation that cannot run under CUDA-graph capture"
        fix = "run the step eagerly to see the error, or move the operation out of the step"
    return GraphCaptureError(f"{name}: {phase} failed at {where}: {kind} cannot be captured in a CUDA "
                             f"graph ({fix}). Original error: {msg.splitlines()[0] if msg else type(exc).__name__}")


def _optimizer_state(opt) -> List[Tensor]:
    return [t for s in opt.state.values() for t in s.values() if isinstance(t, Tensor)]


def _check_optimizer(opt, name: str) -> None:
    for i, group in enumerate(opt.param_groups):
        if group.get("capturable") is not True:
            raise GraphCaptureError(
                f"{name}: optimizer {type(opt).__name__} (param group {i}) is not capturable: construct it "
                f"with capturable=True (torch.optim.Adam / AdamW / ...), or leave the optimizer step out "
                "of the captured step"
            )


class CapturedStep:
    """A step function over static input buffers, captured once as a CUDA graph.

    ``fn(*inputs)`` is any sequence of GPU work (forward, backward with ``create_graph``,
    backward-over-backward, optimizer step) that reads its data only from ``inputs`` and
    returns a tensor, a tuple/list/dict of tensors, or None. Construction

    1. copies ``example_inputs`` into static buffers (the graph reads them on every replay),
    2. runs ``fn`` ``warmup`` times on a side stream: the first run compiles and tunes the
       kernels, the later ones run under ``torch.cuda.set_sync_debug_mode("error")`` so that a
       host synchronisation fails here, naming the line,
    3. restores what the warm-up changed: ``params``, their gradients, the state tensors of
       ``optimizers`` (state created by the warm-up, such as Adam's moments and step, is set to
       zero, its initial value), the default CUDA generator and ``generators``; the warm-up
       leaves no trace, so the first replay is the step eager code would have run first,
    4. allocates the gradients of ``params`` that are still None (zeros), so that the graph
       accumulates into tensors that live outside it and the optimizer reads them,
    5. captures one run of ``fn`` into a private memory pool (``pool``: share one).

    Calling ``step(*inputs)`` copies the new inputs into the buffers, replays the graph and
    returns ``fn``'s outputs: the same tensors on every call, overwritten by the next replay
    (clone what you keep). Inputs must keep the captured shapes and dtypes (else
    :class:`GraphCaptureError` naming the argument; :class:`StepGraphs` captures one graph
    per shape). Non-tensor inputs (None, ints) are passed as they are and must not change.

    Args:
        fn: the step, ``fn(*inputs) -> outputs``.
        example_inputs: tensors of the shapes to capture (CUDA), or None / Python values.
        params: parameters whose gradients the step accumulates (their ``.grad`` is allocated
            before capture and must be zeroed by ``fn`` itself, e.g.
            ``opt.zero_grad(set_to_none=False)``).
        optimizers: optimizers stepped inside ``fn``; each must be ``capturable=True``.
        generators: CUDA generators used inside ``fn`` besides the default one
            (:func:`graph_safe_generator`).
        warmup: warm-up runs (>= 2: one to compile, one checked for synchronisations).
        pool: a memory-pool handle (``torch.cuda.graph_pool_handle()``, another graph's
            ``.pool()``) to share; None: a private pool.
        name: the step's name in error messages.

    Raises:
        GraphCaptureError: no CUDA; a CPU tensor among the inputs, parameters or optimizer
            state; a non-capturable optimizer; a host synchronisation or another operation
            that cannot be captured (the message names the file, line and code).
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        example_inputs: Sequence[Any],
        *,
        params: Iterable[Tensor] = (),
        optimizers: Iterable[Any] = (),
        generators: Iterable[torch.Generator] = (),
        warmup: int = 3,
        pool: Any = None,
        name: str = "step",
    ):
        if not callable(fn):
            raise TypeError(f"{name}: fn must be callable, got {type(fn).__name__}")
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 2:
            raise ValueError(f"{name}: warmup must be an int >= 2 (one run to compile, one checked), got {warmup!r}")
        if isinstance(example_inputs, Tensor) or not isinstance(example_inputs, (tuple, list)):
            raise TypeError(f"{name}: example_inputs must be a tuple or list of the step's inputs, "
                            f"got {type(example_inputs).__name__}")
        _require_cuda(name)
        self.name, self.fn = name, fn
        self.params = [p for p in params]
        self.optimizers = list(optimizers)
        self.generators = list(generators)
        check_graphable(((f"input {i}", x) for i, x in enumerate(example_inputs)), name)
        check_graphable(((f"parameter {i}", p) for i, p in enumerate(self.params)), name)
        for j, opt in enumerate(self.optimizers):
            _check_optimizer(opt, name)
            check_graphable(((f"state of optimizer {j}", t) for t in _optimizer_state(opt)), name)
        for g in self.generators:
            if g.device.type != "cuda":
                raise GraphCaptureError(f"{name}: generator on {g.device} given; a captured step draws only "
                                        "from CUDA generators (ttt_flash.cuda_graph.graph_safe_generator)")
        self.key = shape_key(example_inputs)
        self.static_inputs = [x.detach().clone() if isinstance(x, Tensor) else x for x in example_inputs]
        self.graph = torch.cuda.CUDAGraph()
        self.outputs = None
        self._warm_up(warmup)
        self._capture(pool)
        self.replays = 0

    # ---------------------------------------------------------------- construction

    def _snapshot(self):
        tensors = list(self.params) + [p.grad for p in self.params if p.grad is not None]
        for opt in self.optimizers:
            tensors += _optimizer_state(opt)
        known = {id(t) for t in tensors}
        saved = [(t, t.detach().clone()) for t in tensors]
        rng = torch.cuda.get_rng_state()
        gens = [(g, g.get_state()) for g in self.generators]
        return known, saved, rng, gens

    def _restore(self, snap) -> None:
        known, saved, rng, gens = snap
        with torch.no_grad():
            for t, value in saved:
                t.copy_(value)
            for opt in self.optimizers:  # state the warm-up created starts at zero (Adam's moments, step)
                for t in _optimizer_state(opt):
                    if id(t) not in known:
                        t.zero_()
            for p in self.params:
                if p.grad is not None and id(p.grad) not in known:
                    p.grad.zero_()
        torch.cuda.set_rng_state(rng)
        for g, state in gens:
            g.set_state(state)

    def _warm_up(self, runs: int) -> None:
        snap = self._snapshot()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        previous = torch.cuda.get_sync_debug_mode()
        try:
            with torch.cuda.stream(side):
                for i in range(runs):
                    # the first run may synchronise (Triton compiles and tunes); later runs may not
                    torch.cuda.set_sync_debug_mode("error" if i > 0 else previous)
                    try:
                        self.fn(*self.static_inputs)
                    except GraphCaptureError:
                        raise
                    except RuntimeError as e:
                        if i == 0:
                            raise
                        raise _explain(e, self.name, "warm-up (checked for host synchronisations)") from e
        except BaseException:
            torch.cuda.set_sync_debug_mode(previous)
            torch.cuda.current_stream().wait_stream(side)
            torch.cuda.synchronize()
            self._restore(snap)  # a failed capture leaves the state as it found it
            raise
        finally:
            torch.cuda.set_sync_debug_mode(previous)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        self._restore(snap)
        with torch.no_grad():
            for p in self.params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
        #: the gradient tensors the graph accumulates into (``p.grad`` of ``params`` at capture)
        self.grads = [p.grad for p in self.params]
        torch.cuda.synchronize()

    def _capture(self, pool) -> None:
        for g in self.generators:
            self.graph.register_generator_state(g)
        try:
            with torch.cuda.graph(self.graph, pool=pool, capture_error_mode="thread_local"):
                self.outputs = self.fn(*self.static_inputs)
        except GraphCaptureError:
            raise
        except RuntimeError as e:
            raise _explain(e, self.name, "capture") from e
        torch.cuda.synchronize()

    # ---------------------------------------------------------------- replay

    def pool(self):
        """The graph's memory-pool handle (to share with another :class:`CapturedStep`)."""
        return self.graph.pool()

    def copy_inputs(self, inputs: Sequence[Any]) -> None:
        """Copy ``inputs`` into the static buffers (checked against the captured shapes)."""
        if len(inputs) != len(self.static_inputs):
            raise GraphCaptureError(f"{self.name}: captured with {len(self.static_inputs)} inputs, called with {len(inputs)}")
        for i, (buf, x) in enumerate(zip(self.static_inputs, inputs)):
            if isinstance(buf, Tensor):
                if not isinstance(x, Tensor):
                    raise GraphCaptureError(f"{self.name}: input {i} was a tensor at capture, got {type(x).__name__}")
                if x.shape != buf.shape or x.dtype != buf.dtype:
                    raise GraphCaptureError(
                        f"{self.name}: input {i} has shape {tuple(x.shape)} and dtype {x.dtype}, but the graph was "
                        f"captured for shape {tuple(buf.shape)} and dtype {buf.dtype}: a shape change needs a new "
                        "capture (ttt_flash.cuda_graph.StepGraphs keeps one graph per shape)"
                    )
                if x.data_ptr() != buf.data_ptr():
                    buf.copy_(x, non_blocking=True)
            elif x is not buf and x != buf:
                raise GraphCaptureError(f"{self.name}: input {i} was {buf!r} at capture, got {x!r}; it is baked into the graph")

    def replay(self):
        """Replay the graph on the current contents of :attr:`static_inputs`; ``p.grad`` of
        each of ``params`` is pointed back at the tensor the graph writes (should something,
        e.g. ``optimizer.zero_grad()``, have set it to None in between)."""
        for p, g in zip(self.params, self.grads):
            if p.grad is not g:
                p.grad = g
        self.graph.replay()
        self.replays += 1
        return self.outputs

    def __call__(self, *inputs):
        self.copy_inputs(inputs)
        return self.replay()


class StepGraphs:
    """One :class:`CapturedStep` per input shape, or the eager step.

    ``graphs(*inputs)`` replays the graph captured for the inputs' shapes (capturing it on the
    first call with those shapes) and returns the step's outputs. With ``max_graphs`` graphs
    held, a new shape runs ``fn`` eagerly (one warning); if capture fails and ``fallback`` is
    True, the step runs eagerly from then on (one warning naming the reason), else the
    :class:`GraphCaptureError` propagates. On a machine without CUDA: eager with one warning
    when ``fallback``, else :class:`GraphCaptureError`.

    Args:
        fn: the step (as in :class:`CapturedStep`).
        max_graphs: most graphs held (each has its own memory pool).
        fallback: run eagerly instead of raising when a step cannot be captured.
        **capture_kw: ``params``, ``optimizers``, ``generators``, ``warmup``, ``name`` for
            :class:`CapturedStep`.
    """

    def __init__(self, fn: Callable[..., Any], *, max_graphs: int = 4, fallback: bool = True, **capture_kw):
        if isinstance(max_graphs, bool) or not isinstance(max_graphs, int) or max_graphs < 1:
            raise ValueError(f"max_graphs must be an int >= 1, got {max_graphs!r}")
        self.fn, self.max_graphs, self.fallback, self.capture_kw = fn, max_graphs, fallback, capture_kw
        self.graphs: Dict[Tuple[Hashable, ...], CapturedStep] = {}
        self.disabled: Optional[str] = None  # why the step runs eagerly from now on
        self.eager_calls = 0
        self._warned_full = False

    @property
    def name(self) -> str:
        return self.capture_kw.get("name", "step")

    def clear(self) -> None:
        """Drop every graph (e.g. after a checkpoint replaced the optimizer state)."""
        self.graphs.clear()

    def _eager(self, inputs):
        self.eager_calls += 1
        return self.fn(*inputs)

    def _disable(self, reason: str) -> None:
        self.disabled = reason
        warnings.warn(f"{self.name}: running eagerly, not as a CUDA graph: {reason}", RuntimeWarning, stacklevel=3)

    def __call__(self, *inputs):
        if self.disabled is not None:
            return self._eager(inputs)
        if not torch.cuda.is_available():
            if not self.fallback:
                _require_cuda(self.name)
            self._disable("CUDA is not available")
            return self._eager(inputs)
        key = shape_key(inputs)
        graph = self.graphs.get(key)
        if graph is None:
            if len(self.graphs) >= self.max_graphs:
                if not self._warned_full:
                    self._warned_full = True
                    warnings.warn(
                        f"{self.name}: {len(self.graphs)} graphs held (max_graphs={self.max_graphs}); new input "
                        "shapes run eagerly", RuntimeWarning, stacklevel=2)
                return self._eager(inputs)
            try:
                graph = CapturedStep(self.fn, inputs, **self.capture_kw)
            except GraphCaptureError as e:
                if not self.fallback:
                    raise
                self._disable(str(e))
                return self._eager(inputs)
            self.graphs[key] = graph
        return graph(*inputs)
