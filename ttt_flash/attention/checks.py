"""Validation of the public attention calls: every argument of
:func:`~ttt_flash.attention.api.flash_attention` and
:func:`~ttt_flash.attention.api.flash_attention_varlen` is checked here, once
(:func:`check_dense`, :func:`check_varlen`), before either route (the autograd Functions
eagerly, the custom operators under ``torch.compile``) runs. The composers do not check again."""

from __future__ import annotations

import math
import numbers
import warnings
from typing import Optional

import torch
from torch import Tensor

from .backend import _interpreting, resolve_backend
from .functions import _Spec

__all__ = ["check_dense", "check_varlen", "LAYOUTS"]

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
    if q.dim() == 4 and k.dim() == 4 and 0 < q.shape[2] < q.shape[1] and 0 < k.shape[2] < k.shape[1]:
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


def _check_flags(q, k, v, scale, window, causal, precise_bob, deterministic):
    """The flags as bools and the scale as a float, after :func:`_check_common`."""
    causal, precise_bob, deterministic = (_flag(n, x) for n, x in (("causal", causal), ("precise_bob", precise_bob),
                                                                  ("deterministic", deterministic)))
    return causal, precise_bob, deterministic, _check_common(q, k, v, scale, window, causal)


def _check_shapes(q, k, v, ndim: int, rank_message: str) -> None:
    """q, k, v of ``ndim`` dimensions (else ``rank_message`` with ``{name}`` and ``{shape}``),
    k and v of one shape, q and k of one head dim."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.dim() != ndim:
            raise ValueError(rank_message.format(name=name, shape=tuple(x.shape)))
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got k: {tuple(k.shape)}, v: {tuple(v.shape)}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k must have the same head dim, got {q.shape[-1]} and {k.shape[-1]}")


#: Dense calls already validated: key (:func:`_dense_key`) -> (spec, bnhd, with_lse). A call
#: whose checks warned (the layout guess, the head-dim fallback) is not kept, so it warns again.
_DENSE_OK: dict = {}
_DENSE_OK_MAX = 1024


def _dense_key(q, k, v, causal, scale, window, backend, precise_bob, deterministic, layout, return_lse):
    """Everything a dense call's checks read, the types of the non-tensor arguments included
    (``causal=1`` is refused where ``causal=True`` passes, and they are equal keys in a dict);
    for ``backend="triton"`` off CUDA also whether the Triton interpreter is on."""
    key = (type(q), type(k), type(v), q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype,
           q.device, k.device, v.device, causal.__class__, causal, scale.__class__, scale,
           window.__class__, window, backend, precise_bob.__class__, precise_bob,
           deterministic.__class__, deterministic, layout, return_lse.__class__, return_lse)
    if backend == "triton" and not q.is_cuda:
        key += (_interpreting(),)
    return key


def _may_warn(q, k, layout, backend, spec) -> bool:
    """Whether the checks of this (valid) call may have warned: the layout guess of
    :func:`_check_layout` or ``backend="auto"`` falling back to the reference on CUDA (the head
    dim above the kernels'). Such calls are not cached, so that each one warns as before."""
    looks_bnhd = layout is None and 0 < q.shape[2] < q.shape[1] and 0 < k.shape[2] < k.shape[1]
    return looks_bnhd or (backend == "auto" and spec.backend == "reference" and q.is_cuda)


def check_dense(q, k, v, *, causal, scale, window, backend, precise_bob, deterministic, layout, return_lse):
    """Validate a :func:`~ttt_flash.attention.api.flash_attention` call and resolve its backend.

    Returns:
        ``(q, k, v, spec, bnhd, with_lse)``: q, k, v as (B, H, N, D) views (transposed, not
        copied, for ``layout="bnhd"``), the call's ``_Spec``, whether the output goes back to
        (B, N, H, D), and whether the log-sum-exp is returned.

    A call like one already validated (same tensor types, shapes, dtypes and devices, same
    arguments of the same types: :func:`_dense_key`) reuses that result (host time per call);
    the first call of each kind runs every check.
    """
    key = None
    if not torch.compiler.is_compiling():
        try:
            key = _dense_key(q, k, v, causal, scale, window, backend, precise_bob, deterministic, layout,
                             return_lse)
            hit = _DENSE_OK.get(key)
        except (AttributeError, TypeError, ImportError):  # not tensors, unhashable: the checks say
            key = hit = None
        if hit is not None:
            spec, bnhd, with_lse = hit
            if bnhd:
                q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            return q, k, v, spec, bnhd, with_lse
    out = _check_dense(q, k, v, causal=causal, scale=scale, window=window, backend=backend,
                       precise_bob=precise_bob, deterministic=deterministic, layout=layout,
                       return_lse=return_lse)
    if key is not None and not _may_warn(q, k, layout, backend, out[3]):
        if len(_DENSE_OK) >= _DENSE_OK_MAX:
            _DENSE_OK.clear()
        _DENSE_OK[key] = out[3:]
    return out


def _check_dense(q, k, v, *, causal, scale, window, backend, precise_bob, deterministic, layout, return_lse):
    """The checks of :func:`check_dense`, every one run. Returns:
        ``(q, k, v, spec, bnhd, with_lse)``: q, k, v as (B, H, N, D) views (transposed, not
        copied, for ``layout="bnhd"``), the call's ``_Spec``, whether the output goes back to
        (B, N, H, D), and whether the log-sum-exp is returned.
    """
    causal, precise_bob, deterministic, scale = _check_flags(q, k, v, scale, window, causal, precise_bob,
                                                              deterministic)
    layout_given = layout is not None
    layout = _check_layout(layout, q, k)
    axes = "(batch, seq_len, heads, head_dim)" if layout == "bnhd" else "(batch, heads, seq_len, head_dim)"
    _check_shapes(q, k, v, 4, f"{{name}} must have 4 dimensions {axes} (layout={layout!r}), got shape "
                              "{shape}; for packed sequences use flash_attention_varlen")
    if q.shape[0] != k.shape[0]:
        raise ValueError(f"q and k must have the same batch size, got {q.shape[0]} and {k.shape[0]}")
    if layout == "bnhd":  # views: the kernels and the reference take strides
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    _check_heads_bhnd(q, k, layout_given)
    backend = resolve_backend(backend, q)
    if q.numel() == 0 or k.shape[2] == 0:
        backend = "reference"  # nothing for a kernel to do; the reference handles empties
    spec = _Spec(scale=scale, causal=causal, window=None if window is None else int(window), backend=backend,
                 precise_bob=bool(precise_bob), deterministic=bool(deterministic))
    with_lse = return_lse is not False and _flag("return_lse", return_lse)
    return q, k, v, spec, layout == "bnhd", with_lse


def check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal, scale, window, backend,
                 precise_bob, deterministic, return_lse):
    """Validate a :func:`~ttt_flash.attention.api.flash_attention_varlen` call and resolve its
    backend: ``(spec, with_lse)``, the call's ``_Spec`` (with the longest sequences) and whether
    the log-sum-exp is returned."""
    causal, precise_bob, deterministic, scale = _check_flags(q, k, v, scale, window, causal, precise_bob,
                                                              deterministic)
    _check_shapes(q, k, v, 3, "{name} must have 3 dimensions (total_tokens, heads, head_dim) for varlen "
                              "attention, got shape {shape}")
    _check_heads(q.shape[1], k.shape[1])
    read = max_seqlen_q is None or max_seqlen_k is None  # both given on a GPU: no host read-back
    cq = _check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.shape[0], q.device, read)
    ck = _check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, k.shape[0], q.device, read)
    if cu_seqlens_q.numel() != cu_seqlens_k.numel():
        raise ValueError(
            f"cu_seqlens_q and cu_seqlens_k must describe the same number of sequences, got "
            f"{cu_seqlens_q.numel() - 1} and {cu_seqlens_k.numel() - 1}"
        )
    longest_q = None if cq is None else max(b - a for a, b in zip(cq, cq[1:]))
    longest_k = None if ck is None else max(b - a for a, b in zip(ck, ck[1:]))
    for name, given, longest in (("max_seqlen_q", max_seqlen_q, longest_q), ("max_seqlen_k", max_seqlen_k, longest_k)):
        if given is None:
            continue
        if isinstance(given, bool) or not isinstance(given, numbers.Integral):
            raise TypeError(f"{name} must be an int or None, got {type(given).__name__}")
        if longest is not None and given < longest:
            raise ValueError(f"{name} ({given}) is smaller than the longest sequence ({longest})")
    backend = resolve_backend(backend, q)
    if q.numel() == 0 or k.shape[0] == 0:
        backend = "reference"
    spec = _Spec(
        scale=scale,
        causal=causal,
        window=None if window is None else int(window),
        backend=backend,
        max_seqlen_q=int(longest_q if max_seqlen_q is None else max_seqlen_q),
        max_seqlen_k=int(longest_k if max_seqlen_k is None else max_seqlen_k),
        precise_bob=bool(precise_bob),
        deterministic=bool(deterministic),
    )
    return spec, return_lse is not False and _flag("return_lse", return_lse)
