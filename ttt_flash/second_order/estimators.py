"""Estimators built on Hessian-vector products: one product (:func:`hvp`), Hutchinson's diagonal
and trace, the top eigenvalue by power iteration, the exact diagonal."""

from __future__ import annotations

import math
import numbers
from typing import List, NamedTuple, Optional

import torch
from torch import Tensor, nn

from .hessian import (HessianOperator, LossLike, ParamsLike, Recompute, _acc_dtype, _check_count, _operator,  # noqa: F401
                      _progress, probe_like)

__all__ = ["Eigen", "hvp", "hutchinson_diagonal", "hutchinson_trace", "top_eigenvalue", "exact_diagonal"]

# --------------------------------------------------------------------------- products


def hvp(loss: LossLike, params: Optional[ParamsLike] = None, vecs=None, *, mode: Optional[str] = None,
        module: Optional[nn.Module] = None, recompute: Recompute = None) -> List[Tensor]:
    """One Hessian-vector product ``∇²L(θ) v`` (exact; reverse over reverse by default).

    Args:
        loss: scalar loss tensor, zero-argument callable, or a :class:`HessianOperator`
            (then leave ``params`` out: ``hvp(op, vecs=v)``).
        params: parameters θ (module, tensor, list or ``{name: tensor}``).
        vecs: v, one tensor per parameter of its shape: list in parameter order,
            ``{name: tensor}``, or a single tensor for a single parameter.
        mode: ``"rev_rev"`` (default) or ``"fwd_rev"`` (forward over reverse: ``loss``
            must be a zero-argument callable; module docstring). With an operator, its own.
        module: ``"fwd_rev"``: the module whose parameters ``params`` are (default:
            ``params`` when it is a module); see :class:`HessianOperator`.
        recompute: submodule names of the module whose calls are recomputation units
            (``"fwd_rev"`` with ``recompute="blocks"`` keeps only each block's input); see
            :class:`HessianOperator`.

    Returns:
        H v as a list of tensors, one per parameter, of its shape.

    Raises:
        ValueError: a vector's shape or device differs from its parameter's, the number of
            vectors differs, a parameter does not require grad, the loss is not a scalar.

    Example::

        >>> import torch
        >>> x = torch.tensor([1.0, 2.0], requires_grad=True)
        >>> hvp((x ** 3).sum(), [x], [torch.ones(2)])  # H = diag(6x)
        [tensor([ 6., 12.])]
    """
    if vecs is None:
        raise TypeError("hvp() needs vecs (one vector per parameter)")
    return _operator(loss, params, mode, module, recompute).mv(vecs)


def _probed(op: HessianOperator, n_samples: int, probe: str, generator, bar):
    """Hutchinson's loop: ``(s, z, H z)`` for ``n_samples`` probes z drawn like ``op.params``,
    ticking the progress ``bar`` (None: no bar) after each and closing it at the end."""
    for s in range(n_samples):
        z = probe_like(op.params, probe, generator)
        yield s, z, op.mv(z)
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()


def hutchinson_diagonal(
    loss: LossLike,
    params: Optional[ParamsLike] = None,
    n_samples: int = 1,
    *,
    probe: str = "rademacher",
    generator: Optional[torch.Generator] = None,
    progress: bool = False,
    mode: Optional[str] = None,
    module: Optional[nn.Module] = None,
    recompute: Recompute = None,
) -> List[Tensor]:
    """Hutchinson estimate of the Hessian diagonal: the mean over ``n_samples`` probes z of z ∘ (H z).

    Unbiased for any probe with E[z zᵀ] = I. With Rademacher z the variance of one sample
    at coordinate i is Σ_{j≠i} H_ij² (exact when H is diagonal); Gaussian z adds 2 H_ii².

    Args:
        loss, params: as in :func:`hvp`.
        n_samples: number of probes (each one Hessian-vector product).
        probe: ``"rademacher"`` or ``"gaussian"`` (:data:`PROBES`).
        generator: random generator for the probes (default: the global one).
        progress: show a tqdm bar (off by default).
        mode, module, recompute: as in :func:`hvp` (``"rev_rev"`` or ``"fwd_rev"``).

    Returns:
        One tensor per parameter, of its shape; float32 for float16/bfloat16 parameters,
        the parameter's dtype otherwise.
    """
    op = _operator(loss, params, mode, module, recompute)
    n_samples = _check_count("n_samples", n_samples)
    acc = [torch.zeros(p.shape, dtype=_acc_dtype(p.dtype), device=p.device) for p in op.params]
    for _, z, hz in _probed(op, n_samples, probe, generator, _progress(n_samples, "hutchinson diag", progress)):
        for a, zi, hzi in zip(acc, z, hz):
            a.add_(zi.to(a.dtype) * hzi.to(a.dtype))
    return [a.div_(n_samples) for a in acc]


def hutchinson_trace(
    loss: LossLike,
    params: Optional[ParamsLike] = None,
    n_samples: int = 10,
    *,
    probe: str = "rademacher",
    generator: Optional[torch.Generator] = None,
    progress: bool = False,
    mode: Optional[str] = None,
    module: Optional[nn.Module] = None,
    recompute: Recompute = None,
) -> float:
    """Hutchinson estimate of tr(H): the mean over ``n_samples`` probes z of zᵀ H z.

    Arguments as in :func:`hutchinson_diagonal`. Returns a Python float (accumulated in
    float64). With Rademacher probes one sample's variance is 2 Σ_{i≠j} H_ij².
    """
    op = _operator(loss, params, mode, module, recompute)
    n_samples = _check_count("n_samples", n_samples)
    total = 0.0
    bar = _progress(n_samples, "hutchinson trace", progress)
    for s, z, hz in _probed(op, n_samples, probe, generator, bar):
        total += op.dot(z, hz)
        if bar is not None:
            bar.set_postfix(trace=f"{total / (s + 1):.4g}")
    return total / n_samples


class Eigen(NamedTuple):
    """Result of :func:`top_eigenvalue`."""

    value: float
    """The dominant eigenvalue λ (largest |λ|, with its sign), as the Rayleigh quotient."""
    vector: List[Tensor]
    """Unit eigenvector (over all parameters together), one tensor per parameter."""
    n_iter: int
    """Power iterations run (Hessian-vector products taken)."""
    converged: bool
    """Whether |λ_k − λ_{k−1}| ≤ tol · |λ_k| was reached within ``n_iter``."""


def top_eigenvalue(
    loss: LossLike,
    params: Optional[ParamsLike] = None,
    n_iter: int = 100,
    tol: float = 1e-6,
    *,
    generator: Optional[torch.Generator] = None,
    progress: bool = False,
    mode: Optional[str] = None,
    module: Optional[nn.Module] = None,
    recompute: Recompute = None,
) -> Eigen:
    """Dominant eigenvalue of H by power iteration (v ← Hv / ‖Hv‖).

    Converges to the eigenvalue of largest magnitude (for a loss near a minimum that is
    the largest, the sharpness); the rate is |λ_2 / λ_1| per iteration.

    Args:
        loss, params: as in :func:`hvp`.
        n_iter: maximum number of iterations (Hessian-vector products).
        tol: stop when the Rayleigh quotient changes by at most ``tol`` relative.
        generator: random generator for the start vector.
        progress: show a tqdm bar (off by default).
        mode, module, recompute: as in :func:`hvp` (``"rev_rev"`` or ``"fwd_rev"``).

    Returns:
        :class:`Eigen` (value, unit vector, iterations run, converged). H = 0 gives value 0.
    """
    op = _operator(loss, params, mode, module, recompute)
    n_iter = _check_count("n_iter", n_iter)
    if isinstance(tol, bool) or not isinstance(tol, numbers.Real) or not tol >= 0:
        raise ValueError(f"tol must be a number >= 0, got {tol!r}")

    def normalise(vs):
        norm = math.sqrt(op.dot(vs, vs))
        return [x / norm for x in vs] if norm > 0 else None

    v = normalise([x.to(_acc_dtype(x.dtype)) for x in probe_like(op.params, "gaussian", generator)])
    value, converged, it = 0.0, False, 0
    bar = _progress(n_iter, "power iteration", progress)
    for it in range(1, n_iter + 1):
        hv = [h.to(x.dtype) for h, x in zip(op.mv([x.to(p.dtype) for x, p in zip(v, op.params)]), v)]
        new = op.dot(v, hv)
        w = normalise(hv)
        if bar is not None:
            bar.update(1)
            bar.set_postfix(eigenvalue=f"{new:.6g}")
        if w is None:  # H v = 0: v lies in the null space; with a random start H = 0 in practice
            value, converged = 0.0, True
            break
        done = it > 1 and abs(new - value) <= tol * abs(new)
        value, v = new, w
        if done:
            converged = True
            break
    if bar is not None:
        bar.close()
    return Eigen(value=value, vector=v, n_iter=it, converged=converged)


def exact_diagonal(loss: LossLike, params: Optional[ParamsLike] = None, *, progress: bool = False,
                   mode: Optional[str] = None, module: Optional[nn.Module] = None,
                   recompute: Recompute = None) -> List[Tensor]:
    """diag(H) exactly: H e_i for every unit vector e_i, one product per scalar parameter.

    Costs ``numel`` Hessian-vector products: for small parameter sets (tests, probing a
    few tensors); use :func:`hutchinson_diagonal` otherwise.
    """
    op = _operator(loss, params, mode, module, recompute)
    out = [torch.zeros(p.shape, dtype=_acc_dtype(p.dtype), device=p.device) for p in op.params]
    bar = _progress(op.numel, "exact diagonal", progress)
    for k, p in enumerate(op.params):
        flat = out[k].view(-1)
        for i in range(p.numel()):
            e = [torch.zeros_like(q) for q in op.params]
            e[k].view(-1)[i] = 1
            flat[i] = op.mv(e)[k].reshape(-1)[i]
            if bar is not None:
                bar.update(1)
    if bar is not None:
        bar.close()
    return out
