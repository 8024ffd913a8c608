"""Attention as ``torch.library`` custom operators, for ``torch.compile``.

Under ``torch.compile`` (Dynamo tracing), :func:`ttt_flash.flash_attention` routes through
two opaque custom operators instead of its ``autograd.Function`` s:

* ``ttt_flash::attention_fwd(q, k, v, ...) -> (o, lse)``
* ``ttt_flash::attention_bwd(q, k, v, o, lse, dO, ...) -> (dq, dk, dv)``

with fake (meta) implementations giving output shapes, and ``register_autograd`` linking the
first to the second. The compiled graph calls the same composers (Triton kernels or the
reference) as eager mode, so a compiled first-order step computes what the eager step does.

Double backward through a compiled graph is refused by PyTorch; :mod:`ttt_flash.second_order`
(:func:`~ttt_flash.second_order.second_order_grad`, re-exported here for old imports) turns that
refusal into the library's explanation.
"""

from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch
from torch import Tensor

from .second_order import COMPILE_DOUBLE_BACKWARD_MESSAGE, second_order_grad

__all__ = ["compiled_attention", "second_order_grad", "COMPILE_DOUBLE_BACKWARD_MESSAGE"]

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


#: The arguments of ``ttt_flash::attention_fwd``, in schema order, and those that are not tensors.
_FWD_ARGS = ("q", "k", "v", "cu_q", "cu_k", "scale", "causal", "window", "max_q", "max_k", "backend")
_STATIC_ARGS = _FWD_ARGS[5:]


def _fwd_grads(**grads) -> tuple:
    """The gradient tuple of ``attention_fwd``'s inputs, from gradients given by argument name
    (the others None)."""
    return tuple(grads.get(name) for name in _FWD_ARGS)


def _fwd_setup(ctx, inputs, output):
    args = dict(zip(_FWD_ARGS, inputs))
    o, lse = output
    ctx.save_for_backward(args["q"], args["k"], args["v"], o, lse, args["cu_q"], args["cu_k"])
    ctx.static = {name: args[name] for name in _STATIC_ARGS}


def _fwd_backward(ctx, do, _dlse):
    q, k, v, o, lse, cu_q, cu_k = ctx.saved_tensors
    if do is None:
        return _fwd_grads()
    dq, dk, dv = _attention_bwd(q, k, v, o, lse, do, cu_q=cu_q, cu_k=cu_k, **ctx.static)
    return _fwd_grads(q=dq, k=dk, v=dv)


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
        q, k, v, cu_q=cu_q, cu_k=cu_k, scale=float(scale), causal=bool(causal),
        window=-1 if window is None else int(window),
        max_q=-1 if max_seqlen_q is None else int(max_seqlen_q),
        max_k=-1 if max_seqlen_k is None else int(max_seqlen_k),
        backend=backend,
    )
    return o
