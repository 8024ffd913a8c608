"""What the meta-learning algorithms share: the functional loss, parameter selection,
Meta-SGD step sizes and the argument checks of the inner loops."""

from __future__ import annotations

import math
import numbers
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn
from torch.func import functional_call

from .._select import Selector, preview as _preview, select_names
from ..second_order.grad import second_order_grad

#: Accepted values of the ``optimizer`` argument of :func:`inner_loop`.
INNER_OPTIMIZERS = ("sgd", "adam")

#: What :func:`select_adapted` accepts: None (all), a name, names/prefixes, or a predicate.
Adapt = Selector
LossFn = Callable[[object, object], Tensor]



# --------------------------------------------------------------------------- helpers


def _split_batch(batch, what: str) -> Tuple[tuple, object]:
    if not isinstance(batch, (tuple, list)) or len(batch) != 2:
        raise TypeError(
            f"{what} must be an (inputs, target) pair, got {type(batch).__name__}"
            + (f" of length {len(batch)}" if isinstance(batch, (tuple, list)) else "")
        )
    inputs, target = batch
    args = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
    if what != "batch":  # a support / query set without examples would make a step a silent no-op
        for x in (*args, target):
            if isinstance(x, Tensor) and x.numel() == 0:
                raise ValueError(f"{what} is empty (a tensor of shape {tuple(x.shape)}): give it at least one "
                                 "example (an inner step or a meta-gradient on no data changes nothing)")
    return args, target


def _check_model(model) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")


def _check_names(what: str, names, known, known_as: str) -> None:
    """A ValueError naming the ``names`` (of the argument ``what``) that are not in ``known``,
    called ``known_as`` in the message."""
    stray = [n for n in names if n not in known]
    if stray:
        raise ValueError(f"{what} has names that are not {known_as}: {stray[:5]}{' ...' if len(stray) > 5 else ''}; "
                         f"the {known_as} are {_preview(known)}")


def _check_params(model: nn.Module, params) -> Dict[str, Tensor]:
    if params is None:
        return dict(model.named_parameters())
    if not isinstance(params, Mapping):
        raise TypeError(
            "params must be a {name: tensor} mapping such as dict(model.named_parameters()), "
            f"or None; got {type(params).__name__}"
        )
    known = dict(model.named_parameters())
    _check_names("params", params, known, "parameters of the model")
    for n, p in params.items():
        if not isinstance(p, Tensor):
            raise TypeError(f"params[{n!r}] must be a Tensor, got {type(p).__name__}")
        if p.shape != known[n].shape:
            raise ValueError(
                f"params[{n!r}] has shape {tuple(p.shape)} but the model's parameter has shape "
                f"{tuple(known[n].shape)}"
            )
    return dict(params)


def select_adapted(names: Sequence[str], adapt: Adapt = None) -> List[str]:
    """The parameter names an inner loop adapts, in the order of ``names``.

    Args:
        names: all parameter names (e.g. ``[n for n, _ in model.named_parameters()]``).
        adapt: ``None`` (all), a predicate ``name -> bool``, or a name / iterable of names.
            A name selects the parameter of that exact name, or every parameter under that
            module prefix (``"head"`` selects ``"head.weight"`` and ``"head.bias"``): the
            ANIL recipe is ``adapt=["head"]``.

    Raises:
        ValueError: an entry of ``adapt`` matches no parameter, or nothing is selected.
    """
    return select_names(names, adapt, arg="adapt")


def meta_sgd_lrs(params: Mapping[str, Tensor], lr: float, *, adapt: Adapt = None,
                 per_element: bool = True) -> Dict[str, Tensor]:
    """Initial Meta-SGD step sizes (Li et al., 2017): one learnable tensor per adapted parameter.

    Returns ``{name: tensor}`` filled with ``lr``, of the parameter's shape (``per_element``)
    or a scalar, each a leaf with ``requires_grad=True``: pass it as ``lrs`` to
    :func:`inner_loop` and give it to the outer optimizer (wrap it in an
    ``nn.ParameterDict`` with dots replaced to keep it in a module).
    """
    out = {}
    for n in select_adapted(list(params), adapt):
        p = params[n]
        shape = p.shape if per_element else ()
        out[n] = torch.full(shape, float(lr), dtype=p.dtype, device=p.device, requires_grad=True)
    return out


def functional_loss(model: nn.Module, params: Optional[Mapping[str, Tensor]], loss_fn: LossFn,
                    batch, *, return_output: bool = False):
    """``loss_fn(model(*inputs), target)`` with the model's parameters replaced by ``params``.

    ``batch`` is an ``(inputs, target)`` pair. Parameters absent from ``params`` (and all
    buffers) are the model's own. The model is not mutated. Returns the scalar loss,
    differentiable w.r.t. ``params`` and whatever they depend on; with ``return_output``,
    ``(loss, output)`` (the model's output, e.g. for an accuracy).
    """
    _check_model(model)
    args, target = _split_batch(batch, "batch")
    out = functional_call(model, {} if params is None else dict(params), args)
    loss = loss_fn(out, target)
    if not isinstance(loss, Tensor) or loss.numel() != 1:
        raise ValueError(
            "loss_fn must return a scalar tensor, got "
            + (f"shape {tuple(loss.shape)}" if isinstance(loss, Tensor) else type(loss).__name__)
        )
    return (loss.reshape(()), out) if return_output else loss.reshape(())


def check_inner_optimizer(optimizer, what: str = "optimizer") -> str:
    """``optimizer`` if it is one of :data:`INNER_OPTIMIZERS`; else ``ValueError`` naming ``what``."""
    if optimizer not in INNER_OPTIMIZERS:
        raise ValueError(f"{what} must be one of {INNER_OPTIMIZERS}, got {optimizer!r}")
    return optimizer


def _check_steps(steps) -> int:
    if isinstance(steps, bool) or not isinstance(steps, numbers.Integral):
        raise TypeError(f"steps must be an int, got {type(steps).__name__}")
    if steps < 0:
        raise ValueError(f"steps must be >= 0, got {steps}")
    return int(steps)


def _bad_values(x: Tensor, allow_negative: bool) -> bool:
    """Whether ``x`` holds a NaN / ±inf (or, unless allowed, a negative) value. Not checked
    while compiling or under a torch.func transform, where values cannot be inspected."""
    if torch.compiler.is_compiling():
        return False
    try:
        bad = ~torch.isfinite(x) if allow_negative else ~torch.isfinite(x) | (x < 0)
        return bool(bad.any())
    except RuntimeError:
        return False


def _check_lr(lr, name: str = "lr", scalar: bool = True):
    if isinstance(lr, Tensor):
        if not lr.is_floating_point():
            raise TypeError(f"{name} must be a float or a floating-point tensor, got dtype {lr.dtype}")
        if scalar and lr.dim() != 0:
            raise ValueError(
                f"{name} must be a float or a 0-dim tensor (one step size for every parameter), got a "
                f"tensor of shape {tuple(lr.shape)}; use lr.reshape(()) or, for per-parameter step "
                "sizes, lrs={name: tensor} (Meta-SGD)"
            )
        if _bad_values(lr, allow_negative=not scalar):
            raise ValueError(
                f"{name} must be finite" + (" and >= 0" if scalar else "") + f", got a tensor holding "
                f"{lr.detach().flatten()[:4].tolist()}{'...' if lr.numel() > 4 else ''}"
            )
        return lr
    if isinstance(lr, bool) or not isinstance(lr, numbers.Real):
        raise TypeError(f"{name} must be a float or a tensor, got {type(lr).__name__}")
    if not math.isfinite(lr) or lr < 0:
        raise ValueError(f"{name} must be finite and >= 0, got {lr}")
    return float(lr)


def _inner_grads(loss: Tensor, tensors: Sequence[Tensor], first_order: bool) -> List[Tensor]:
    """``d loss / d tensors`` for one inner step: with the graph of the gradient (second
    order) unless ``first_order`` (then constants); zeros for a tensor the loss does not use."""
    grads = second_order_grad(loss, list(tensors), create_graph=not first_order, allow_unused=True,
                              materialize_grads=True)
    return [g.detach() for g in grads] if first_order else list(grads)


def _safe_sqrt(x: Tensor) -> Tensor:
    # sqrt has an infinite derivative at 0, which turns a parameter whose gradient is exactly
    # zero (unused unit, masked input) into NaN second-order gradients (0 * inf). Clamping at
    # the dtype's smallest normal changes the value by < 1e-19 and makes that derivative 0.
    return x.clamp_min(torch.finfo(x.dtype).tiny).sqrt()
