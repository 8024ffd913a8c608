"""GradMem: memory tokens written by gradient steps on the context's LM loss.

Imports torch, :mod:`ttt_flash.models` and
:mod:`ttt_flash.memory._common`; never Lightning.
"""

from __future__ import annotations

from typing import List, Optional, Tuple, Union

import torch
from torch import Tensor, nn

from .._checks import check_int
from ..models import GPT, GPTConfig
from ._gpt import gpt_of
from ._common import inner_grad_mode, log_lr_parameter, context_parallel_of, inner_step, masked_lm_loss, masked_lm_loss_part

__all__ = ["GradMem"]


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

    Context parallelism (``model`` a ``GPT(..., context_parallel=...)``, or
    :meth:`set_context_parallel`): the written sequence ``[M; c]`` of m + L tokens is cut
    across the P ranks of the group (rank r: tokens (m+L)·r//P … (m+L)·(r+1)//P − 1, so the
    memory tokens sit on the first rank(s)). Every rank passes the *whole* context, targets
    and query (token ids; the same on every rank) and holds the whole memory: each inner
    step takes the rank's share of ∇_M L_c and adds the shares with the differentiable
    all-reduce (:func:`ttt_flash.distributed.all_reduce_sum`), so every rank takes the same
    step and the outer gradient differentiates through the write exactly. The read (m + Q
    tokens) runs whole on every rank (``GPT(..., local=True)``), so every rank gets the same
    query logits and outer loss; the backward from it on every rank leaves on each rank a
    share of the parameters' gradients, and their **mean over the group** is the gradient of
    the outer loss (:class:`ttt_flash.lightning.GradMemKV` with ``context_parallel=P`` does
    this; docs/distributed.md).

    Args:
        model: the language model, a :class:`~ttt_flash.models.GPT` or the
            :class:`~ttt_flash.models.GPTConfig` that builds one (uses ``model.tok_emb`` and
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
        model: Union[GPTConfig, GPT],
        memory_tokens: int = 8,
        inner_steps: int = 1,
        inner_lr: float = 1.0,
        *,
        first_order: bool = False,
        learn_inner_lr: bool = True,
    ):
        super().__init__()
        check_int("memory_tokens", memory_tokens, 1)
        check_int("inner_steps", inner_steps, 0)
        model = gpt_of(model)
        self.model = model
        self.inner_steps, self.first_order = inner_steps, bool(first_order)
        self.memory = nn.Parameter(torch.randn(memory_tokens, model.config.d_model) * 0.02)
        self.log_inner_lr = log_lr_parameter(inner_lr, learn_inner_lr)

    def set_context_parallel(self, context_parallel) -> None:
        """Switch the model's context parallelism (``GPT.set_context_parallel``: True, a
        ProcessGroup, or None/False to switch it off); see the class docstring."""
        self.model.set_context_parallel(context_parallel)

    @property
    def vocab_size(self) -> int:
        """Token ids the model embeds."""
        return self.model.config.vocab_size

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

    def _with_memory(self, memory: Tensor, idx: Tensor, local: bool = False) -> Tensor:
        emb = self.model.tok_emb(idx)
        x = torch.cat([memory.to(emb.dtype), emb], dim=1)
        return self.model(inputs_embeds=x, local=local)[:, memory.shape[1]:]

    def write_loss(self, memory: Tensor, context: Tensor, context_targets: Tensor) -> Tensor:
        """L_c(M): the per-sequence masked LM loss of ``context`` after ``memory``, summed
        over the batch (a scalar). With context parallelism: this rank's part of it (the
        parts of the group's ranks add up to L_c)."""
        cp = context_parallel_of(self.model)
        if cp is None:
            return masked_lm_loss(self._with_memory(memory, context), context_targets).sum()
        m = memory.shape[1]
        start, end = cp.bounds(m + context.shape[1])
        a, b = max(start - m, 0), max(end - m, 0)  # this rank's context tokens
        emb = self.model.tok_emb(context[:, a:b])
        # The memory slice is empty on ranks past the memory tokens; it keeps the memory in
        # every rank's graph, so that every rank's backward runs its exchanges.
        x = torch.cat([memory[:, min(start, m):min(end, m)].to(emb.dtype), emb], dim=1)
        logits = self.model(inputs_embeds=x)[:, x.shape[1] - (b - a):]
        count = (context_targets != -100).sum(-1)
        return masked_lm_loss_part(logits, context_targets[:, a:b], count).sum()

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
        track, create_graph = inner_grad_mode(first_order)
        cp = context_parallel_of(self.model)
        reduce = None if cp is None else cp.reduce
        memory = self.initial_memory(context.shape[0])
        lr = self.inner_lr
        losses = []
        for _ in range(steps):
            (memory,), loss = inner_step(lambda m: self.write_loss(m, context, context_targets), (memory,), lr,
                                         track=track, create_graph=create_graph, reduce=reduce)
            loss = loss.detach() if reduce is None else reduce(loss.detach())
            losses.append(loss / context.shape[0])
        return (memory if track else memory.detach()), losses

    def read(self, memory: Tensor, query: Tensor) -> Tensor:
        """(B, Q, vocab) logits of ``query`` (B, Q) after ``memory`` (B, m, d_model). With
        context parallelism every rank reads the whole query (the same logits on every rank)."""
        return self._with_memory(memory, query, local=True)

    def forward(self, context: Tensor, context_targets: Tensor, query: Tensor) -> Tensor:
        """Write ``context``, then return the query logits read from the written memory."""
        memory, _ = self.write(context, context_targets)
        return self.read(memory, query)
