"""A decoder-only transformer (pre-norm, RoPE, SwiGLU, optional GQA and sliding window)
whose attention can be differentiated twice exactly.

The model is a pure function of its parameters: it works under
``torch.func.functional_call`` and ``torch.autograd.grad(..., create_graph=True)``, including
with activation checkpointing, which is what meta-learning and test-time-training loops need.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, fields
from functools import partial
from typing import Optional, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call
from torch.utils.checkpoint import checkpoint

from ..distributed.context_parallel import sequence_offset
from .._checks import check_int
from ..attention.registry import check_attention, context_parallel_attention_for
from .layers import CausalSelfAttention, RMSNorm, SwiGLU, rope_angles

__all__ = ["GPTConfig", "GPT", "Block", "lm_loss"]


def _default_mlp_hidden(d_model: int) -> int:
    """8/3 · d_model rounded up to a multiple of 64 (768 → 2048, 64 → 192)."""
    return 64 * math.ceil(8 * d_model / 3 / 64)


@dataclass
class GPTConfig:
    """Hyperparameters of :class:`GPT`. Validated on construction (``ValueError`` naming the
    field); ``n_kv_head`` and ``mlp_hidden`` left as ``None`` are filled in."""

    vocab_size: int
    """Number of token ids; ``idx`` entries lie in [0, vocab_size)."""

    n_layer: int
    """Number of transformer blocks."""

    n_head: int
    """Number of query heads H_q; ``d_model`` must be divisible by it, with an even quotient
    (the head dim D, which RoPE splits in halves)."""

    d_model: int
    """Width of the residual stream."""

    n_kv_head: Optional[int] = None
    """Number of key/value heads H_kv (grouped-query attention); ``n_head`` must be a multiple
    of it. ``None`` means ``n_head`` (plain multi-head attention); 1 is multi-query."""

    mlp_hidden: Optional[int] = None
    """Hidden width of the SwiGLU MLP. ``None`` means 8/3 · d_model rounded up to a multiple
    of 64 (same parameter count as a 4 · d_model GELU MLP; 768 → 2048)."""

    rope_base: float = 10000.0
    """Base θ of the rotary position embedding."""

    window: Optional[int] = None
    """Sliding-window attention in every layer: each token sees its ``window`` most recent
    tokens, itself included. ``None`` means full causal attention."""

    attention: str = "ttt_flash"
    """Attention implementation: ``"ttt_flash"`` (exact double backward, O(N) memory on GPU),
    ``"sdpa"`` (PyTorch's ``scaled_dot_product_attention``; its fused kernels refuse double
    backward) or ``"math"`` (materialised softmax, any order of derivative, O(N²) memory)."""

    tie_embeddings: bool = True
    """Use the token embedding matrix as the output (LM head) matrix."""

    checkpoint: bool = False
    """Recompute each block's activations in the backward pass (non-reentrant activation
    checkpointing: correct under ``create_graph=True`` and ``functional_call``)."""

    dropout: float = 0.0
    """Dropout probability on the embeddings and on each residual branch (not on attention
    probabilities, so that every attention implementation computes the same function)."""

    bias: bool = False
    """Biases in the attention and MLP linear layers (the LM head never has one)."""

    def __post_init__(self):
        check_int("GPTConfig.vocab_size", self.vocab_size, 1)
        check_int("GPTConfig.n_layer", self.n_layer, 1)
        check_int("GPTConfig.n_head", self.n_head, 1)
        check_int("GPTConfig.d_model", self.d_model, 1)
        if self.n_kv_head is None:
            self.n_kv_head = self.n_head
        check_int("GPTConfig.n_kv_head", self.n_kv_head, 1)
        if self.n_head % self.n_kv_head != 0:
            raise ValueError(
                f"GPTConfig.n_head ({self.n_head}) must be a multiple of GPTConfig.n_kv_head "
                f"({self.n_kv_head}) for grouped-query attention"
            )
        if self.d_model % self.n_head != 0:
            raise ValueError(
                f"GPTConfig.d_model ({self.d_model}) must be divisible by GPTConfig.n_head "
                f"({self.n_head})"
            )
        if (self.d_model // self.n_head) % 2 != 0:
            raise ValueError(
                f"GPTConfig.d_model / GPTConfig.n_head (the head dim, "
                f"{self.d_model // self.n_head}) must be even for rotary embeddings"
            )
        if self.mlp_hidden is None:
            self.mlp_hidden = _default_mlp_hidden(self.d_model)
        check_int("GPTConfig.mlp_hidden", self.mlp_hidden, 1)
        if isinstance(self.rope_base, bool) or not isinstance(self.rope_base, numbers.Real):
            raise TypeError(f"GPTConfig.rope_base must be a float, got {type(self.rope_base).__name__}")
        if not (math.isfinite(self.rope_base) and self.rope_base > 1):
            raise ValueError(f"GPTConfig.rope_base must be a finite number > 1, got {self.rope_base}")
        self.rope_base = float(self.rope_base)
        if self.window is not None:
            check_int("GPTConfig.window", self.window, 1)
        check_attention(self.attention, what="GPTConfig.attention")
        for name in ("tie_embeddings", "checkpoint", "bias"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"GPTConfig.{name} must be a bool, got {type(getattr(self, name)).__name__}")
        if isinstance(self.dropout, bool) or not isinstance(self.dropout, numbers.Real):
            raise TypeError(f"GPTConfig.dropout must be a float, got {type(self.dropout).__name__}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout}")

    @property
    def head_dim(self) -> int:
        """D = d_model / n_head."""
        return self.d_model // self.n_head

    @classmethod
    def _preset(cls, defaults: dict, overrides: dict) -> "GPTConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise TypeError(f"unknown GPTConfig field(s) {unknown}; fields are {sorted(known)}")
        return cls(**{**defaults, **overrides})

    @classmethod
    def tiny(cls, **overrides) -> "GPTConfig":
        """CPU-test size: 2 layers, d_model 64, 4 heads (D = 16), byte vocabulary (256)."""
        return cls._preset(dict(vocab_size=256, n_layer=2, n_head=4, d_model=64), overrides)

    @classmethod
    def gpt2_small(cls, **overrides) -> "GPTConfig":
        """GPT-2 small shape: 12 layers, d_model 768, 12 heads (D = 64), MLP hidden 2048.

        ``vocab_size`` defaults to 50304 (the GPT-2 BPE's 50257 padded to a multiple of 64);
        pass ``vocab_size=256`` for byte-level modelling. About 124M parameters with the
        default vocabulary and tied embeddings (85M without the embedding).
        """
        return cls._preset(dict(vocab_size=50304, n_layer=12, n_head=12, d_model=768), overrides)


class Block(nn.Module):
    """Pre-norm transformer block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.dropout = config.dropout
        self.attn_norm = RMSNorm(config.d_model)
        self.attn = CausalSelfAttention(
            config.d_model,
            config.n_head,
            config.n_kv_head,
            impl=config.attention,
            window=config.window,
            bias=config.bias,
        )
        self.mlp_norm = RMSNorm(config.d_model)
        self.mlp = SwiGLU(config.d_model, config.mlp_hidden, bias=config.bias)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, local: bool = False) -> Tensor:
        """x: (B, N, d_model); cos, sin: rotary tables. Returns (B, N, d_model). ``local``:
        no context parallelism in this call (:meth:`GPT.forward`)."""
        h = self.attn(self.attn_norm(x), cos, sin, local=True) if local else self.attn(self.attn_norm(x), cos, sin)
        x = x + F.dropout(h, self.dropout, self.training)
        return x + F.dropout(self.mlp(self.mlp_norm(x)), self.dropout, self.training)


class GPT(nn.Module):
    """Decoder-only transformer language model.

    Token embedding (no learned positions: RoPE in every attention layer), ``n_layer``
    :class:`Block` s, a final RMSNorm and a linear LM head (the embedding matrix when
    ``config.tie_embeddings``).

    ``context_parallel`` (None: off; True: the default process group; or a
    ``torch.distributed`` ProcessGroup): one sequence across the group's ranks. Each rank
    passes its block of the tokens (rank r: tokens N·r//P … N·(r+1)//P − 1,
    :func:`ttt_flash.distributed.shard_sequence`) and gets that block's logits; attention runs
    through :func:`ttt_flash.distributed.context_parallel_attention` (needs
    ``attention="ttt_flash"`` and ``n_head`` ≥ P), RoPE uses global token indices. The sum
    over ranks of the per-rank losses is differentiated exactly (twice); parameters get each
    rank's share of their gradient: add them with ``all_reduce_sum`` (docs/distributed.md).

    Example: a Hessian-vector product of the LM loss w.r.t. all parameters::

        >>> import torch
        >>> from ttt_flash.models import GPT, GPTConfig
        >>> model = GPT(GPTConfig.tiny())
        >>> idx = torch.randint(0, 256, (2, 16))
        >>> params = [p for p in model.parameters()]
        >>> grads = torch.autograd.grad(model.loss(idx[:, :-1], idx[:, 1:]), params, create_graph=True)
        >>> hvp = torch.autograd.grad(grads, params, grad_outputs=[torch.randn_like(g) for g in grads])
        >>> len(hvp) == len(params)
        True
    """

    def __init__(self, config: GPTConfig, *, context_parallel=None):
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        # Context parallelism (docs/distributed.md): None/False off; True the default process
        # group; or a torch.distributed ProcessGroup. Each rank then runs the model on its
        # block of the sequence (tokens N·r//P … N·(r+1)//P − 1) with global RoPE positions.
        self.set_context_parallel(context_parallel)
        self.norm = RMSNorm(config.d_model)
        # Tied: the head is tok_emb.weight itself, so there is one parameter, one entry in
        # state_dict and one key to replace under functional_call.
        self.lm_head = None if config.tie_embeddings else nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.reset_parameters()

    def set_context_parallel(self, context_parallel) -> None:
        """Switch context parallelism on (True: the default process group; a ProcessGroup)
        or off (None/False); see the class docstring."""
        on = not (context_parallel is None or context_parallel is False)
        group = None if isinstance(context_parallel, bool) else context_parallel
        attend = None
        if on:
            attend = context_parallel_attention_for(self.config.attention, group, what="GPTConfig.attention")
            attend = partial(attend, causal=True)
            for i, block in enumerate(self.blocks):
                if not isinstance(block.attn, CausalSelfAttention):
                    raise ValueError(
                        f"context parallelism needs every block's attention to be a CausalSelfAttention; "
                        f"block {i} has {type(block.attn).__name__}, which would run on each rank's block "
                        "alone (docs/distributed.md: which memory models take context_parallel)"
                    )
        self.context_parallel = on
        self.context_parallel_group = group
        for block in self.blocks:
            block.attn.attend = attend

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Normal(0, 0.02) weights, zero biases, unit norm gains; the residual output
        projections (``attn.proj``, ``mlp.down``) get std 0.02 / sqrt(2 · n_layer)."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
            if isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        for block in self.blocks:
            nn.init.normal_(block.attn.proj.weight, mean=0.0, std=residual_std)
            nn.init.normal_(block.mlp.down.weight, mean=0.0, std=residual_std)

    @property
    def output_weight(self) -> Tensor:
        """The (vocab_size, d_model) LM head matrix (``tok_emb.weight`` when tied)."""
        return self.tok_emb.weight if self.lm_head is None else self.lm_head.weight

    def num_parameters(self, exclude_embeddings: bool = False) -> int:
        """Number of parameters, each shared tensor counted once. ``exclude_embeddings``
        leaves out the token embedding and an untied LM head."""
        total = sum(p.numel() for p in self.parameters())
        if exclude_embeddings:
            total -= self.tok_emb.weight.numel()
            if self.lm_head is not None:
                total -= self.lm_head.weight.numel()
        return total

    def _positions(self, positions, batch: int, n: int, device) -> Tensor:
        if positions is None:
            return torch.arange(n, device=device)
        if isinstance(positions, numbers.Integral) and not isinstance(positions, bool):
            return torch.arange(int(positions), int(positions) + n, device=device)
        if not isinstance(positions, Tensor):
            raise TypeError(f"positions must be None, an int offset or a Tensor, got {type(positions).__name__}")
        if positions.shape not in ((n,), (batch, n)):
            raise ValueError(
                f"positions must have shape (N,) = ({n},) or (B, N) = ({batch}, {n}), "
                f"got {tuple(positions.shape)}"
            )
        return positions.to(device)

    def _run_block(self, block: Block, x: Tensor, cos: Tensor, sin: Tensor, local: bool = False) -> Tensor:
        if not (self.config.checkpoint and torch.is_grad_enabled()):
            return block(x, cos, sin, local)
        # The recomputation in the backward pass must use the parameters of *this* forward
        # pass. Under functional_call those are swapped back out by the time backward runs,
        # so they are passed to the checkpointed function explicitly instead of being read
        # from the module during recomputation.
        names, tensors = zip(*block.named_parameters())

        def run(x, cos, sin, *params):  # ``local`` is fixed here: the recomputation uses it too
            return functional_call(block, dict(zip(names, params)), (x, cos, sin, local))

        return checkpoint(run, x, cos, sin, *tensors, use_reentrant=False)

    def forward(
        self,
        idx: Optional[Tensor] = None,
        *,
        inputs_embeds: Optional[Tensor] = None,
        positions: Union[None, int, Tensor] = None,
        return_hidden: bool = False,
        local: bool = False,
    ) -> Tensor:
        """Run the model on token ids or on embeddings.

        Args:
            idx: (B, N) integer token ids. Exactly one of ``idx`` and ``inputs_embeds``.
            inputs_embeds: (B, N, d_model) input vectors used in place of ``tok_emb(idx)``
                (continuous inputs; learned memory tokens concatenated to token embeddings).
            positions: RoPE positions of the N inputs: ``None`` for 0..N−1, an int ``p`` for
                p..p+N−1, or a (N,) or (B, N) tensor (any values, e.g. to place memory
                tokens or a chunk of a longer sequence). Attention is always causal in
                the order of the inputs, whatever the positions. With context parallelism
                N is this rank's block and ``None``/``p`` count from the block's global
                offset (a tensor is used as given).
            return_hidden: return the final normalised hidden states instead of logits.
            local: with context parallelism, run this call in this process alone over the
                whole given sequence (local attention, positions from 0 or as given): for a
                short sequence that every rank holds whole, e.g. the query that the memory
                models read on every rank. No effect without context parallelism.

        Returns:
            (B, N, vocab_size) logits, or (B, N, d_model) hidden states with
            ``return_hidden=True``.
        """
        if (idx is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of idx and inputs_embeds")
        if idx is not None:
            if not isinstance(idx, Tensor) or idx.dim() != 2 or idx.is_floating_point() or idx.is_complex():
                raise ValueError(
                    "idx must be an integer tensor of shape (B, N), got "
                    + (f"{idx.dtype} of shape {tuple(idx.shape)}" if isinstance(idx, Tensor) else type(idx).__name__)
                )
            x = self.tok_emb(idx)
        else:
            if not isinstance(inputs_embeds, Tensor) or inputs_embeds.dim() != 3 or inputs_embeds.shape[-1] != self.config.d_model:
                raise ValueError(
                    f"inputs_embeds must be a tensor of shape (B, N, d_model={self.config.d_model}), got "
                    + (str(tuple(inputs_embeds.shape)) if isinstance(inputs_embeds, Tensor) else type(inputs_embeds).__name__)
                )
            x = inputs_embeds
        batch, n, _ = x.shape
        pos = self._positions(positions, batch, n, x.device)
        if self.context_parallel and not local and (positions is None or not isinstance(positions, Tensor)):
            pos = pos + sequence_offset(n, group=self.context_parallel_group, device=x.device)[0]
        cos, sin = rope_angles(pos, self.config.head_dim, self.config.rope_base, x.dtype)
        x = F.dropout(x, self.config.dropout, self.training)
        for block in self.blocks:
            x = self._run_block(block, x, cos, sin, bool(local and self.context_parallel))
        h = self.norm(x)
        if return_hidden:
            return h
        return F.linear(h, self.output_weight)

    def loss(
        self,
        idx: Tensor,
        targets: Tensor,
        *,
        positions: Union[None, int, Tensor] = None,
        ignore_index: int = -100,
    ) -> Tensor:
        """Mean next-token cross-entropy: ``lm_loss(self(idx, positions=positions), targets)``.

        ``idx`` and ``targets`` are (B, N); shift them yourself (``idx[:, :-1]``,
        ``idx[:, 1:]``).
        """
        return lm_loss(self(idx, positions=positions), targets, ignore_index=ignore_index)


def lm_loss(logits: Tensor, targets: Tensor, ignore_index: int = -100) -> Tensor:
    """Mean cross-entropy of (B, N, V) ``logits`` against (B, N) integer ``targets``, over the
    positions whose target is not ``ignore_index``. float16/bfloat16 logits are upcast to
    float32 first. Differentiable twice."""
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    return F.cross_entropy(logits.flatten(0, -2), targets.flatten(), ignore_index=ignore_index)
