"""The public attention functions: :func:`flash_attention` on (B, H, N, D) tensors and
:func:`flash_attention_varlen` on packed sequences. Each validates its arguments
and resolves its backend in one place (:func:`ttt_flash.attention.checks.check_dense` /
:func:`~ttt_flash.attention.checks.check_varlen`) and hands it to the one dispatch,
``ttt_flash.attention.functions._apply``, which runs the same composers eagerly and under
``torch.compile``."""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
from torch import Tensor

from . import checks
from .functions import _apply

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
    q, k, v, spec, bnhd, with_lse = checks.check_dense(
        q, k, v, causal=causal, scale=scale, window=window, backend=backend, precise_bob=precise_bob,
        deterministic=deterministic, layout=layout, return_lse=return_lse)
    if "meta" in (q.device.type, k.device.type, v.device.type):  # shapes only (model tooling on the meta device)
        o = q.new_empty(*q.shape[:3], v.shape[-1], device="meta")
        lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
        o = o.transpose(1, 2) if bnhd else o
        return (o, o.new_empty(q.shape[:3], dtype=lse_dtype)) if with_lse else o
    if with_lse:
        o, lse = _apply(q, k, v, spec, None, None, with_lse=True)
        return (o.transpose(1, 2) if bnhd else o), lse
    o = _apply(q, k, v, spec, None, None)
    return o.transpose(1, 2) if bnhd else o


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
    spec, with_lse = checks.check_varlen(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=causal, scale=scale, window=window,
        backend=backend, precise_bob=precise_bob, deterministic=deterministic, return_lse=return_lse)
    return _apply(q, k, v, spec, cu_seqlens_q, cu_seqlens_k, with_lse=with_lse)
