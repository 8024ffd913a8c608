"""Triton kernels of ttt-flash: forward, tangent forward, first backward and exact
backward-over-backward.

Exports the composer contract of ``docs/architecture.md`` (same signatures as
``ttt_flash.attention.reference``): :func:`attn_fwd`, :func:`attn_bwd`, :func:`attn_bob`,
:func:`attn_tangent` and :func:`attn_jvp`. Imports torch and triton only.
"""

from .bwd import attn_bwd
from .fwd import attn_fwd
from .jvp import attn_jvp, attn_tangent
from .bob import attn_bob
from .common import MAX_HEAD_DIM, SUPPORTED_HEAD_DIMS

__all__ = ["attn_fwd", "attn_bwd", "attn_bob", "attn_jvp", "attn_tangent", "MAX_HEAD_DIM", "SUPPORTED_HEAD_DIMS"]
