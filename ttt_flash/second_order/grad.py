"""Gradients of gradients, and a clear refusal where PyTorch cannot take them.

:func:`second_order_grad` is ``torch.autograd.grad`` for the library's second-order entry
points (:mod:`ttt_flash.meta`, :mod:`ttt_flash.second_order`, :mod:`ttt_flash.memory`): PyTorch's
AOTAutograd compiles backward graphs as once-differentiable and refuses ``create_graph=True``
through a ``torch.compile``'d graph (with an error about donated buffers, or "does not
currently support double backward"); this function says what to do instead: run the
second-order step eagerly, where the exact FlashBoB path works, and compile first-order
steps only.

The backward passes it starts run on the calling thread (:class:`calling_thread_backward`),
not on PyTorch's per-device autograd threads: at short sequence lengths, where a
second-order step is host-bound, handing each backward to another thread and back costs more
than the kernels (docs/benchmarks.md, "Short sequences").

Imports torch only.
"""

from __future__ import annotations

import os
from typing import Optional, Sequence

import torch
from torch import Tensor

__all__ = ["second_order_grad", "COMPILE_DOUBLE_BACKWARD_MESSAGE", "calling_thread_backward",
           "use_calling_thread", "CALLING_THREAD"]

#: The switch: the library's own backward passes run on the calling thread
#: (:func:`second_order_grad`, so the inner loops of :mod:`ttt_flash.meta`, the memory layers'
#: writes and :class:`~ttt_flash.second_order.HessianOperator`'s products, which Sophia-H and
#: AdaHessian refresh with; the Lightning modules' ``backward``; the attention chain of
#: :mod:`ttt_flash.bench`). On by default;
#: ``TTT_FLASH_CALLING_THREAD_BACKWARD=0`` in the environment at import turns it off (PyTorch's
#: per-device autograd threads, its default), :func:`use_calling_thread` inside a ``with`` block.
CALLING_THREAD: bool = os.environ.get("TTT_FLASH_CALLING_THREAD_BACKWARD", "1") != "0"

_is_multithreading = torch._C._is_multithreading_enabled
_set_multithreading = torch._C._set_multithreading_enabled


class calling_thread_backward:
    """``with calling_thread_backward():``: the backward passes started inside the block
    (``torch.autograd.grad``, ``Tensor.backward``) run on the calling thread, as under
    ``torch.autograd.set_multithreading_enabled(False)``, while :data:`CALLING_THREAD` is on;
    with it off the block changes nothing.

    PyTorch runs the backward of CUDA tensors on one autograd thread per device: the calling
    thread hands the graph over and waits to be woken. The results are the same on either
    thread (each node still runs on the streams its forward used); what changes is the host
    time, two thread hand-offs per backward and the caches of another core, which at short
    sequence lengths is more than the GPU work. The setting is thread-local and restored on
    exit; backward passes on several GPUs from one thread then run one after another. Wrap
    your own short-sequence second-order loops the same way::

        with ttt_flash.second_order.calling_thread_backward():
            g = torch.autograd.grad(loss, params, create_graph=True)
    """

    __slots__ = ("_prev",)

    def __enter__(self) -> None:
        self._prev = None
        if CALLING_THREAD:
            self._prev = _is_multithreading()
            _set_multithreading(False)

    def __exit__(self, *exc) -> None:
        if self._prev is not None:
            _set_multithreading(self._prev)


class use_calling_thread:
    """``with use_calling_thread(enabled):`` sets :data:`CALLING_THREAD` inside the block (A/B
    timings, tests); the previous setting comes back on exit."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = bool(enabled)
        self._saved: Optional[bool] = None

    def __enter__(self) -> None:
        global CALLING_THREAD
        self._saved = CALLING_THREAD
        CALLING_THREAD = self.enabled

    def __exit__(self, *exc) -> None:
        global CALLING_THREAD
        CALLING_THREAD = self._saved

#: The library's explanation, raised instead of PyTorch's when a second-order gradient is
#: taken through a graph that ``torch.compile`` built.
COMPILE_DOUBLE_BACKWARD_MESSAGE = (
    "second-order gradients (create_graph=True) through a torch.compile'd graph are not "
    "supported by PyTorch: AOTAutograd compiles backward graphs as once-differentiable, so "
    "an exact Hessian-vector product, MAML or gradient-written memory step cannot go through "
    "them. Run second-order steps with the eager (uncompiled) module, where ttt_flash's "
    "double backward is exact, and compile only first-order steps (or functions that do not "
    "need gradients of gradients)."
)

_PYTORCH_MARKERS = (
    "does not currently support double backward",
    "donated buffers",
)

def _is_compile_double_backward(e: BaseException) -> bool:
    return isinstance(e, RuntimeError) and any(m in str(e) for m in _PYTORCH_MARKERS)


def _through_compiled_backward(grads, depth: int = 3) -> bool:
    """Whether a result of ``grad(create_graph=True)`` hangs off a compiled backward graph
    (AOTAutograd's ``CompiledFunctionBackward`` node, whose own backward raises)."""
    frontier = [g.grad_fn for g in grads if isinstance(g, Tensor) and g.grad_fn is not None]
    seen = set()
    for _ in range(depth):
        nxt = []
        for fn in frontier:
            if fn is None or fn in seen:
                continue
            seen.add(fn)
            if fn.name().startswith("CompiledFunctionBackward"):
                return True
            nxt.extend(f for f, _ in fn.next_functions)
        frontier = nxt
    return False


def second_order_grad(outputs, inputs: Sequence[Tensor], **kwargs):
    """``torch.autograd.grad`` that refuses, with :data:`COMPILE_DOUBLE_BACKWARD_MESSAGE`
    (``RuntimeError``), what PyTorch cannot do: gradients of gradients through a graph built
    by ``torch.compile``. With ``create_graph=True`` the check is made at once (PyTorch
    itself would only fail at the next differentiation, or with an error about donated
    buffers). Same arguments and result as ``torch.autograd.grad``; the backward runs on the
    calling thread (:class:`calling_thread_backward`)."""
    try:
        with calling_thread_backward():
            grads = torch.autograd.grad(outputs, inputs, **kwargs)
    except RuntimeError as e:
        if _is_compile_double_backward(e):
            raise RuntimeError(COMPILE_DOUBLE_BACKWARD_MESSAGE) from e
        raise
    if kwargs.get("create_graph") and _through_compiled_backward(grads):
        raise RuntimeError(COMPILE_DOUBLE_BACKWARD_MESSAGE)
    return grads
