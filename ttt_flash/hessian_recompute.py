"""Recomputation units for Hessian-vector products: a forward over reverse product that keeps
only each unit's inputs (primal and tangent) instead of every activation of the model.

Forward over reverse (``mode="fwd_rev"`` in :mod:`ttt_flash.hessian`) takes the tangent, in
direction v, of a plain gradient. Its memory advantage over reverse over reverse is that the
reverse pass builds no ``create_graph`` graph, so a part of the model can be recomputed in the
backward pass (activation checkpointing) and its intermediates freed block by block; reverse
over reverse must keep the graph of the whole first backward for its second reverse pass,
recomputed or not. This module provides that recomputation (docs/forward-mode.md, "Memory").

Public names:

* :func:`recompute`: ``fn(*args)`` as one recomputation unit.
* :func:`recomputed`: a context in which named submodules of a module are recomputation units.
* :func:`forward_over_reverse`: the context in which units recompute under forward mode (entered
  by :class:`ttt_flash.hessian.HessianOperator` for each ``fwd_rev`` product).

What a unit does depends on where it runs:

* inside a ``torch.autograd.forward_ad`` level *and* :func:`forward_over_reverse` (a ``fwd_rev``
  product): the unit's forward runs without a graph, with tangents (the jvp rules of every op,
  ``flash_attention``'s tangent kernel among them); it keeps its inputs and their tangents.
  Its backward recomputes the unit from the primal inputs and returns the gradient of each input
  with its tangent: with cotangent ḡ (tangent ġ) and inputs z (tangents ż),
  ``∇_z⟨ḡ, f(z)⟩`` and its tangent ``J(z)ᵀ ġ + ∇²_z⟨ḡ, f(z)⟩ ż``, the second term by a
  reverse pass through the unit's own recomputed gradient graph (for attention, the BoB), freed
  when the unit is done. No tangent is computed with grad mode on, so no reference cycle between
  a tensor and its tangent's graph keeps intermediates alive until the dual level closes, and
  backward ops that have no forward-mode formula in PyTorch (``silu_backward``) are never given
  a tangent;
* with grad enabled, outside forward mode and torch.func transforms (training, reverse over
  reverse): non-reentrant ``torch.utils.checkpoint``, exact for first and second derivatives
  (the ``create_graph`` graph of a second derivative keeps the recomputed activations);
* elsewhere (torch.func transforms, which refuse saved-tensor hooks; forward mode outside
  :func:`forward_over_reverse`, e.g. back-propagating a loss of the tangents; no grad): a plain
  call, exact.

A unit's function must be pure in its arguments: every tensor it reads that requires grad or has
a tangent must be one of ``args`` (a closure over a parameter would drop that parameter's
gradient; the backward checks it and raises).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Union

import torch
from torch import Tensor, nn
from torch.autograd import forward_ad
from torch.utils.checkpoint import checkpoint

__all__ = ["recompute", "recomputed", "forward_over_reverse", "unit_modules"]

_functorch_active = torch._C._are_functorch_transforms_active
_STATE = threading.local()


def _fwd_rev_depth() -> int:
    return getattr(_STATE, "fwd_rev", 0)


@contextlib.contextmanager
def forward_over_reverse() -> Iterator[None]:
    """Declare that inside the current ``forward_ad`` level only gradients and their tangents
    are taken (never a gradient of a tangent): :func:`recompute` units then recompute under
    forward mode. :class:`ttt_flash.hessian.HessianOperator` enters it for every ``fwd_rev``
    product with ``recompute``; enter it yourself around a hand-written forward over reverse
    product (``forward_ad.dual_level()``, the loss, ``torch.autograd.grad``).

    Outside it a unit under forward mode is a plain call, because the tangent a unit returns
    carries no graph: back-propagating a loss of the tangents (consistency-model training) would
    lose the unit's part.
    """
    _STATE.fwd_rev = _fwd_rev_depth() + 1
    try:
        yield
    finally:
        _STATE.fwd_rev -= 1


class _Unit(torch.autograd.Function):
    """(run, y, *inputs) -> y: attaches the recomputing backward to ``y = run(*inputs)``,
    computed beforehand without a graph and with tangents (so the forward runs once)."""

    @staticmethod
    def forward(run, y, *inputs):
        return y.view_as(y)

    @staticmethod
    def setup_context(ctx, inputs, output):
        run, _, *xs = inputs
        ctx.run = run
        ctx.save_for_backward(*xs)
        ctx.tangents = [None] * len(xs)

    @staticmethod
    def jvp(ctx, _run_t, y_t, *tangents):
        # y already carries its tangent (computed with the forward); the inputs' tangents are
        # kept for the backward, where they multiply the unit's Hessian
        ctx.tangents = list(tangents)
        return None if y_t is None else y_t.view_as(y_t)

    @staticmethod
    def backward(ctx, grad_out):
        xs = ctx.saved_tensors
        need = ctx.needs_input_grad[2:]
        g, g_t = forward_ad.unpack_dual(grad_out)
        leaves = []
        for x, n in zip(xs, need):
            p = forward_ad.unpack_dual(x).primal.detach()
            leaves.append(p.requires_grad_() if n else p)
        idx = [i for i, n in enumerate(need) if n]
        ins = [leaves[i] for i in idx]
        with torch.enable_grad():
            y = ctx.run(*leaves)
            _check_recomputed(y, ins)
            grads = torch.autograd.grad(y, ins, g, create_graph=True, allow_unused=True)
            # one reverse pass from two roots: the gradient graph with cotangents ż (the
            # Hessian term) and y with cotangent ġ (the Jacobian term)
            roots, cots = [], []
            for gr, i in zip(grads, idx):
                t = ctx.tangents[i]
                if gr is not None and t is not None and gr.requires_grad:
                    roots.append(gr)
                    cots.append(t)
            if g_t is not None:
                roots.append(y)
                cots.append(g_t)
            dots = torch.autograd.grad(roots, ins, cots, allow_unused=True) if roots else [None] * len(ins)
        out: List[Optional[Tensor]] = [None] * len(xs)
        for i, gr, d in zip(idx, grads, dots):
            if gr is None:
                continue
            gr = gr.detach()
            out[i] = gr if d is None else forward_ad.make_dual(gr, d.detach())
        return (None, None, *out)


def _check_recomputed(y, leaves: Sequence[Tensor]) -> None:
    """The recomputed output reaches no tensor requiring grad but the unit's inputs, and carries
    no tangent (its function read nothing dual but its inputs)."""
    if forward_ad.unpack_dual(y).tangent is not None:
        raise RuntimeError(
            "recompute: the unit's function reads a tensor with a forward-mode tangent that is "
            "not one of its arguments (e.g. a parameter captured by a closure); pass every such "
            "tensor as an argument of recompute(fn, *args)"
        )
    ok = {id(t) for t in leaves}
    seen, stack = set(), [y.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        var = getattr(node, "variable", None)  # AccumulateGrad: a leaf requiring grad
        if var is not None and id(var) not in ok:
            raise RuntimeError(
                "recompute: the unit's function reads a tensor that requires grad "
                f"(shape {tuple(var.shape)}) and is not one of its arguments (e.g. a parameter "
                "captured by a closure), so its gradient would be lost; pass it as an argument "
                "of recompute(fn, *args)"
            )
        stack.extend(f for f, _ in node.next_functions)


def recompute(fn: Callable[..., Tensor], *args) -> Tensor:
    """``fn(*args)`` as one recomputation unit (module docstring): only ``args`` are kept for
    the backward pass, the intermediates are recomputed there.

    Args:
        fn: a function of ``args`` returning one tensor. Every tensor it reads that requires
            grad (or has a forward-mode tangent) must be among ``args``.
        args: positional arguments; tensors and other values (passed through).

    Returns:
        ``fn(*args)``.

    Example: a language-model loss whose vocabulary head is recomputed in chunks of tokens
    (the head's fp32 logits are the largest activations of a small language model)::

        >>> import torch
        >>> import torch.nn.functional as F
        >>> from ttt_flash.hessian_recompute import recompute
        >>> h = torch.randn(6, 4, requires_grad=True)      # (tokens, d_model) hidden states
        >>> w = torch.randn(10, 4, requires_grad=True)     # (vocab, d_model) head
        >>> y = torch.randint(0, 10, (6,))
        >>> ce = lambda h, w, y: F.cross_entropy(h @ w.T, y, reduction="sum")
        >>> loss = sum(recompute(ce, h[i:i + 2], w, y[i:i + 2]) for i in range(0, 6, 2)) / 6
        >>> torch.allclose(loss, F.cross_entropy(h @ w.T, y))
        True
    """
    if not callable(fn):
        raise TypeError(f"recompute: fn must be callable, got {type(fn).__name__}")
    wants_grad = torch.is_grad_enabled() and any(isinstance(a, Tensor) and a.requires_grad for a in args)
    if forward_ad._current_level >= 0:
        if not (wants_grad and _fwd_rev_depth() > 0) or _functorch_active():
            return fn(*args)
        with torch.no_grad():  # forward mode still runs: y gets its tangent, no graph is kept
            y = fn(*args)
        if not isinstance(y, Tensor):
            raise TypeError(f"recompute: fn must return one tensor, got {type(y).__name__}")
        tensors = [a for a in args if isinstance(a, Tensor)]
        if len(tensors) == len(args):
            return _Unit.apply(fn, y, *args)
        slots = [isinstance(a, Tensor) for a in args]

        def run(*ts):
            it = iter(ts)
            return fn(*(next(it) if s else a for s, a in zip(slots, args)))

        return _Unit.apply(run, y, *tensors)
    if _functorch_active() or not wants_grad:
        return fn(*args)
    return checkpoint(fn, *args, use_reentrant=False)


# --------------------------------------------------------------------------- modules

Names = Union[str, Sequence[str]]


def unit_modules(module: nn.Module, names: Names) -> Dict[str, nn.Module]:
    """``{name: submodule}`` of the units ``names`` choose in ``module``: each name is a dotted
    submodule path (``"blocks.3"``); a name of an ``nn.ModuleList`` / ``nn.ModuleDict`` stands
    for each of its children (``"blocks"``: every transformer block).

    Raises:
        TypeError: ``module`` is not an nn.Module or a name is not a str.
        ValueError: a name matches no submodule, or a unit lies inside another unit.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be an nn.Module, got {type(module).__name__}")
    names = [names] if isinstance(names, str) else list(names)
    if not names:
        raise ValueError("recompute: give at least one submodule name (e.g. 'blocks')")
    units: Dict[str, nn.Module] = {}
    for name in names:
        if not isinstance(name, str):
            raise TypeError(f"recompute names must be submodule names (str), got {type(name).__name__}")
        try:
            sub = module.get_submodule(name)
        except AttributeError:
            children = [n for n, _ in module.named_children()]
            raise ValueError(
                f"recompute: {type(module).__name__} has no submodule {name!r}; its children are "
                f"{children} (a name of an nn.ModuleList stands for each of its children)"
            ) from None
        if isinstance(sub, (nn.ModuleList, nn.ModuleDict)):
            for child_name, child in sub.named_children():
                units[f"{name}.{child_name}" if name else child_name] = child
        else:
            units[name] = sub
    paths = sorted(units)
    for a, b in zip(paths, paths[1:]):
        if b.startswith(a + ".") or a == "":
            raise ValueError(f"recompute: unit {b!r} lies inside unit {a!r}; name one of them")
    return units


@contextlib.contextmanager
def recomputed(module: nn.Module, names: Names) -> Iterator[Dict[str, nn.Module]]:
    """A context in which the submodules ``names`` of ``module`` (:func:`unit_modules`) are
    recomputation units: each call of one goes through :func:`recompute` with the submodule's
    parameters as arguments (read at call time, so ``torch.func.functional_call`` swaps work).
    The submodules' ``forward`` is restored on exit.

    Example::

        with recomputed(model, "blocks"), forward_ad.dual_level(), forward_over_reverse():
            ...  # a forward over reverse product keeping only each block's input

    Raises:
        RuntimeError: a submodule is already a unit (nested ``recomputed`` of the same module).
    """
    units = unit_modules(module, names)
    patched = []
    try:
        for name, sub in units.items():
            if getattr(sub, "_ttt_recompute_unit", False):
                raise RuntimeError(f"recompute: {name!r} is already a recomputation unit (nested recomputed())")
            own = sub.__dict__.get("forward")
            sub.forward = _unit_forward(sub, own if own is not None else type(sub).forward.__get__(sub))
            sub._ttt_recompute_unit = True
            patched.append((sub, own))
        yield units
    finally:
        for sub, own in patched:
            del sub._ttt_recompute_unit
            if own is None:
                del sub.forward
            else:
                sub.forward = own


def _unit_forward(sub: nn.Module, forward: Callable) -> Callable:
    """The forward of a unit: :func:`recompute` of the original forward with the submodule's
    parameters as explicit arguments (swapped in by ``functional_call`` when recomputed)."""
    inside = threading.local()

    def call(*args, **kwargs):
        if getattr(inside, "active", False):  # functional_call below calls the module again
            return forward(*args, **kwargs)
        if kwargs:
            raise TypeError(
                f"recompute: a unit ({type(sub).__name__}) is called with positional arguments "
                f"only; got keywords {sorted(kwargs)}"
            )
        names, params = zip(*sub.named_parameters()) if any(True for _ in sub.parameters()) else ((), ())
        n = len(args)

        def run(*ts):
            inside.active = True
            try:
                return torch.func.functional_call(sub, dict(zip(names, ts[n:])), tuple(ts[:n]))
            finally:
                inside.active = False

        return recompute(run, *args, *params)

    return call
