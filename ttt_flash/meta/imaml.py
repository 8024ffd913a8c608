"""Implicit MAML: a graph-free proximal inner loop and the meta-gradient by conjugate
gradient on exact Hessian-vector products."""

from __future__ import annotations

import math
import numbers
from collections import OrderedDict
from typing import Callable, Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor, nn

from ..second_order.grad import second_order_grad
from ._common import (INNER_OPTIMIZERS, Adapt, LossFn, _check_lr, _check_model, _check_params, _check_steps,
                      _split_batch, functional_loss, select_adapted)

# --------------------------------------------------------------------------- iMAML and Reptile
#
# Implicit MAML (Rajeswaran et al., 2019): the inner loop minimises the proximal task loss
#
#     G(φ; θ) = L_task(φ) + (λ/2) ‖φ − θ‖²
#
# without a graph. At its minimiser φ*, ∇L_task(φ*) + λ(φ* − θ) = 0, so (implicit function
# theorem) dφ*/dθ = (I + H/λ)⁻¹ with H = ∇²L_task(φ*), symmetric: the meta-gradient is
# g = (I + H/λ)⁻¹ ∇_φ L_query(φ*), solved by conjugate gradient on exact Hessian-vector
# products (ttt_flash.second_order). Memory does not grow with the number of inner steps.
# Reptile (Nichol et al., 2018) uses θ − φ (φ: the weights after the inner steps) as the
# meta-gradient: first order, one graph-free inner loop per task.

#: Accepted values of ``hessian_mode``: ``"rev_rev"`` (reverse over reverse: the gradient
#: graph of L_task is built once and reused by every product) or ``"fwd_rev"`` (forward over
#: reverse: each product re-runs L_task with a tangent; no ``create_graph`` graph is kept,
#: so the peak memory is lower, at about one extra forward pass per product).
HESSIAN_MODES = ("rev_rev", "fwd_rev")



class CGReport(NamedTuple):
    """How a conjugate-gradient solve of ``A x = b`` ended.

    Attributes:
        steps: iterations run (each one product with A).
        residual: ‖b − A x‖ of the returned x (float64 sums), recomputed from the recursion.
        rel_residual: ``residual / ‖b‖`` (0 when b = 0).
        converged: ``rel_residual <= tol``.
        negative_curvature: the solve stopped at a direction p with pᵀAp <= 0: A is not
            positive definite there (for iMAML: λ is smaller than −λ_min(H), which happens
            when the inner loop is far from a minimum of the proximal loss).
    """

    steps: int
    residual: float
    rel_residual: float
    converged: bool
    negative_curvature: bool


class IMAMLResult(NamedTuple):
    """What :func:`imaml_meta_gradient` returns for one task.

    Attributes:
        grads: ``{name: tensor}`` the meta-gradient dL_query(φ*(θ))/dθ for every name of
            ``params`` (detached; the parameter's shape and dtype).
        adapted: ``{name: tensor}`` the adapted weights φ (detached) for the adapted names,
            the input tensors for the rest.
        loss_query: the query loss at φ (detached scalar).
        cg: the :class:`CGReport` of the solve.
    """

    grads: Dict[str, Tensor]
    adapted: Dict[str, Tensor]
    loss_query: Tensor
    cg: CGReport



def _flat_dot(a: Sequence[Tensor], b: Sequence[Tensor]) -> float:
    return float(sum((x.double() * y.double()).sum() for x, y in zip(a, b)))


def conjugate_gradient(
    mv: Callable[[List[Tensor]], List[Tensor]],
    b: Sequence[Tensor],
    steps: int,
    tol: float = 1e-10,
) -> Tuple[List[Tensor], CGReport]:
    """Solve ``A x = b`` for a symmetric positive definite ``A`` given as products ``mv(v) = A v``.

    ``b`` and ``x`` are lists of tensors (one per parameter, any shapes); inner products are
    summed in float64. Starts at x = 0 and stops after ``steps`` products, when
    ‖b − A x‖ <= ``tol``·‖b‖, or at a direction of non-positive curvature (the
    :class:`CGReport` says which). In exact arithmetic it solves an n-dimensional system in
    n steps.

    Returns:
        ``(x, report)``: the iterate of smallest residual (the last one for a positive
        definite A; for an indefinite A the residual may grow before a direction of
        non-positive curvature shows, so x is never worse than x = 0).
    """
    steps = _check_steps(steps)
    if isinstance(tol, bool) or not isinstance(tol, numbers.Real) or not tol >= 0:
        raise ValueError(f"tol must be a float >= 0, got {tol!r}")
    b = [t.detach() for t in b]
    x = [torch.zeros_like(t) for t in b]
    r = [t.clone() for t in b]
    p = [t.clone() for t in b]
    b_norm = math.sqrt(_flat_dot(b, b))
    rr = b_norm**2
    done, negative = 0, False
    if b_norm == 0:
        return x, CGReport(0, 0.0, 0.0, True, False)
    best, best_rr = x, rr
    for _ in range(steps):
        if math.sqrt(rr) <= tol * b_norm:
            break
        ap = mv(p)
        pap = _flat_dot(p, ap)
        done += 1
        if not pap > 0:
            negative = True
            break
        alpha = rr / pap
        x = [xi + alpha * pi for xi, pi in zip(x, p)]
        r = [ri - alpha * api for ri, api in zip(r, ap)]
        rr_new = _flat_dot(r, r)
        p = [ri + (rr_new / rr) * pi for ri, pi in zip(r, p)]
        rr = rr_new
        if rr <= best_rr:
            best, best_rr = x, rr
    # the iterate of smallest residual: for a positive definite A the last one; for an
    # indefinite one, CG's residual can grow before a non-positive curvature shows
    res = math.sqrt(best_rr)
    return best, CGReport(done, res, res / b_norm, res <= tol * b_norm, negative)


def _check_lam(lam, allow_zero: bool) -> float:
    if isinstance(lam, bool) or not isinstance(lam, numbers.Real):
        raise TypeError(f"lam must be a float, got {type(lam).__name__}")
    if not math.isfinite(lam) or lam < 0 or (lam == 0 and not allow_zero):
        raise ValueError(
            f"lam (the proximal weight λ of L_task + (λ/2)‖φ − θ‖²) must be finite and "
            f"{'>= 0' if allow_zero else '> 0'}, got {lam}"
        )
    return float(lam)


def _inner_optimizer(optimizer, leaves: List[Tensor], lr: float, betas, eps) -> torch.optim.Optimizer:
    if optimizer == "sgd":
        return torch.optim.SGD(leaves, lr=lr)
    if optimizer == "adam":
        return torch.optim.Adam(leaves, lr=lr, betas=betas, eps=eps)
    if isinstance(optimizer, str) or not callable(optimizer):
        raise ValueError(
            f"optimizer must be one of {INNER_OPTIMIZERS} or a callable tensors -> "
            f"torch.optim.Optimizer (e.g. lambda ps: torch.optim.LBFGS(ps)), got {optimizer!r}"
        )
    opt = optimizer(leaves)
    if not isinstance(opt, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer(tensors) must return a torch.optim.Optimizer, got {type(opt).__name__}"
        )
    return opt


def proximal_inner_loop(
    model: nn.Module,
    params: Optional[Mapping[str, Tensor]],
    loss_fn: LossFn,
    support_batch,
    steps: int,
    lr: float,
    lam: float = 0.0,
    *,
    adapt: Adapt = None,
    optimizer: Union[str, Callable[[List[Tensor]], torch.optim.Optimizer]] = "sgd",
    betas: Tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
) -> Dict[str, Tensor]:
    r"""Adapt ``params`` to one task without a graph: ``steps`` optimizer steps on
    ``L_task(φ) + (λ/2)‖φ − θ‖²`` from φ = θ (the iMAML inner problem; ``lam=0``: plain
    first-order adaptation, Reptile's inner loop).

    The adapted weights are fresh leaf tensors; nothing of the inner loop stays in memory
    after a step, so any number of steps costs the memory of one forward and backward pass.

    Args:
        model, params, loss_fn, support_batch, adapt: as in :func:`inner_loop`.
        steps: optimizer steps (>= 0).
        lr: step size of ``"sgd"`` / ``"adam"`` (float >= 0; ignored for a callable
            ``optimizer``).
        lam: proximal weight λ >= 0 (penalty toward the initial weights θ, which are held
            fixed).
        optimizer: ``"sgd"``, ``"adam"`` (``torch.optim`` with ``lr``, ``betas``, ``eps``) or
            any callable ``tensors -> torch.optim.Optimizer`` (e.g.
            ``lambda ps: torch.optim.LBFGS(ps, line_search_fn="strong_wolfe")``); steps are
            taken with a closure, so LBFGS works.

    Returns:
        ``{name: tensor}``: detached adapted tensors (``requires_grad=False``) for the adapted
        names, the input tensors for the rest.
    """
    _check_model(model)
    params = _check_params(model, params)
    steps = _check_steps(steps)
    lr = _check_lr(lr)
    if isinstance(lr, Tensor):
        lr = float(lr.detach())
    lam = _check_lam(lam, allow_zero=True)
    _split_batch(support_batch, "support_batch")
    names = select_adapted(list(params), adapt)
    if torch.is_inference_mode_enabled():
        raise RuntimeError(
            "proximal_inner_loop needs autograd and cannot run under torch.inference_mode(): wrap "
            "the call in torch.inference_mode(False) and clone tensors created in inference mode first"
        )
    theta = {n: params[n].detach() for n in names}
    leaves = [theta[n].clone().requires_grad_(True) for n in names]
    fixed = {n: (p.detach() if n not in theta else None) for n, p in params.items()}
    fast = dict(fixed)
    opt = _inner_optimizer(optimizer, leaves, lr, betas, eps)

    def closure():
        opt.zero_grad(set_to_none=True)
        fast.update(zip(names, leaves))
        loss = functional_loss(model, fast, loss_fn, support_batch)
        if lam:
            loss = loss + 0.5 * lam * sum(((x - theta[n]) ** 2).sum() for n, x in zip(names, leaves))
        grads = torch.autograd.grad(loss, leaves, allow_unused=True, materialize_grads=True)
        for x, g in zip(leaves, grads):
            x.grad = g
        return loss.detach()

    with torch.enable_grad():
        for _ in range(steps):
            opt.step(closure)
    out = dict(params)
    out.update({n: x.detach() for n, x in zip(names, leaves)})
    return out


class _TaskLoss(nn.Module):
    """L_task as a module whose parameters are the adapted tensors (for forward-over-reverse
    products, which swap a module's parameters): ``forward()`` evaluates ``loss_fn`` on the
    batch with the model's weights replaced by these parameters and ``fixed``.

    A floating-point target is a parameter too (after the weights; products give it a zero
    tangent): torch.func's forward-over-reverse through ``F.mse_loss`` fails on the implicit
    zero tangent of a constant target ("ZeroTensors are immutable"), not on a real one.
    """

    def __init__(self, model: nn.Module, loss_fn: LossFn, batch, tensors: Mapping[str, Tensor],
                 fixed: Mapping[str, Tensor]):
        super().__init__()
        object.__setattr__(self, "_model", model)  # not a submodule: its parameters are not ours
        self._loss_fn, self._fixed = loss_fn, dict(fixed)
        self._inputs, target = batch
        self._names = list(tensors)
        # an OrderedDict keeps the order (ParameterDict sorts the keys of a plain dict)
        self.weights = nn.ParameterDict(OrderedDict(
            (n.replace(".", "__"), nn.Parameter(t.detach(), requires_grad=True)) for n, t in tensors.items()
        ))
        self._target = target
        self.extra = nn.ParameterDict()  # a submodule after ``weights``: its parameter comes last
        if isinstance(target, Tensor) and target.is_floating_point():
            self.extra["target"] = nn.Parameter(target.detach(), requires_grad=True)

    def forward(self) -> Tensor:
        weights = {n: self.weights[n.replace(".", "__")] for n in self._names}
        target = self.extra["target"] if "target" in self.extra else self._target
        return functional_loss(self._model, {**self._fixed, **weights}, self._loss_fn,
                               (self._inputs, target))

    def hvp(self, vecs: List[Tensor]) -> List[Tensor]:
        """H v for the weights (forward over reverse, :class:`ttt_flash.second_order.HessianOperator`)."""
        from ..second_order.hessian import HessianOperator

        op = HessianOperator(lambda: self(), self, mode="fwd_rev")
        extra = [torch.zeros_like(t) for t in self.extra.values()]
        return op.mv([*vecs, *extra])[: len(vecs)]


def _check_hessian_mode(mode) -> str:
    if mode not in HESSIAN_MODES:
        raise ValueError(f"hessian_mode must be one of {HESSIAN_MODES}, got {mode!r}")
    return mode


def _task_hessian(model, loss_fn, support_batch, phi: Dict[str, Tensor], w: Dict[str, Tensor], hessian_mode: str):
    """``(hess, grads_phi)``: ``hess(vecs)``, the product with the Hessian of L_task at φ w.r.t. the
    adapted weights ``phi`` (the shared weights ``w`` held), and the gradient graph it uses
    (``"rev_rev"``; None for ``"fwd_rev"``, which recomputes per product)."""
    grads_phi = None
    if hessian_mode == "rev_rev":
        from ..second_order.hessian import HessianOperator  # imported where it is used

        loss_s = functional_loss(model, {**w, **phi}, loss_fn, support_batch)
        grads_phi = second_order_grad(loss_s, list(phi.values()), create_graph=True,
                                      allow_unused=True)
        if any(g is not None and g.requires_grad for g in grads_phi):
            op = HessianOperator.from_grads(list(grads_phi), phi)
            hess = op.mv
        else:  # L_task linear in φ (or independent of it): H = 0
            hess = lambda vecs: [torch.zeros_like(t) for t in vecs]  # noqa: E731
    else:
        task = _TaskLoss(model, loss_fn, support_batch, phi, {n: t.detach() for n, t in w.items()})
        hess = task.hvp
    return hess, grads_phi


def _mixed_term(model, loss_fn, support_batch, phi: Dict[str, Tensor], w: Dict[str, Tensor], g: List[Tensor],
                grads_phi, hessian_mode: str) -> List[Tensor]:
    """∂_w⟨∇_φ L_task, g⟩: the mixed second derivative for the shared weights ``w``."""
    if hessian_mode == "rev_rev":
        live = [i for i, t in enumerate(grads_phi) if t is not None and t.requires_grad]
        mixed = (
            torch.autograd.grad([grads_phi[i] for i in live], list(w.values()),
                                grad_outputs=[g[i] for i in live], allow_unused=True,
                                materialize_grads=True)
            if live else [torch.zeros_like(t) for t in w.values()]
        )
    else:
        both = _TaskLoss(model, loss_fn, support_batch, {**phi, **w}, {})
        full = both.hvp([*g, *(torch.zeros_like(t) for t in w.values())])
        mixed = full[len(phi):]
    return mixed


def imaml_meta_gradient(
    model: nn.Module,
    params: Optional[Mapping[str, Tensor]],
    loss_fn: LossFn,
    support_batch,
    query_batch,
    steps: int,
    lr: float,
    lam: float,
    *,
    cg_steps: int = 10,
    cg_tol: float = 1e-6,
    adapt: Adapt = None,
    optimizer: Union[str, Callable[[List[Tensor]], torch.optim.Optimizer]] = "sgd",
    betas: Tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    hessian_mode: str = "rev_rev",
    warn: bool = True,
) -> IMAMLResult:
    r"""Implicit MAML (Rajeswaran et al., 2019) for one task: the meta-gradient without
    differentiating through the inner loop.

    1. φ ← :func:`proximal_inner_loop` (``steps`` steps of ``optimizer`` on
       ``L_task(φ) + (λ/2)‖φ − θ‖²`` on ``support_batch``, no graph).
    2. ``v = ∇_φ L_query(φ)`` on ``query_batch``.
    3. ``g`` solves ``(I + H/λ) g = v`` by :func:`conjugate_gradient` (``cg_steps``
       products, stop at relative residual ``cg_tol``), ``H = ∇²_φ L_task(φ)`` applied by
       exact Hessian-vector products (:class:`ttt_flash.second_order.HessianOperator`: through
       ``flash_attention`` these are exact double backward).

    ``g`` is dφ*/dθᵀ ∇L_query at the minimiser φ* of the proximal loss; it is exact when the
    inner loop has converged and CG has. Memory does not depend on ``steps``.

    With ``adapt`` a subset (ANIL-style), the other parameters w are shared by the inner
    and the query loss: their meta-gradient is ``∂_w L_query − ∂_w⟨∇_φ L_task, g⟩ / λ`` (the
    implicit function theorem with L_task depending on w), one more product.

    Args:
        model, params, loss_fn, support_batch, adapt: as in :func:`inner_loop`.
        query_batch: ``(inputs, target)`` the adapted weights are scored on.
        steps, lr, optimizer, betas, eps: the inner loop (:func:`proximal_inner_loop`).
        lam: proximal weight λ > 0. Larger λ keeps φ nearer θ and makes (I + H/λ) better
            conditioned (fewer CG steps).
        cg_steps: at most this many CG iterations (each one Hessian-vector product); 0 gives
            g = 0 for the adapted weights.
        cg_tol: relative residual ‖v − (I + H/λ) g‖ / ‖v‖ at which CG stops.
        hessian_mode: ``"rev_rev"`` or ``"fwd_rev"`` (:data:`HESSIAN_MODES`): forward over
            reverse keeps no gradient graph, so its peak memory is lower.
        warn: issue a ``RuntimeWarning`` (with the residual) when CG does not reach
            ``cg_tol``; the :class:`CGReport` in the result says the same either way.

    Returns:
        :class:`IMAMLResult` ``(grads, adapted, loss_query, cg)``; ``grads`` has one detached
        tensor per name of ``params`` (all of the model's parameters when None). Nothing is
        written into ``.grad``: accumulate ``grads`` yourself (the Lightning module does).
    """
    _check_model(model)
    params = _check_params(model, params)
    lam = _check_lam(lam, allow_zero=False)
    cg_steps = _check_steps(cg_steps)
    hessian_mode = _check_hessian_mode(hessian_mode)
    _split_batch(query_batch, "query_batch")
    if isinstance(cg_tol, bool) or not isinstance(cg_tol, numbers.Real) or not cg_tol >= 0:
        raise ValueError(f"cg_tol must be a float >= 0, got {cg_tol!r}")
    fast = proximal_inner_loop(model, params, loss_fn, support_batch, steps, lr, lam, adapt=adapt,
                               optimizer=optimizer, betas=betas, eps=eps)
    names = select_adapted(list(params), adapt)
    others = [n for n in params if n not in set(names)]
    with torch.enable_grad():
        phi = {n: fast[n].detach().requires_grad_(True) for n in names}
        w = {n: params[n].detach().requires_grad_(True) for n in others}
        # the query gradient, for adapted and shared weights
        loss_q = functional_loss(model, {**w, **phi}, loss_fn, query_batch)
        gq = torch.autograd.grad(loss_q, [*phi.values(), *w.values()], allow_unused=True,
                                 materialize_grads=True)
        v, gw = list(gq[: len(names)]), list(gq[len(names):])
        # the Hessian of L_task at φ, w.r.t. the adapted weights
        hess, grads_phi = _task_hessian(model, loss_fn, support_batch, phi, w, hessian_mode)

        def mv(vecs: List[Tensor]) -> List[Tensor]:
            return [x + h / lam for x, h in zip(vecs, hess(vecs))]

        g, report = conjugate_gradient(mv, v, cg_steps, cg_tol)
        out = dict(zip(names, g))
        if others:
            mixed = _mixed_term(model, loss_fn, support_batch, phi, w, g, grads_phi, hessian_mode)
            for n, a, m in zip(others, gw, mixed):
                out[n] = (a - m / lam).detach()
    if warn and not report.converged:
        import warnings

        why = ("it met a direction of non-positive curvature (I + H/lam is not positive definite: "
               "run the inner loop longer or raise lam)" if report.negative_curvature else
               "raise cg_steps or lam (a larger lam conditions I + H/lam better)")
        warnings.warn(
            f"iMAML's conjugate gradient did not converge: relative residual {report.rel_residual:.3e} "
            f"> cg_tol {cg_tol:.1e} after {report.steps} of cg_steps={cg_steps} steps; {why}",
            RuntimeWarning,
            stacklevel=2,
        )
    grads = {n: out[n].detach() for n in params}
    return IMAMLResult(grads, fast, loss_q.detach(), report)
