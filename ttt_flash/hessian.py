"""Hessian-vector products and the estimators built on them, for any scalar loss.

For a scalar loss L(θ) over parameters θ = (θ_1, ..., θ_m) (tensors of any shapes), a
Hessian-vector product ``H v = ∇²L(θ) v`` is computed in one of two :data:`MODES`:

* ``"rev_rev"`` (default), reverse over reverse: the gradient g = ∇L is built once with
  ``create_graph=True``, then each product is ``∇_θ ⟨g, v⟩`` (one reverse pass through
  the kept graph). The loss may be a tensor.
* ``"fwd_rev"``, forward over reverse: each product re-runs the loss (a zero-argument
  callable) and takes the tangent in direction v of a plain gradient. No ``create_graph``
  graph of the model is kept, so peak memory is lower (docs/forward-mode.md). When the
  parameters belong to a module (``params`` is the module, or ``module=`` names it), the
  product is ``torch.func.jvp`` of ``torch.func.grad`` with the module's parameters swapped
  in (``torch.func.functional_call``), which covers every PyTorch op torch.func covers;
  otherwise v is attached to the parameters (leaf tensors) as their
  ``torch.autograd.forward_ad`` tangents, which needs forward-mode formulas for the
  backward ops of the loss (``silu_backward``, e.g., has none: pass ``module=``).

  ``recompute`` (either mode; needs a module and a loss callable) names submodules, e.g.
  ``"blocks"``, whose calls are recomputation units (:mod:`ttt_flash.hessian_recompute`). Under
  ``"fwd_rev"`` each unit keeps only its inputs and their tangents and is recomputed in the
  backward pass, so the peak memory is that of the unit inputs plus one unit, well below reverse
  over reverse, which must keep the ``create_graph`` graph of every unit (with ``recompute`` its
  units are ``torch.utils.checkpoint`` regions, which that graph keeps alive anyway). The
  product then attaches v to the parameters in place (the ``forward_ad`` route), with the units'
  backward ops differentiated inside the units, so SwiGLU models need no ``torch.func``.

Through a transformer whose attention is :func:`ttt_flash.flash_attention`, every product
is exact in both modes and never materialises an N × N attention matrix on the Triton
backend.

Public names:

* :class:`HessianOperator`: the linear map v ↦ H v of one loss, gradient graph built once
  (reuse it for many products).
* :func:`hvp`: one Hessian-vector product.
* :func:`hutchinson_diagonal`: unbiased estimate of diag(H), mean of z ∘ (H z).
* :func:`hutchinson_trace`: unbiased estimate of tr(H), mean of zᵀ H z.
* :func:`top_eigenvalue`: dominant eigenvalue (largest |λ|) and eigenvector by power iteration.
* :func:`exact_diagonal`: diag(H) exactly, one product per scalar parameter (small sets only).
* :func:`select_params`: ``{name: parameter}`` of a module, by names, prefixes or a predicate.
* :func:`probe_like`: one random probe (Rademacher ±1 or Gaussian) per parameter.
* :data:`PROBES`: accepted probe distributions; :data:`MODES`: accepted ``mode`` values.
* :func:`recompute`, :func:`recomputed`: recomputation units (:mod:`ttt_flash.hessian_recompute`).

Parameters (the ``params`` argument everywhere) may be an ``nn.Module`` (its parameters
that require grad), one tensor, a sequence of tensors or a ``{name: tensor}`` mapping
(e.g. from :func:`select_params`, to work on a subset). Every tensor must require grad.
Results are lists of tensors in the order of ``params``, each of its parameter's shape.

The loss (the ``loss`` argument everywhere) is a scalar tensor whose graph reaches the
parameters, a zero-argument callable returning one, or a :class:`HessianOperator` built
before (its graph is reused; ``params`` must then be omitted).

Example: the trace and top eigenvalue of a small network's loss Hessian::

    >>> import torch
    >>> from torch import nn
    >>> from ttt_flash.hessian import HessianOperator, hutchinson_trace, top_eigenvalue
    >>> _ = torch.manual_seed(0)
    >>> net = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1))
    >>> x, y = torch.randn(32, 3), torch.randn(32, 1)
    >>> op = HessianOperator(nn.functional.mse_loss(net(x), y), net)
    >>> op.numel
    41
    >>> isinstance(hutchinson_trace(op, n_samples=20), float)
    True
    >>> top_eigenvalue(op, n_iter=50).value > 0
    True
"""

from __future__ import annotations

import contextlib
import math
import numbers
from typing import Callable, Dict, List, Mapping, NamedTuple, Optional, Sequence, Union

import torch
from torch import Tensor, nn

from torch.autograd import forward_ad

from ._select import Selector, preview as _preview, select_names
from .hessian_recompute import forward_over_reverse, recompute, recomputed, unit_modules
from .second_order import second_order_grad

__all__ = [
    "HessianOperator",
    "Eigen",
    "hvp",
    "hutchinson_diagonal",
    "hutchinson_trace",
    "top_eigenvalue",
    "exact_diagonal",
    "select_params",
    "probe_like",
    "PROBES",
    "MODES",
    "recompute",
    "recomputed",
]

#: Accepted values of ``probe``: Rademacher (±1 with probability ½ each; the default,
#: lower variance, and z ∘ (Hz) is exact for a diagonal H) or standard Gaussian.
PROBES = ("rademacher", "gaussian")

#: Accepted values of ``mode``: ``"rev_rev"`` (reverse over reverse, the default) or
#: ``"fwd_rev"`` (forward over reverse; the loss must be a zero-argument callable).
MODES = ("rev_rev", "fwd_rev")

ParamsLike = Union[nn.Module, Tensor, Sequence[Tensor], Mapping[str, Tensor]]
LossLike = Union[Tensor, Callable[[], Tensor], "HessianOperator"]
#: Submodule names whose calls are recomputation units (``"blocks"``: each transformer block).
Recompute = Optional[Union[str, Sequence[str]]]
Select = Selector


# --------------------------------------------------------------------------- helpers


def select_params(module: nn.Module, names: Select = None) -> Dict[str, Tensor]:
    """The parameters of ``module`` that require grad, as ``{name: parameter}``, in module order.

    Args:
        module: any ``nn.Module``.
        names: ``None`` (all), a predicate ``name -> bool``, or a name / iterable of names.
            A name selects the parameter of that exact name, or every parameter under that
            module prefix (``"blocks.0"`` selects every parameter of the first block).

    Raises:
        ValueError: an entry of ``names`` matches no parameter, or nothing is selected.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be an nn.Module, got {type(module).__name__}")
    named = {n: p for n, p in module.named_parameters() if p.requires_grad}
    return {n: named[n] for n in select_names(list(named), names, pool="parameter requiring grad")}


def _as_params(params: ParamsLike) -> tuple:
    """(names, tensors) from any accepted ``params``; validated."""
    if isinstance(params, nn.Module):
        named = [(n, p) for n, p in params.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError(f"the module ({type(params).__name__}) has no parameter that requires grad")
        names, tensors = [n for n, _ in named], [p for _, p in named]
    elif isinstance(params, Tensor):
        names, tensors = ["params"], [params]
    elif isinstance(params, Mapping):
        names, tensors = [str(n) for n in params], list(params.values())
    elif isinstance(params, (list, tuple)):
        names, tensors = [f"params[{i}]" for i in range(len(params))], list(params)
    else:
        raise TypeError(
            "params must be an nn.Module, a Tensor, a list/tuple of Tensors or a {name: Tensor} "
            f"mapping, got {type(params).__name__}"
        )
    if not tensors:
        raise ValueError("params is empty: give at least one tensor")
    seen = set()
    for n, p in zip(names, tensors):
        if not isinstance(p, Tensor):
            raise TypeError(f"{n} must be a torch.Tensor, got {type(p).__name__}")
        if not p.is_floating_point():
            raise TypeError(f"{n} must be a floating-point tensor, got dtype {p.dtype}")
        if not p.requires_grad:
            raise ValueError(
                f"{n} (shape {tuple(p.shape)}) does not require grad: a Hessian is taken w.r.t. "
                "tensors with requires_grad=True (drop it from params, or call .requires_grad_())"
            )
        if id(p) in seen:
            raise ValueError(f"{n} appears twice in params (the same tensor)")
        seen.add(id(p))
    return names, tensors


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype of estimates: float32 for half types, the dtype otherwise."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _check_count(name: str, value, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def probe_like(
    tensors: Sequence[Tensor], probe: str = "rademacher", generator: Optional[torch.Generator] = None
) -> List[Tensor]:
    """One random probe per tensor, of its shape, dtype and device.

    ``"rademacher"``: entries ±1 with probability ½ each; ``"gaussian"``: standard normal.
    ``generator`` (optional) may live on any device; probes are drawn there and moved.
    """
    if probe not in PROBES:
        raise ValueError(f"probe must be one of {PROBES}, got {probe!r}")
    out = []
    for t in tensors:
        device = generator.device if generator is not None else t.device
        if probe == "rademacher":
            z = torch.randint(0, 2, t.shape, generator=generator, device=device).to(t.dtype).mul_(2).sub_(1)
        else:
            z = torch.randn(t.shape, generator=generator, device=device, dtype=_acc_dtype(t.dtype)).to(t.dtype)
        out.append(z.to(t.device))
    return out


def _progress(total: int, desc: str, enabled: bool):
    if not enabled:
        return None
    from tqdm.auto import tqdm  # imported lazily: only when a bar is asked for

    return tqdm(total=total, desc=desc, leave=False)


# --------------------------------------------------------------------------- operator


class HessianOperator:
    """The linear map v ↦ ∇²L(θ) v of a scalar loss L over parameters θ.

    The gradient graph (``create_graph=True``) is built once at construction; each
    :meth:`mv` is one reverse pass through it (about the cost of two backward passes of
    L), keeping the graph for the next product. Drop the operator to free the graph.

    Args:
        loss: scalar tensor whose graph reaches ``params``, or a zero-argument callable
            returning one (called once, with grad enabled; with ``mode="fwd_rev"`` a
            callable is required and is called once per product).
        params: see the module docstring (module, tensor, list or ``{name: tensor}``).
        mode: ``"rev_rev"`` (default) or ``"fwd_rev"`` (:data:`MODES`; module docstring).
        module: the ``nn.Module`` whose parameters ``params`` are (default: ``params`` itself
            when it is a module); used by ``"fwd_rev"`` and by ``recompute``.
        recompute: submodule names of ``module`` whose calls are recomputation units
            (``"blocks"``: each child of the ModuleList ``blocks``); module docstring. None
            (default): no recomputation.

    Attributes:
        names: one name per parameter (``"params[i]"`` for a list).
        params: the parameter tensors, in order.
        mode: ``"rev_rev"`` or ``"fwd_rev"``.
        gradient: ∇L, one detached tensor per parameter (zeros where L does not depend on it).
            With ``"fwd_rev"``: the gradient of the latest product's loss call (one plain
            gradient pass if read before any product).
        reached: per parameter, whether the loss's graph reaches it (its gradient is not None).
        numel: total number of scalar parameters (the Hessian is numel × numel).

    A parameter that L does not use, or in which L is linear, has a zero gradient graph:
    its rows and columns of H are 0 and products are 0 there (not an error).
    Third-order derivatives are not needed and not taken.
    """

    def __init__(self, loss: Union[Tensor, Callable[[], Tensor]], params: ParamsLike, mode: str = "rev_rev",
                 *, module: Optional[nn.Module] = None, recompute: Recompute = None):
        self.mode = _check_mode(mode)
        self.names, self.params = _as_params(params)
        owner = params if module is None and isinstance(params, nn.Module) else module
        self._units = self._init_recompute(loss, owner, recompute)
        if mode == "fwd_rev":
            self._init_fwd_rev(loss, owner)
            return
        if callable(loss) and not isinstance(loss, Tensor):
            with torch.enable_grad(), self._units_context():
                loss = loss()
        _check_loss(loss)
        with torch.enable_grad():
            grads = second_order_grad(loss, self.params, create_graph=True, allow_unused=True)
        self._init_from_grads(list(grads))

    def _init_recompute(self, loss, owner: Optional[nn.Module], recompute) -> Optional[tuple]:
        """(module, names) of the recomputation units, validated; None without ``recompute``."""
        if recompute is None:
            return None
        if owner is None:
            raise ValueError(
                "recompute names submodules of a module: pass the module as params or as module= "
                "(e.g. hvp(loss, params, vecs, module=model, recompute='blocks'))"
            )
        if isinstance(loss, Tensor) or not callable(loss):
            raise TypeError(
                "recompute needs the loss as a zero-argument callable (the units are installed "
                f"while it runs), not a {type(loss).__name__}"
            )
        unit_modules(owner, recompute)  # raises on a bad name now rather than at the first product
        return owner, recompute

    def _units_context(self):
        """The :func:`~ttt_flash.hessian_recompute.recomputed` context of the operator's units
        (a no-op context without ``recompute``)."""
        if self._units is None:
            return contextlib.nullcontext()
        return recomputed(*self._units)

    @classmethod
    def from_grads(cls, grads: Sequence[Optional[Tensor]], params: ParamsLike) -> "HessianOperator":
        """An operator from gradients already built with ``create_graph=True``.

        ``grads[i]`` is ∂L/∂params[i] carrying its graph (e.g. ``p.grad`` after
        ``loss.backward(create_graph=True)``), or None (treated as 0).

        Raises:
            ValueError: lengths or shapes differ, or no gradient carries a graph (the
                backward pass was run without ``create_graph=True``).
        """
        op = cls.__new__(cls)
        op.mode = "rev_rev"
        op._units = None
        op.names, op.params = _as_params(params)
        grads = list(grads)
        if len(grads) != len(op.params):
            raise ValueError(f"got {len(grads)} gradients for {len(op.params)} parameters")
        for n, g, p in zip(op.names, grads, op.params):
            if g is not None and g.shape != p.shape:
                raise ValueError(f"gradient of {n} has shape {tuple(g.shape)}, the parameter {tuple(p.shape)}")
        if not any(g is not None and g.requires_grad for g in grads):
            raise ValueError(
                "no gradient carries a graph, so Hessian-vector products cannot be taken: run the "
                "backward pass with create_graph=True (loss.backward(create_graph=True) or "
                "torch.autograd.grad(loss, params, create_graph=True))"
            )
        op._init_from_grads(grads)
        return op

    def _init_from_grads(self, grads: List[Optional[Tensor]]) -> None:
        self._grads = grads
        self.reached = [g is not None for g in grads]
        # Only gradients that depend on θ enter the reverse pass; the rest contribute 0.
        self._live = [i for i, g in enumerate(grads) if g is not None and g.requires_grad]
        self.gradient = [
            torch.zeros_like(p) if g is None else g.detach() for g, p in zip(grads, self.params)
        ]
        self.numel = sum(p.numel() for p in self.params)

    def _init_fwd_rev(self, loss, module: Optional[nn.Module]) -> None:
        if isinstance(loss, Tensor) or not callable(loss):
            raise TypeError(
                "mode='fwd_rev' re-runs the loss for every product (forward over reverse): give a "
                "zero-argument callable returning the scalar loss (e.g. lambda: model.loss(x, y)), "
                f"not a {type(loss).__name__}; or use mode='rev_rev' with a loss tensor"
            )
        self._module, self._module_names = None, None
        if module is not None:
            if not isinstance(module, nn.Module):
                raise TypeError(f"module must be an nn.Module, got {type(module).__name__}")
            owned = {id(p): n for n, p in module.named_parameters()}
            missing = [n for n, p in zip(self.names, self.params) if id(p) not in owned]
            if missing:
                raise ValueError(
                    f"params {_preview(missing)} are not parameters of the module "
                    f"({type(module).__name__}) given for mode='fwd_rev'"
                )
            self._module = module
            self._module_names = [owned[id(p)] for p in self.params]
        for n, p in zip(self.names, self.params):
            if (module is None or self._units is not None) and not p.is_leaf:
                raise ValueError(
                    f"mode='fwd_rev' attaches the direction to each parameter as a forward-mode "
                    f"tangent, which needs leaf tensors; {n} is not a leaf (it has a grad_fn): "
                    "pass the leaf tensors the loss is computed from, or use mode='rev_rev'"
                )
        self._loss_fn = loss
        self._fwd_grad: Optional[List[Optional[Tensor]]] = None
        self.numel = sum(p.numel() for p in self.params)

    def __getattr__(self, name: str):
        # fwd_rev: gradient and reached come from a loss call (the latest product's, or one
        # plain gradient pass when read first); rev_rev sets them as attributes.
        if name in ("gradient", "reached") and self.__dict__.get("mode") == "fwd_rev":
            if self.__dict__.get("_fwd_grad") is None:
                with torch.enable_grad(), self._units_context():
                    loss = self._loss_fn()
                _check_loss(loss)
                self._fwd_grad = [None if g is None else g.detach() for g in
                                  torch.autograd.grad(loss, self.params, allow_unused=True)]
            grads = self._fwd_grad
            if name == "reached":
                return [g is not None for g in grads]
            return [torch.zeros_like(p) if g is None else g for g, p in zip(grads, self.params)]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __len__(self) -> int:
        return len(self.params)

    def _check_vecs(self, vecs) -> List[Tensor]:
        if isinstance(vecs, Tensor):
            vecs = [vecs]
        elif isinstance(vecs, Mapping):
            missing = [n for n in self.names if n not in vecs]
            extra = [n for n in vecs if n not in self.names]
            if missing or extra:
                raise ValueError(
                    f"vecs keys must be the parameter names; missing {missing}, unexpected {extra}"
                )
            vecs = [vecs[n] for n in self.names]
        elif isinstance(vecs, (list, tuple)):
            vecs = list(vecs)
        else:
            raise TypeError(
                f"vecs must be a Tensor, a list/tuple of Tensors or a {{name: Tensor}} mapping, got {type(vecs).__name__}"
            )
        if len(vecs) != len(self.params):
            raise ValueError(
                f"got {len(vecs)} vectors for {len(self.params)} parameters: give one vector per "
                f"parameter, of its shape (parameters: {_preview(self.names)})"
            )
        out = []
        for n, v, p in zip(self.names, vecs, self.params):
            if not isinstance(v, Tensor):
                raise TypeError(f"the vector for {n} must be a torch.Tensor, got {type(v).__name__}")
            if v.shape != p.shape:
                raise ValueError(
                    f"the vector for {n} has shape {tuple(v.shape)}, but the parameter has shape {tuple(p.shape)}"
                )
            if v.device != p.device:
                raise ValueError(f"the vector for {n} is on {v.device}, the parameter on {p.device}")
            if v.is_complex():
                raise TypeError(f"the vector for {n} is complex ({v.dtype}); give a real tensor")
            out.append(v.detach().to(p.dtype))  # integer probes (e.g. ±1) are cast
        return out

    def mv(self, vecs) -> List[Tensor]:
        """H v: one tensor per parameter, of its shape and dtype.

        ``vecs``: one tensor per parameter, of its shape (a list in parameter order, a
        ``{name: tensor}`` mapping, or one tensor when there is one parameter).
        """
        vecs = self._check_vecs(vecs)
        if self.mode == "fwd_rev":
            return self._mv_fwd_rev(vecs)
        out = [torch.zeros_like(p) for p in self.params]
        if not self._live:
            return out
        with torch.enable_grad():
            hv = second_order_grad(
                [self._grads[i] for i in self._live],
                self.params,
                grad_outputs=[vecs[i] for i in self._live],
                retain_graph=True,
                allow_unused=True,
            )
        return [o if h is None else h.detach() for o, h in zip(out, hv)]

    def _mv_fwd_rev(self, vecs: List[Tensor]) -> List[Tensor]:
        """H v as the tangent of ∇L in direction v (forward over reverse)."""
        if self._module is not None and self._units is None:
            return self._mv_func(vecs)
        # v attached to each parameter in place as its forward-mode tangent at a fresh dual
        # level (removed when the level closes); the loss is re-run and a plain gradient taken.
        # With recompute, the units keep only their inputs and recompute in the backward pass.
        out, grads = [], []
        with forward_ad.dual_level(), self._units_context(), forward_over_reverse():
            with torch.no_grad():
                for p, v in zip(self.params, vecs):
                    p.copy_(forward_ad.make_dual(p.detach().clone(), v))
            with torch.enable_grad():
                loss = self._loss_fn()
            _check_loss(loss)
            gs = torch.autograd.grad(loss, self.params, allow_unused=True)
            for g, p in zip(gs, self.params):
                if g is None:
                    grads.append(None)
                    out.append(torch.zeros_like(p))
                    continue
                primal, tangent = forward_ad.unpack_dual(g)
                grads.append(primal.detach())
                out.append(torch.zeros_like(p) if tangent is None else tangent.detach().clone())
        self._fwd_grad = grads
        return out

    def _mv_func(self, vecs: List[Tensor]) -> List[Tensor]:
        """torch.func.jvp of torch.func.grad, the module's parameters swapped for the
        transformed ones while the loss callable runs."""
        call = _LossCall(self._module, self._loss_fn)
        keys = ["module." + n for n in self._module_names]

        def loss_of(*ps):
            loss = torch.func.functional_call(call, dict(zip(keys, ps)), ())
            _check_loss_shape(loss)
            return loss

        def grad_of(*ps):
            return torch.func.grad(loss_of, argnums=tuple(range(len(ps))))(*ps)

        with torch.enable_grad():
            g, hv = torch.func.jvp(grad_of, tuple(p.detach() for p in self.params), tuple(vecs))
        self._fwd_grad = [x.detach() for x in g]
        return [h.detach() for h in hv]

    __call__ = mv

    def dot(self, a: Sequence[Tensor], b: Sequence[Tensor]) -> float:
        """⟨a, b⟩ summed over all parameters, in float64."""
        return float(sum((x.double() * y.double()).sum() for x, y in zip(a, b)))


class _LossCall(nn.Module):
    """Wraps a zero-argument loss callable that reads ``module``'s parameters, so that
    ``torch.func.functional_call`` can swap them while it runs."""

    def __init__(self, module: nn.Module, fn: Callable[[], Tensor]):
        super().__init__()
        self.module = module
        self.fn = fn

    def forward(self) -> Tensor:
        return self.fn()


def _check_loss_shape(loss) -> None:
    if not isinstance(loss, Tensor):
        raise TypeError(f"the loss callable must return a scalar torch.Tensor, got {type(loss).__name__}")
    if loss.numel() != 1:
        raise ValueError(f"loss must be a scalar (one element), got shape {tuple(loss.shape)}; reduce it (.mean())")


def _check_loss(loss) -> None:
    if not isinstance(loss, Tensor):
        raise TypeError(f"loss must be a scalar torch.Tensor (or a callable returning one), got {type(loss).__name__}")
    if loss.numel() != 1:
        raise ValueError(f"loss must be a scalar (one element), got shape {tuple(loss.shape)}; reduce it (.mean())")
    if not loss.requires_grad:
        raise ValueError(
            "loss does not require grad: compute it with grad enabled (not under torch.no_grad()) "
            "from parameters that require grad"
        )


def _check_mode(mode) -> str:
    if mode not in MODES:
        raise ValueError(
            f"mode must be one of {MODES} (reverse over reverse, or forward over reverse), got {mode!r}"
        )
    return mode


def _operator(loss: LossLike, params: Optional[ParamsLike], mode: Optional[str] = None,
              module: Optional[nn.Module] = None, recompute: Recompute = None) -> HessianOperator:
    if isinstance(loss, HessianOperator):
        if params is not None:
            raise ValueError("give params only with a loss, not with a HessianOperator (it has its own)")
        if mode is not None and _check_mode(mode) != loss.mode:
            raise ValueError(f"mode={mode!r} differs from the HessianOperator's mode {loss.mode!r}")
        if recompute is not None:
            raise ValueError("give recompute when building the HessianOperator, not with it")
        return loss
    if params is None:
        raise TypeError("params is required when loss is a tensor or a callable")
    return HessianOperator(loss, params, mode="rev_rev" if mode is None else mode, module=module,
                           recompute=recompute)


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
    bar = _progress(n_samples, "hutchinson diag", progress)
    for _ in range(n_samples):
        z = probe_like(op.params, probe, generator)
        for a, zi, hz in zip(acc, z, op.mv(z)):
            a.add_(zi.to(a.dtype) * hz.to(a.dtype))
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
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
    for s in range(n_samples):
        z = probe_like(op.params, probe, generator)
        total += op.dot(z, op.mv(z))
        if bar is not None:
            bar.update(1)
            bar.set_postfix(trace=f"{total / (s + 1):.4g}")
    if bar is not None:
        bar.close()
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
