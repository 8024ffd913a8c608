r"""Memory written by gradient descent: three ways to store a context in weights or slots by
inner gradient steps whose effect is meta-learned by differentiating through them.

* :class:`GradMem` (model level, GradMem-style): ``m`` learned memory tokens are prepended to
  a context; ``k`` inner gradient steps on the LM loss of the context update *only the
  memory tokens* (weights fixed); the model then answers queries from ``[memory; query]``,
  without the context.
* :class:`FastWeightTTT` (end-to-end test-time training): chosen MLP sublayers of a
  :class:`~ttt_flash.models.GPT` are fast weights, updated by gradient steps of the
  next-token loss over successive chunks of the context (sliding-window attention in the
  model); the adapted model then answers queries.
* :class:`GradientMemoryAttention`: a drop-in attention layer (B, N, d_model) → (B, N,
  d_model) that reads memory slots plus the current chunk and writes each chunk into the
  slots by gradient steps of a reconstruction loss through softmax attention.
  :class:`MemoryLM` is a small language model built from it.

In all three, the outer loss differentiates through every inner step
(``torch.autograd.grad(..., create_graph=True)``): second order, exactly, through
:func:`ttt_flash.flash_attention`. ``first_order=True`` treats the inner gradients as
constants (the outer gradient then still reaches the initial state and the step size,
through ``state − η · g``, but not through ``g``). Inner step sizes are learned as
``log η``.

Inner loops run with gradients enabled even when called under ``torch.no_grad()`` (they
need them); the result is then detached. Under ``torch.inference_mode()`` they cannot run:
leave it first (``with torch.inference_mode(False), torch.enable_grad():`` and clone
inference tensors).

Floor 3 (docs/architecture.md): imports torch, :mod:`ttt_flash.attention`,
:mod:`ttt_flash.reference` and :mod:`ttt_flash.models`; never Lightning.
"""

from __future__ import annotations

import math
import numbers
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor, nn
from torch.func import functional_call
from torch.utils.checkpoint import checkpoint

from .attention import flash_attention
from .ops import second_order_grad
from .models import GPT, RMSNorm, SwiGLU
from .reference import naive_attention

__all__ = [
    "MEMORY_ATTENTION_IMPLS",
    "masked_lm_loss",
    "GradMem",
    "FastWeightTTT",
    "GradientMemoryAttention",
    "MemoryLM",
]

#: Accepted values of the ``attention`` argument of :class:`GradientMemoryAttention`.
MEMORY_ATTENTION_IMPLS = ("ttt_flash", "math")


# --------------------------------------------------------------------------- helpers


def _check_int(name: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def _log_lr(inner_lr: float, learn: bool) -> nn.Parameter:
    if isinstance(inner_lr, bool) or not isinstance(inner_lr, numbers.Real) or not inner_lr > 0:
        raise ValueError(f"inner_lr must be a float > 0 (it is learned as log inner_lr), got {inner_lr!r}")
    return nn.Parameter(torch.tensor(math.log(float(inner_lr))), requires_grad=learn)


def _attend(q: Tensor, k: Tensor, v: Tensor, *, causal: bool, impl: str) -> Tensor:
    if impl == "ttt_flash":
        return flash_attention(q, k, v, causal=causal, layout="bhnd")
    if impl == "math":
        return naive_attention(q, k, v, causal=causal)
    raise ValueError(f"attention must be one of {MEMORY_ATTENTION_IMPLS}, got {impl!r}")


def masked_lm_loss(logits: Tensor, targets: Tensor, ignore_index: int = -100) -> Tensor:
    """Per-sequence mean cross-entropy over the positions whose target is not
    ``ignore_index``: (B, N, V) logits, (B, N) targets → (B,). A sequence without targets
    scores 0 (not NaN). float16/bfloat16 logits are upcast to float32. Differentiable twice."""
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    ce = F.cross_entropy(logits.transpose(1, 2), targets, ignore_index=ignore_index, reduction="none")
    count = (targets != ignore_index).sum(-1).clamp_min(1)
    return ce.sum(-1) / count


def _inner_grad_mode(first_order: bool) -> Tuple[bool, bool]:
    """(track, create_graph): whether the outer computation is differentiated, and whether
    the inner gradients keep their graph (second order)."""
    track = torch.is_grad_enabled()
    return track, track and not first_order


# --------------------------------------------------------------------------- GradMem


class GradMem(nn.Module):
    r"""Gradient-written memory tokens for a :class:`~ttt_flash.models.GPT` (GradMem-style).

    With memory tokens :math:`M_0 \in R^{m×d}` (learned), a context ``c`` with next-token
    targets ``t`` and step size :math:`η = e^{\log η}` (learned):

        M_{s+1} = M_s − η ∇_M L_c(M_s),   s = 0 … k−1,
        L_c(M)  = Σ_b mean_{i: t_{b,i} ≠ −100} CE(GPT([M; E c_b])_{m+i}, t_{b,i})

    (the loss is summed over the batch so that each sequence's memory takes its own
    gradient, unscaled by the batch size). The answer to a query ``q`` is
    ``GPT([M_k; E q])`` at the query positions: the query sees the written memory, never
    the context. The GPT weights are fixed inside the loop; the outer loss trains them,
    :math:`M_0` and :math:`\log η` through every inner step (second order unless
    ``first_order``).

    Positions: memory tokens take RoPE positions 0…m−1, the context and the query
    m, m+1, …

    Args:
        model: the language model (uses ``model.tok_emb`` and
            ``model(inputs_embeds=...)``).
        memory_tokens: m.
        inner_steps: k (0: the memory is never written; a baseline).
        inner_lr: initial η.
        first_order: drop second-order terms (treat ∇_M L_c as a constant).
        learn_inner_lr: train log η.

    Example::

        >>> import torch
        >>> from ttt_flash.models import GPT, GPTConfig
        >>> from ttt_flash.memory import GradMem
        >>> gm = GradMem(GPT(GPTConfig.tiny(vocab_size=32, n_layer=1)), memory_tokens=4)
        >>> ctx = torch.randint(0, 32, (2, 10))
        >>> logits = gm(ctx, ctx.roll(-1, 1), ctx[:, :3])
        >>> logits.shape
        torch.Size([2, 3, 32])
        >>> logits.sum().backward()  # second order through the write
    """

    def __init__(
        self,
        model: GPT,
        memory_tokens: int = 8,
        inner_steps: int = 1,
        inner_lr: float = 1.0,
        *,
        first_order: bool = False,
        learn_inner_lr: bool = True,
    ):
        super().__init__()
        _check_int("memory_tokens", memory_tokens, 1)
        _check_int("inner_steps", inner_steps, 0)
        self.model = model
        self.inner_steps, self.first_order = inner_steps, bool(first_order)
        self.memory = nn.Parameter(torch.randn(memory_tokens, model.config.d_model) * 0.02)
        self.log_inner_lr = _log_lr(inner_lr, learn_inner_lr)

    @property
    def num_memory(self) -> int:
        return self.memory.shape[0]

    @property
    def inner_lr(self) -> Tensor:
        """η = exp(log η)."""
        return self.log_inner_lr.exp()

    def initial_memory(self, batch: int) -> Tensor:
        """M_0 expanded to (batch, m, d_model)."""
        return self.memory.unsqueeze(0).expand(batch, -1, -1)

    def _with_memory(self, memory: Tensor, idx: Tensor) -> Tensor:
        emb = self.model.tok_emb(idx)
        x = torch.cat([memory.to(emb.dtype), emb], dim=1)
        return self.model(inputs_embeds=x)[:, memory.shape[1]:]

    def write_loss(self, memory: Tensor, context: Tensor, context_targets: Tensor) -> Tensor:
        """L_c(M): the per-sequence masked LM loss of ``context`` after ``memory``, summed
        over the batch (a scalar)."""
        return masked_lm_loss(self._with_memory(memory, context), context_targets).sum()

    def write(
        self,
        context: Tensor,
        context_targets: Tensor,
        *,
        steps: Optional[int] = None,
        first_order: Optional[bool] = None,
    ) -> Tuple[Tensor, List[Tensor]]:
        """Write a context into the memory.

        Args:
            context: (B, L) token ids.
            context_targets: (B, L) next-token targets, ``-100`` where not scored.
            steps: inner steps (default ``self.inner_steps``).
            first_order: default ``self.first_order``.

        Returns:
            ``(memory, losses)``: the written (B, m, d_model) memory and the detached write
            loss (mean over the batch) before each step.
        """
        steps = self.inner_steps if steps is None else steps
        first_order = self.first_order if first_order is None else first_order
        track, create_graph = _inner_grad_mode(first_order)
        memory = self.initial_memory(context.shape[0])
        lr = self.inner_lr
        losses = []
        for _ in range(steps):
            with torch.enable_grad():
                m_in = memory if track and memory.requires_grad else memory.detach().requires_grad_(True)
                loss = self.write_loss(m_in, context, context_targets)
                (grad,) = second_order_grad(loss, m_in, create_graph=create_graph)
            losses.append(loss.detach() / context.shape[0])
            memory = m_in - lr * grad
        return (memory if track else memory.detach()), losses

    def read(self, memory: Tensor, query: Tensor) -> Tensor:
        """(B, Q, vocab) logits of ``query`` (B, Q) after ``memory`` (B, m, d_model)."""
        return self._with_memory(memory, query)

    def forward(self, context: Tensor, context_targets: Tensor, query: Tensor) -> Tensor:
        """Write ``context``, then return the query logits read from the written memory."""
        memory, _ = self.write(context, context_targets)
        return self.read(memory, query)


# --------------------------------------------------------------------------- fast-weight TTT


def _linear(x: Tensor, lin: nn.Linear) -> Tensor:
    """``lin(x)``, or with per-sequence weights (``lin.weight`` (B, out, in), as swapped in by
    ``functional_call``) one matrix per sequence of the (B, N, in) input."""
    w, b = lin.weight, lin.bias
    if w.dim() == 2:
        return F.linear(x, w, b)
    y = torch.bmm(x, w.transpose(1, 2))
    return y if b is None else y + b.unsqueeze(1)


class _FastSwiGLU(nn.Module):
    """The same function as the :class:`SwiGLU` it wraps (same parameters and names), which
    also accepts per-sequence weights of shape (B, out, in) and biases (B, out)."""

    def __init__(self, mlp: SwiGLU):
        super().__init__()
        self.gate, self.up, self.down = mlp.gate, mlp.up, mlp.down

    def forward(self, x: Tensor) -> Tensor:
        return _linear(F.silu(_linear(x, self.gate)) * _linear(x, self.up), self.down)


class FastWeightTTT(nn.Module):
    r"""End-to-end test-time training of chosen MLP sublayers of a :class:`GPT`.

    The fast weights W (the ``gate``, ``up`` and ``down`` matrices, and biases if any, of
    the SwiGLU MLPs of the blocks ``fast_layers``) start at the model's own parameters W_0
    and are updated on successive chunks ``c_1, c_2, …`` of C tokens of the context:

        W_{j+1} = W_j − η ∇_W L(W_j; c_j)      (``inner_steps`` such steps per chunk)

    where L is the mean next-token loss on the scored targets of the chunk. The model uses
    sliding-window attention (``config.window = w``); a chunk's forward pass recomputes its
    ``w − 1`` preceding context tokens with the current fast weights, so that its attention
    sees exactly its window (``window=None``: each chunk attends within itself only). The
    queries are answered by the adapted model, attending to the last ``w − 1`` context
    tokens. The outer loss trains every weight — W_0, the slow weights and log η — through
    all chunk updates (second order unless ``first_order``).

    Each sequence of a batch has its own fast weights: they are carried as (B, out, in)
    tensors (``torch.func.functional_call`` swaps them in; the chosen MLPs are replaced at
    construction by modules computing the same function that also accept such batched
    weights; parameter names and the state dict are unchanged), and the chunk loss is summed
    over the batch, so each sequence's weights take its own gradient.

    Args:
        model: the GPT; its ``config.window`` sets the attention window.
        fast_layers: indices of the blocks whose MLP is fast (negative: from the end).
        chunk_size: C, tokens per inner update.
        inner_steps: gradient steps per chunk.
        inner_lr: initial η.
        first_order: drop second-order terms.
        learn_inner_lr: train log η.

    Example::

        >>> import torch
        >>> from ttt_flash.models import GPT, GPTConfig
        >>> from ttt_flash.memory import FastWeightTTT
        >>> ttt = FastWeightTTT(GPT(GPTConfig.tiny(vocab_size=32, window=4)), fast_layers=[-1], chunk_size=8)
        >>> ctx = torch.randint(0, 32, (2, 24))
        >>> ttt(ctx, ctx.roll(-1, 1), ctx[:, :5]).shape
        torch.Size([2, 5, 32])
    """

    def __init__(
        self,
        model: GPT,
        fast_layers: Sequence[int] = (-1,),
        chunk_size: int = 64,
        inner_steps: int = 1,
        inner_lr: float = 0.1,
        *,
        first_order: bool = False,
        learn_inner_lr: bool = True,
    ):
        super().__init__()
        _check_int("chunk_size", chunk_size, 1)
        _check_int("inner_steps", inner_steps, 0)
        n = len(model.blocks)
        layers = []
        for i in fast_layers:
            _check_int("fast_layers entry", i, -n)
            if i >= n:
                raise ValueError(f"fast_layers entry {i} is out of range for a model of {n} blocks")
            layers.append(i % n)
        if not layers or len(set(layers)) != len(layers):
            raise ValueError(f"fast_layers must name distinct blocks, got {list(fast_layers)}")
        for i in layers:
            mlp = model.blocks[i].mlp
            if not isinstance(mlp, (SwiGLU, _FastSwiGLU)):
                raise TypeError(f"block {i}'s mlp must be a SwiGLU, got {type(mlp).__name__}")
            if isinstance(mlp, SwiGLU):
                model.blocks[i].mlp = _FastSwiGLU(mlp)
        self.model = model
        self.fast_layers = sorted(layers)
        self.chunk_size, self.inner_steps, self.first_order = chunk_size, inner_steps, bool(first_order)
        self.fast_names = [
            f"blocks.{i}.mlp.{name}" for i in self.fast_layers for name, _ in model.blocks[i].mlp.named_parameters()
        ]
        self.log_inner_lr = _log_lr(inner_lr, learn_inner_lr)

    @property
    def inner_lr(self) -> Tensor:
        return self.log_inner_lr.exp()

    @property
    def overlap(self) -> int:
        """Preceding tokens a chunk recomputes: ``window − 1`` (0 without a window)."""
        w = self.model.config.window
        return 0 if w is None else w - 1

    def initial_fast_weights(self, batch: int) -> Dict[str, Tensor]:
        """W_0 expanded to one copy per sequence: {name: (batch, *shape)}."""
        params = dict(self.model.named_parameters())
        return {n: params[n].unsqueeze(0).expand(batch, *params[n].shape) for n in self.fast_names}

    def _logits(self, fast: Optional[Dict[str, Tensor]], idx: Tensor, start: int) -> Tensor:
        if not fast:
            return self.model(idx, positions=start)
        return functional_call(self.model, fast, (idx,), {"positions": start}, strict=False)

    def chunk_loss(self, fast: Dict[str, Tensor], context: Tensor, targets: Tensor, start: int, end: int) -> Tensor:
        """Mean next-token loss of ``context[:, start:end]`` per sequence, summed over the
        batch, with fast weights ``fast``; the ``overlap`` preceding tokens are recomputed as
        attention context (not scored)."""
        lo = max(0, start - self.overlap)
        tgt = targets[:, lo:end].clone()
        tgt[:, : start - lo] = -100
        return masked_lm_loss(self._logits(fast, context[:, lo:end], lo), tgt).sum()

    def adapt(
        self,
        context: Tensor,
        context_targets: Tensor,
        *,
        steps: Optional[int] = None,
        first_order: Optional[bool] = None,
    ) -> Tuple[Dict[str, Tensor], List[Tensor]]:
        """Fast weights after reading ``context`` (B, L) with targets ``context_targets``.

        Returns ``(fast, losses)``: {name: (B, *shape)} fast weights and the detached chunk
        loss (mean over the batch) before each update (``chunks · steps`` of them)."""
        steps = self.inner_steps if steps is None else steps
        first_order = self.first_order if first_order is None else first_order
        track, create_graph = _inner_grad_mode(first_order)
        if context.dim() != 2 or context_targets.shape != context.shape:
            raise ValueError(
                f"FastWeightTTT.adapt expects context (B, L) and context_targets of the same shape "
                f"(one target per context token, -100 where not scored), got context "
                f"{tuple(context.shape)} and context_targets {tuple(context_targets.shape)}"
            )
        batch, length = context.shape
        fast = self.initial_fast_weights(batch)
        lr = self.inner_lr
        losses = []
        for start in range(0, length, self.chunk_size):
            end = min(length, start + self.chunk_size)
            for _ in range(steps):
                with torch.enable_grad():
                    fast_in = {n: w if track and w.requires_grad else w.detach().requires_grad_(True)
                               for n, w in fast.items()}
                    loss = self.chunk_loss(fast_in, context, context_targets, start, end)
                    grads = second_order_grad(loss, list(fast_in.values()), create_graph=create_graph)
                losses.append(loss.detach() / batch)
                fast = {n: w - lr * g for (n, w), g in zip(fast_in.items(), grads)}
        if not track:
            fast = {n: w.detach() for n, w in fast.items()}
        return fast, losses

    def predict(self, fast: Optional[Dict[str, Tensor]], context: Tensor, query: Tensor) -> Tensor:
        """(B, Q, vocab) logits of ``query`` placed after ``context`` (the last ``overlap``
        context tokens are attended to), with fast weights ``fast`` (None: the initial)."""
        tail = min(self.overlap, context.shape[1])
        start = context.shape[1] - tail
        idx = torch.cat([context[:, start:], query], dim=1)
        return self._logits(fast, idx, start)[:, tail:]

    def forward(self, context: Tensor, context_targets: Tensor, query: Tensor) -> Tensor:
        """Adapt to each sequence's context, return the (B, Q, vocab) query logits."""
        fast, _ = self.adapt(context, context_targets)
        return self.predict(fast, context, query)


# --------------------------------------------------------------------------- memory layer


class GradientMemoryAttention(nn.Module):
    r"""Attention over gradient-written memory slots plus causal attention within a chunk.

    Per head (dimension D, scale τ = D^{-1/2}), with projections q_t, k_t, v_t of the input
    and S slots with keys K ∈ R^{S×D} and values V ∈ R^{S×D} (initial K_0, V_0 learned), the
    sequence is cut into chunks c = 1, 2, … of C tokens. Chunk c

    1. reads: o_t = softmax(τ q_t [K_c; k_{c,≤t}]ᵀ) [V_c; v_{c,≤t}] for t in chunk c — one
       causal attention call with the S slot keys in front of the chunk's keys and the
       mask aligned bottom-right, so every query sees all slots and the chunk up to itself;
    2. is written (not after the last chunk) by ``inner_steps`` gradient steps on the
       reconstruction loss through softmax attention over the slots, addressed by the
       chunk's keys:

           ℓ_c(K, V) = (1 / 2C) Σ_{t ∈ c} ‖ softmax(τ k_t Kᵀ) V − v_t ‖²
           (K, V) ← (K, V) − η ∇_{(K, V)} ℓ_c(K, V)

       with η = e^{log η} learned. The write keeps its graph (``create_graph=True``), so
       the outer loss differentiates through every write (second order: exact through
       :func:`ttt_flash.flash_attention`).

    Output: ``proj(o)``. Each sequence and head has its own slots; no positions are used
    (order enters through the causal mask and the chunk order), so RoPE tables passed by a
    host model (e.g. :class:`~ttt_flash.models.Block` calls ``attn(x, cos, sin)``) are
    accepted and ignored: ``block.attn = GradientMemoryAttention(...)`` replaces a GPT's
    attention.

    Args:
        d_model: input and output width.
        heads: number of heads (d_model divisible by it).
        memory_slots: S.
        inner_steps: gradient steps per write.
        inner_lr: initial η.
        chunk_size: C.
        attention: ``"ttt_flash"`` or ``"math"`` (materialised softmax, for tests).
        first_order: treat the write gradients as constants.
        learn_inner_lr: train log η.
        bias: biases in the projections.

    Example::

        >>> import torch
        >>> from ttt_flash.memory import GradientMemoryAttention
        >>> layer = GradientMemoryAttention(32, 4, memory_slots=8, inner_steps=1, inner_lr=1.0, chunk_size=16)
        >>> layer(torch.randn(2, 40, 32)).shape
        torch.Size([2, 40, 32])
    """

    def __init__(
        self,
        d_model: int,
        heads: int,
        memory_slots: int = 16,
        inner_steps: int = 1,
        inner_lr: float = 1.0,
        chunk_size: int = 64,
        *,
        attention: str = "ttt_flash",
        first_order: bool = False,
        learn_inner_lr: bool = True,
        bias: bool = False,
    ):
        super().__init__()
        _check_int("d_model", d_model, 1)
        _check_int("heads", heads, 1)
        _check_int("memory_slots", memory_slots, 1)
        _check_int("inner_steps", inner_steps, 0)
        _check_int("chunk_size", chunk_size, 1)
        if d_model % heads:
            raise ValueError(f"d_model ({d_model}) must be divisible by heads ({heads})")
        if attention not in MEMORY_ATTENTION_IMPLS:
            raise ValueError(f"attention must be one of {MEMORY_ATTENTION_IMPLS}, got {attention!r}")
        self.heads, self.head_dim = heads, d_model // heads
        self.inner_steps, self.chunk_size = inner_steps, chunk_size
        self.attention, self.first_order = attention, bool(first_order)
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=bias)
        self.proj = nn.Linear(d_model, d_model, bias=bias)
        self.slot_k = nn.Parameter(torch.randn(heads, memory_slots, self.head_dim))
        self.slot_v = nn.Parameter(torch.zeros(heads, memory_slots, self.head_dim))
        self.log_inner_lr = _log_lr(inner_lr, learn_inner_lr)

    @property
    def inner_lr(self) -> Tensor:
        return self.log_inner_lr.exp()

    def write_loss(self, slot_k: Tensor, slot_v: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """ℓ_c summed over batch and heads: slots (B, H, S, D), chunk keys/values (B, H, C, D)."""
        recon = _attend(k, slot_k, slot_v, causal=False, impl=self.attention)
        return 0.5 * (recon - v).square().sum() / k.shape[2]

    def write(self, slot_k: Tensor, slot_v: Tensor, k: Tensor, v: Tensor,
              first_order: Optional[bool] = None) -> Tuple[Tensor, Tensor]:
        """The slots after writing one chunk (``inner_steps`` gradient steps)."""
        first_order = self.first_order if first_order is None else first_order
        track, create_graph = _inner_grad_mode(first_order)
        lr = self.inner_lr
        for _ in range(self.inner_steps):
            with torch.enable_grad():
                sk = slot_k if track and slot_k.requires_grad else slot_k.detach().requires_grad_(True)
                sv = slot_v if track and slot_v.requires_grad else slot_v.detach().requires_grad_(True)
                loss = self.write_loss(sk, sv, k, v)
                gk, gv = second_order_grad(loss, (sk, sv), create_graph=create_graph)
            slot_k, slot_v = sk - lr * gk, sv - lr * gv
        if not track:
            slot_k, slot_v = slot_k.detach(), slot_v.detach()
        return slot_k, slot_v

    def forward(self, x: Tensor, *unused, write: bool = True, **unused_kw) -> Tensor:
        """x: (B, N, d_model) → (B, N, d_model). ``write=False`` never writes (every chunk
        reads the initial slots: the pre-write baseline). Other arguments are ignored.
        An empty sequence (N = 0) gives an empty (B, 0, d_model) output."""
        width = self.qkv.in_features
        if x.dim() != 3 or x.shape[-1] != width:
            raise ValueError(
                f"GradientMemoryAttention expects x of shape (batch, seq_len, d_model={width}), got "
                f"{tuple(x.shape)}" + ("; add a batch dimension with x.unsqueeze(0)" if x.dim() == 2 else "")
            )
        batch, n, _ = x.shape
        if n == 0:
            return self.proj(x.new_zeros(batch, 0, self.proj.in_features))
        q, k, v = rearrange(self.qkv(x), "b n (three h d) -> three b h n d", three=3, h=self.heads)
        slot_k = self.slot_k.unsqueeze(0).expand(batch, -1, -1, -1).to(q.dtype)
        slot_v = self.slot_v.unsqueeze(0).expand(batch, -1, -1, -1).to(q.dtype)
        outs = []
        for start in range(0, n, self.chunk_size):
            end = min(n, start + self.chunk_size)
            qc, kc, vc = q[:, :, start:end], k[:, :, start:end], v[:, :, start:end]
            keys, values = torch.cat([slot_k, kc], dim=2), torch.cat([slot_v, vc], dim=2)
            outs.append(_attend(qc, keys, values, causal=True, impl=self.attention))
            if write and end < n:
                slot_k, slot_v = self.write(slot_k, slot_v, kc, vc)
        return self.proj(rearrange(torch.cat(outs, dim=2), "b h n d -> b n (h d)"))


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
    def __init__(self, d_model: int, heads: int, memory_slots: int, inner_steps: int, inner_lr: float,
                 chunk_size: int, attention: str, conv: int, first_order: bool):
        super().__init__()
        self.attn_norm = RMSNorm(d_model)
        self.conv = _ShortConv(d_model, conv) if conv > 1 else nn.Identity()
        self.attn = GradientMemoryAttention(d_model, heads, memory_slots, inner_steps, inner_lr, chunk_size,
                                            attention=attention, first_order=first_order)
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
        attention: str = "ttt_flash",
        conv: int = 2,
        first_order: bool = False,
        checkpoint: bool = False,
    ):
        super().__init__()
        _check_int("vocab_size", vocab_size, 1)
        _check_int("n_layer", n_layer, 1)
        _check_int("conv", conv, 1)
        self.checkpoint = bool(checkpoint)
        self.tok_emb = nn.Embedding(vocab_size, d_model)
        self.blocks = nn.ModuleList(
            _MemoryBlock(d_model, heads, memory_slots, inner_steps, inner_lr, chunk_size, attention, conv, first_order)
            for _ in range(n_layer)
        )
        self.norm = RMSNorm(d_model)
        nn.init.normal_(self.tok_emb.weight, std=0.02)
        for block in self.blocks:
            for lin in (block.attn.qkv, block.attn.proj, block.mlp.gate, block.mlp.up, block.mlp.down):
                nn.init.normal_(lin.weight, std=0.02)
            for lin in (block.attn.proj, block.mlp.down):
                nn.init.normal_(lin.weight, std=0.02 / math.sqrt(2 * n_layer))

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
