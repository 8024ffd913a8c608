"""The base of :class:`~ttt_flash.second_order.optim.SophiaH` and
:class:`~ttt_flash.second_order.optim.AdaHessian`: refreshing a Hutchinson estimate of the
Hessian diagonal (from ``p.grad``'s graph, a closure or a loss), averaging it across processes,
and every update split into a host part and a device part for ``capturable=True``.

The user-facing API (how to refresh, capturable steps) is described in
:mod:`ttt_flash.second_order.optim`.

Imports torch, :mod:`ttt_flash.second_order.hessian` and :mod:`ttt_flash.distributed`.
"""

from __future__ import annotations

import math
import numbers
from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch import Tensor

from ..distributed.data_parallel import all_reduce_mean_, broadcast_
from .hessian import PROBES, HessianOperator, probe_like

__all__ = ["HessianOptimizer", "accumulate_samples"]


def _check_real(name: str, value, lo: float, hi: float = math.inf, *, lo_open: bool = False, hi_open: bool = False):
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a float, got {type(value).__name__}")
    value = float(value)
    bad_lo = value <= lo if lo_open else value < lo
    bad_hi = value >= hi if hi_open else value > hi
    if not math.isfinite(value) or bad_lo or bad_hi:
        interval = f"{'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"
        raise ValueError(f"{name} must be in {interval}, got {value}")
    return value


def _check_betas(betas) -> Tuple[float, float]:
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise TypeError(f"betas must be a pair (beta1, beta2), got {betas!r}")
    return (
        _check_real("betas[0]", betas[0], 0.0, 1.0, hi_open=True),
        _check_real("betas[1]", betas[1], 0.0, 1.0, hi_open=True),
    )


def _check_k(k) -> int:
    if isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 1:
        raise ValueError(f"k (refresh the Hessian estimate every k steps) must be an int >= 1, got {k!r}")
    return int(k)


def _batched(pairs: List[Tuple[dict, Tensor]], items: List, by_item: bool = False):
    """``(group, params, items)`` for the (group, parameter) ``pairs`` and their ``items``,
    batched by param group, dtype and device (``by_item``: by group and item identity, the
    item being the shared tuple of step scalars, itself one per group, dtype and device),
    in the order of first appearance. With ``by_item`` the third element is that one item."""
    batches: Dict[tuple, list] = {}
    for (group, p), item in zip(pairs, items):
        key = (id(group), id(item)) if by_item else (id(group), p.dtype, p.device)
        batch = batches.get(key)
        if batch is None:
            batch = batches[key] = [group, [], item if by_item else []]
        batch[1].append(p)
        if not by_item:
            batch[2].append(item)
    return [tuple(b) for b in batches.values()]


def accumulate_samples(acc: List[Optional[Tensor]], live: List[int], z: List[Tensor], hz: List[Tensor]) -> None:
    """``acc[i] += z[i] ∘ hz[i]`` for each i in ``live`` (the first sample stored as is), with
    ``torch._foreach_*``: the Hutchinson samples of all parameters in a few kernels."""
    if not live:
        return
    samples = torch._foreach_mul([z[i] for i in live], [hz[i] for i in live])
    if acc[live[0]] is None:
        for i, sample in zip(live, samples):
            acc[i] = sample
    else:
        torch._foreach_add_([acc[i] for i in live], samples)


class HessianOptimizer(torch.optim.Optimizer):
    """Base of :class:`SophiaH` and :class:`AdaHessian`: the Hessian-refresh machinery.

    Subclasses define :meth:`_absorb_hessians` (fold diagonal estimates into the state)
    and :meth:`_update_group` (the step of a param group's parameters of one dtype and
    device, with ``torch._foreach_*`` operations). Every param group has ``k`` (refresh every
    k steps) and ``probe`` (:data:`ttt_flash.second_order.PROBES`).
    """

    _hessian_state_key = "hessian"

    def __init__(self, params, defaults: dict):
        defaults = dict(defaults)
        defaults["k"] = _check_k(defaults["k"])
        if defaults["probe"] not in PROBES:
            raise ValueError(f"probe must be one of {PROBES}, got {defaults['probe']!r}")
        if not isinstance(defaults.get("capturable", False), bool):
            raise TypeError(f"capturable must be a bool, got {type(defaults['capturable']).__name__}")
        defaults.setdefault("capturable", False)
        super().__init__(params, defaults)
        # Host-side mirror of the device step counters of capturable groups: param -> [step,
        # hessian_step]. Filled from the state once (one read per parameter) after a load.
        self._host: Dict[Tensor, List[int]] = {}
        # The step's scalars (learning-rate and bias-correction terms) as 0-dim tensors on the
        # parameters' devices, written in place by the host before every update:
        # (group index, dtype, device, slot) -> tuple of tensors.
        self._scalars: Dict[tuple, Tuple[Tensor, ...]] = {}
        self._prepared: Optional[List[Tuple[Tensor, ...]]] = None
        self._skip_update = False

    def load_state_dict(self, state_dict: dict) -> None:
        capturable = [g["capturable"] for g in self.param_groups]
        # torch casts every floating state tensor but ``step`` to its parameter's dtype: keep
        # the saved Hessian counter as saved (a bf16 counter stops counting at 256).
        saved = {pid: s["hessian_step"] for pid, s in state_dict["state"].items() if "hessian_step" in s}
        super().load_state_dict(state_dict)
        ids = [pid for g in state_dict["param_groups"] for pid in g["params"]]
        by_id = dict(zip(ids, (p for g in self.param_groups for p in g["params"])))
        for pid, value in saved.items():
            if by_id.get(pid) in self.state:
                self.state[by_id[pid]]["hessian_step"] = value
        with torch.no_grad():
            for group, flag in zip(self.param_groups, capturable):
                group["capturable"] = flag  # the flag this optimizer was built with, not the checkpoint's
                for p in group["params"]:
                    state = self.state.get(p)
                    if not state:
                        continue
                    for key in ("step", "hessian_step"):
                        value = state[key]
                        if flag:
                            state[key] = torch.as_tensor(value, dtype=torch.float32).to(p.device).clone()
                        elif isinstance(value, Tensor):
                            state[key] = int(value.item())
        self._host = {}
        self._scalars = {}
        self._prepared = None

    # ------------------------------------------------------------------ schedule

    def _counts(self, group, p) -> List[int]:
        """[step, hessian_step] of ``p`` on the host: the state's ints, or for a capturable
        group the host mirror of its device counters (read from them once after a load)."""
        state = self.state.get(p)
        if not group["capturable"]:
            return [int(state["step"]), int(state["hessian_step"])] if state else [0, 0]
        counts = self._host.get(p)
        if counts is None:
            counts = [int(state["step"]), int(state["hessian_step"])] if state else [0, 0]
            self._host[p] = counts
        return counts

    def _group_steps(self, group) -> int:
        for p in group["params"]:
            if self.state.get(p):
                return self._counts(group, p)[0]
        return 0

    @property
    def hessian_due(self) -> bool:
        """Whether the next :meth:`step` is one where the Hessian estimate is refreshed:
        steps 0, k, 2k, ... (counted before the step) of any param group."""
        return any(self._group_steps(g) % g["k"] == 0 for g in self.param_groups)

    def _capturable_param(self, p: Tensor) -> bool:
        return any(g["capturable"] for g in self.param_groups if any(q is p for q in g["params"]))

    def _init_state(self, p: Tensor) -> dict:
        state = self.state[p]
        if not state:
            if self._capturable_param(p):  # device counters: a captured step advances them
                state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                state["hessian_step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                self._host[p] = [0, 0]
            else:
                state["step"] = 0
                state["hessian_step"] = 0
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state[self._hessian_state_key] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state

    # ------------------------------------------------------------------ Hessian

    def _trainable(self) -> List[Tuple[dict, Tensor]]:
        return [(g, p) for g in self.param_groups for p in g["params"] if p.requires_grad]

    def param_pairs(self) -> List[Tuple[dict, Tensor]]:
        """(param group, parameter) pairs of every parameter that requires grad, in the
        groups' order: the ``pairs`` of :meth:`host_step` / :meth:`device_step`."""
        return self._trainable()

    def update_hessian(
        self,
        loss: Optional[Tensor] = None,
        *,
        n_samples: int = 1,
        generator: Optional[torch.Generator] = None,
        weight: Optional[float] = None,
        mode: str = "rev_rev",
        module: Optional[torch.nn.Module] = None,
        recompute=None,
    ) -> None:
        """Refresh the Hessian-diagonal estimate with ``n_samples`` Hutchinson probes.

        Args:
            loss: ``None``: use the graph carried by ``p.grad`` (after
                ``loss.backward(create_graph=True)``); the gradients are detached afterwards.
                A scalar loss tensor: take ∇loss with ``create_graph=True`` internally
                (``p.grad`` untouched).
            n_samples: probes averaged into this refresh.
            generator: random generator for the probes (default: the global one).
            weight: with several :mod:`torch.distributed` processes, this process's share of
                the global batch (``None``: equal shares). The probes are rank 0's
                (broadcast) and the estimates are averaged over processes with these
                weights: the estimate of the global-batch loss. Ignored in one process.
            mode: ``"rev_rev"`` (default: the products go through a ``create_graph`` graph)
                or ``"fwd_rev"`` (forward over reverse, no such graph: ``loss`` must be a
                zero-argument callable, re-run for each probe; :mod:`ttt_flash.second_order`).
            module: ``"fwd_rev"``: the module owning the parameters (products through
                ``torch.func``; see :class:`ttt_flash.second_order.HessianOperator`).
            recompute: ``"fwd_rev"`` only: submodule names of ``module`` (e.g.
                ``"blocks"``) whose calls are recomputation units: each keeps only its inputs
                and their tangents and is recomputed in the backward pass, so the peak memory
                of a product is a few blocks' activations (:mod:`ttt_flash.second_order.recomputation`).

        Only parameters the loss reaches are refreshed. Runs regardless of
        :attr:`hessian_due` (you decide when); does not count as a step.

        Raises:
            ValueError: ``loss=None`` and no ``p.grad`` carries a graph.
        """
        pairs = self._trainable()
        if recompute is not None and mode != "fwd_rev":
            raise ValueError(
                "update_hessian(recompute=...) needs mode='fwd_rev' (reverse over reverse keeps "
                "the whole create_graph graph, recomputed or not)"
            )
        if mode == "fwd_rev":
            if loss is None or isinstance(loss, Tensor) or not callable(loss):
                raise ValueError(
                    "update_hessian(mode='fwd_rev') re-runs the loss for every probe: pass a "
                    "zero-argument callable returning it, e.g. update_hessian(lambda: model.loss(x, y), "
                    "mode='fwd_rev')"
                )
            if not pairs:
                raise ValueError("the optimizer has no parameter that requires grad")
            op = HessianOperator(loss, [p for _, p in pairs], mode="fwd_rev", module=module,
                                recompute=recompute)
        elif loss is None:
            pairs = [(g, p) for g, p in pairs if p.grad is not None]
            if not pairs:
                raise ValueError(
                    "update_hessian() found no gradients: call loss.backward(create_graph=True) "
                    "first, or pass the loss: update_hessian(loss)"
                )
            grads = [p.grad for _, p in pairs]
            if not any(gr.requires_grad for gr in grads):
                raise ValueError(
                    "update_hessian() needs the loss graph, but p.grad carries none: run "
                    "loss.backward(create_graph=True) (not plain loss.backward()) before it, or pass "
                    "the loss: update_hessian(loss)"
                )
            op = HessianOperator.from_grads(grads, [p for _, p in pairs])
        else:
            if not pairs:
                raise ValueError("the optimizer has no parameter that requires grad")
            op = HessianOperator(loss, [p for _, p in pairs])
        if isinstance(n_samples, bool) or not isinstance(n_samples, numbers.Integral) or n_samples < 1:
            raise ValueError(f"n_samples must be an int >= 1, got {n_samples!r}")

        live = None
        acc = [None] * len(pairs)
        for _ in range(n_samples):
            z = [probe_like([p], g["probe"], generator)[0] for g, p in pairs]
            broadcast_(z)  # distributed: every process uses rank 0's probes (no-op otherwise)
            hz = op.mv(z)
            if live is None:  # after a product: fwd_rev learns what the loss reaches from it
                live = [i for i, r in enumerate(op.reached) if r]
            accumulate_samples(acc, live, z, hz)
        # Distributed: the weighted mean of the local estimates (same probes) is the estimate
        # for the global batch. No-op in one process.
        all_reduce_mean_([acc[i] for i in live], weight)
        with torch.no_grad():
            for i in live:
                group, p = pairs[i]
                self._init_state(p)
            self.host_refresh([pairs[i] for i in live])
            if n_samples > 1 and live:
                torch._foreach_div_([acc[i] for i in live], float(n_samples))
            self.device_refresh([pairs[i] for i in live], [acc[i] for i in live])
        del op
        if loss is None:
            for _, p in pairs:
                if p.grad is not None and p.grad.requires_grad:
                    p.grad = p.grad.detach()

    def _absorb_hessians(self, group: dict, params: List[Tensor], states: List[dict], diags: List[Tensor]) -> None:
        """Fold the diagonal estimates ``diags`` into the states of ``params`` (one param
        group, dtype and device)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ host / device split
    #
    # An update is a host part (counters, checks, the step's scalars written into 0-dim
    # device tensors) and a device part (only tensor operations: no .item(), no branch on
    # tensor values), so that the device part can be captured in a CUDA graph and replayed
    # after the host part of each step (ttt_flash.lightning.lm.LanguageModel(cuda_graph=True)).
    # step() runs both; the eager and the captured update run the same kernels.

    def host_refresh(self, pairs: List[Tuple[dict, Tensor]]) -> None:
        """Host part of a Hessian refresh of ``pairs`` ((group, param) pairs): their states
        exist and, for capturable groups, the host mirror counts the refresh."""
        for group, p in pairs:
            self._init_state(p)
            if group["capturable"]:
                self._counts(group, p)[1] += 1

    def device_refresh(self, pairs: List[Tuple[dict, Tensor]], diags: List[Tensor]) -> None:
        """Device part of a Hessian refresh: fold each diagonal estimate (shaped like its
        parameter) into the state and count it (``hessian_step``). Capturable; the parameters
        of one group, dtype and device are folded together (``torch._foreach_*``: a few
        kernels per group, not a few per parameter)."""
        with torch.no_grad():
            for group, params, items in _batched(pairs, diags):
                states = [self.state[p] for p in params]
                self._absorb_hessians(group, params, states, items)
                if group["capturable"]:
                    torch._foreach_add_([s["hessian_step"] for s in states], 1.0)
                else:
                    for s in states:
                        s["hessian_step"] += 1

    def _host_scalars(self, group: dict, step: int, hessian_step: int) -> Tuple[float, ...]:
        """The step's scalars of a parameter at (step, hessian_step), as Python floats."""
        raise NotImplementedError

    def host_step(self, pairs: List[Tuple[dict, Tensor]]) -> None:
        """Host part of an update of ``pairs`` ((group, param) pairs): checks that each has a
        Hessian estimate, advances the step counters (the host ones; a capturable group's
        device counters advance in :meth:`device_step`) and writes the step's scalars
        (learning rate, weight-decay factor, bias corrections) into 0-dim tensors on the
        parameters' devices, in place (``fill_``: no synchronisation).

        Raises:
            RuntimeError: a parameter to update has no Hessian estimate yet.
        """
        index = {id(g): i for i, g in enumerate(self.param_groups)}
        slots: Dict[tuple, tuple] = {}
        prepared = []
        for group, p in pairs:
            state = self._init_state(p)
            counts = self._counts(group, p)
            if counts[1] == 0:
                raise RuntimeError(
                    f"{type(self).__name__}.step(): a parameter of shape {tuple(p.shape)} has no "
                    "Hessian estimate yet. Refresh it before the first step: "
                    "loss.backward(create_graph=True) then step() (refreshed when hessian_due), "
                    "or optimizer.update_hessian() / update_hessian(loss) (see ttt_flash.second_order.optim)"
                )
            if group["capturable"]:
                counts[0] += 1
            else:
                state["step"] += 1
                counts[0] += 1
            gi = index[id(group)]
            key = (gi, p.dtype, p.device, counts[0], counts[1])
            if key not in slots:  # one set of scalars per distinct (group, dtype, device, counts)
                slot = sum(1 for k in slots if k[:3] == key[:3])
                cache_key = (gi, p.dtype, p.device, slot)
                values = self._host_scalars(group, counts[0], counts[1])
                tensors = self._scalars.get(cache_key)
                if tensors is None:
                    tensors = tuple(torch.zeros((), dtype=p.dtype, device=p.device) for _ in values)
                    self._scalars[cache_key] = tensors
                for t, v in zip(tensors, values):
                    t.fill_(v)
                slots[key] = tensors
            prepared.append(slots[key])
        self._prepared = prepared

    def device_step(self, pairs: List[Tuple[dict, Tensor]]) -> None:
        """Device part of the update of ``pairs`` (after :meth:`host_step` on the same
        pairs): advances a capturable group's device step counters and updates every
        parameter from ``p.grad`` with the scalars :meth:`host_step` wrote. Only tensor
        operations: capturable in a CUDA graph, replayed after each step's
        :meth:`host_step`. The parameters that share a param group and the step's scalars
        (hence dtype and device) are updated together with ``torch._foreach_*`` operations."""
        if self._prepared is None or len(self._prepared) != len(pairs):
            raise RuntimeError(f"{type(self).__name__}.device_step() needs host_step() on the same parameters first")
        with torch.no_grad():
            for group, params, scalars in _batched(pairs, self._prepared, by_item=True):
                states = [self.state[p] for p in params]
                if group["capturable"]:
                    torch._foreach_add_([s["step"] for s in states], 1.0)
                self._update_group(group, params, [p.grad for p in params], states, scalars)

    def skip_next_update(self) -> None:
        """The next :meth:`step` only runs its closure (and returns its loss): this step's
        update already ran, e.g. in a replayed CUDA graph after :meth:`host_step`."""
        self._skip_update = True

    # ------------------------------------------------------------------ step

    def _update_group(self, group: dict, params: List[Tensor], grads: List[Tensor], states: List[dict],
                      scalars: Tuple[Tensor, ...]) -> None:
        """Update ``params`` (one param group, dtype and device) from ``grads`` with the
        step's ``scalars`` (0-dim tensors written by :meth:`host_step`)."""
        raise NotImplementedError

    def step(self, closure: Optional[Callable[[], Tensor]] = None):
        """One update of every parameter with a gradient; returns the closure's loss.

        If the Hessian estimate is due (:attr:`hessian_due`) and ``p.grad`` carries a graph
        (backward ran with ``create_graph=True``), the estimate is refreshed first. Any graph
        on ``p.grad`` is dropped before the update.

        Raises:
            RuntimeError: a parameter to update has no Hessian estimate yet.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._skip_update:
            self._skip_update = False
            return loss
        pairs = [(g, p) for g, p in self._trainable() if p.grad is not None]
        if any(p.grad.requires_grad for _, p in pairs):
            if self.hessian_due:
                self.update_hessian()
            else:
                for _, p in pairs:
                    p.grad = p.grad.detach()
        for _, p in pairs:
            if p.grad.is_sparse:
                raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
        with torch.no_grad():
            self.host_step(pairs)
            self.device_step(pairs)
        return loss
