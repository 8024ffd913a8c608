"""MemoryLM: a small language model whose token mixer is GradientMemoryAttention.

Imports torch, :mod:`ttt_flash.models` and the memory layer;
never Lightning.
"""

from __future__ import annotations

import math
from typing import Any, Dict

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call
from torch.utils.checkpoint import checkpoint

from .._checks import check_int
from ..models import RMSNorm, SwiGLU
from .attention_layer import GradientMemoryAttention, MemoryAttentionName, SlotQuery, WriteRule

__all__ = ["MemoryLM"]


class _ShortConv(nn.Module):
    """Causal depthwise convolution over time: y_t = Σ_{j<width} w_j ∘ x_{t−j}, initialised
    with w_0 = 1 and w_{j≥1} ~ N(0, 1) (a random mix of the previous tokens into each
    channel; with w_{j≥1} = 0 binding a value to its key is learned much later)."""

    def __init__(self, dim: int, width: int):
        super().__init__()
        weight = torch.randn(width, dim)
        weight[0] = 1.0
        self.weight = nn.Parameter(weight)

    def forward(self, x: Tensor) -> Tensor:
        out = x * self.weight[0]
        for j in range(1, self.weight.shape[0]):
            out = out + F.pad(x, (0, 0, j, 0))[:, : x.shape[1]] * self.weight[j]
        return out


class _MemoryBlock(nn.Module):
    """``x + attn(conv(norm(x)))``, then ``x + SwiGLU(norm(x))``; ``layer``: the keyword
    arguments of the :class:`GradientMemoryAttention`."""

    def __init__(self, d_model: int, heads: int, conv: int, layer: Dict[str, Any]):
        super().__init__()
        self.attn_norm = RMSNorm(d_model)
        self.conv = _ShortConv(d_model, conv) if conv > 1 else nn.Identity()
        self.attn = GradientMemoryAttention(d_model, heads, **layer)
        self.mlp_norm = RMSNorm(d_model)
        self.mlp = SwiGLU(d_model, 64 * math.ceil(8 * d_model / 3 / 64))

    def forward(self, x: Tensor, write: bool = True) -> Tensor:
        x = x + self.attn(self.conv(self.attn_norm(x)), write=write)
        return x + self.mlp(self.mlp_norm(x))


class MemoryLM(nn.Module):
    """A language model whose token mixer is :class:`GradientMemoryAttention`.

    Token embedding, ``n_layer`` pre-norm blocks ``x + attn(conv(norm(x)))``,
    ``x + SwiGLU(norm(x))``, final RMSNorm, tied LM head. ``conv`` is the width of a causal
    depthwise short convolution before each attention (the standard companion of
    recurrent/memory mixers on associative recall: it lets a value token see its key;
    1 disables it).

    Args:
        vocab_size, d_model, n_layer, heads: as usual.
        memory_slots, inner_steps, inner_lr, chunk_size, attention, first_order: of every
            :class:`GradientMemoryAttention`.
        conv: short-convolution width.
        checkpoint: activation checkpointing of each block (non-reentrant).
        write_gate: every layer learns a per-token write gate
            (:class:`GradientMemoryAttention`'s ``write_gate``).
        write_rule: every layer's write step, ``"gradient"`` or ``"slot_normalized"``
            (:class:`GradientMemoryAttention`'s ``write_rule``).
        qk_norm, qk_scale, parallel_write, kv_shift, slot_query: of every :class:`GradientMemoryAttention`.
    """

    def __init__(
        self,
        vocab_size: int,
        d_model: int = 64,
        n_layer: int = 2,
        heads: int = 4,
        memory_slots: int = 16,
        inner_steps: int = 1,
        inner_lr: float = 1.0,
        chunk_size: int = 64,
        *,
        attention: MemoryAttentionName = "ttt_flash",
        conv: int = 2,
        first_order: bool = False,
        checkpoint: bool = False,
        write_gate: bool = False,
        write_rule: WriteRule = "gradient",
        qk_norm: bool = False,
        qk_scale: float = 10.0,
        parallel_write: bool = True,
        kv_shift: bool = False,
        slot_query: SlotQuery = "query",
    ):
        super().__init__()
        check_int("vocab_size", vocab_size, 1)
        check_int("n_layer", n_layer, 1)
        check_int("conv", conv, 1)
        self.checkpoint = bool(checkpoint)
        self.tok_emb = nn.Embedding(vocab_size, d_model)
        layer = dict(memory_slots=memory_slots, inner_steps=inner_steps, inner_lr=inner_lr, chunk_size=chunk_size,
                     attention=attention, first_order=first_order, write_gate=write_gate, write_rule=write_rule,
                     qk_norm=qk_norm, qk_scale=qk_scale, parallel_write=parallel_write, kv_shift=kv_shift,
                     slot_query=slot_query)
        self.blocks = nn.ModuleList(_MemoryBlock(d_model, heads, conv, layer) for _ in range(n_layer))
        self.norm = RMSNorm(d_model)
        nn.init.normal_(self.tok_emb.weight, std=0.02)
        for block in self.blocks:
            for lin in (block.attn.qkv, block.attn.proj, block.mlp.gate, block.mlp.up, block.mlp.down):
                nn.init.normal_(lin.weight, std=0.02)
            for lin in (block.attn.proj, block.mlp.down):
                nn.init.normal_(lin.weight, std=0.02 / math.sqrt(2 * n_layer))

    @property
    def vocab_size(self) -> int:
        """Token ids the model embeds."""
        return self.tok_emb.num_embeddings

    def _run_block(self, block: _MemoryBlock, x: Tensor, write: bool) -> Tensor:
        if not (self.checkpoint and torch.is_grad_enabled()):
            return block(x, write)
        names, tensors = zip(*block.named_parameters())

        def run(x, *params):
            return functional_call(block, dict(zip(names, params)), (x, write))

        return checkpoint(run, x, *tensors, use_reentrant=False)

    def forward(self, idx: Tensor, *, write: bool = True) -> Tensor:
        """(B, N) token ids → (B, N, vocab_size) logits. ``write=False``: no layer writes
        its slots (the pre-write baseline)."""
        x = self.tok_emb(idx)
        for block in self.blocks:
            x = self._run_block(block, x, write)
        return F.linear(self.norm(x), self.tok_emb.weight)
