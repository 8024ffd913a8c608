"""Validation of the public attention calls: every argument of :func:`flash_attention` and
:func:`flash_attention_varlen` is checked here, once, before either route (eager Functions or
the compiled custom operators) runs. The composers do not check again."""

from __future__ import annotations

import math
import numbers
import warnings
from typing import Optional

import torch
from torch import Tensor

def _check_tensor(name: str, x) -> None:
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {x.dtype}")


def _flag(name: str, value) -> bool:
    """``value`` as a bool: True/False or a NumPy bool; anything else (a string such as "no",
    an int) is a TypeError, so that no flag is read as True by accident."""
    if isinstance(value, bool):
        return value
    kind = type(value)
    if kind.__module__ == "numpy" and kind.__name__ in ("bool", "bool_"):
        return bool(value)
    raise TypeError(f"{name} must be a bool (True or False), got {kind.__name__} {value!r}")


def _check_common(q, k, v, scale, window, causal) -> float:
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_tensor(name, x)
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(
            f"q, k and v must share one dtype, got q: {q.dtype}, k: {k.dtype}, v: {v.dtype}; "
            "cast them with .to(q.dtype)"
        )
    if not (q.device == k.device == v.device):
        raise ValueError(
            f"q, k and v must be on one device, got q: {q.device}, k: {k.device}, v: {v.device}"
        )
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if window is not None:
        if isinstance(window, bool) or not isinstance(window, numbers.Integral):
            raise TypeError(f"window must be an int or None, got {type(window).__name__}")
        if window < 1:
            raise ValueError(f"window must be >= 1 (the number of most recent keys a query sees), got {window}")
        if not causal:
            raise ValueError("window requires causal=True (a sliding window looks back from each query)")
    if q.dim() > 0 and q.shape[-1] == 0:
        raise ValueError(f"head dim (q.shape[-1]) must be >= 1, got 0 (q of shape {tuple(q.shape)})")
    if scale is None:
        return q.shape[-1] ** -0.5
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")
    scale = float(scale)
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    return scale


def _check_heads(hq: int, hkv: int) -> None:
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(
            f"the number of query heads ({hq}) must be a multiple of the number of key/value "
            f"heads ({hkv}) (grouped-query attention)"
        )


def _check_cu_seqlens(name: str, cu, tokens: int, device, read: bool = True) -> Optional[list]:
    """The checked values of ``cu`` as a list; None (the values unchecked, nothing read back
    to the host) when ``read`` is False and ``cu`` is on a GPU: with ``max_seqlen_*`` given the
    call stays free of device synchronisations (CUDA-graph capture, docs/cuda-graphs.md)."""
    if not isinstance(cu, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of dtype torch.int32, got {type(cu).__name__}")
    if cu.dtype != torch.int32:
        raise ValueError(f"{name} must have dtype torch.int32, got {cu.dtype}; use {name}.to(torch.int32)")
    if cu.dim() != 1 or cu.numel() < 2:
        raise ValueError(f"{name} must be 1-D with batch_size + 1 >= 2 entries, got shape {tuple(cu.shape)}")
    if cu.device != device:
        raise ValueError(f"{name} must be on the same device as q ({device}), got {cu.device}")
    if not read and cu.device.type != "cpu":
        return None
    try:
        values = cu.tolist()
    except RuntimeError as e:  # e.g. a vmapped (batched) tensor has no data to read
        raise NotImplementedError(
            f"{name} must be a concrete tensor: torch.func.vmap over cu_seqlens is not supported; "
            "vmap over q, k, v only"
        ) from e
    if values[0] != 0:
        raise ValueError(f"{name}[0] must be 0, got {values[0]}")
    if any(b < a for a, b in zip(values, values[1:])):
        raise ValueError(f"{name} must be non-decreasing (cumulative sequence lengths), got {values}")
    if values[-1] != tokens:
        raise ValueError(
            f"{name}[-1] must equal the number of packed tokens ({tokens}), got {values[-1]}"
        )
    return values


#: Accepted values of ``flash_attention``'s ``layout`` argument.
LAYOUTS = ("bhnd", "bnhd")


def _check_layout(layout: Optional[str], q: Tensor, k: Tensor) -> str:
    """The layout to use: ``layout`` itself, or ``"bhnd"`` when None, warning when the shapes
    look like FlashAttention's (B, N, H, D): more heads than positions in q and in k."""
    if layout is not None:
        if layout not in LAYOUTS:
            raise ValueError(
                f"layout must be 'bhnd' (batch, heads, seq_len, head_dim; the default, as "
                f"scaled_dot_product_attention) or 'bnhd' (batch, seq_len, heads, head_dim, as "
                f"FlashAttention's flash_attn_func), got {layout!r}"
            )
        return layout
    if q.dim() == 4 and k.dim() == 4 and q.shape[1] > q.shape[2] and k.shape[1] > k.shape[2]:
        warnings.warn(
            f"flash_attention reads q {tuple(q.shape)} and k {tuple(k.shape)} as (batch, heads, "
            f"seq_len, head_dim): {q.shape[1]} heads over {q.shape[2]} queries and "
            f"{k.shape[1]} heads over {k.shape[2]} keys. If they are (batch, seq_len, heads, "
            "head_dim) (FlashAttention's layout), pass layout='bnhd'; pass layout='bhnd' to "
            "state the layout and silence this warning",
            UserWarning,
            stacklevel=3,
        )
    return "bhnd"


def _check_heads_bhnd(q: Tensor, k: Tensor, layout_given: bool) -> None:
    """:func:`_check_heads` for (B, H, N, D) tensors, with a hint when the tensors would be
    consistent read as (B, N, H, D)."""
    try:
        _check_heads(q.shape[1], k.shape[1])
    except ValueError as e:
        hkv = k.shape[2]
        # the hint only for shapes that look like (B, N, H, D), as the layout warning's: more
        # "heads" than positions in q and k (not ordinary self-attention shapes)
        looks_bnhd = q.shape[1] > q.shape[2] and k.shape[1] > k.shape[2]
        if not layout_given and hkv and q.shape[2] % hkv == 0 and looks_bnhd:
            raise ValueError(
                f"{e}; q {tuple(q.shape)} and k {tuple(k.shape)} are read as (batch, heads, "
                "seq_len, head_dim): if they are (batch, seq_len, heads, head_dim) "
                "(FlashAttention's layout), pass layout='bnhd'"
            ) from None
        raise
