"""Second-order optimisers with a Hutchinson estimate of the Hessian diagonal.

* :class:`SophiaH`: Sophia (Liu et al., 2023, "Sophia: A Scalable Stochastic Second-order
  Optimizer for Language Model Pre-training", Algorithm 3 with the Hutchinson estimator):
  an EMA of the Hessian diagonal refreshed every ``k`` steps, a per-coordinate clipped
  Newton-like step, decoupled weight decay.
* :class:`AdaHessian`: AdaHessian (Yao et al., 2021, "ADAHESSIAN: An Adaptive Second Order
  Optimizer for Machine Learning"): Adam with the second moment of the gradient replaced by
  that of the (optionally spatially averaged) Hessian diagonal, raised to ``hessian_power``.

Both take a Hessian-vector product through the loss graph, which through a transformer
with :func:`ttt_flash.flash_attention` is exact. They share one API:

**Refreshing the Hessian estimate** needs a loss graph; pick one of

1. ``loss.backward(create_graph=True)`` then ``optimizer.step()``: when the estimate is due
   (:attr:`~SophiaH.hessian_due`), ``step`` first refreshes it from the graph carried by
   ``p.grad``. A closure works the same way: ``step(closure)`` with a closure that runs
   ``loss.backward(create_graph=optimizer.hessian_due)``::

       for x, y in data:
           optimizer.zero_grad()
           loss = loss_fn(model(x), y)
           loss.backward(create_graph=optimizer.hessian_due)  # graph only when needed
           optimizer.step()

2. ``optimizer.update_hessian()`` explicitly after ``loss.backward(create_graph=True)``
   (before ``step``), e.g. to refresh on a schedule of your own.
3. ``optimizer.update_hessian(loss)``: from a loss tensor (gradients taken internally with
   ``torch.autograd.grad``; ``p.grad`` is not touched), e.g. on a separate batch after
   ``step``, as the Sophia authors do for their Gauss-Newton estimator.

After a refresh from ``p.grad`` the gradients are replaced by detached copies, which frees
the double-backward graph and breaks the parameter ↔ gradient reference cycle that
``backward(create_graph=True)`` creates. ``step`` on a parameter that has never had a
Hessian estimate raises ``RuntimeError``: no step runs on a silent zero estimate.

One Hutchinson probe per refresh (``n_samples`` in :meth:`~SophiaH.update_hessian` for
more), Rademacher by default (``probe="gaussian"`` as written in the Sophia paper; both
are unbiased, Rademacher has the lower variance). Under :mod:`torch.distributed` (several
processes), :meth:`~SophiaH.update_hessian` draws the probes on rank 0 and broadcasts them,
and averages the local estimates over processes (weighted by ``weight``), so every process
holds the estimate one process would get on the global batch; the gradients themselves must
be averaged by the caller (:func:`ttt_flash.distributed.average_gradients`; docs/distributed.md).

**Capturable** (``capturable=True``, for CUDA graphs; docs/cuda-graphs.md): the step counters
``state["step"]`` and ``state["hessian_step"]`` are 0-dim float32 tensors on the parameters'
device, and every update is a host part (:meth:`~SophiaH.host_step`: checks, a host mirror of
the counters, the step's learning-rate and bias-correction terms written into 0-dim device
tensors in place) and a device part (:meth:`~SophiaH.device_step`: tensor operations only, no
``.item()`` and no branch on a tensor's value), which a CUDA graph captures once and replays
after each step's host part. Both settings run the same kernels: the numbers are identical.

The shared machinery (refresh, averaging across processes, the host/device split) is
:class:`~ttt_flash.second_order.hessian_optimizer.HessianOptimizer`; this module holds the
two update rules. On CUDA, Sophia-H updates a param group's float32 parameters in one launch
(:func:`ttt_flash.kernels.optim.sophia_update_`: one pass over memory); elsewhere, and for
AdaHessian, a param group's tensors are updated together with ``torch._foreach_*`` operations.
Imports torch, :mod:`ttt_flash.kernels.optim` and :mod:`ttt_flash.second_order.hessian_optimizer`.
"""

from __future__ import annotations

import math
from typing import List, Optional, Tuple

import torch
from torch import Tensor

from ..kernels.optim import fused_update_applies, sophia_update_
from .hessian_optimizer import HessianOptimizer, _check_betas, _check_real

__all__ = ["SophiaH", "AdaHessian", "HessianOptimizer"]


class SophiaH(HessianOptimizer):
    r"""Sophia with the Hutchinson estimator of the Hessian diagonal (Liu et al., 2023).

    Per coordinate, with g_t the gradient and ĥ the Hutchinson estimate z ∘ (H z):

    * every ``k`` steps (steps 0, k, 2k, ...: :attr:`hessian_due`):
      ``h ← β₂ h + (1 − β₂) ĥ`` (:meth:`update_hessian`, or inside :meth:`step`);
    * every step: ``m ← β₁ m + (1 − β₁) g``; ``θ ← θ − lr · weight_decay · θ``;
      ``θ ← θ − lr · clip(m / max(ρ · h, ε), 1)``, where clip(x, 1) = max(min(x, 1), −1).

    Where h ≤ 0 (negative curvature or not yet estimated) or |m| ≥ ρ h the step is the
    sign step ``lr · sign(m)``: each coordinate moves by at most ``lr``. No bias
    correction, as in the paper's Algorithm 3. ``h`` starts at 0.

    Args:
        params: parameters or param groups.
        lr: learning rate η (the largest move of one coordinate per step).
        betas: (β₁, β₂): EMA rates of the gradient and of the Hessian diagonal.
        rho: ρ (γ in the paper's final version), scales h in the denominator; larger ρ
            means smaller, less often clipped steps.
        weight_decay: decoupled weight decay λ (θ ← θ − η λ θ).
        k: refresh the Hessian estimate every k steps.
        eps: ε, floor of ρ·h.
        probe: Hutchinson probe distribution, ``"rademacher"`` or ``"gaussian"``.
        capturable: keep the step counters as device tensors and read no tensor value on the
            host in the update, so that :meth:`device_step` can be captured in a CUDA graph
            (the module docstring, "Capturable"). Same numbers either way.

    Defaults are those of the authors' release (lr 1e-4, betas (0.965, 0.99), rho 0.04,
    weight decay 0.1, k = 10). The released Sophia-G multiplies h by the tokens per
    batch because its Gauss-Newton estimate is of a summed loss; this Hutchinson estimate
    is of the loss itself, so ρ applies to h directly.

    After each :meth:`step`, :attr:`clip_fraction` holds (as a 0-dim tensor) the fraction
    of updated coordinates whose step was clipped to ±lr.

    Example (see the module docstring for the other ways to refresh)::

        >>> import torch
        >>> w = torch.nn.Parameter(torch.tensor([1.0, -2.0]))
        >>> opt = SophiaH([w], lr=0.1, weight_decay=0.0)
        >>> loss = (torch.tensor([3.0, 0.5]) * w * w).sum() / 2   # H = diag(3, 0.5)
        >>> loss.backward(create_graph=opt.hessian_due)
        >>> opt.step()
        >>> opt.state[w]["hessian"]                               # (1 − β₂) · diag(H)
        tensor([0.0300, 0.0050])
    """

    _hessian_state_key = "hessian"

    def __init__(
        self,
        params,
        lr: float = 1e-4,
        betas: Tuple[float, float] = (0.965, 0.99),
        rho: float = 0.04,
        weight_decay: float = 1e-1,
        k: int = 10,
        eps: float = 1e-15,
        probe: str = "rademacher",
        capturable: bool = False,
    ):
        defaults = dict(
            lr=_check_real("lr", lr, 0.0),
            betas=_check_betas(betas),
            rho=_check_real("rho", rho, 0.0, lo_open=True),
            weight_decay=_check_real("weight_decay", weight_decay, 0.0),
            k=k,
            eps=_check_real("eps", eps, 0.0, lo_open=True),
            probe=probe,
            capturable=capturable,
        )
        super().__init__(params, defaults)
        self.clip_fraction: Optional[Tensor] = None
        self._clipped: List[Tensor] = []
        self._counted = 0

    def _absorb_hessians(self, group, params, states, diags):
        beta2 = group["betas"][1]
        hs = [s["hessian"] for s in states]
        torch._foreach_mul_(hs, beta2)
        torch._foreach_add_(hs, [d.to(p.dtype) for p, d in zip(params, diags)], alpha=1 - beta2)

    def _host_scalars(self, group, step, hessian_step):
        lr = group["lr"]
        return (1 - lr * group["weight_decay"], -lr)

    def _update_group(self, group, params, grads, states, scalars):
        decay, neg_lr = scalars  # 0-dim tensors: 1 − lr·λ and −lr
        beta1 = group["betas"][0]
        ms = [s["exp_avg"] for s in states]
        hs = [s["hessian"] for s in states]
        if params[0].is_cuda and fused_update_applies(params, grads, ms, hs):  # one pass over memory, one launch
            counts = sophia_update_(params, grads, ms, hs, decay, neg_lr, beta1, group["rho"], group["eps"],
                                    group["weight_decay"] != 0)
            self._clipped.append(counts.sum(dtype=torch.float64))
            self._counted += sum(p.numel() for p in params)
            return
        if group["weight_decay"] != 0:
            torch._foreach_mul_(params, decay)
        torch._foreach_mul_(ms, beta1)
        torch._foreach_add_(ms, grads, alpha=1 - beta1)
        # ratio = min(|m| / max(ρ·h, ε), 1); the step is −lr·sign(m)·ratio (sign(m)·lr is exact)
        ratio = torch._foreach_abs(ms)
        floor = torch._foreach_mul(hs, group["rho"])
        torch._foreach_clamp_min_(floor, group["eps"])
        torch._foreach_div_(ratio, floor)
        del floor
        torch._foreach_clamp_max_(ratio, 1.0)
        # clipped coordinates (ratio == 1) counted per tensor in float64 (exact): floor(ratio) is 1
        # there and 0 elsewhere
        self._clipped += torch._foreach_norm(torch._foreach_floor(ratio), 1, dtype=torch.float64)
        self._counted += sum(p.numel() for p in params)
        step = torch._foreach_sign(ms)
        torch._foreach_mul_(step, neg_lr)
        torch._foreach_addcmul_(params, step, ratio)

    def device_step(self, pairs):
        self._clipped, self._counted = [], 0
        super().device_step(pairs)
        if self._clipped:
            self.clip_fraction = torch.stack(self._clipped).sum().float() / self._counted  # float64 counts
        self._clipped = []

    device_step.__doc__ = HessianOptimizer.device_step.__doc__ + """
        Sets :attr:`clip_fraction` (a 0-dim tensor)."""


class AdaHessian(HessianOptimizer):
    r"""AdaHessian (Yao et al., 2021): Adam with the squared Hessian diagonal as second moment.

    Per coordinate, with D the Hutchinson estimate z ∘ (H z) (spatially averaged, see below):

    * every ``k`` steps (the paper refreshes every step: ``k = 1``):
      ``v ← β₂ v + (1 − β₂) D²``, counted by ``hessian_step`` s;
    * every step t: ``m ← β₁ m + (1 − β₁) g``;
      ``θ ← θ − lr · (m / (1 − β₁ᵗ) / ((√v / √(1 − β₂ˢ))^hessian_power + eps) + weight_decay · θ)``.

    Spatial averaging (``spatial_average=True``): for a parameter with 3 or more dimensions
    (a convolution kernel (C_out, C_in, *kernel)), D is replaced by the mean of |D| over the
    kernel dimensions, one value per (C_out, C_in) pair, as in the authors' release. Vectors
    and matrices (all of a transformer) are not averaged.

    Args:
        params: parameters or param groups.
        lr: learning rate.
        betas: (β₁, β₂): EMA rates of the gradient and of the squared Hessian diagonal.
        eps: added to the denominator.
        weight_decay: decoupled weight decay (θ ← θ − lr · weight_decay · θ).
        hessian_power: exponent in (0, 1] of the Hessian term (1: Newton-like, 0.5: Adam-like).
        k: refresh the Hessian estimate every k steps (the bias correction counts refreshes).
        spatial_average: average conv kernels' Hessian diagonals spatially.
        probe: Hutchinson probe distribution, ``"rademacher"`` or ``"gaussian"``.
        capturable: as in :class:`SophiaH`.

    Defaults are the authors' (lr 0.15, betas (0.9, 0.999), eps 1e-4, no weight decay,
    hessian_power 1).
    """

    _hessian_state_key = "exp_hessian_diag_sq"

    def __init__(
        self,
        params,
        lr: float = 0.15,
        betas: Tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-4,
        weight_decay: float = 0.0,
        hessian_power: float = 1.0,
        k: int = 1,
        spatial_average: bool = True,
        probe: str = "rademacher",
        capturable: bool = False,
    ):
        if not isinstance(spatial_average, bool):
            raise TypeError(f"spatial_average must be a bool, got {type(spatial_average).__name__}")
        defaults = dict(
            lr=_check_real("lr", lr, 0.0),
            betas=_check_betas(betas),
            eps=_check_real("eps", eps, 0.0),
            weight_decay=_check_real("weight_decay", weight_decay, 0.0),
            hessian_power=_check_real("hessian_power", hessian_power, 0.0, 1.0, lo_open=True),
            k=k,
            spatial_average=spatial_average,
            probe=probe,
            capturable=capturable,
        )
        super().__init__(params, defaults)

    def _absorb_hessians(self, group, params, states, diags):
        if group["spatial_average"]:
            diags = [d.abs().mean(dim=tuple(range(2, d.dim())), keepdim=True).expand_as(d) if d.dim() >= 3 else d
                     for d in diags]
        beta2 = group["betas"][1]
        diags = [d.to(p.dtype) for p, d in zip(params, diags)]
        vs = [s["exp_hessian_diag_sq"] for s in states]
        torch._foreach_mul_(vs, beta2)
        torch._foreach_addcmul_(vs, diags, diags, value=1 - beta2)

    def _host_scalars(self, group, step, hessian_step):
        beta1, beta2 = group["betas"]
        lr = group["lr"]
        bias1 = 1 - beta1 ** step
        bias2 = 1 - beta2 ** hessian_step
        return (math.sqrt(bias2), 1 - lr * group["weight_decay"], -lr / bias1)

    def _update_group(self, group, params, grads, states, scalars):
        sqrt_bias2, decay, neg_step = scalars  # 0-dim tensors: √(1 − β₂ˢ), 1 − lr·λ, −lr / (1 − β₁ᵗ)
        beta1 = group["betas"][0]
        ms = [s["exp_avg"] for s in states]
        torch._foreach_mul_(ms, beta1)
        torch._foreach_add_(ms, grads, alpha=1 - beta1)
        denom = torch._foreach_sqrt([s["exp_hessian_diag_sq"] for s in states])
        torch._foreach_div_(denom, sqrt_bias2)
        torch._foreach_pow_(denom, group["hessian_power"])
        torch._foreach_add_(denom, group["eps"])
        if group["weight_decay"] != 0:
            torch._foreach_mul_(params, decay)
        step = torch._foreach_mul(ms, neg_step)
        torch._foreach_div_(step, denom)
        torch._foreach_add_(params, step)
