"""The Hessian operator of one loss: v ↦ H v in the two :data:`MODES` (reverse over reverse,
forward over reverse), parameters chosen by name (:func:`select_params`) and random probes
(:func:`probe_like`). The estimators built on it are in :mod:`ttt_flash.second_order.estimators`;
the package docstring (:mod:`ttt_flash.second_order`) describes both modes."""

from __future__ import annotations

import contextlib
import numbers
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Union

import torch
from torch import Tensor, nn

from torch.autograd import forward_ad

from .._select import Selector, preview as _preview, select_names
from .recomputation import forward_over_reverse, recomputed, unit_modules
from .grad import second_order_grad

__all__ = ["HessianOperator", "select_params", "probe_like", "PROBES", "MODES"]

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
        """The :func:`~ttt_flash.second_order.recomputation.recomputed` context of the operator's units
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
