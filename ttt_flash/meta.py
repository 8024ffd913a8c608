"""Model-agnostic inner loops for MAML-family meta-learning.

MAML (Finn et al., 2017) adapts a model to a task with a few gradient steps on the task's
*support* set and trains the initial weights so that the adapted model does well on the
task's *query* set. The outer (meta) gradient differentiates through every inner step,
which needs second derivatives of the model: through a transformer, second derivatives
of attention, which :func:`ttt_flash.flash_attention` computes exactly.

Two equivalent paths are provided:

* :func:`inner_loop`: functional, built on :func:`torch.func.functional_call`. The model
  is never mutated; parameters live in a ``{name: tensor}`` dict that carries the graph.
  Supports second- and first-order MAML, Meta-SGD (learnable per-parameter step sizes),
  ANIL-style adaptation of a parameter subset and a differentiable Adam.
* :func:`higher_inner_loop`: the same through ``higher.innerloop_ctx`` for any torch
  optimizer that ``higher`` knows (SGD, Adam, RMSprop, ...).

Two algorithms keep no graph of the inner loop, so their memory does not grow with the
number of inner steps:

* :func:`imaml_meta_gradient`: implicit MAML. A graph-free inner loop
  (:func:`proximal_inner_loop`) on ``L_task + (λ/2)‖φ − θ‖²``, then the meta-gradient by
  :func:`conjugate_gradient` on exact Hessian-vector products (:mod:`ttt_flash.hessian`).
* :func:`reptile_meta_gradient`: Reptile, ``θ − φ``.

Both return the adapted parameters as a dict that :func:`functional_loss` evaluates on
the query set::

    >>> import torch
    >>> from torch import nn
    >>> from ttt_flash.meta import inner_loop, functional_loss
    >>> net = nn.Sequential(nn.Linear(1, 8), nn.Tanh(), nn.Linear(8, 1))
    >>> mse = nn.functional.mse_loss
    >>> support = (torch.randn(5, 1), torch.randn(5, 1))   # (inputs, target)
    >>> query = (torch.randn(7, 1), torch.randn(7, 1))
    >>> fast = inner_loop(net, None, mse, support, steps=2, lr=0.1)
    >>> functional_loss(net, fast, mse, query).backward()  # second-order meta-gradient
    >>> net[0].weight.grad.shape
    torch.Size([8, 1])

Batches are ``(inputs, target)`` pairs: ``inputs`` is one tensor or a tuple of tensors
passed positionally to the model, and ``loss_fn(model(*inputs), target)`` must return a
scalar. ``target`` may be anything ``loss_fn`` understands.
"""

from __future__ import annotations

import math
import numbers
from collections import OrderedDict
from typing import Callable, Dict, Iterable, List, Mapping, NamedTuple, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor, nn
from torch.func import functional_call

from ._select import Selector, preview as _preview, select_names
from .second_order import second_order_grad

__all__ = [
    "inner_loop",
    "higher_inner_loop",
    "MAML",
    "Learner",
    "functional_loss",
    "select_adapted",
    "meta_sgd_lrs",
    "INNER_OPTIMIZERS",
    "check_inner_optimizer",
    "proximal_inner_loop",
    "imaml_meta_gradient",
    "reptile_meta_gradient",
    "conjugate_gradient",
    "CGReport",
    "IMAMLResult",
    "ReptileResult",
    "HESSIAN_MODES",
]

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
    return args, target


def _check_model(model) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")


def _check_params(model: nn.Module, params) -> Dict[str, Tensor]:
    if params is None:
        return dict(model.named_parameters())
    if not isinstance(params, Mapping):
        raise TypeError(
            "params must be a {name: tensor} mapping such as dict(model.named_parameters()), "
            f"or None; got {type(params).__name__}"
        )
    known = dict(model.named_parameters())
    unknown = [n for n in params if n not in known]
    if unknown:
        raise ValueError(
            f"params has names that are not parameters of the model: {unknown[:5]}"
            f"{' ...' if len(unknown) > 5 else ''}; the model's parameters are {_preview(known)}"
        )
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


# --------------------------------------------------------------------------- inner loops


def inner_loop(
    model: nn.Module,
    params: Optional[Mapping[str, Tensor]],
    loss_fn: LossFn,
    support_batch,
    steps: int,
    lr: Union[float, Tensor],
    *,
    first_order: bool = False,
    lrs: Optional[Mapping[str, Tensor]] = None,
    adapt: Adapt = None,
    optimizer: str = "sgd",
    betas: Tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
) -> Dict[str, Tensor]:
    r"""Adapt ``params`` to one task with ``steps`` differentiable gradient steps.

    Each step evaluates ``L = loss_fn(model(*inputs), target)`` on ``support_batch`` with the
    current parameters (:func:`functional_loss`), computes
    ``g = torch.autograd.grad(L, adapted, create_graph=not first_order)`` and updates

    * ``optimizer="sgd"``: ``θ ← θ − α ∘ g``
    * ``optimizer="adam"``: ``m ← β₁m + (1−β₁)g``, ``v ← β₂v + (1−β₂)g²``,
      ``θ ← θ − α ∘ m̂ / (√v̂ + ε)`` with bias-corrected ``m̂ = m/(1−β₁ᵗ)``,
      ``v̂ = v/(1−β₂ᵗ)`` (``torch.optim.Adam``'s formula, no weight decay). The state
      ``m``, ``v`` starts at zero for every call and lives in the autograd graph, so the
      meta-gradient differentiates through it.

    where ``α`` is ``lrs[name]`` if given (Meta-SGD) else ``lr``. The returned parameters
    are functions of the initial ``params`` (and of ``lr``/``lrs`` when they require
    grad): a query loss computed with them backpropagates through every inner step, with
    exact second-order terms unless ``first_order``.

    Args:
        model: any ``nn.Module``; it is called through ``torch.func.functional_call`` and
            never mutated. Buffers are the model's own.
        params: ``{name: tensor}`` of the weights to start from (typically
            ``dict(model.named_parameters())``), or None for exactly that. Names must be
            parameters of ``model``; missing names use the model's own tensors.
        loss_fn: ``loss_fn(output, target) -> scalar tensor``.
        support_batch: ``(inputs, target)``; ``inputs`` a tensor or a tuple of tensors
            passed positionally to ``model``. Shapes are whatever the model takes, e.g.
            (K, 1) for sinusoid regression, (S, N, d_in) for sequences.
        steps: number of inner steps (>= 0; 0 returns ``params`` unchanged).
        lr: inner step size α (float >= 0, or a finite, non-negative 0-dim tensor, e.g. a
            learnable scalar).
        first_order: drop second-order terms (FOMAML): inner gradients are computed without
            ``create_graph`` and treated as constants. The query gradient then flows only
            through the identity path of each update (and into ``lrs``).
        lrs: Meta-SGD: ``{name: tensor}`` of per-parameter step sizes (scalar or the
            parameter's shape, see :func:`meta_sgd_lrs`), used instead of ``lr`` for the
            parameters it names; every name must be an adapted parameter. Values must be
            finite; learned step sizes may turn negative (Meta-SGD learns their sign too).
        adapt: which parameters to adapt (see :func:`select_adapted`): None (all), names or
            module prefixes, or a predicate. The others are returned unchanged, as the very
            same tensor objects (ANIL: ``adapt=["head"]``).
        optimizer: ``"sgd"`` or ``"adam"``.
        betas, eps: Adam's coefficients (ignored for SGD).

    Returns:
        ``{name: tensor}`` with one entry per name in ``params`` (all of the model's
        parameters when ``params`` is None): adapted tensors for the adapted names, the
        input tensors for the rest.

    Raises:
        TypeError / ValueError: bad model, params, batch, steps (< 0 or not an int), lr,
            optimizer, lrs or adapt names, with a message that says which.

    Gradients are computed even when called under ``torch.no_grad()`` (e.g. in a
    validation loop): the inner loop needs them. ``torch.inference_mode()`` is refused with
    an explanation (autograd cannot run there). Parameters that do not require grad (e.g.
    detached copies) are adapted from a detached leaf copy. A parameter the support loss
    does not depend on gets a zero gradient.
    """
    _check_model(model)
    params = _check_params(model, params)
    steps = _check_steps(steps)
    lr = _check_lr(lr)
    check_inner_optimizer(optimizer)
    if not isinstance(first_order, bool):
        raise TypeError(f"first_order must be a bool, got {type(first_order).__name__}")
    _split_batch(support_batch, "support_batch")
    names = select_adapted(list(params), adapt)
    alphas = {n: lr for n in names}
    if lrs is not None:
        if not isinstance(lrs, Mapping):
            raise TypeError(f"lrs must be a {{name: tensor}} mapping or None, got {type(lrs).__name__}")
        stray = [n for n in lrs if n not in alphas]
        if stray:
            raise ValueError(
                f"lrs has step sizes for parameters that are not adapted: {stray[:5]}; "
                f"adapted parameters are {_preview(names)}"
            )
        for n, a in lrs.items():
            a = _check_lr(a, f"lrs[{n!r}]", scalar=False)
            if isinstance(a, Tensor) and a.dim() > 0 and a.shape != params[n].shape:
                raise ValueError(
                    f"lrs[{n!r}] must be a scalar or have the parameter's shape "
                    f"{tuple(params[n].shape)}, got {tuple(a.shape)}"
                )
            alphas[n] = a
    beta1, beta2 = betas
    if optimizer == "adam" and not (0 <= beta1 < 1 and 0 <= beta2 < 1 and eps > 0):
        raise ValueError(f"adam needs 0 <= betas < 1 and eps > 0, got betas={betas}, eps={eps}")

    fast = dict(params)
    if steps == 0:
        return fast
    if torch.is_inference_mode_enabled():
        raise RuntimeError(
            "inner_loop needs autograd and cannot run under torch.inference_mode() (Lightning "
            "evaluates in it by default): wrap the call in torch.inference_mode(False) and clone "
            "tensors created in inference mode (the batch) first"
        )
    with torch.enable_grad():
        for n in names:
            if not fast[n].requires_grad:
                fast[n] = fast[n].detach().requires_grad_(True)
        m = {n: torch.zeros_like(fast[n]) for n in names} if optimizer == "adam" else None
        v = {n: torch.zeros_like(fast[n]) for n in names} if optimizer == "adam" else None
        for t in range(1, steps + 1):
            loss = functional_loss(model, fast, loss_fn, support_batch)
            grads = _inner_grads(loss, [fast[n] for n in names], first_order)
            for n, g in zip(names, grads):
                if optimizer == "sgd":
                    update = g
                else:
                    m[n] = beta1 * m[n] + (1 - beta1) * g
                    v[n] = beta2 * v[n] + (1 - beta2) * g * g
                    m_hat = m[n] / (1 - beta1**t)
                    v_hat = v[n] / (1 - beta2**t)
                    update = m_hat / (_safe_sqrt(v_hat) + eps)
                fast[n] = fast[n] - alphas[n] * update
    return fast


def higher_inner_loop(
    model: nn.Module,
    loss_fn: LossFn,
    support_batch,
    steps: int,
    optimizer: Union[torch.optim.Optimizer, Callable[[Iterable[Tensor]], torch.optim.Optimizer]],
    *,
    first_order: bool = False,
) -> Dict[str, Tensor]:
    """The inner loop through ``higher.innerloop_ctx``, for any optimizer ``higher`` supports.

    Equivalent to :func:`inner_loop` for ``torch.optim.SGD`` (no momentum) and all
    parameters adapted: the same adapted weights and the same meta-gradient. Uses
    ``copy_initial_weights=False``, so the meta-gradient reaches ``model``'s own
    parameters.

    Args:
        model: the module to adapt (not mutated).
        loss_fn, support_batch, steps: as in :func:`inner_loop`.
        optimizer: a ``torch.optim.Optimizer`` over (some of) ``model.parameters()`` whose
            hyperparameters (lr, momentum, betas, ...) the differentiable copy uses; its own
            state is left alone. Or a callable ``params -> Optimizer``. Parameters the
            optimizer does not hold stay fixed.
        first_order: treat inner gradients as constants (FOMAML), by detaching them in
            ``higher``'s ``grad_callback``.

    Returns:
        ``{name: tensor}`` of all of ``model``'s parameters after ``steps`` steps,
        evaluable with :func:`functional_loss`.
    """
    import higher

    _check_model(model)
    steps = _check_steps(steps)
    if not isinstance(optimizer, torch.optim.Optimizer):
        if not callable(optimizer):
            raise TypeError(
                "optimizer must be a torch.optim.Optimizer or a callable params -> Optimizer, "
                f"got {type(optimizer).__name__}"
            )
        optimizer = optimizer(model.parameters())
    args, target = _split_batch(support_batch, "support_batch")
    detach = (lambda grads: [None if g is None else g.detach() for g in grads]) if first_order else None
    names = [n for n, _ in model.named_parameters()]
    with torch.enable_grad(), higher.innerloop_ctx(
        model, optimizer, copy_initial_weights=False, track_higher_grads=True
    ) as (fmodel, diffopt):
        for _ in range(steps):
            loss = loss_fn(fmodel(*args), target)
            diffopt.step(loss, grad_callback=detach)
        fast = list(fmodel.parameters())
    if len(fast) != len(names):  # pragma: no cover - higher deduplicates shared params like we do
        raise RuntimeError(f"higher returned {len(fast)} parameters for {len(names)} names")
    return dict(zip(names, fast))


# --------------------------------------------------------------------------- iMAML and Reptile
#
# Implicit MAML (Rajeswaran et al., 2019): the inner loop minimises the proximal task loss
#
#     G(φ; θ) = L_task(φ) + (λ/2) ‖φ − θ‖²
#
# without a graph. At its minimiser φ*, ∇L_task(φ*) + λ(φ* − θ) = 0, so (implicit function
# theorem) dφ*/dθ = (I + H/λ)⁻¹ with H = ∇²L_task(φ*), symmetric: the meta-gradient is
# g = (I + H/λ)⁻¹ ∇_φ L_query(φ*), solved by conjugate gradient on exact Hessian-vector
# products (ttt_flash.hessian). Memory does not grow with the number of inner steps.
# Reptile (Nichol et al., 2018) uses θ − φ (φ: the weights after the inner steps) as the
# meta-gradient: first order, one graph-free inner loop per task.

#: Accepted values of ``hessian_mode``: ``"rev_rev"`` (reverse over reverse: the gradient
#: graph of L_task is built once and reused by every product) or ``"fwd_rev"`` (forward over
#: reverse: each product re-runs L_task with a tangent; no ``create_graph`` graph is kept,
#: so the peak memory is lower, at about one extra forward pass per product).
HESSIAN_MODES = ("rev_rev", "fwd_rev")


# --------------------------------------------------------------------------- object-style MAML


class MAML(nn.Module):
    r"""Object-style MAML (learn2learn's ``MAML``) over the step of :func:`inner_loop`.

    ::

        maml = MAML(net, lr=0.1)                  # first_order=False: second-order MAML
        learner = maml.clone()                    # one per task
        for _ in range(steps):
            learner.adapt(loss_fn(learner(x_s), y_s))
        loss_fn(learner(x_q), y_q).backward()     # meta-gradient into net's parameters

    ``learner.adapt(loss)`` is ``θ ← θ − lr · ∇_θ loss`` on the adapted parameters, with the
    graph of the gradient kept (exact second order through attention) unless ``first_order``:
    ``steps`` calls of it equal ``inner_loop(net, None, loss_fn, (x_s, y_s), steps, lr)``.
    The wrapped module is never mutated; a learner holds its adapted parameters as a
    ``{name: tensor}`` dict (:attr:`Learner.params`) that :func:`functional_loss` accepts too.

    Args:
        module: the ``nn.Module`` whose parameters are the meta-learned initialisation.
        lr: inner step size (float >= 0, or a 0-dim tensor; an ``nn.Parameter`` is learned
            with the module, as in Meta-SGD with one step size).
        first_order: drop second-order terms (FOMAML).
        adapt: which parameters the inner steps change (:func:`select_adapted`: None for all,
            names or module prefixes, or a predicate); the others stay the module's own (ANIL).

    Calling ``maml(*args)`` runs the module with its own (unadapted) parameters. (The Lightning
    module that trains MAML recipes is another class: ``ttt_flash.lightning.MAML``.)
    """

    def __init__(self, module: nn.Module, lr: Union[float, Tensor], *, first_order: bool = False,
                 adapt: Adapt = None):
        super().__init__()
        _check_model(module)
        if not isinstance(first_order, bool):
            raise TypeError(f"first_order must be a bool, got {type(first_order).__name__}")
        self.module = module
        self.lr = _check_lr(lr)
        self.first_order = first_order
        self.adapted = select_adapted([n for n, _ in module.named_parameters()], adapt)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def clone(self) -> "Learner":
        """A learner starting from the module's parameters (the graph leads back to them)."""
        params = dict(self.module.named_parameters())
        for n in self.adapted:  # a frozen parameter is adapted from a leaf copy (as in inner_loop)
            if not params[n].requires_grad:
                params[n] = params[n].detach().requires_grad_(True)
        return Learner(self, params)


class Learner:
    """One task's adapted copy of a :class:`MAML` module (made by :meth:`MAML.clone`).

    ``learner(*args)`` runs the module with :attr:`params`; :meth:`adapt` takes one inner
    step; :meth:`clone` branches (the copy's steps do not change this learner).
    """

    def __init__(self, maml: MAML, params: Dict[str, Tensor]):
        self.maml = maml
        #: ``{name: tensor}`` of the current parameters: adapted ones carry the graph.
        self.params = params

    def __call__(self, *args, **kwargs):
        return functional_call(self.maml.module, self.params, args, kwargs)

    def adapt(self, loss: Tensor, *, first_order: Optional[bool] = None) -> "Learner":
        """One inner step ``θ ← θ − lr · ∇_θ loss`` on the adapted parameters; returns self.

        ``loss``: a scalar computed with this learner (``loss_fn(learner(x), y)``).
        ``first_order``: overrides the :class:`MAML`'s setting for this step.
        """
        first_order = self.maml.first_order if first_order is None else first_order
        if not isinstance(first_order, bool):
            raise TypeError(f"first_order must be a bool or None, got {type(first_order).__name__}")
        if not isinstance(loss, Tensor) or loss.numel() != 1:
            raise ValueError(
                "adapt(loss) needs a scalar tensor, got "
                + (f"shape {tuple(loss.shape)}" if isinstance(loss, Tensor) else type(loss).__name__)
            )
        if not loss.requires_grad:
            raise RuntimeError(
                "adapt(loss): the loss has no graph; compute it with the learner (loss_fn(learner(x), y)) "
                "with gradients enabled (not under torch.no_grad() or torch.inference_mode(); wrap "
                "validation in torch.enable_grad())"
            )
        names = self.maml.adapted
        with torch.enable_grad():
            grads = _inner_grads(loss.reshape(()), [self.params[n] for n in names], first_order)
        params = dict(self.params)
        for n, g in zip(names, grads):
            params[n] = params[n] - self.maml.lr * g
        self.params = params
        return self

    def clone(self) -> "Learner":
        """A learner starting where this one is (same tensors, so the same graph)."""
        return Learner(self.maml, dict(self.params))

    def named_parameters(self) -> Iterable[Tuple[str, Tensor]]:
        return iter(self.params.items())

    def parameters(self) -> Iterable[Tensor]:
        return iter(self.params.values())


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


class ReptileResult(NamedTuple):
    """What :func:`reptile_meta_gradient` returns for one task.

    Attributes:
        grads: ``{name: tensor}``: θ − φ for the adapted names, zeros for the rest (detached).
        adapted: ``{name: tensor}`` φ (detached) for the adapted names, the inputs for the rest.
    """

    grads: Dict[str, Tensor]
    adapted: Dict[str, Tensor]


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
        """H v for the weights (forward over reverse, :class:`ttt_flash.hessian.HessianOperator`)."""
        from .hessian import HessianOperator

        op = HessianOperator(lambda: self(), self, mode="fwd_rev")
        extra = [torch.zeros_like(t) for t in self.extra.values()]
        return op.mv([*vecs, *extra])[: len(vecs)]


def _check_hessian_mode(mode) -> str:
    if mode not in HESSIAN_MODES:
        raise ValueError(f"hessian_mode must be one of {HESSIAN_MODES}, got {mode!r}")
    return mode


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
       exact Hessian-vector products (:class:`ttt_flash.hessian.HessianOperator`: through
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
        grads_phi = None
        if hessian_mode == "rev_rev":
            from .hessian import HessianOperator  # same floor; imported where it is used

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

        def mv(vecs: List[Tensor]) -> List[Tensor]:
            return [x + h / lam for x, h in zip(vecs, hess(vecs))]

        g, report = conjugate_gradient(mv, v, cg_steps, cg_tol)
        out = dict(zip(names, g))
        if others:
            # ∂_w⟨∇_φ L_task, g⟩: the mixed second derivative of the shared weights
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
                mixed = full[len(names):]
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


def reptile_meta_gradient(
    model: nn.Module,
    params: Optional[Mapping[str, Tensor]],
    loss_fn: LossFn,
    support_batch,
    steps: int,
    lr: float,
    *,
    adapt: Adapt = None,
    optimizer: Union[str, Callable[[List[Tensor]], torch.optim.Optimizer]] = "sgd",
    betas: Tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
) -> ReptileResult:
    r"""Reptile (Nichol et al., 2018) for one task: ``θ − φ`` as the meta-gradient.

    φ is ``steps`` graph-free optimizer steps on ``L_task`` from θ
    (:func:`proximal_inner_loop` with λ = 0). An outer SGD step of size ε on this gradient is
    Reptile's update ``θ ← θ + ε (φ − θ)``; averaged over tasks it is the batched version.
    First order: no second derivatives, memory of one forward and backward pass.

    Args:
        model, params, loss_fn, support_batch, steps, lr, adapt, optimizer, betas, eps: as in
            :func:`proximal_inner_loop`.

    Returns:
        :class:`ReptileResult` ``(grads, adapted)``: ``grads[n] = θ_n − φ_n`` for the adapted
        names and zeros for the rest, detached.
    """
    fast = proximal_inner_loop(model, params, loss_fn, support_batch, steps, lr, 0.0, adapt=adapt,
                               optimizer=optimizer, betas=betas, eps=eps)
    params = _check_params(model, params)
    names = set(select_adapted(list(params), adapt))
    grads = {n: (p.detach() - fast[n]) if n in names else torch.zeros_like(p.detach())
             for n, p in params.items()}
    return ReptileResult(grads, fast)
