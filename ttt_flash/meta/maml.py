"""MAML: the differentiable inner loop (functional and through ``higher``) and the
object-style :class:`MAML` / :class:`Learner`."""

from __future__ import annotations

from typing import Callable, Dict, Iterable, Mapping, Optional, Tuple, Union

import torch
from torch import Tensor, nn
from torch.func import functional_call

from ._common import (Adapt, LossFn, _bad_values, _check_lr, _check_model, _check_names, _check_params, _check_steps,
                      _inner_grads, _safe_sqrt, _split_batch, check_inner_optimizer, functional_loss,
                      select_adapted)


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
        _check_names("lrs", lrs, names, "adapted parameters")
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
        lr = self.maml.lr
        if isinstance(lr, Tensor) and _bad_values(lr, allow_negative=True):  # a learned step size gone bad
            raise ValueError(f"MAML.lr is {lr.detach().item()}: the learned inner step size is no longer finite "
                             "(lower the outer learning rate, or clip the meta-gradient)")
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
