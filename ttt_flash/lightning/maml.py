"""MAML-family meta-training as a LightningModule.

One training step takes a :class:`ttt_flash.tasks.MetaBatch` of T tasks and, for each task,

1. scores the meta-initialisation θ on the query set (``loss_pre``: pre-adaptation),
2. adapts θ on the support set with :func:`ttt_flash.meta.inner_loop` (``inner_steps``
   differentiable steps of SGD or Adam, optionally Meta-SGD step sizes and an ANIL-style
   parameter subset),
3. scores the adapted weights on the query set (``loss_post``) and backpropagates
   ``loss_post / T`` into θ (and the Meta-SGD step sizes) through the inner loop, exactly
   to second order unless ``first_order``.

With ``algorithm="imaml"`` step 2 runs without a graph on the proximal loss and step 3 adds
iMAML's implicit meta-gradient (conjugate gradient on exact Hessian-vector products) to
``.grad``; with ``algorithm="reptile"`` it adds θ − φ (:mod:`ttt_flash.meta`).

The task gradients are accumulated (one backward per task, so only one task's graph is
alive at a time) and the outer optimizer (Adam, ``outer_lr``) steps once per meta-batch
(manual optimization). Validation and test do the same without the outer step, with
``eval_inner_steps`` first-order inner steps (the adapted weights are identical; no
second-order graph is needed to score them).

Logged per stage (``train``, ``val``, ``test``): ``{stage}/loss_pre``, ``{stage}/loss_post``
and, for ``loss="cross_entropy"``, ``{stage}/acc_pre``, ``{stage}/acc_post``. Training also
logs ``train/step_time_s`` (wall clock of one outer step), ``train/seq_len`` (the tasks'
sequence length: a data ``curriculum`` grows it) and, on CUDA,
``train/peak_mem_gib`` (peak allocated memory of that step).
"""

from __future__ import annotations

import contextlib
from typing import Dict, List, Literal, Mapping, Optional, Union

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torch import Tensor, nn

from ._step import GraphedTraining, LocalGradients, StepTimer, host_number
from .checkpoint_io import save_hyperparameters_with_net
from .fsdp2 import FSDP2Steps
from ..meta import (HESSIAN_MODES, check_inner_optimizer, functional_loss, imaml_meta_gradient, inner_loop,
                    proximal_inner_loop, reptile_meta_gradient, select_adapted)
from ..second_order.grad import calling_thread_backward
from ..tasks import MetaBatch, incontext_mse
from ..models import NetConfig

__all__ = ["MAML", "LOSSES", "ALGORITHMS"]

#: Accepted values of ``algorithm``.
ALGORITHMS = ("maml", "imaml", "reptile")
#: iMAML's options, with the values used when ``algorithm="imaml"`` leaves them unset.
_IMAML_DEFAULTS = {"imaml_lam": 1.0, "cg_steps": 5, "cg_tol": 1e-3, "hessian_mode": "rev_rev"}


def _cross_entropy(logits: Tensor, target: Tensor) -> Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


#: Losses the ``loss`` argument names: ``loss_fn(output, target) -> scalar``.
LOSSES = {"mse": F.mse_loss, "incontext_mse": incontext_mse, "cross_entropy": _cross_entropy}


def _key(name: str) -> str:  # nn.ParameterDict keys cannot contain dots
    return name.replace(".", "__")


def _check_algorithm(algorithm, first_order, meta_sgd, **imaml) -> Dict[str, object]:
    """iMAML's options with their defaults filled in; ValueError for a bad ``algorithm`` or an
    option that does not apply to it."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
    if algorithm != "maml":
        for name, value in (("first_order", first_order), ("meta_sgd", meta_sgd)):
            if value:
                why = ("first order by construction" if algorithm == "reptile"
                       else "exact without differentiating through the inner loop")
                raise ValueError(f"{name}=true applies to algorithm='maml' only ({algorithm} is {why} "
                                 f"and learns no step sizes); set {name}: false")
    if algorithm != "imaml":
        given = [n for n, v in imaml.items() if v is not None]
        if given:
            raise ValueError(f"{', '.join(given)} appl{'ies' if len(given) == 1 else 'y'} to algorithm='imaml' "
                             f"only, got algorithm={algorithm!r}: remove {' and '.join(given)} or set algorithm: imaml")
        return {}
    out = {n: (_IMAML_DEFAULTS[n] if v is None else v) for n, v in imaml.items()}
    if isinstance(out["imaml_lam"], bool) or not isinstance(out["imaml_lam"], (int, float)) or not out["imaml_lam"] > 0:
        raise ValueError(f"imaml_lam must be a float > 0, got {out['imaml_lam']!r}")
    if isinstance(out["cg_steps"], bool) or not isinstance(out["cg_steps"], int) or out["cg_steps"] < 1:
        raise ValueError(f"cg_steps must be an int >= 1, got {out['cg_steps']!r}")
    if isinstance(out["cg_tol"], bool) or not isinstance(out["cg_tol"], (int, float)) or not out["cg_tol"] >= 0:
        raise ValueError(f"cg_tol must be a float >= 0, got {out['cg_tol']!r}")
    if out["hessian_mode"] not in HESSIAN_MODES:
        raise ValueError(f"hessian_mode must be one of {HESSIAN_MODES}, got {out['hessian_mode']!r}")
    return out


#: The relative CG residual above which :class:`MAML` warns that iMAML's meta-gradient is
#: unreliable (CG removed less than half of the residual).
CG_WARN_RESIDUAL = 0.5

class MAML(LightningModule):
    """MAML / FOMAML / Meta-SGD / ANIL meta-training of a small network.

    Args:
        net: the network: an ``nn.Module`` (in a recipe ``net: {class_path:
            ttt_flash.models.SinusoidMLP, init_args: ...}``, any network the inner loop can
            differentiate through), or a :class:`ttt_flash.models.NetConfig` that builds one of
            the library's (an MLP or a transformer whose attention is
            ``ttt_flash.flash_attention``). None: ``NetConfig()`` (the sinusoid MLP).
        inner_steps: inner (adaptation) steps per task during training.
        inner_lr: inner step size (initial value of the Meta-SGD step sizes with ``meta_sgd``).
        first_order: first-order MAML (no second derivatives in the meta-gradient).
        meta_sgd: learn one inner step size per adapted parameter element (Meta-SGD).
        adapt: names or module prefixes of the parameters the inner loop adapts (None: all).
            ANIL: ``["head"]``.
        inner_optimizer: ``"sgd"`` or ``"adam"`` (differentiable Adam, state in the graph).
        outer_lr: learning rate of the outer Adam optimizer.
        eval_inner_steps: inner steps at validation/test (None: ``inner_steps``).
        loss: ``"mse"`` (sinusoid), ``"incontext_mse"`` (in-context regression) or
            ``"cross_entropy"`` (classification; also logs accuracy).
        grad_clip: clip the meta-gradient to this global norm (None: no clipping).
        cuda_graph: on CUDA, capture the whole training step (every task's inner loop and
            backward, clipping, the outer Adam step, made ``capturable``) as a CUDA graph once
            per batch shape and replay it (docs/cuda-graphs.md); other shapes, the CPU and DDP
            run eagerly (one warning). Validation stays eager.
        algorithm: ``"maml"`` (the above: differentiate through the inner loop), ``"imaml"``
            (implicit MAML, :func:`ttt_flash.meta.imaml_meta_gradient`: graph-free inner loop
            on L_task + (λ/2)‖φ − θ‖², meta-gradient by conjugate gradient on exact
            Hessian-vector products; memory does not grow with ``inner_steps``) or
            ``"reptile"`` (:func:`ttt_flash.meta.reptile_meta_gradient`: θ − φ). ``first_order``
            and ``meta_sgd`` apply to ``"maml"`` only.
        imaml_lam: iMAML's proximal weight λ > 0 (default 1.0); iMAML only.
        cg_steps: iMAML's conjugate-gradient steps per task (default 5); iMAML only.
        cg_tol: iMAML's CG relative-residual tolerance: CG stops early below it (default
            1e-3); iMAML only. The largest relative residual of a step is logged as
            ``train/cg_rel_residual``. A fixed budget of ``cg_steps`` often ends above
            ``cg_tol`` with a usable meta-gradient (a residual of 0.1 leaves it about 10 % off,
            below the noise of a meta-batch), so a warning is issued only the first time the
            solve is unusable: CG met non-positive curvature, or left more than
            :data:`CG_WARN_RESIDUAL` of the residual.
        hessian_mode: ``"rev_rev"`` (default) or ``"fwd_rev"`` (forward over reverse: lower
            peak memory) for iMAML's Hessian-vector products; iMAML only.

    Under ``--trainer.strategy=fsdp2`` (:class:`~ttt_flash.lightning.FSDP2Strategy`),
    ``configure_model`` shards the network's blocks and the network with ``fully_shard``;
    every training and evaluation step holds the full weights (:func:`ttt_flash.fsdp.unsharded`)
    and the meta-gradients are reduce-scattered to the shards (docs/distributed.md).
    """

    #: (metric, mode) the best checkpoints are ranked by (ttt_flash.lightning.outputs.BestCheckpoints)
    val_metric = ("val/loss_post", "min")

    def __init__(
        self,
        net: Optional[Union[nn.Module, NetConfig]] = None,
        inner_steps: int = 1,
        inner_lr: float = 0.01,
        first_order: bool = False,
        meta_sgd: bool = False,
        adapt: Optional[List[str]] = None,
        inner_optimizer: Literal["sgd", "adam"] = "sgd",
        outer_lr: float = 1e-3,
        eval_inner_steps: Optional[int] = None,
        loss: Literal["mse", "incontext_mse", "cross_entropy"] = "mse",
        grad_clip: Optional[float] = None,
        cuda_graph: bool = False,
        algorithm: Literal["maml", "imaml", "reptile"] = "maml",
        imaml_lam: Optional[float] = None,
        cg_steps: Optional[int] = None,
        cg_tol: Optional[float] = None,
        hessian_mode: Optional[Literal["rev_rev", "fwd_rev"]] = None,
    ):
        super().__init__()
        self._imaml = _check_algorithm(algorithm, first_order, meta_sgd, imaml_lam=imaml_lam,
                                       cg_steps=cg_steps, cg_tol=cg_tol, hessian_mode=hessian_mode)
        if cuda_graph and algorithm != "maml":
            raise ValueError(f"cuda_graph=true applies to algorithm='maml' only (the {algorithm} step runs "
                             "eagerly); set cuda_graph: false")
        if net is None:
            net = NetConfig()
        if isinstance(net, Mapping):  # hparams of a checkpoint written through LightningCLI
            net = NetConfig(**net)
        if not isinstance(net, (NetConfig, nn.Module)):
            raise TypeError(f"net must be an nn.Module or a NetConfig, got {type(net).__name__}")
        for name, value in (("inner_steps", inner_steps), ("eval_inner_steps", eval_inner_steps)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        if not inner_lr >= 0:
            raise ValueError(f"inner_lr must be >= 0, got {inner_lr}")
        if not outer_lr > 0:
            raise ValueError(f"outer_lr must be > 0, got {outer_lr}")
        check_inner_optimizer(inner_optimizer, "inner_optimizer")
        if loss not in LOSSES:
            raise ValueError(f"loss must be one of {sorted(LOSSES)}, got {loss!r}")
        if grad_clip is not None and not grad_clip > 0:
            raise ValueError(f"grad_clip must be > 0 or None, got {grad_clip}")
        save_hyperparameters_with_net(self, net)
        self._cg_warned = False
        self.automatic_optimization = False
        self._timer, self._local = StepTimer(), LocalGradients()
        self._graphed = GraphedTraining(cuda_graph)
        self._fsdp2 = FSDP2Steps()
        self.net_config = net if isinstance(net, NetConfig) else None
        self.net = net.build() if isinstance(net, NetConfig) else net
        self.adapted_names = select_adapted([n for n, _ in self.net.named_parameters()], adapt)
        self.loss_fn = LOSSES[loss]
        self.inner_lrs: Optional[nn.ParameterDict] = None
        if meta_sgd:
            params = dict(self.net.named_parameters())
            self.inner_lrs = nn.ParameterDict(
                {_key(n): nn.Parameter(torch.full_like(params[n], inner_lr)) for n in self.adapted_names}
            )

    def forward(self, *inputs: Tensor) -> Tensor:
        return self.net(*inputs)

    def configure_model(self) -> None:
        # --trainer.strategy=fsdp2: the network's blocks and the network sharded with fully_shard;
        # every step holds the full parameters (ttt_flash.fsdp.unsharded, docs/distributed.md)
        blocks = next((n for n, m in self.net.named_modules() if n.split(".")[-1] == "blocks"
                       and isinstance(m, nn.ModuleList)), None)
        self._fsdp2.shard(self, self.net, blocks)
        if self._fsdp2.active:
            h = self.hparams
            unsupported = [what for what, bad in (("meta_sgd", h.meta_sgd), ("cuda_graph", h.cuda_graph),
                                                  (f"algorithm={h.algorithm!r}", h.algorithm != "maml")) if bad]
            if unsupported:
                raise ValueError(f"{', '.join(unsupported)} under --trainer.strategy=fsdp2 is not supported: "
                                 "use algorithm: maml without meta_sgd and cuda_graph, or --trainer.strategy=ddp")

    def backward(self, loss: Tensor, *args, **kwargs) -> None:
        """The outer backward (``manual_backward``), on the calling thread like the inner
        loops' (:class:`ttt_flash.second_order.calling_thread_backward`)."""
        with calling_thread_backward():
            super().backward(loss, *args, **kwargs)

    def configure_optimizers(self):
        # capturable on CUDA with or without cuda_graph: the graphed and the eager run then step
        # the same kernels (identical losses)
        capturable = self.device.type == "cuda"
        return torch.optim.Adam(self.parameters(), lr=self.hparams.outer_lr, capturable=capturable)

    # ------------------------------------------------------------------ meta-learning

    def adapt(self, support, steps: int, first_order: bool) -> Dict[str, Tensor]:
        """The adapted parameters of ``self.net`` for one task's support ``(inputs, target)``."""
        lrs = None
        if self.inner_lrs is not None:
            lrs = {n: self.inner_lrs[_key(n)] for n in self.adapted_names}
        return inner_loop(
            self.net,
            dict(self.net.named_parameters()),
            self.loss_fn,
            support,
            steps,
            self.hparams.inner_lr,
            first_order=first_order,
            lrs=lrs,
            adapt=self.adapted_names,
            optimizer=self.hparams.inner_optimizer,
        )

    def _proximal_adapt(self, support, steps: int) -> Dict[str, Tensor]:
        """iMAML's / Reptile's graph-free adaptation (λ = 0 for Reptile)."""
        lam = self._imaml["imaml_lam"] if self.hparams.algorithm == "imaml" else 0.0
        return proximal_inner_loop(self.net, dict(self.net.named_parameters()), self.loss_fn, support, steps,
                                   self.hparams.inner_lr, lam, adapt=self.adapted_names,
                                   optimizer=self.hparams.inner_optimizer)

    def _first_order_task(self, support, query, tasks: int, sums: Dict[str, Tensor]) -> Dict[str, Tensor]:
        """One task of iMAML or Reptile: its meta-gradient / ``tasks`` added to the ``.grad``
        of the network's parameters; returns the post-adaptation scores (detached)."""
        h, params = self.hparams, dict(self.net.named_parameters())
        if h.algorithm == "imaml":
            res = imaml_meta_gradient(
                self.net, params, self.loss_fn, support, query, h.inner_steps, h.inner_lr,
                self._imaml["imaml_lam"], cg_steps=self._imaml["cg_steps"], cg_tol=self._imaml["cg_tol"],
                adapt=self.adapted_names, optimizer=h.inner_optimizer,
                hessian_mode=self._imaml["hessian_mode"], warn=False,
            )
            worst = torch.tensor(res.cg.rel_residual)
            sums["cg_rel_residual"] = torch.maximum(sums.get("cg_rel_residual", worst), worst)
            unusable = res.cg.negative_curvature or res.cg.rel_residual > max(CG_WARN_RESIDUAL, self._imaml["cg_tol"])
            if unusable and not self._cg_warned:
                self._cg_warned = True
                import warnings

                why = ("met non-positive curvature (I + H/lam is not positive definite)" if res.cg.negative_curvature
                       else f"left a relative residual of {res.cg.rel_residual:.3e} after {res.cg.steps} steps")
                warnings.warn(
                    f"iMAML's conjugate gradient {why}: the meta-gradient is unreliable; raise "
                    "model.init_args.cg_steps or imaml_lam. train/cg_rel_residual logs the largest residual "
                    "of each step (warned once)", RuntimeWarning)
        else:
            res = reptile_meta_gradient(self.net, params, self.loss_fn, support, h.inner_steps, h.inner_lr,
                                        adapt=self.adapted_names, optimizer=h.inner_optimizer)
        for n, p in params.items():
            g = res.grads[n] / tasks
            p.grad = g.clone() if p.grad is None else p.grad.add_(g)
        with torch.no_grad():
            return self._score(res.adapted, query)

    def _score(self, params: Optional[Dict[str, Tensor]], query) -> Dict[str, Tensor]:
        loss, out = functional_loss(self.net, params, self.loss_fn, query, return_output=True)
        metrics = {"loss": loss}
        if self.hparams.loss == "cross_entropy":
            metrics["acc"] = (out.argmax(-1) == query[1]).float().mean()
        return metrics

    def _log(self, stage: str, sums: Dict[str, Tensor], tasks: int, **kw) -> None:
        for name, value in sums.items():
            # val / test: the mean over every process
            self.log(f"{stage}/{name}", value / tasks, batch_size=tasks,
                     prog_bar=name == "loss_post", sync_dist=stage != "train", **kw)

    def _check_batch(self, batch) -> None:
        if not isinstance(batch, MetaBatch):
            raise TypeError(f"MAML expects ttt_flash.tasks.MetaBatch batches, got {type(batch).__name__}")
        if self.net_config is not None:
            want, key = self.net_config.in_dim, "net.in_dim"
        else:  # an injected network whose input map is a Linear named embed (TinyTransformer, MemoryRegressor, ...)
            embed = getattr(self.net, "embed", None)
            want, key = (embed.in_features, "net.init_args.in_dim") if isinstance(embed, nn.Linear) else (None, "")
        if want is not None and batch.support_inputs.shape[-1] != want:
            raise ValueError(
                f"the data's inputs have width {batch.support_inputs.shape[-1]} but {key} is "
                f"{want}; for in-context regression set {key} to the data's dim + 2"
            )

    def on_train_start(self) -> None:
        # Under DDP (docs/distributed.md): DDP's hooks cannot reduce a backward through the
        # inner loop's autograd.grad graph correctly, so they are switched off; each process
        # meta-trains on its own tasks and training_step averages the meta-gradients.
        self._local.begin(self.trainer)
        self._graphed.reset()

    def on_load_checkpoint(self, checkpoint) -> None:
        self._graphed.reset()  # the loaded optimizer state lives in new tensors: capture again

    def on_train_batch_start(self, batch, batch_idx: int) -> None:
        # Lightning switches DDP's sync back on after every manual-optimization forward
        # (its _DDPForwardRedirection): switch it off again before each step, or DDP's
        # reducer joins the next backward (a collective the other path does not match).
        self._local.keep_off(self.trainer)

    def _meta_gradients(self, batch: MetaBatch, backward) -> Dict[str, Tensor]:
        """Every task's meta-gradient / ``num_tasks`` added to the parameters' ``.grad``
        (``backward(loss)`` for MAML; iMAML and Reptile add theirs directly); returns the summed
        pre- and post-adaptation scores."""
        tasks = batch.num_tasks
        sums: Dict[str, Tensor] = {}
        for t in range(tasks):
            support, query = batch.task(t)
            with torch.no_grad():
                pre = self._score(None, query)
            if self.hparams.algorithm == "maml":
                fast = self.adapt(support, self.hparams.inner_steps, self.hparams.first_order)
                post = self._score(fast, query)
                backward(post["loss"] / tasks)
            else:
                post = self._first_order_task(support, query, tasks, sums)
            for name, value in [*((f"{k}_pre", v) for k, v in pre.items()),
                                *((f"{k}_post", v.detach()) for k, v in post.items())]:
                sums[name] = sums.get(name, 0.0) + value
        return sums

    def _graphed_meta_update(self, *fields) -> Dict[str, Tensor]:
        """One meta-update on ``MetaBatch(*fields)`` with the raw optimizer: what the CUDA graph
        of ``cuda_graph=True`` captures (gradients zeroed in place, no host synchronisation)."""
        batch = MetaBatch(*fields)
        opt = self.optimizers().optimizer
        opt.zero_grad(set_to_none=False)
        sums = self._meta_gradients(batch, Tensor.backward)
        if self.hparams.grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(self.parameters(), self.hparams.grad_clip, foreach=True)
        opt.step()
        return sums

    def _graphed_training_step(self, batch: MetaBatch) -> Tensor:
        lopt = self.optimizers()
        cuda = batch.support_inputs.is_cuda
        self._timer.start(cuda)
        sums = self._graphed.run(self._graphed_meta_update, tuple(batch), self.parameters(), [lopt.optimizer],
                                 name="MAML.training_step")
        self._graphed.take_backward()  # manual optimization: no Lightning backward follows
        sums = {k: v.clone() for k, v in sums.items()}  # the graph's outputs are overwritten by the next replay
        lopt._on_before_step()  # the step counts of Lightning's manual-optimization loop (global_step)
        lopt._on_after_step()
        return self._end_training_step(batch, sums, cuda)

    def _end_training_step(self, batch: MetaBatch, sums: Dict[str, Tensor], cuda: bool) -> Tensor:
        """The step's time and metrics logged; its mean post-adaptation loss."""
        tasks = batch.num_tasks
        self._timer.log(self, cuda, tasks)
        self._log("train", sums, tasks)
        self.log("train/seq_len", host_number(batch.support_inputs.shape[-2]), batch_size=tasks)
        return sums["loss_post"] / tasks

    def training_step(self, batch: MetaBatch, batch_idx: int) -> Tensor:
        self._check_batch(batch)
        if self._graphed.usable(batch.support_inputs.is_cuda, "DDP" if self._local.active else None):
            return self._graphed_training_step(batch)
        opt = self.optimizers()
        cuda = batch.support_inputs.is_cuda
        self._timer.start(cuda)
        opt.zero_grad()
        tasks = batch.num_tasks
        if self._fsdp2.active:  # FSDP2: full parameters through the step, gradients reduce-scattered
            full = self._fsdp2.begin()
            try:
                sums = self._meta_gradients(batch, self.manual_backward)
                full.reduce_gradients()
            finally:
                self._fsdp2.end()
        else:
            sums = self._meta_gradients(batch, self.manual_backward)
        if "cg_rel_residual" in sums:
            self.log("train/cg_rel_residual", sums.pop("cg_rel_residual"), batch_size=tasks)
        self._local.add(tasks)  # DDP: mean over all processes' tasks
        self._local.average(self.parameters())
        if self.hparams.grad_clip is not None:
            self.clip_gradients(opt, gradient_clip_val=self.hparams.grad_clip, gradient_clip_algorithm="norm")
        opt.step()
        return self._end_training_step(batch, sums, cuda)

    def _evaluate(self, batch: MetaBatch, stage: str) -> None:
        self._check_batch(batch)
        steps = self.hparams.eval_inner_steps
        steps = self.hparams.inner_steps if steps is None else steps
        # Lightning evaluates under torch.inference_mode; the inner loop needs autograd.
        with torch.inference_mode(False), torch.enable_grad(), self._held():
            batch = MetaBatch(*(None if x is None else x.clone() for x in batch))
            sums: Dict[str, Tensor] = {}
            for t in range(batch.num_tasks):
                support, query = batch.task(t)
                if self.hparams.algorithm == "maml":
                    fast = self.adapt(support, steps, first_order=True)
                else:
                    fast = self._proximal_adapt(support, steps)
                with torch.no_grad():
                    for when, params in (("pre", None), ("post", fast)):
                        for k, v in self._score(params, query).items():
                            sums[f"{k}_{when}"] = sums.get(f"{k}_{when}", 0.0) + v
        self._log(stage, sums, batch.num_tasks, on_epoch=True)

    def _held(self):
        """FSDP2: the full parameters for the evaluation's inner loop (a no-op context otherwise)."""
        if not self._fsdp2.active:
            return contextlib.nullcontext()
        stack = contextlib.ExitStack()
        self._fsdp2.begin()
        stack.callback(self._fsdp2.end)
        return stack

    def validation_step(self, batch: MetaBatch, batch_idx: int) -> None:
        self._evaluate(batch, "val")

    def test_step(self, batch: MetaBatch, batch_idx: int) -> None:
        self._evaluate(batch, "test")
