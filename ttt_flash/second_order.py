"""Gradients of gradients, and a clear refusal where PyTorch cannot take them.

:func:`second_order_grad` is ``torch.autograd.grad`` for the library's second-order entry
points (:mod:`ttt_flash.meta`, :mod:`ttt_flash.hessian`, :mod:`ttt_flash.memory`): PyTorch's
AOTAutograd compiles backward graphs as once-differentiable and refuses ``create_graph=True``
through a ``torch.compile``'d graph (with an error about donated buffers, or "does not
currently support double backward"); this function says what to do instead: run the
second-order step eagerly, where the exact FlashBoB path works, and compile first-order
steps only.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

__all__ = ["second_order_grad", "COMPILE_DOUBLE_BACKWARD_MESSAGE"]

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
    buffers). Same arguments and result as ``torch.autograd.grad``."""
    try:
        grads = torch.autograd.grad(outputs, inputs, **kwargs)
    except RuntimeError as e:
        if _is_compile_double_backward(e):
            raise RuntimeError(COMPILE_DOUBLE_BACKWARD_MESSAGE) from e
        raise
    if kwargs.get("create_graph") and _through_compiled_backward(grads):
        raise RuntimeError(COMPILE_DOUBLE_BACKWARD_MESSAGE)
    return grads
