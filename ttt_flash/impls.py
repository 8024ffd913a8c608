"""The attention implementations, by the names users write in recipes and configs.

One registry, one vocabulary: every model and layer that lets its user pick how attention is
computed (``GPTConfig.attention``, ``NetConfig.attention``, the ``attention`` argument of
:class:`~ttt_flash.memory.GradientMemoryAttention`) looks the name up here.

======================  ===============================================================
name                    what runs
======================  ===============================================================
``"ttt_flash"``         :func:`ttt_flash.flash_attention` (``backend="auto"``: the Triton
                        kernels on CUDA, the chunked PyTorch reference elsewhere). Exact
                        first and second derivatives, O(N) memory on the Triton path.
``"math"``              :func:`ttt_flash.reference.naive_attention`: materialised
                        softmax(QKᵀ)V in plain torch ops; any order of derivative, O(N²)
                        memory. The oracle.
``"sdpa"``              ``torch.nn.functional.scaled_dot_product_attention`` with its own
                        kernel choice; its fused CUDA kernels have no double backward.
======================  ===============================================================

Below the registry, :func:`ttt_flash.flash_attention`'s ``backend`` argument
(``"auto"``/``"triton"``/``"reference"``) chooses between the Triton kernels and the PyTorch
reference; ``attention.py`` is the only place that makes that choice. Above it, the Hugging
Face integration registers ``"ttt_flash"`` under transformers' name ``"ttt_bob"``
(:data:`HF_NAME`), and ``GPT(..., context_parallel=...)`` asks :func:`context_parallel_attention_for`
for the implementation across ranks (:data:`CONTEXT_PARALLEL_IMPLS`: ``"ttt_flash"``, through
:func:`ttt_flash.context_parallel.context_parallel_attention`).

Every implementation has the signature ``attend(q, k, v, *, causal, window=None)`` with q
(B, H_q, N_q, D), k and v (B, H_kv, N_k, D), H_q a multiple of H_kv (GQA), scale D^-1/2, and
returns (B, H_q, N_q, D). ``window`` (causal only) lets each query see its ``window`` most
recent keys, itself included.
"""

from __future__ import annotations

from functools import partial
from typing import Callable, Dict, Literal, Optional, Sequence, Tuple

import torch.nn.functional as F
from torch import Tensor

from .attention import flash_attention
from .context_parallel import context_parallel_attention
from .reference import attention_mask, naive_attention

__all__ = ["AttentionName", "ATTENTION_IMPLS", "CONTEXT_PARALLEL_IMPLS", "HF_NAME", "attend", "get_attention",
           "check_attention", "context_parallel_attention_for"]

#: The name transformers knows the ``"ttt_flash"`` implementation by
#: (``attn_implementation="ttt_bob"``; see :mod:`ttt_flash.integrations.transformers`).
HF_NAME = "ttt_bob"


def _ttt_flash(q: Tensor, k: Tensor, v: Tensor, *, causal: bool, window: Optional[int] = None) -> Tensor:
    return flash_attention(q, k, v, causal=causal, window=window, layout="bhnd")


def _math(q: Tensor, k: Tensor, v: Tensor, *, causal: bool, window: Optional[int] = None) -> Tensor:
    return naive_attention(q, k, v, causal=causal, window=window)


def _sdpa(q: Tensor, k: Tensor, v: Tensor, *, causal: bool, window: Optional[int] = None) -> Tensor:
    gqa = q.shape[1] != k.shape[1]
    if window is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
    mask = attention_mask(q.shape[2], k.shape[2], causal=causal, window=window, device=q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


_REGISTRY: Dict[str, Callable[..., Tensor]] = {"ttt_flash": _ttt_flash, "math": _math, "sdpa": _sdpa}

#: The type of an ``attention`` argument: recipes' YAML is checked against it (jsonargparse).
AttentionName = Literal["ttt_flash", "math", "sdpa"]

#: Every accepted implementation name, in the order the docs list them.
ATTENTION_IMPLS: Tuple[str, ...] = tuple(_REGISTRY)

#: The implementations that run across context-parallel ranks (exact to second order).
CONTEXT_PARALLEL_IMPLS: Tuple[str, ...] = ("ttt_flash",)

def check_attention(name: str, allowed: Optional[Sequence[str]] = None, *, what: str = "attention") -> str:
    """Check that ``name`` is an implementation the caller supports; return it.

    Args:
        name: an implementation name (see the module docstring).
        allowed: the names the caller supports (default: all of :data:`ATTENTION_IMPLS`).
        what: the argument's name, for the error message.

    Raises:
        ValueError: ``name`` is not an implementation (or not one of ``allowed``).
    """
    allowed = ATTENTION_IMPLS if allowed is None else tuple(allowed)
    if name not in allowed:
        raise ValueError(f"{what} must be one of {allowed}, got {name!r}")
    return name


def get_attention(name: str) -> Callable[..., Tensor]:
    """The attention function registered as ``name``: ``attend(q, k, v, *, causal, window=None)``."""
    return _REGISTRY[check_attention(name)]


def attend(q: Tensor, k: Tensor, v: Tensor, *, impl: str, causal: bool = True,
           window: Optional[int] = None) -> Tensor:
    """Attention through the implementation ``impl``: q (B, H_q, N_q, D), k, v (B, H_kv, N_k, D)
    → (B, H_q, N_q, D), scale D^-1/2.

    Example::

        >>> import torch
        >>> from ttt_flash.impls import attend
        >>> q = k = v = torch.randn(1, 2, 5, 8)
        >>> attend(q, k, v, impl="math", causal=True).shape
        torch.Size([1, 2, 5, 8])
    """
    return get_attention(impl)(q, k, v, causal=causal, window=window)


def context_parallel_attention_for(name: str, group=None, *, what: str = "attention") -> Callable[..., Tensor]:
    """Implementation ``name`` with the sequence sharded across the ranks of ``group`` (None:
    the default process group): ``attend(q, k, v, *, causal, window=None)`` over each rank's
    block of tokens (:func:`ttt_flash.context_parallel.context_parallel_attention`).

    Raises:
        ValueError: ``name`` is not one of :data:`CONTEXT_PARALLEL_IMPLS`.
    """
    if name not in CONTEXT_PARALLEL_IMPLS:
        raise ValueError(f"context parallelism needs {what}='ttt_flash', got {name!r}")
    return partial(context_parallel_attention, group=group)
