"""Models built on :func:`ttt_flash.flash_attention` (installed as ``ttt_flash.models``).

Public names:

* :class:`GPTConfig` — validated hyperparameters of :class:`GPT`, with presets
  ``GPTConfig.tiny()`` and ``GPTConfig.gpt2_small()``.
* :class:`GPT` — decoder-only transformer (RMSNorm pre-norm, RoPE, SwiGLU, GQA, optional
  sliding window), differentiable twice exactly with ``attention="ttt_flash"``.
* :class:`Block` — one pre-norm transformer block.
* :func:`lm_loss` — mean next-token cross-entropy of logits against targets.
* :data:`ATTENTION_IMPLS` — accepted values of ``GPTConfig.attention`` (the names of
  :mod:`ttt_flash.attention.registry`).
* MAML networks (:mod:`~ttt_flash.models.regressors`): :class:`NetConfig`,
  :class:`SinusoidMLP`, :class:`TinyTransformer`, :class:`GPTRegressor`,
  :class:`MemoryRegressor` (gradient-memory attention: MAML over it is third order).
* layers: :class:`RMSNorm`, :class:`CausalSelfAttention`, :class:`SwiGLU`,
  :func:`causal_attention`, :func:`rope_angles`, :func:`apply_rope`.
"""

from .gpt import GPT, Block, GPTConfig, lm_loss
from .layers import (
    ATTENTION_IMPLS,
    CausalSelfAttention,
    RMSNorm,
    SwiGLU,
    apply_rope,
    causal_attention,
    rope_angles,
)
from .regressors import GPTRegressor, MemoryRegressor, NetConfig, SinusoidMLP, TinyTransformer

__all__ = [
    "GPT",
    "GPTConfig",
    "Block",
    "lm_loss",
    "ATTENTION_IMPLS",
    "RMSNorm",
    "CausalSelfAttention",
    "SwiGLU",
    "causal_attention",
    "rope_angles",
    "apply_rope",
    "NetConfig",
    "SinusoidMLP",
    "TinyTransformer",
    "GPTRegressor",
    "MemoryRegressor",
]
