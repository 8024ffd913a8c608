"""Exact second order on models sharded with FSDP2 (``torch.distributed.fsdp.fully_shard``).

FSDP2 keeps every parameter as a DTensor shard and all-gathers the full parameter only around
each sharded module's forward and backward. A gradient of a gradient (a Hessian-vector
product, the Sophia-H / AdaHessian refresh, a second-order MAML meta-gradient) differentiates
the first backward's graph, which holds the full parameters: after FSDP2's default
post-backward resharding their storage is freed, and FSDP2's reduce-scatter writes the sharded
gradient outside autograd, so there is nothing to differentiate through.

The route taken here uses FSDP2's own controls. For the length of one second-order step,
:func:`unsharded` all-gathers every sharded module's parameters (``FSDPModule.unshard``),
switches resharding after forward and after backward off and FSDP2's gradient reduction off
(``set_reshard_after_forward(False)``, ``set_reshard_after_backward(False)``,
``set_requires_gradient_sync(False)``). Inside the block the model's parameters are the
full tensors, so every second-order computation runs on this process's batch exactly as in
one process. The block then reduces what the step produced (gradients, Hessian-vector
products, Hutchinson estimates) to each process's shard with one reduce-scatter per tensor
(a DTensor ``Partial → Shard`` redistribution), weighted by each process's share of the
global batch. On leaving the block the settings are restored and the parameters resharded.

Memory: inside the block every process holds the full parameters (as DDP does, 2 bytes per
parameter in bf16, 4 in fp32) and the step's full-size gradients and products; outside it
(plain steps, the optimizer state, the gradients between steps) everything stays sharded.
Only the steps that need second order pay: with Sophia-H refreshing every k steps, k − 1 of
k steps run under FSDP2's usual full sharding. docs/distributed.md compares the memory per
GPU with DDP.

Public names:

* :func:`unsharded`: the context manager above; yields an :class:`Unsharded`.
* :class:`Unsharded`: ``params`` (full tensors, ``{name: tensor}``), ``sharded`` (the DTensor
  parameters the optimizer holds), :meth:`~Unsharded.gather`, :meth:`~Unsharded.shard`,
  :meth:`~Unsharded.reduce_gradients`.
* :func:`hvp`: a Hessian-vector product of the global loss, vectors and result sharded like
  the parameters.
* :func:`update_hessian`: the Sophia-H / AdaHessian refresh from the graph that
  ``loss.backward(create_graph=True)`` left on the full parameters' ``.grad``.
* :func:`shard_blocks`: ``fully_shard`` on each block of a ModuleList and on the model.
* :func:`check_fsdp2`: the sharded modules of a model, or a clear error for what cannot work
  (FSDP1 wrappers, CPU offload, a mesh of more than one dimension).

Example (every process; ``model`` sharded with :func:`shard_blocks`, ``opt`` a
:class:`ttt_flash.second_order.optim.SophiaH` built on the sharded parameters)::

    with unsharded(model) as full:
        loss = model.loss(x, y)
        loss.backward(create_graph=True)        # graph on the full parameters' .grad
        update_hessian(opt, full, weight=x.numel())
        full.reduce_gradients(weight=x.numel())  # sharded .grad of the global-batch loss
    opt.step()

A second-order MAML step: ``fast = inner_loop(model, full.params, ...)``, the query loss's
``backward()`` and ``full.reduce_gradients(weight=tasks)`` inside the block.
"""

from __future__ import annotations

import contextlib
import numbers
from typing import Dict, Iterator, List, Mapping, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch import Tensor, nn

from .distributed import broadcast_
from .second_order.hessian import HessianOperator, probe_like
from .second_order.hessian_optimizer import HessianOptimizer

__all__ = ["unsharded", "Unsharded", "hvp", "update_hessian", "shard_blocks", "check_fsdp2", "fsdp_modules"]

_USE_INSTEAD = ("shard the model with torch.distributed.fsdp.fully_shard (FSDP2; ttt_flash.fsdp.shard_blocks), "
                "or train with DDP (docs/distributed.md)")


def _fsdp2():
    from torch.distributed.fsdp import FSDPModule, fully_shard

    return FSDPModule, fully_shard


def fsdp_modules(model: nn.Module) -> List[nn.Module]:
    """The modules of ``model`` (itself included) that ``fully_shard`` has sharded, in module order."""
    FSDPModule, _ = _fsdp2()
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def _groups(module) -> list:
    """FSDP2's parameter groups of one sharded module (one per ``fully_shard`` call)."""
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:  # torch releases with one group per state
        group = getattr(state, "_fsdp_param_group", None)
        groups = [] if group is None else [group]
    return list(groups)


def check_fsdp2(model: nn.Module) -> List[nn.Module]:
    """The FSDP2-sharded modules of ``model``; a clear error for what the second-order paths
    cannot take.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``, or holds FSDP1
            (``FullyShardedDataParallel``) wrappers.
        ValueError: nothing is sharded with ``fully_shard``; a sharded module offloads its
            parameters to the CPU; a mesh has more than one dimension (HSDP).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    from torch.distributed.fsdp import FullyShardedDataParallel

    if any(isinstance(m, FullyShardedDataParallel) for m in model.modules()):
        raise TypeError(
            "model holds FullyShardedDataParallel (FSDP1) wrappers, whose flat parameters and "
            "hooks cannot take gradients of gradients: " + _USE_INSTEAD)
    mods = fsdp_modules(model)
    if not mods:
        raise ValueError("model has no module sharded with torch.distributed.fsdp.fully_shard: call "
                         "fully_shard (e.g. ttt_flash.fsdp.shard_blocks(model)) first, or use the "
                         "one-process functions of ttt_flash.second_order / ttt_flash.meta")
    from torch.distributed.fsdp import CPUOffloadPolicy

    for m in mods:
        for g in _groups(m):
            if isinstance(getattr(g, "offload_policy", None), CPUOffloadPolicy):
                raise ValueError(
                    f"{type(m).__name__} is sharded with offload_policy=CPUOffloadPolicy(): a "
                    "second-order step keeps the full parameters on the device through its double "
                    "backward, which CPU offload cannot serve; shard without offload_policy (the "
                    "memory per GPU is in docs/distributed.md), or use DDP")
            mesh = getattr(g.mesh_info, "mesh", None)
            if mesh is not None and mesh.ndim != 1:
                raise ValueError(
                    f"{type(m).__name__} is sharded over a {mesh.ndim}-D mesh (HSDP or FSDP with "
                    "tensor parallelism); the second-order paths support a 1-D data-parallel mesh: "
                    "pass fully_shard(mesh=mesh['data_parallel']) or a 1-D mesh")
    return mods


def shard_blocks(model: nn.Module, blocks: str = "blocks", *, mesh=None,
                 reshard_after_forward: bool = True) -> nn.Module:
    """``fully_shard`` each child of the ModuleList ``model.<blocks>`` and then ``model`` itself
    (its remaining parameters: embeddings, final norm, head); returns ``model``.

    Args:
        model: e.g. :class:`ttt_flash.models.GPT` (blocks ``"blocks"``).
        blocks: name (dotted for a nested one, e.g. ``"gpt.blocks"``) of the ModuleList whose
            children are sharded one by one (one all-gather per block); ``None``: only
            ``model`` as one unit.
        mesh: a 1-D ``DeviceMesh`` (None: all processes of the default group).
        reshard_after_forward: FSDP2's policy for plain (first-order) steps: ``True`` frees
            each block's full parameters after its forward (least memory; all-gathered again
            in the backward), ``False`` keeps them until after the backward.
    """
    _, fully_shard = _fsdp2()
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if not isinstance(reshard_after_forward, bool):
        raise TypeError(f"reshard_after_forward must be a bool, got {type(reshard_after_forward).__name__}")
    if blocks is not None:
        try:
            units = model.get_submodule(blocks)
        except AttributeError:
            units = None
        if not isinstance(units, nn.ModuleList):
            raise ValueError(f"model.{blocks} is not an nn.ModuleList ({type(model).__name__} has "
                             f"{type(units).__name__}); pass blocks= the name of its list of blocks, or None")
        for block in units:
            fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward)
    return model


class Unsharded:
    """The full parameters of a sharded model inside :func:`unsharded`, and the reductions
    back to the shards.

    Attributes:
        params: ``{name: full tensor}`` of the parameters that require grad, as the modules
            compute with them inside the block (pass to :func:`ttt_flash.meta.inner_loop`,
            :class:`ttt_flash.second_order.HessianOperator`, ...).
        sharded: ``{name: DTensor parameter}``, the same names: what the optimizer holds.
    """

    def __init__(self, sharded: Dict[str, Tensor], params: Dict[str, Tensor]):
        self.sharded, self.params = sharded, params
        p = next(iter(sharded.values()))
        self.mesh = p.device_mesh
        self.group = self.mesh.get_group()
        # collectives of the reductions' bookkeeping run where the parameters live (NCCL: the GPU)
        self.device = next(iter(params.values())).device if params else torch.device("cpu")

    def _share(self, weight: Optional[float]) -> float:
        """This process's factor ``w_r / Σ_s w_s`` of the weighted mean (``None``: equal shares)."""
        n = dist.get_world_size(self.group)
        if weight is None:
            return 1.0 / n
        if isinstance(weight, bool) or not isinstance(weight, numbers.Real) or not weight >= 0:
            raise ValueError(f"weight must be a number >= 0 (this process's share of the batch), got {weight!r}")
        total = torch.tensor([float(weight)], dtype=torch.float64, device=self.device)
        dist.all_reduce(total, group=self.group)
        if not total.item() > 0:
            raise ValueError("the weights of all processes sum to 0")
        return float(weight) / total.item()

    def gather(self, tensors: Union[Sequence[Tensor], Mapping[str, Tensor]]) -> List[Tensor]:
        """Full tensors, in the order of :attr:`params`, from DTensors sharded like the
        parameters (all-gathered) or from full tensors (kept)."""
        from torch.distributed.tensor import DTensor

        tensors = self._ordered(tensors, "tensors")
        out = []
        for (n, p), t in zip(self.params.items(), tensors):
            full = t.full_tensor() if isinstance(t, DTensor) else t
            if full.shape != p.shape:
                raise ValueError(f"the tensor for {n} has shape {tuple(full.shape)}, the parameter {tuple(p.shape)}")
            out.append(full.detach().to(device=p.device, dtype=p.dtype))
        return out

    def _ordered(self, tensors, what: str) -> list:
        if isinstance(tensors, Mapping):
            missing = [n for n in self.params if n not in tensors]
            if missing:
                raise ValueError(f"{what} lacks the parameters {missing[:5]}")
            return [tensors[n] for n in self.params]
        tensors = list(tensors)
        if len(tensors) != len(self.params):
            raise ValueError(f"got {len(tensors)} {what} for {len(self.params)} parameters")
        return tensors

    def shard(self, tensors: Union[Sequence[Optional[Tensor]], Mapping[str, Tensor]],
              weight: Optional[float] = None) -> List[Optional[Tensor]]:
        """The weighted mean over processes ``Σ_r w_r t_r / Σ_r w_r`` of full-size tensors (one
        per parameter, in the order of :attr:`params`), each returned as this process's
        shard: a DTensor placed like its parameter (one reduce-scatter per tensor). None
        stays None (every process must pass None at the same places).

        ``weight``: this process's share of the global batch (tokens, tasks); ``None``:
        equal shares.
        """
        from torch.distributed.tensor import DTensor, Partial

        tensors = self._ordered(tensors, "tensors")
        share = self._share(weight)
        out = []
        for (n, s), t in zip(self.sharded.items(), tensors):
            if t is None:
                out.append(None)
                continue
            part = DTensor.from_local((t.detach() * share).to(s.dtype), s.device_mesh, [Partial()] * s.device_mesh.ndim)
            red = part.redistribute(s.device_mesh, s.placements)
            if red.to_local().shape != s.to_local().shape:
                raise RuntimeError(f"{n}: the reduced shard has shape {tuple(red.to_local().shape)}, the "
                                   f"parameter's {tuple(s.to_local().shape)} (an uneven sharding this module "
                                   "does not handle)")
            out.append(red)
        return out

    def reduce_gradients(self, weight: Optional[float] = None) -> None:
        """Move the full parameters' ``.grad`` (this process's batch) to the sharded
        parameters' ``.grad``, as the weighted mean over processes (added to a sharded
        gradient already there). The full ``.grad`` are cleared; a parameter without a
        gradient on every process keeps its sharded ``.grad``."""
        has = torch.tensor([p.grad is not None for p in self.params.values()], dtype=torch.int32, device=self.device)
        dist.all_reduce(has, group=self.group)  # a gradient on any process: all take part
        grads = [None if not h else (torch.zeros_like(p) if p.grad is None else p.grad)
                 for h, p in zip(has.tolist(), self.params.values())]
        for (n, s), g in zip(self.sharded.items(), self.shard(grads, weight)):
            if g is None:
                continue
            s.grad = g if s.grad is None else s.grad + g
        for p in self.params.values():
            p.grad = None


def _saved_policy(mods) -> list:
    """What :func:`unsharded` changes, per sharded module and parameter group, to restore it."""
    out = []
    for m in mods:
        state = m._get_fsdp_state()
        groups = [(g, g.post_forward_mesh_info, g.reshard_after_backward, g.reduce_grads) for g in _groups(m)]
        out.append((state, getattr(state, "_auto_reshard_after_forward", None), groups))
    return out


def _restore_policy(saved) -> None:
    for state, auto, groups in saved:
        if auto is not None:
            state._auto_reshard_after_forward = auto
        for g, mesh_info, after_backward, reduce_grads in groups:
            g.post_forward_mesh_info = mesh_info
            g.reshard_after_backward = after_backward
            g.reduce_grads = reduce_grads


#: ids of the models inside an unsharded() block (blocks do not nest)
_HELD: set = set()


@contextlib.contextmanager
def unsharded(model: nn.Module) -> Iterator[Unsharded]:
    """Hold the full parameters of every ``fully_shard``-ed module of ``model`` for one
    second-order step; yields an :class:`Unsharded`.

    On entry: all-gather every sharded module (``unshard()``) and switch off resharding after
    forward and backward and FSDP2's own gradient reduction (which would reduce a gradient
    still carrying its graph and drop the graph). Inside: the model's parameters are the full
    tensors; forward, ``autograd.grad(create_graph=True)``, ``backward(create_graph=True)``
    and backward-over-backward run as in one process on this process's batch, and gradients
    accumulate on the full parameters' ``.grad`` until :meth:`Unsharded.reduce_gradients`.
    On exit (also on an error): the full ``.grad`` are dropped, FSDP2's settings restored
    and the parameters resharded. Every process must enter and leave together.

    Memory inside the block: the full parameters (as under DDP) plus what the step builds.

    Raises:
        TypeError: see :func:`check_fsdp2`.
        ValueError: see :func:`check_fsdp2`.
        RuntimeError: inside another block for the same model (blocks do not nest), or
            under ``torch.inference_mode``.
    """
    from torch.distributed.tensor import DTensor

    mods = check_fsdp2(model)
    if id(model) in _HELD:
        raise RuntimeError(f"{type(model).__name__} is already unsharded by an enclosing unsharded() block: "
                           "use that block's Unsharded (blocks do not nest)")
    if torch.is_inference_mode_enabled():
        raise RuntimeError("unsharded() under torch.inference_mode: the second-order step needs autograd; "
                           "leave inference mode first (with torch.inference_mode(False), torch.enable_grad())")
    for m in mods:  # a no-grad forward under reshard_after_forward=False leaves full weights behind
        m.reshard()
    sharded = {n: p for n, p in model.named_parameters() if p.requires_grad}
    if not sharded:
        raise ValueError(f"{type(model).__name__} has no parameter that requires grad")
    plain = [n for n, p in sharded.items() if not isinstance(p, DTensor)]
    if plain:
        raise RuntimeError(f"parameters {plain[:3]} are not sharded DTensors: they lie outside every "
                           "fully_shard-ed module (call fully_shard on the model itself too: shard_blocks does)")
    saved = _saved_policy(mods)
    params: Dict[str, Tensor] = {}
    _HELD.add(id(model))
    try:
        for m in mods:
            m.set_reshard_after_forward(False, recurse=False)
            m.set_reshard_after_backward(False, recurse=False)
            m.set_requires_gradient_sync(False, recurse=False)
        for m in mods:
            m.unshard()
        params = {n: p for n, p in model.named_parameters() if n in sharded}
        yield Unsharded(sharded, params)
    finally:
        _HELD.discard(id(model))
        for p in params.values():
            p.grad = None
        _restore_policy(saved)
        for m in mods:
            m.reshard()


def hvp(model: nn.Module, loss, vecs, *, weight: Optional[float] = None) -> List[Tensor]:
    """A Hessian-vector product ``∇²L v`` of the global loss ``L = Σ_r w_r L_r / Σ_r w_r``
    over the parameters of a ``fully_shard``-ed model (reverse over reverse, exact).

    Args:
        model: the sharded model (its parameters that require grad, in module order).
        loss: a zero-argument callable returning this process's scalar loss ``L_r`` (run
            once, with the full parameters).
        vecs: v, one tensor per parameter (list in parameter order or ``{name: tensor}``):
            DTensors sharded like the parameters, or full tensors (the same on every process).
        weight: this process's share ``w_r`` of the global batch (``None``: equal shares).

    Returns:
        H v, one DTensor per parameter, sharded like it.
    """
    if isinstance(loss, Tensor) or not callable(loss):
        raise TypeError("loss must be a zero-argument callable returning this process's loss: it runs inside "
                        f"the unsharded step, with the full parameters (got {type(loss).__name__})")
    with unsharded(model) as full:
        v = full.gather(vecs)
        op = HessianOperator(loss, list(full.params.values()))
        return full.shard(op.mv(v), weight)


def update_hessian(optimizer, full: Unsharded, *, n_samples: int = 1,
                   generator: Optional[torch.Generator] = None, weight: Optional[float] = None) -> None:
    """Refresh a :class:`ttt_flash.second_order.optim.SophiaH` / :class:`~ttt_flash.second_order.optim.AdaHessian`
    estimate over a sharded model, inside :func:`unsharded`, after
    ``loss.backward(create_graph=True)``.

    The Hutchinson probes are full-size, drawn on process 0 (from ``generator``, in the
    optimizer's parameter order, as :meth:`~ttt_flash.second_order.optim.HessianOptimizer.update_hessian`
    draws them) and broadcast; each process takes ``z ∘ (H_r z)`` through its own graph; the
    estimates are reduce-scattered as the weighted mean (the estimate for the global batch)
    and folded into the optimizer's sharded state. The full gradients are detached afterwards
    (the graph is freed); reduce them with :meth:`Unsharded.reduce_gradients`.

    Args:
        optimizer: the second-order optimizer, built on the sharded parameters.
        full: the :class:`Unsharded` of the step.
        n_samples: probes averaged into this refresh.
        generator: the probes' random generator (default: the global one).
        weight: this process's share of the global batch (``None``: equal shares).

    Raises:
        ValueError: the optimizer holds parameters that are not the model's, or no full
            gradient carries a graph.
    """
    if not isinstance(optimizer, HessianOptimizer):
        raise TypeError(f"optimizer must be a ttt_flash.second_order.optim.SophiaH or AdaHessian, got {type(optimizer).__name__}")
    if isinstance(n_samples, bool) or not isinstance(n_samples, numbers.Integral) or n_samples < 1:
        raise ValueError(f"n_samples must be an int >= 1, got {n_samples!r}")
    names = {id(s): n for n, s in full.sharded.items()}
    pairs = optimizer._trainable()
    foreign = [tuple(p.shape) for _, p in pairs if id(p) not in names]
    if foreign:
        raise ValueError(f"the optimizer holds {len(foreign)} parameters that are not the sharded model's "
                         f"(shapes {foreign[:3]}): build it on the model's parameters outside unsharded()")
    rows = [(g, p, full.params[names[id(p)]]) for g, p in pairs if full.params[names[id(p)]].grad is not None]
    grads = [u.grad for _, _, u in rows]
    if not any(gr.requires_grad for gr in grads):
        raise ValueError("update_hessian() needs the loss graph on the full parameters' .grad: run "
                         "loss.backward(create_graph=True) inside the same unsharded() block first")
    op = HessianOperator.from_grads(grads, [u for _, _, u in rows])
    acc: List[Optional[Tensor]] = [None] * len(rows)
    live = [i for i, r in enumerate(op.reached) if r]
    for _ in range(n_samples):
        z = [probe_like([u], g["probe"], generator)[0] for g, _, u in rows]
        broadcast_(z)
        hz = op.mv(z)
        for i in live:
            sample = z[i] * hz[i]
            acc[i] = sample if acc[i] is None else acc[i].add_(sample)
    by_name = {names[id(p)]: a for (_, p, _), a in zip(rows, acc)}
    shards = full.shard([None if by_name.get(n) is None else by_name[n].div_(n_samples) for n in full.params],
                        weight)
    shard_of = dict(zip(full.params, shards))
    with torch.no_grad():
        done = [(group, p, shard_of[names[id(p)]]) for group, p, _ in rows if shard_of[names[id(p)]] is not None]
        optimizer.host_refresh([(g, p) for g, p, _ in done])
        optimizer.device_refresh([(g, p) for g, p, _ in done], [est for _, _, est in done])
    del op
    for _, _, u in rows:
        u.grad = u.grad.detach()
