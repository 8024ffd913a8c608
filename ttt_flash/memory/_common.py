"""What the memory mechanisms share: the learned inner step size, the per-sequence LM loss
and :func:`inner_step`, the one gradient step every inner loop takes; and what their
context-parallel paths share (:func:`context_parallel_of`, :func:`masked_lm_loss_part`); and
:func:`gpt_of`, which lets the GPT-based mechanisms take a GPT or its config.

Imports torch, :mod:`ttt_flash.models`, :mod:`ttt_flash.second_order` and
:mod:`ttt_flash.distributed.context_parallel` only.
"""

from __future__ import annotations

import math
import numbers
from typing import Callable, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..distributed.context_parallel import group_size_rank, all_reduce_sum, block_bounds
from ..second_order import second_order_grad

__all__ = ["masked_lm_loss", "masked_lm_loss_part", "inner_step", "inner_grad_mode", "log_lr_parameter",
           "ContextParallelShard", "context_parallel_of"]


def log_lr_parameter(inner_lr: float, learn: bool) -> nn.Parameter:
    """The scalar parameter ``log(inner_lr)`` (learned when ``learn``); raises unless
    ``inner_lr`` is a real number > 0."""
    if isinstance(inner_lr, bool) or not isinstance(inner_lr, numbers.Real) or not inner_lr > 0:
        raise ValueError(f"inner_lr must be a float > 0 (it is learned as log inner_lr), got {inner_lr!r}")
    return nn.Parameter(torch.tensor(math.log(float(inner_lr))), requires_grad=learn)


def masked_lm_loss(logits: Tensor, targets: Tensor, ignore_index: int = -100) -> Tensor:
    """Per-sequence mean cross-entropy over the positions whose target is not
    ``ignore_index``: (B, N, V) logits, (B, N) targets → (B,). A sequence without targets
    scores 0 (not NaN). float16/bfloat16 logits are upcast to float32. Differentiable twice."""
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    ce = F.cross_entropy(logits.transpose(1, 2), targets, ignore_index=ignore_index, reduction="none")
    count = (targets != ignore_index).sum(-1).clamp_min(1)
    return ce.sum(-1) / count


def masked_lm_loss_part(logits: Tensor, targets: Tensor, count: Tensor, ignore_index: int = -100) -> Tensor:
    """This block's part of :func:`masked_lm_loss`: (B, n) logits and targets of a block of
    the sequence, ``count`` (B,) the scored targets of the *whole* sequence → (B,) summed
    cross-entropy of the block / ``count`` (the parts of the blocks add up to the loss)."""
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    ce = F.cross_entropy(logits.transpose(1, 2), targets, ignore_index=ignore_index, reduction="none")
    return ce.sum(-1) / count.clamp_min(1)


class ContextParallelShard:
    """Where a memory model's sequence is cut under context parallelism: rank r of the P
    ranks of ``group`` holds tokens ``N·r//P … N·(r+1)//P − 1`` of every length-N sequence
    it runs (:func:`ttt_flash.distributed.block_bounds`). The state that the inner loop
    writes (memory tokens, fast weights) is held whole by every rank; its gradient is the sum
    of the ranks' shares, added by :meth:`reduce` (the differentiable all-reduce, so that the
    outer gradient differentiates through it exactly)."""

    def __init__(self, group):
        self.group = group
        self.size, self.rank = group_size_rank(group)

    def bounds(self, seq_len: int) -> Tuple[int, int]:
        """``(start, end)``: this rank's tokens of a length-``seq_len`` sequence."""
        return block_bounds(seq_len, self.rank, self.size)

    def reduce(self, x: Tensor) -> Tensor:
        """Σ over the group, differentiable to any order."""
        return all_reduce_sum(x, group=self.group)


def context_parallel_of(model) -> Optional[ContextParallelShard]:
    """The :class:`ContextParallelShard` of a :class:`~ttt_flash.models.GPT` switched to
    context parallelism, else None."""
    if not getattr(model, "context_parallel", False):
        return None
    return ContextParallelShard(model.context_parallel_group)


def inner_grad_mode(first_order: bool) -> Tuple[bool, bool]:
    """(track, create_graph): whether the outer computation is differentiated, and whether
    the inner gradients keep their graph (second order)."""
    track = torch.is_grad_enabled()
    return track, track and not first_order


def inner_step(loss_fn: Callable[..., Tensor], state: Sequence[Tensor], lr: Tensor, *,
               track: bool, create_graph: bool,
               reduce: Optional[Callable[[Tensor], Tensor]] = None) -> Tuple[List[Tensor], Tensor]:
    """One inner gradient step ``x ← x − lr · ∇_x loss_fn(*state)`` on every tensor of ``state``.

    Runs with gradients enabled (the step needs them). A state tensor that is not part of a
    tracked graph (``track`` False, or it does not require grad) becomes a fresh leaf first.
    ``create_graph`` keeps the graph of the gradient (second order; False: first order, the
    gradient a constant). ``reduce`` (context parallelism: ``loss_fn`` is this rank's part of
    the loss) maps each gradient share to the whole gradient, differentiably. Returns
    ``(new_state, loss)``: the stepped tensors (shapes of ``state``) and the loss before the
    step.
    """
    with torch.enable_grad():
        xs = [x if track and x.requires_grad else x.detach().requires_grad_(True) for x in state]
        loss = loss_fn(*xs)
        grads = second_order_grad(loss, xs, create_graph=create_graph)
        if reduce is not None:
            grads = [reduce(g) for g in grads]
    return [x - lr * g for x, g in zip(xs, grads)], loss

