"""Small networks for the meta-learning recipes.

* :class:`SinusoidMLP`: the MLP of MAML's sinusoid experiment (1 → 40 → 40 → 1, ReLU).
* :class:`TinyTransformer`: a pre-LayerNorm decoder-only transformer over real-valued
  tokens whose attention is :func:`ttt_flash.flash_attention` (or, for comparisons,
  materialised attention or PyTorch SDPA). No positional embedding: the causal mask and
  the token contents carry the order the in-context regression task needs, and the model
  runs at any context length.
* :class:`GPTRegressor`: the library's :class:`ttt_flash.models.GPT` (RoPE, RMSNorm, SwiGLU)
  between a linear token embedding and a linear head, for real-valued tokens.
* :class:`MemoryRegressor`: pre-LayerNorm blocks whose attention is a
  :class:`ttt_flash.memory.GradientMemoryAttention` (memory slots written by gradient steps
  through softmax attention); MAML over it differentiates three times through attention.
* :class:`NetConfig`: the option group that picks and sizes one of them (the ``net``
  argument of :class:`ttt_flash.lightning.MAML`).

Every network is differentiable to any order through every layer (MAML differentiates
twice, three times through the memory layer's second-order writes).

Imports torch, :mod:`ttt_flash.attention.registry`, the GPT and (lazily: :mod:`ttt_flash.memory`
imports the models) the memory layer; never Lightning.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch.nn.functional as F
from torch import Tensor, nn

from .._checks import check_int
from ..attention.registry import ATTENTION_IMPLS, AttentionName, attend, check_attention
from .gpt import GPT, GPTConfig

__all__ = ["NetConfig", "SinusoidMLP", "TinyTransformer", "GPTRegressor", "MemoryRegressor", "ATTENTIONS"]

#: Attention implementations :class:`TinyTransformer` and :class:`GPTRegressor` can use: the
#: names of :mod:`ttt_flash.attention.registry`.
ATTENTIONS = ATTENTION_IMPLS


class SinusoidMLP(nn.Module):
    """MLP ``in_dim → hidden (×depth) → out_dim`` with ReLU: (..., in_dim) -> (..., out_dim)."""

    def __init__(self, in_dim: int = 1, out_dim: int = 1, hidden: int = 40, depth: int = 2):
        super().__init__()
        for name, value, least in (("in_dim", in_dim, 1), ("out_dim", out_dim, 1), ("hidden", hidden, 1),
                                   ("depth", depth, 0)):
            check_int(name, value, least)
        layers, width = [], in_dim
        for _ in range(depth):
            layers += [nn.Linear(width, hidden), nn.ReLU()]
            width = hidden
        self.body = nn.Sequential(*layers)
        self.head = nn.Linear(width, out_dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.body(x))


class _Block(nn.Module):
    def __init__(self, d_model: int, n_heads: int, attention: str, causal: bool):
        super().__init__()
        self.n_heads, self.attention, self.causal = n_heads, attention, causal
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.out = nn.Linear(4 * d_model, d_model)

    def forward(self, x: Tensor) -> Tensor:
        b, n, d = x.shape
        qkv = self.qkv(self.ln1(x)).view(b, n, 3, self.n_heads, d // self.n_heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)  # each (B, H, N, D)
        o = attend(q, k, v, impl=self.attention, causal=self.causal).transpose(1, 2).reshape(b, n, d)
        x = x + self.proj(o)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TinyTransformer(nn.Module):
    """Decoder-only transformer over real-valued tokens: (B, N, in_dim) -> (B, N, out_dim).

    ``embed`` (linear) → ``n_layers`` pre-LN blocks (attention + 4× GELU MLP) → LayerNorm →
    ``head`` (linear). ``attention`` picks :func:`ttt_flash.flash_attention` (``"ttt_flash"``,
    exact double backward with O(N) memory), :func:`ttt_flash.attention.reference.naive_attention`
    (``"math"``, materialises N × N scores; the oracle) or
    ``torch.nn.functional.scaled_dot_product_attention`` (``"sdpa"``; its fused CUDA kernels
    have no double backward).
    """

    def __init__(self, in_dim: int, out_dim: int = 1, d_model: int = 64, n_heads: int = 4,
                 n_layers: int = 2, attention: str = "ttt_flash", causal: bool = True):
        super().__init__()
        check_attention(attention)
        if d_model % n_heads:
            raise ValueError(f"d_model ({d_model}) must be a multiple of n_heads ({n_heads})")
        self.embed = nn.Linear(in_dim, d_model)
        self.blocks = nn.ModuleList(_Block(d_model, n_heads, attention, causal) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, out_dim)

    def forward(self, x: Tensor) -> Tensor:
        if x.dim() != 3:
            raise ValueError(f"TinyTransformer takes (batch, seq_len, in_dim) inputs, got shape {tuple(x.shape)}")
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(self.ln_f(h))


class GPTRegressor(nn.Module):
    """:class:`ttt_flash.models.GPT` over real-valued tokens: (B, N, in_dim) -> (B, N, out_dim).

    ``embed`` (linear in_dim → d_model) → ``GPT(inputs_embeds=..., return_hidden=True)``
    (``n_layers`` causal blocks with RoPE positions, final RMSNorm) → ``head`` (linear).
    ``attention`` is ``GPTConfig.attention`` (``"ttt_flash"``, ``"math"`` or ``"sdpa"``). The
    GPT's token embedding is unused (its vocabulary is 1).
    """

    def __init__(self, in_dim: int, out_dim: int = 1, d_model: int = 64, n_heads: int = 4,
                 n_layers: int = 2, attention: str = "ttt_flash"):
        super().__init__()
        config = GPTConfig.tiny(vocab_size=1, n_layer=n_layers, n_head=n_heads, d_model=d_model,
                                attention=attention)
        self.embed = nn.Linear(in_dim, d_model)
        self.gpt = GPT(config)
        self.head = nn.Linear(d_model, out_dim)

    def forward(self, x: Tensor) -> Tensor:
        if x.dim() != 3:
            raise ValueError(f"GPTRegressor takes (batch, seq_len, in_dim) inputs, got shape {tuple(x.shape)}")
        return self.head(self.gpt(inputs_embeds=self.embed(x), return_hidden=True))


class _MemoryBlock(nn.Module):
    def __init__(self, d_model: int, n_heads: int, attention: str, memory_slots: int, chunk_size: int,
                 write_lr: float, first_order: bool):
        super().__init__()
        from ..memory.attention_layer import GradientMemoryAttention  # lazy: memory imports models

        self.ln1 = nn.LayerNorm(d_model)
        self.attn = GradientMemoryAttention(d_model, n_heads, memory_slots=memory_slots, inner_steps=1,
                                            inner_lr=write_lr, chunk_size=chunk_size, attention=attention,
                                            first_order=first_order)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.out = nn.Linear(4 * d_model, d_model)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class MemoryRegressor(nn.Module):
    """Transformer over real-valued tokens whose attention reads and writes gradient memory:
    (B, N, in_dim) -> (B, N, out_dim).

    ``embed`` (linear) → ``n_layers`` pre-LN blocks (a
    :class:`~ttt_flash.memory.GradientMemoryAttention` of ``memory_slots`` slots written every
    ``chunk_size`` tokens by one gradient step of size ``write_lr`` (learned), + a 4× GELU
    MLP) → LayerNorm → ``head`` (linear). ``attention``: ``"ttt_flash"`` or ``"math"``.
    ``first_order``: the writes' gradients are constants (the layer's ``first_order``);
    False (default) keeps them second order, so MAML's meta-gradient through this network is
    a third derivative through attention.
    """

    def __init__(self, in_dim: int, out_dim: int = 1, d_model: int = 32, n_heads: int = 2,
                 n_layers: int = 1, attention: str = "ttt_flash", memory_slots: int = 8,
                 chunk_size: int = 8, write_lr: float = 1.0, first_order: bool = False):
        super().__init__()
        self.embed = nn.Linear(in_dim, d_model)
        self.blocks = nn.ModuleList(
            _MemoryBlock(d_model, n_heads, attention, memory_slots, chunk_size, write_lr, first_order)
            for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, out_dim)

    def forward(self, x: Tensor) -> Tensor:
        if x.dim() != 3:
            raise ValueError(f"MemoryRegressor takes (batch, seq_len, in_dim) inputs, got shape {tuple(x.shape)}")
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(self.ln_f(h))


@dataclass(frozen=True)
class NetConfig:
    """The network MAML meta-trains.

    Attributes:
        kind: ``"mlp"`` (:class:`SinusoidMLP`), ``"transformer"`` (:class:`TinyTransformer`),
            ``"gpt"`` (:class:`GPTRegressor`: :class:`ttt_flash.models.GPT`) or ``"memory"``
            (:class:`MemoryRegressor`: gradient-memory attention).
        in_dim: input width (1 for sinusoid; ``dim + 2`` for in-context regression).
        out_dim: output width.
        hidden: MLP hidden width.
        depth: MLP hidden layers.
        d_model: transformer width.
        n_heads: attention heads (``d_model`` must be a multiple; for ``gpt`` the head dim
            ``d_model / n_heads`` must be even, for RoPE).
        n_layers: transformer blocks.
        attention: ``"ttt_flash"``, ``"math"`` or ``"sdpa"`` (see :class:`TinyTransformer`;
            ``memory`` takes ``"ttt_flash"`` or ``"math"``).
        causal: causal attention mask (``transformer`` only; ``gpt`` and ``memory`` are causal).
        memory_slots: ``memory`` only: slots per head.
        memory_chunk: ``memory`` only: tokens per written chunk.
        memory_lr: ``memory`` only: initial write step size (learned).
        memory_first_order: ``memory`` only: first-order writes (the layer's ``first_order``).
    """

    kind: Literal["mlp", "transformer", "gpt", "memory"] = "mlp"
    in_dim: int = 1
    out_dim: int = 1
    hidden: int = 40
    depth: int = 2
    d_model: int = 64
    n_heads: int = 4
    n_layers: int = 2
    attention: AttentionName = "ttt_flash"
    causal: bool = True
    memory_slots: int = 8
    memory_chunk: int = 8
    memory_lr: float = 1.0
    memory_first_order: bool = False

    def __post_init__(self):
        if self.kind not in ("mlp", "transformer", "gpt", "memory"):
            raise ValueError(f"kind must be 'mlp', 'transformer', 'gpt' or 'memory', got {self.kind!r}")
        if self.kind == "memory" and self.attention == "sdpa":
            raise ValueError("kind='memory' needs attention 'ttt_flash' or 'math' (the memory writes "
                             "differentiate through attention; SDPA's fused kernels have no double backward)")
        if not isinstance(self.memory_first_order, bool):
            raise ValueError(f"memory_first_order must be a bool, got {self.memory_first_order!r}")
        if isinstance(self.memory_lr, bool) or not isinstance(self.memory_lr, (int, float)) or not self.memory_lr > 0:
            raise ValueError(f"memory_lr must be a float > 0, got {self.memory_lr!r}")
        for name in ("in_dim", "out_dim", "hidden", "depth", "d_model", "n_heads", "n_layers",
                     "memory_slots", "memory_chunk"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < (0 if name == "depth" else 1):
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        check_attention(self.attention)
        if self.kind in ("transformer", "gpt", "memory") and self.d_model % self.n_heads:
            raise ValueError(f"d_model ({self.d_model}) must be a multiple of n_heads ({self.n_heads})")
        if self.kind == "gpt" and (self.d_model // self.n_heads) % 2:
            raise ValueError(f"gpt needs an even head dim d_model / n_heads for RoPE, got {self.d_model // self.n_heads}")

    def build(self) -> nn.Module:
        if self.kind == "mlp":
            return SinusoidMLP(self.in_dim, self.out_dim, self.hidden, self.depth)
        if self.kind == "memory":
            return MemoryRegressor(self.in_dim, self.out_dim, self.d_model, self.n_heads, self.n_layers,
                                   self.attention, self.memory_slots, self.memory_chunk, self.memory_lr,
                                   self.memory_first_order)
        if self.kind == "gpt":
            return GPTRegressor(self.in_dim, self.out_dim, self.d_model, self.n_heads, self.n_layers, self.attention)
        return TinyTransformer(self.in_dim, self.out_dim, self.d_model, self.n_heads, self.n_layers,
                               self.attention, self.causal)
