"""Building blocks of :class:`~ttt_flash.models.GPT`: RMSNorm, rotary embeddings, SwiGLU and
causal self-attention with a choice of attention implementation.

Every layer is a plain function of its inputs and its registered parameters (no buffers, no
cached state, no in-place updates of parameters), so ``torch.func.functional_call`` and
double backward compose with it.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor, nn

from ..attention.registry import ATTENTION_IMPLS, attend

__all__ = [
    "ATTENTION_IMPLS",
    "RMSNorm",
    "rope_angles",
    "apply_rope",
    "causal_attention",
    "CausalSelfAttention",
    "SwiGLU",
]

_LOW_PRECISION = (torch.float16, torch.bfloat16)


class RMSNorm(nn.Module):
    """Root-mean-square layer norm: ``x / sqrt(mean(x², -1) + eps) · weight``.

    Computed in float32 for float16/bfloat16 inputs (cast back), in the input dtype
    otherwise. Input (..., dim) → output (..., dim).
    """

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float() if x.dtype in _LOW_PRECISION else x
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return y.to(x.dtype) * self.weight


def rope_angles(
    positions: Tensor, head_dim: int, base: float, dtype: torch.dtype
) -> Tuple[Tensor, Tensor]:
    """Rotary cos/sin tables for the given positions.

    Args:
        positions: (N,) or (B, N) positions (integer or real). Computed in float64 so that
            large positions lose no precision, then cast to ``dtype``.
        head_dim: D, even.
        base: RoPE base θ; pair i rotates at frequency ``base^(-2i/D)``.

    Returns:
        ``(cos, sin)``, each (N, D/2) for (N,) positions or (B, 1, N, D/2) for (B, N)
        positions, so that they broadcast against (B, H, N, D/2).
    """
    inv_freq = base ** (
        -torch.arange(0, head_dim, 2, dtype=torch.float64, device=positions.device) / head_dim
    )
    angles = positions.to(torch.float64).unsqueeze(-1) * inv_freq
    if angles.dim() == 3:  # (B, N, D/2) -> (B, 1, N, D/2): one table for every head
        angles = angles.unsqueeze(1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate (B, H, N, D) ``x`` by the angles in ``cos``/``sin`` (see :func:`rope_angles`).

    Half-split convention (GPT-NeoX / Llama): feature i is paired with feature i + D/2.
    Out of place; for positions m and n the rotated dot product depends on m − n only.
    """
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)  # under autocast x may be lower precision
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def causal_attention(
    q: Tensor, k: Tensor, v: Tensor, *, impl: str, window: Optional[int] = None
) -> Tensor:
    """Causal softmax attention, scale D^-1/2, through the implementation ``impl`` of
    :mod:`ttt_flash.attention.registry` (``"ttt_flash"``, ``"math"`` or ``"sdpa"``).

    Args:
        q: (B, H_q, N, D); k, v: (B, H_kv, N, D) with H_q a multiple of H_kv (GQA).
        impl: one of :data:`ATTENTION_IMPLS`.
        window: if set, each query sees its ``window`` most recent keys, itself included.

    Returns:
        (B, H_q, N, D).
    """
    return attend(q, k, v, impl=impl, causal=True, window=window)


class CausalSelfAttention(nn.Module):
    """Multi-head (grouped-query) causal self-attention with rotary position embeddings.

    One fused input projection d_model → (H_q + 2·H_kv)·D, RoPE on queries and keys,
    :func:`causal_attention`, output projection H_q·D → d_model.
    """

    def __init__(
        self,
        d_model: int,
        n_head: int,
        n_kv_head: int,
        *,
        impl: str = "ttt_flash",
        window: Optional[int] = None,
        bias: bool = False,
    ):
        super().__init__()
        self.n_head, self.n_kv_head = n_head, n_kv_head
        self.head_dim = d_model // n_head
        self.impl, self.window = impl, window
        #: None, or an attention function ``(q, k, v, window=...)`` that replaces
        #: :func:`causal_attention` (set by ``GPT(..., context_parallel=...)``)
        self.attend = None
        self.qkv = nn.Linear(d_model, (n_head + 2 * n_kv_head) * self.head_dim, bias=bias)
        self.proj = nn.Linear(n_head * self.head_dim, d_model, bias=bias)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, *, local: bool = False) -> Tensor:
        """x: (B, N, d_model); cos, sin from :func:`rope_angles`. Returns (B, N, d_model).
        ``local``: attend within ``x`` alone even when :attr:`attend` is set (a context-parallel
        model run on a short sequence that every rank holds whole)."""
        hq, hkv, d = self.n_head, self.n_kv_head, self.head_dim
        q, k, v = self.qkv(x).split((hq * d, hkv * d, hkv * d), dim=-1)
        q = rearrange(q, "b n (h d) -> b h n d", h=hq)
        k = rearrange(k, "b n (h d) -> b h n d", h=hkv)
        v = rearrange(v, "b n (h d) -> b h n d", h=hkv)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.attend is not None and not local:
            o = self.attend(q, k, v, window=self.window)
        else:
            o = causal_attention(q, k, v, impl=self.impl, window=self.window)
        return self.proj(rearrange(o, "b h n d -> b n (h d)"))


class SwiGLU(nn.Module):
    """Gated MLP ``down(silu(gate(x)) ∘ up(x))``: (..., d_model) → (..., d_model)."""

    def __init__(self, d_model: int, hidden: int, *, bias: bool = False):
        super().__init__()
        self.gate = nn.Linear(d_model, hidden, bias=bias)
        self.up = nn.Linear(d_model, hidden, bias=bias)
        self.down = nn.Linear(hidden, d_model, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))
