"""Attention as ``torch.library`` custom operators, for ``torch.compile``.

Under ``torch.compile`` (Dynamo tracing), :func:`ttt_flash.flash_attention` routes through
two opaque custom operators instead of its ``autograd.Function`` s:

* ``ttt_flash::attention_fwd(q, k, v, ...) -> (o, lse)``
* ``ttt_flash::attention_bwd(q, k, v, o, lse, dO, ...) -> (dq, dk, dv)``

with fake (meta) implementations giving output shapes, and ``register_autograd`` linking the
first to the second. The compiled graph calls the same composers (Triton kernels or the
reference) as eager mode, so a compiled first-order step computes what the eager step does.

Double backward is a different matter: PyTorch's AOTAutograd compiles the backward graph as
a once-differentiable function and refuses ``create_graph=True`` through it (with an error
about donated buffers, or "does not currently support double backward"). ttt-flash's
second-order entry points (:mod:`ttt_flash.meta`, :mod:`ttt_flash.hessian`,
:mod:`ttt_flash.memory`) catch those errors and say what to do instead
(:func:`second_order_grad`): run the second-order step eagerly, where the exact FlashBoB
path works, and compile first-order steps only.

Imports torch only (the composer module is passed in by ``attention.py``).
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence, Tuple

import torch
from torch import Tensor

__all__ = ["compiled_attention", "second_order_grad", "COMPILE_DOUBLE_BACKWARD_MESSAGE"]

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

# The composer modules, registered by attention.py under the backend names.
_COMPOSERS: dict = {}


def register_composers(name: str, getter: Callable) -> None:
    """Register ``getter() -> module`` (with ``attn_fwd``/``attn_bwd``) as backend ``name``."""
    _COMPOSERS[name] = getter


def _opt(x: int) -> Optional[int]:
    return None if x < 0 else x


def _row_dtype(q: Tensor, backend: str) -> torch.dtype:
    return torch.float64 if (backend == "reference" and q.dtype == torch.float64) else torch.float32


def _row_shape(q: Tensor, varlen: bool) -> Tuple[int, ...]:
    return (q.shape[1], q.shape[0]) if varlen else tuple(q.shape[:-1])


def _kwargs(cu_q, cu_k, scale, causal, window, max_q, max_k) -> dict:
    return dict(scale=scale, causal=causal, window=_opt(window), cu_seqlens_q=cu_q,
                cu_seqlens_k=cu_k, max_seqlen_q=_opt(max_q), max_seqlen_k=_opt(max_k))


@torch.library.custom_op("ttt_flash::attention_fwd", mutates_args=())
def _attention_fwd(
    q: Tensor, k: Tensor, v: Tensor, cu_q: Optional[Tensor], cu_k: Optional[Tensor],
    scale: float, causal: bool, window: int, max_q: int, max_k: int, backend: str,
) -> Tuple[Tensor, Tensor]:
    o, lse = _COMPOSERS[backend]().attn_fwd(q, k, v, **_kwargs(cu_q, cu_k, scale, causal, window, max_q, max_k))
    return o.contiguous(), lse.to(_row_dtype(q, backend)).contiguous()


@_attention_fwd.register_fake
def _attention_fwd_fake(q, k, v, cu_q, cu_k, scale, causal, window, max_q, max_k, backend):
    o = q.new_empty(q.shape)
    lse = q.new_empty(_row_shape(q, cu_q is not None), dtype=_row_dtype(q, backend))
    return o, lse


@torch.library.custom_op("ttt_flash::attention_bwd", mutates_args=())
def _attention_bwd(
    q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, do: Tensor,
    cu_q: Optional[Tensor], cu_k: Optional[Tensor],
    scale: float, causal: bool, window: int, max_q: int, max_k: int, backend: str,
) -> Tuple[Tensor, Tensor, Tensor]:
    dq, dk, dv, _ = _COMPOSERS[backend]().attn_bwd(
        q, k, v, o, lse, do, **_kwargs(cu_q, cu_k, scale, causal, window, max_q, max_k))
    return dq.contiguous(), dk.contiguous(), dv.contiguous()


@_attention_bwd.register_fake
def _attention_bwd_fake(q, k, v, o, lse, do, cu_q, cu_k, scale, causal, window, max_q, max_k, backend):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _fwd_setup(ctx, inputs, output):
    q, k, v, cu_q, cu_k, *static = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse, cu_q, cu_k)
    ctx.static = static


def _fwd_backward(ctx, do, _dlse):
    q, k, v, o, lse, cu_q, cu_k = ctx.saved_tensors
    if do is None:
        return (None,) * 11
    dq, dk, dv = _attention_bwd(q, k, v, o, lse, do, cu_q, cu_k, *ctx.static)
    return (dq, dk, dv) + (None,) * 8


def _bwd_setup(ctx, inputs, output):
    pass


def _bwd_backward(ctx, *grads):
    # Reached only if someone differentiates the custom operator itself eagerly; the eager
    # public path uses attention.py's autograd.Functions, which are differentiable twice.
    raise RuntimeError(COMPILE_DOUBLE_BACKWARD_MESSAGE)


_attention_fwd.register_autograd(_fwd_backward, setup_context=_fwd_setup)
_attention_bwd.register_autograd(_bwd_backward, setup_context=_bwd_setup)


def compiled_attention(q, k, v, cu_q, cu_k, *, scale: float, causal: bool, window: Optional[int],
                       max_seqlen_q: Optional[int], max_seqlen_k: Optional[int], backend: str) -> Tensor:
    """The custom-operator path of ``flash_attention`` (used while ``torch.compile`` traces)."""
    o, _ = _attention_fwd(
        q, k, v, cu_q, cu_k, float(scale), bool(causal),
        -1 if window is None else int(window),
        -1 if max_seqlen_q is None else int(max_seqlen_q),
        -1 if max_seqlen_k is None else int(max_seqlen_k),
        backend,
    )
    return o


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
