"""What the memory mechanisms share: the learned inner step size, the per-sequence LM loss
and :func:`inner_step`, the one gradient step every inner loop takes.

Floor 3 (docs/architecture.md): imports torch and :mod:`ttt_flash.ops` only.
"""

from __future__ import annotations

import math
import numbers
from typing import Callable, List, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..second_order import second_order_grad

__all__ = ["masked_lm_loss", "inner_step"]


def _log_lr(inner_lr: float, learn: bool) -> nn.Parameter:
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


def _inner_grad_mode(first_order: bool) -> Tuple[bool, bool]:
    """(track, create_graph): whether the outer computation is differentiated, and whether
    the inner gradients keep their graph (second order)."""
    track = torch.is_grad_enabled()
    return track, track and not first_order


def inner_step(loss_fn: Callable[..., Tensor], state: Sequence[Tensor], lr: Tensor, *,
               track: bool, create_graph: bool) -> Tuple[List[Tensor], Tensor]:
    """One inner gradient step ``x ← x − lr · ∇_x loss_fn(*state)`` on every tensor of ``state``.

    Runs with gradients enabled (the step needs them). A state tensor that is not part of a
    tracked graph (``track`` False, or it does not require grad) becomes a fresh leaf first.
    ``create_graph`` keeps the graph of the gradient (second order; False: first order, the
    gradient a constant). Returns ``(new_state, loss)``: the stepped tensors (shapes of
    ``state``) and the loss before the step.
    """
    with torch.enable_grad():
        xs = [x if track and x.requires_grad else x.detach().requires_grad_(True) for x in state]
        loss = loss_fn(*xs)
        grads = second_order_grad(loss, xs, create_graph=create_graph)
    return [x - lr * g for x, g in zip(xs, grads)], loss

