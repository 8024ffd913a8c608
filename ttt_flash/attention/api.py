"""The public attention functions: :func:`flash_attention` on (B, H, N, D) tensors and
:func:`flash_attention_varlen` on packed sequences. Each validates its arguments
(:mod:`ttt_flash.attention.checks`), resolves the backend and hands the call to the one
dispatch, :func:`ttt_flash.attention.functions._apply`."""

from __future__ import annotations

import numbers
from typing import Optional, Tuple, Union

from torch import Tensor

from .backend import resolve_backend
from .checks import (_check_common, _check_cu_seqlens, _check_heads, _check_heads_bhnd, _check_layout, _flag)
from .functions import _apply, _Spec

__all__ = ["flash_attention", "flash_attention_varlen"]

# --------------------------------------------------------------------------- public API


def flash_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = False,
    scale: Optional[float] = None,
    window: Optional[int] = None,
    backend: str = "auto",
    precise_bob: bool = True,
    deterministic: bool = False,
    layout: Optional[str] = None,
    return_lse: bool = False,
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    r"""Attention on (B, H, N, D) tensors (``layout="bnhd"``: (B, N, H, D)), differentiable to any order exactly.

    ``o = softmax(scale · q kᵀ + mask) v`` for each batch and head, with exact gradients
    and exact gradients of gradients (Hessian-vector products, MAML, gradient-written
    memory), never materialising the N_q × N_k matrix on the Triton backend.

    Args:
        q: queries, shape (B, H_q, N_q, D).
        k: keys, shape (B, H_kv, N_k, D). H_q must be a multiple of H_kv (grouped-query
            attention: query head h uses key head h // (H_q / H_kv)).
        v: values, shape (B, H_kv, N_k, D).
        causal: mask future keys. Aligned to the bottom-right when N_q ≠ N_k: query i
            sees key j iff j ≤ i + N_k − N_q (FlashAttention-2 convention).
        scale: softmax scale; defaults to D^-1/2.
        window: with ``causal=True``, each query sees only its ``window`` most recent
            keys, its own aligned position included: j > i + N_k − N_q − window.
        backend: ``"auto"`` (Triton kernels for CUDA float16/bfloat16/float32, the
            PyTorch reference otherwise), ``"triton"`` or ``"reference"``.
        precise_bob: Triton backend only. True (default): the backward-over-backward runs a
            row-statistics pass, then forms the cotangents of S and dP per tile, keeping
            16-bit errors below PyTorch's own math path even where attention is peaked
            (bf16 ~2.4e-3 relative L2). False: the two-pass affine form of
            docs/bob-math.md (fewer products), whose 16-bit error grows where attention is
            peaked (terms cancel).
        deterministic: accepted for compatibility; it changes nothing. Every pass of both
            backends is atomic-free (each output element is written by one program, its sums
            taken in a fixed order), so results are bitwise reproducible run to run on one
            device with the same torch and triton, whatever its value; different GPUs or
            tile tables may round differently.
        layout: axis order of q, k, v and the output. ``"bhnd"``: (B, H, N, D), as
            ``torch.nn.functional.scaled_dot_product_attention`` (the shapes above).
            ``"bnhd"``: (B, N, H, D), as FlashAttention's ``flash_attn_func``; the inputs
            are read through transposed views (no copies) and the output is returned as
            a (B, N_q, H_q, D) view (its memory is (B, H, N, D)-contiguous; gradients come
            back in the inputs' shapes). ``None`` (default): ``"bhnd"``, with a
            ``UserWarning`` when the shapes look like (B, N, H, D), i.e. when q and k both
            have more heads than positions (``q.shape[1] > q.shape[2]`` and
            ``k.shape[1] > k.shape[2]``); and a ``ValueError`` on mismatched head counts
            says so when the tensors would be consistent read as (B, N, H, D). Tensors of
            one layout with equal shapes and at least as many positions as heads cannot
            be told apart: pass ``layout`` explicitly to state it (and silence the check).
        return_lse: also return the row log-sum-exp of the masked, scaled scores,
            ``lse[b, h, i] = log Σ_j exp(scale · q_i·k_j)`` over the keys query i sees, as
            FlashAttention's ``return_softmax_lse`` / ``return_attn_probs``. ``lse`` is
            differentiable like the output: first, second and higher derivatives of a loss
            of (o, lse) are exact, with no N_q × N_k tensor (docs/bob-math.md, "The
            log-sum-exp as an output"). A cotangent of ``lse`` costs one more forward and
            first backward in each backward (with K as the values). Under ``torch.compile``
            the call runs eagerly (a graph break; ``fullgraph=True`` refuses it).

    Returns:
        Tensor of shape (B, H_q, N_q, D) (``layout="bnhd"``: (B, N_q, H_q, D)), dtype of
        ``q``. A query row that sees no key returns 0, and all its gradients are 0.
        With ``return_lse=True``: the pair ``(o, lse)``, ``lse`` of shape (B, H_q, N_q) in
        either layout, float64 for float64 inputs and float32 otherwise; a row that sees no
        key has ``lse = -inf`` (gradients through it stay 0, never NaN).

    Inputs may be non-contiguous (e.g. produced by ``transpose``). Derivatives of any order
    are exact: the third and higher recompute the backward-over-backward in blocks of query
    rows with plain PyTorch ops (O(rows × N_k) memory per head; docs/second-order.md).

    Example: an exact Hessian-vector product through attention::

        >>> import torch
        >>> from ttt_flash import flash_attention
        >>> q, k, v = (torch.randn(1, 2, 16, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
        >>> loss = flash_attention(q, k, v, causal=True).square().sum()
        >>> grads = torch.autograd.grad(loss, (q, k, v), create_graph=True)
        >>> vecs = [torch.randn_like(g) for g in grads]
        >>> hvp = torch.autograd.grad(grads, (q, k, v), grad_outputs=vecs)
        >>> [tuple(h.shape) for h in hvp]
        [(1, 2, 16, 8), (1, 2, 16, 8), (1, 2, 16, 8)]
    """
    causal, precise_bob, deterministic = (_flag(n, x) for n, x in (("causal", causal), ("precise_bob", precise_bob),
                                                                  ("deterministic", deterministic)))
    scale = _check_common(q, k, v, scale, window, causal)
    layout_given = layout is not None
    layout = _check_layout(layout, q, k)
    axes = "(batch, seq_len, heads, head_dim)" if layout == "bnhd" else "(batch, heads, seq_len, head_dim)"
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.dim() != 4:
            raise ValueError(
                f"{name} must have 4 dimensions {axes} (layout={layout!r}), got shape "
                f"{tuple(x.shape)}; for packed sequences use flash_attention_varlen"
            )
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got k: {tuple(k.shape)}, v: {tuple(v.shape)}")
    if q.shape[0] != k.shape[0]:
        raise ValueError(f"q and k must have the same batch size, got {q.shape[0]} and {k.shape[0]}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k must have the same head dim, got {q.shape[-1]} and {k.shape[-1]}")
    if layout == "bnhd":  # views: the kernels and the reference take strides
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    _check_heads_bhnd(q, k, layout_given)
    backend = resolve_backend(backend, q)
    if q.numel() == 0 or k.shape[2] == 0:
        backend = "reference"  # nothing for a kernel to do; the reference handles empties
    spec = _Spec(scale=scale, causal=causal, window=None if window is None else int(window), backend=backend,
                 precise_bob=bool(precise_bob), deterministic=bool(deterministic))
    if return_lse is not False and _flag("return_lse", return_lse):
        o, lse = _apply(q, k, v, spec, None, None, with_lse=True)
        return (o.transpose(1, 2) if layout == "bnhd" else o), lse
    o = _apply(q, k, v, spec, None, None)
    return o.transpose(1, 2) if layout == "bnhd" else o


def flash_attention_varlen(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: Optional[int],
    max_seqlen_k: Optional[int],
    *,
    causal: bool = False,
    scale: Optional[float] = None,
    window: Optional[int] = None,
    backend: str = "auto",
    precise_bob: bool = True,
    deterministic: bool = False,
    return_lse: bool = False,
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    r"""Attention over variable-length sequences packed along the token axis.

    Sequence b owns query tokens ``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` and key tokens
    ``cu_seqlens_k[b]:cu_seqlens_k[b+1]``; no token attends across sequences. Empty
    sequences are allowed. Masks (``causal``, ``window``), ``scale``, ``backend``,
    ``precise_bob``, ``deterministic`` and ``return_lse`` are as in :func:`flash_attention`, applied per sequence with that sequence's lengths.

    The packed (T, H, D) layout is FlashAttention's ``flash_attn_varlen_func`` layout (no
    ``layout`` argument here).

    Args:
        q: (T_q, H_q, D) packed queries.
        k, v: (T_k, H_kv, D) packed keys and values.
        cu_seqlens_q, cu_seqlens_k: int32 tensors of shape (B + 1,): 0, then cumulative
            sequence lengths; the last entry equals T_q (resp. T_k).
        max_seqlen_q, max_seqlen_k: the longest query (key) sequence, or None to compute
            it (one device synchronisation).

    Returns:
        (T_q, H_q, D) tensor, differentiable twice like :func:`flash_attention`. With
        ``return_lse=True``: the pair ``(o, lse)``, ``lse`` the differentiable row
        log-sum-exp of shape (H_q, T_q) (FlashAttention's varlen layout), float64 for
        float64 inputs and float32 otherwise, ``-inf`` on rows that see no key.

    Example::

        >>> import torch
        >>> from ttt_flash import flash_attention_varlen
        >>> cu = torch.tensor([0, 3, 3, 8], dtype=torch.int32)  # lengths 3, 0, 5
        >>> q, k, v = (torch.randn(8, 2, 4) for _ in range(3))
        >>> flash_attention_varlen(q, k, v, cu, cu, 5, 5, causal=True).shape
        torch.Size([8, 2, 4])
    """
    causal, precise_bob, deterministic = (_flag(n, x) for n, x in (("causal", causal), ("precise_bob", precise_bob),
                                                                  ("deterministic", deterministic)))
    scale = _check_common(q, k, v, scale, window, causal)
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.dim() != 3:
            raise ValueError(
                f"{name} must have 3 dimensions (total_tokens, heads, head_dim) for varlen "
                f"attention, got shape {tuple(x.shape)}"
            )
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got k: {tuple(k.shape)}, v: {tuple(v.shape)}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k must have the same head dim, got {q.shape[-1]} and {k.shape[-1]}")
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
    if return_lse is not False and _flag("return_lse", return_lse):
        return _apply(q, k, v, spec, cu_seqlens_q, cu_seqlens_k, with_lse=True)
    return _apply(q, k, v, spec, cu_seqlens_q, cu_seqlens_k)
