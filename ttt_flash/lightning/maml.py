"""MAML-family meta-training as a LightningModule.

One training step takes a :class:`ttt_flash.tasks.MetaBatch` of T tasks and, for each task,

1. scores the meta-initialisation θ on the query set (``loss_pre``: pre-adaptation),
2. adapts θ on the support set with :func:`ttt_flash.meta.inner_loop` (``inner_steps``
   differentiable steps of SGD or Adam, optionally Meta-SGD step sizes and an ANIL-style
   parameter subset),
3. scores the adapted weights on the query set (``loss_post``) and backpropagates
   ``loss_post / T`` into θ (and the Meta-SGD step sizes) through the inner loop, exactly
   to second order unless ``first_order``.

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

from typing import Dict, List, Literal, Mapping, Optional

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torch import Tensor, nn

from ._step import GraphedTraining, LocalGradients, StepTimer
from ..meta import check_inner_optimizer, functional_loss, inner_loop, select_adapted
from ..tasks import MetaBatch, incontext_mse
from ..models import NetConfig

__all__ = ["MAML", "LOSSES"]


def _cross_entropy(logits: Tensor, target: Tensor) -> Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


#: Losses the ``loss`` argument names: ``loss_fn(output, target) -> scalar``.
LOSSES = {"mse": F.mse_loss, "incontext_mse": incontext_mse, "cross_entropy": _cross_entropy}


def _key(name: str) -> str:  # nn.ParameterDict keys cannot contain dots
    return name.replace(".", "__")


class MAML(LightningModule):
    """MAML / FOMAML / Meta-SGD / ANIL meta-training of a small network.

    Args:
        net: the network (:class:`ttt_flash.models.NetConfig`: an MLP or a transformer
            whose attention is ``ttt_flash.flash_attention``).
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
    """

    def __init__(
        self,
        net: NetConfig = NetConfig(),
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
    ):
        super().__init__()
        if isinstance(net, Mapping):  # hparams of a checkpoint written through LightningCLI
            net = NetConfig(**net)
        if not isinstance(net, NetConfig):
            raise TypeError(f"net must be a NetConfig, got {type(net).__name__}")
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
        self.save_hyperparameters()
        self.automatic_optimization = False
        self._timer, self._local = StepTimer(), LocalGradients()
        self._graphed = GraphedTraining(cuda_graph)
        self.net_config = net
        self.net = net.build()
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

    def _score(self, params: Optional[Dict[str, Tensor]], query) -> Dict[str, Tensor]:
        loss, out = functional_loss(self.net, params, self.loss_fn, query, return_output=True)
        metrics = {"loss": loss}
        if self.hparams.loss == "cross_entropy":
            metrics["acc"] = (out.argmax(-1) == query[1]).float().mean()
        return metrics

    def _log(self, stage: str, sums: Dict[str, Tensor], tasks: int, **kw) -> None:
        for name, value in sums.items():
            self.log(f"{stage}/{name}", value / tasks, batch_size=tasks,
                     prog_bar=name == "loss_post", **kw)

    def _check_batch(self, batch) -> None:
        if not isinstance(batch, MetaBatch):
            raise TypeError(f"MAML expects ttt_flash.tasks.MetaBatch batches, got {type(batch).__name__}")
        want = self.net_config.in_dim
        if batch.support_inputs.shape[-1] != want:
            raise ValueError(
                f"the data's inputs have width {batch.support_inputs.shape[-1]} but net.in_dim is "
                f"{want}; for in-context regression set net.in_dim to the data's dim + 2"
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

    def _graphed_meta_update(self, *fields) -> Dict[str, Tensor]:
        """One meta-update on ``MetaBatch(*fields)`` with the raw optimizer: what the CUDA graph
        of ``cuda_graph=True`` captures (gradients zeroed in place, no host synchronisation)."""
        batch = MetaBatch(*fields)
        opt = self.optimizers().optimizer
        opt.zero_grad(set_to_none=False)
        tasks = batch.num_tasks
        sums: Dict[str, Tensor] = {}
        for t in range(tasks):
            support, query = batch.task(t)
            with torch.no_grad():
                pre = self._score(None, query)
            fast = self.adapt(support, self.hparams.inner_steps, self.hparams.first_order)
            post = self._score(fast, query)
            (post["loss"] / tasks).backward()
            for name, value in [*((f"{k}_pre", v) for k, v in pre.items()),
                                *((f"{k}_post", v.detach()) for k, v in post.items())]:
                sums[name] = sums.get(name, 0.0) + value
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
        tasks = batch.num_tasks
        self._timer.log(self, cuda, tasks)
        self._log("train", sums, tasks)
        self.log("train/seq_len", float(batch.support_inputs.shape[-2]), batch_size=tasks)
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
        sums: Dict[str, Tensor] = {}
        for t in range(tasks):
            support, query = batch.task(t)
            with torch.no_grad():
                pre = self._score(None, query)
            fast = self.adapt(support, self.hparams.inner_steps, self.hparams.first_order)
            post = self._score(fast, query)
            self.manual_backward(post["loss"] / tasks)
            for name, value in [*((f"{k}_pre", v) for k, v in pre.items()),
                                *((f"{k}_post", v.detach()) for k, v in post.items())]:
                sums[name] = sums.get(name, 0.0) + value
        self._local.add(tasks)  # DDP: mean over all processes' tasks
        self._local.average(self.parameters())
        if self.hparams.grad_clip is not None:
            self.clip_gradients(opt, gradient_clip_val=self.hparams.grad_clip, gradient_clip_algorithm="norm")
        opt.step()
        self._timer.log(self, cuda, tasks)
        self._log("train", sums, tasks)
        self.log("train/seq_len", float(batch.support_inputs.shape[-2]), batch_size=tasks)
        return sums["loss_post"] / tasks

    def _evaluate(self, batch: MetaBatch, stage: str) -> None:
        self._check_batch(batch)
        steps = self.hparams.eval_inner_steps
        steps = self.hparams.inner_steps if steps is None else steps
        # Lightning evaluates under torch.inference_mode; the inner loop needs autograd.
        with torch.inference_mode(False), torch.enable_grad():
            batch = MetaBatch(*(None if x is None else x.clone() for x in batch))
            sums: Dict[str, Tensor] = {}
            for t in range(batch.num_tasks):
                support, query = batch.task(t)
                fast = self.adapt(support, steps, first_order=True)
                with torch.no_grad():
                    for when, params in (("pre", None), ("post", fast)):
                        for k, v in self._score(params, query).items():
                            sums[f"{k}_{when}"] = sums.get(f"{k}_{when}", 0.0) + v
        self._log(stage, sums, batch.num_tasks, on_epoch=True)

    def validation_step(self, batch: MetaBatch, batch_idx: int) -> None:
        self._evaluate(batch, "val")

    def test_step(self, batch: MetaBatch, batch_idx: int) -> None:
        self._evaluate(batch, "test")
