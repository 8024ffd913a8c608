"""FastWeightTTT: end-to-end test-time training of chosen MLP sublayers of a GPT.

Imports torch, :mod:`ttt_flash.models` and
:mod:`ttt_flash.memory._common`; never Lightning.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call

from .._checks import check_int
from ..models import GPT, GPTConfig, SwiGLU
from ._gpt import gpt_of
from ._common import inner_grad_mode, log_lr_parameter, context_parallel_of, inner_step, masked_lm_loss, masked_lm_loss_part

__all__ = ["FastWeightTTT"]


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

    Context parallelism (``model`` a ``GPT(..., context_parallel=...)``, or
    :meth:`set_context_parallel`): each chunk's sequence (its ``overlap`` preceding tokens
    and the chunk, n tokens) is cut across the P ranks of the group (rank r: tokens
    n·r//P … n·(r+1)//P − 1 of it). Every rank passes the *whole* context, targets and query
    (token ids) and holds the whole fast weights; each update adds the ranks' gradient
    shares with the differentiable all-reduce
    (:func:`ttt_flash.distributed.all_reduce_sum`), so the outer gradient differentiates
    through every update exactly. The prediction (the last ``overlap`` context tokens and
    the query) runs whole on every rank (``GPT(..., local=True)``): every rank gets the same
    logits and outer loss, and the **mean over the group** of the ranks' parameter-gradient
    shares is its gradient (docs/distributed.md).

    Args:
        model: the GPT, or the :class:`~ttt_flash.models.GPTConfig` that builds one; its
            ``config.window`` sets the attention window.
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
        model: Union[GPTConfig, GPT],
        fast_layers: Sequence[int] = (-1,),
        chunk_size: int = 64,
        inner_steps: int = 1,
        inner_lr: float = 0.1,
        *,
        first_order: bool = False,
        learn_inner_lr: bool = True,
    ):
        super().__init__()
        check_int("chunk_size", chunk_size, 1)
        check_int("inner_steps", inner_steps, 0)
        model = gpt_of(model)
        n = len(model.blocks)
        layers = []
        for i in fast_layers:
            check_int("fast_layers entry", i, -n)
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
        self.log_inner_lr = log_lr_parameter(inner_lr, learn_inner_lr)

    @property
    def inner_lr(self) -> Tensor:
        return self.log_inner_lr.exp()

    @property
    def vocab_size(self) -> int:
        """Token ids the model embeds."""
        return self.model.config.vocab_size

    def set_context_parallel(self, context_parallel) -> None:
        """Switch the model's context parallelism (``GPT.set_context_parallel``); see the
        class docstring."""
        self.model.set_context_parallel(context_parallel)

    @property
    def overlap(self) -> int:
        """Preceding tokens a chunk recomputes: ``window − 1`` (0 without a window)."""
        w = self.model.config.window
        return 0 if w is None else w - 1

    def initial_fast_weights(self, batch: int) -> Dict[str, Tensor]:
        """W_0 expanded to one copy per sequence: {name: (batch, *shape)}."""
        params = dict(self.model.named_parameters())
        return {n: params[n].unsqueeze(0).expand(batch, *params[n].shape) for n in self.fast_names}

    def _logits(self, fast: Optional[Dict[str, Tensor]], idx: Tensor, start: int, local: bool = False) -> Tensor:
        if not fast:
            return self.model(idx, positions=start, local=local)
        return functional_call(self.model, fast, (idx,), {"positions": start, "local": local}, strict=False)

    def chunk_loss(self, fast: Dict[str, Tensor], context: Tensor, targets: Tensor, start: int, end: int) -> Tensor:
        """Mean next-token loss of ``context[:, start:end]`` per sequence, summed over the
        batch, with fast weights ``fast``; the ``overlap`` preceding tokens are recomputed as
        attention context (not scored). With context parallelism: this rank's part of it."""
        lo = max(0, start - self.overlap)
        tgt = targets[:, lo:end].clone()
        tgt[:, : start - lo] = -100
        cp = context_parallel_of(self.model)
        if cp is None:
            return masked_lm_loss(self._logits(fast, context[:, lo:end], lo), tgt).sum()
        a, b = cp.bounds(end - lo)  # the GPT adds the block's offset a to the positions
        count = (tgt != -100).sum(-1)
        return masked_lm_loss_part(self._logits(fast, context[:, lo + a:lo + b], lo), tgt[:, a:b], count).sum()

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
        track, create_graph = inner_grad_mode(first_order)
        if context.dim() != 2 or context_targets.shape != context.shape:
            raise ValueError(
                f"FastWeightTTT.adapt expects context (B, L) and context_targets of the same shape "
                f"(one target per context token, -100 where not scored), got context "
                f"{tuple(context.shape)} and context_targets {tuple(context_targets.shape)}"
            )
        batch, length = context.shape
        cp = context_parallel_of(self.model)
        reduce = None if cp is None else cp.reduce
        fast = self.initial_fast_weights(batch)
        lr = self.inner_lr
        losses = []
        for start in range(0, length, self.chunk_size):
            end = min(length, start + self.chunk_size)
            for _ in range(steps):
                names = list(fast)
                weights, loss = inner_step(
                    lambda *ws: self.chunk_loss(dict(zip(names, ws)), context, context_targets, start, end),
                    list(fast.values()), lr, track=track, create_graph=create_graph, reduce=reduce)
                loss = loss.detach() if reduce is None else reduce(loss.detach())
                losses.append(loss / batch)
                fast = dict(zip(names, weights))
        if not track:
            fast = {n: w.detach() for n, w in fast.items()}
        return fast, losses

    def predict(self, fast: Optional[Dict[str, Tensor]], context: Tensor, query: Tensor) -> Tensor:
        """(B, Q, vocab) logits of ``query`` placed after ``context`` (the last ``overlap``
        context tokens are attended to), with fast weights ``fast`` (None: the initial). With
        context parallelism every rank computes them whole (the same on every rank)."""
        tail = min(self.overlap, context.shape[1])
        start = context.shape[1] - tail
        idx = torch.cat([context[:, start:], query], dim=1)
        return self._logits(fast, idx, start, local=True)[:, tail:]

    def forward(self, context: Tensor, context_targets: Tensor, query: Tensor) -> Tensor:
        """Adapt to each sequence's context, return the (B, Q, vocab) query logits."""
        fast, _ = self.adapt(context, context_targets)
        return self.predict(fast, context, query)
