"""Exact pure-PyTorch attention: forward, first backward and backward-over-backward.

This package is the oracle every kernel is tested against and the CPU path of
:func:`ttt_flash.flash_attention`. It implements the closed form of
``docs/bob-math.md`` with query rows processed in chunks, so memory is
O(chunk × N_k) per head rather than O(N_q × N_k).

It exposes the composer contract of ``docs/architecture.md`` (``attn_fwd``,
``attn_bwd``, ``attn_bob``) plus :func:`naive_attention`, a materialised
autograd-able attention used as a second, independent oracle in tests, and
:func:`bob_vjp` / :func:`bob_jvp`, the derivatives of the backward-over-backward
(third order and up) by blockwise recomputation, on every backend.

Precision: float64 and float32 inputs are computed in their own precision;
float16 and bfloat16 inputs are computed in float32 and results cast back.
Row vectors (``lse``, ``delta``) are float64 for float64 inputs, float32 otherwise.

Its modules: ``composers.py`` (masks, the naive oracle, ``attn_fwd`` / ``attn_bwd`` /
``attn_bob``), ``tangent.py`` (``attn_jvp``, ``attn_tangent``), ``recompute.py`` (``bob_vjp``,
``bob_jvp``).
"""

from .composers import (DEFAULT_CHUNK, attention_mask, attn_bob, attn_bwd, attn_fwd, naive_attention,
                        naive_attention_varlen)
from .recompute import bob_jvp, bob_vjp
from .tangent import attn_jvp, attn_tangent

__all__ = [
    "attn_fwd",
    "attn_bwd",
    "attn_bob",
    "attn_jvp",
    "attn_tangent",
    "bob_vjp",
    "bob_jvp",
    "naive_attention",
    "naive_attention_varlen",
    "attention_mask",
    "DEFAULT_CHUNK",
]
