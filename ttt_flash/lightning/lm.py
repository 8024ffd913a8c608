"""Language modelling with second-order optimisers: a LightningModule for
:class:`ttt_flash.models.GPT` and its Hessian-refresh callback; the byte-level text data is
:class:`ttt_flash.lightning.data.ByteTextDataModule`.

* :class:`LanguageModel`: next-token training of a GPT with ``optimizer`` one of
  ``"sophiah"`` (:class:`ttt_flash.second_order.optim.SophiaH`), ``"adamw"`` or ``"adahessian"``
  (:class:`ttt_flash.second_order.optim.AdaHessian`); linear warm-up then cosine decay of the learning rate.
* :class:`HessianRefresh`: on the steps where the Hessian estimate is due, the module's
  backward pass runs with ``create_graph=True`` and, before the optimizer step, the
  optimizer's Hutchinson estimate is refreshed from that graph
  (:meth:`ttt_flash.second_order.optim.SophiaH.update_hessian`). With ``attention="ttt_flash"`` every
  Hessian-vector product is exact. :class:`LanguageModel` adds one by itself when its
  optimizer is second-order and the Trainer has none.

Logged: ``train/loss``, ``train/lr``, ``train/step_time_s`` (wall clock of the whole step,
Hessian refresh included; with ``cuda_graph=True`` on CUDA the step's span on the GPU stream
from CUDA events, logged one step late), on CUDA ``train/peak_mem_gib``; with Sophia-H
``train/clip_fraction`` (coordinates whose step was clipped); with a second-order optimizer
``train/hessian_refresh_s`` (time of the Hessian-vector product and update, without the
``create_graph`` backward; 0 on steps without a refresh); ``val/loss`` and ``val/bits_per_token`` (loss / ln 2: bits per
byte for byte tokens). The numbers computed on the host are logged as CPU tensors. With
``cuda_graph=True`` on CUDA the progress bar shows ``train/loss_prev``, the previous step's loss
read without waiting for the GPU, in place of ``train/loss`` (logged as before).

Example (a CPU smoke run)::

    >>> import lightning.pytorch as pl
    >>> from ttt_flash.models import GPTConfig
    >>> from ttt_flash.lightning import ByteTextDataModule, LanguageModel
    >>> model = LanguageModel(GPTConfig.tiny(n_layer=1), optimizer="sophiah", lr=1e-3)
    >>> data = ByteTextDataModule(seq_len=32, batch_size=2, max_bytes=2**16)
    >>> trainer = pl.Trainer(fast_dev_run=1, logger=False, enable_progress_bar=False,
    ...                      enable_model_summary=False, accelerator="cpu")
    >>> trainer.fit(model, data)  # doctest: +SKIP
"""

from __future__ import annotations

import math
import warnings
from dataclasses import asdict
from typing import Literal, Mapping, Optional, Tuple, Union

import torch
from lightning.pytorch import LightningModule
from torch import Tensor

from ._step import (GraphedTraining, GraphedZeroGrad, LateHostValue, LocalGradients, StepTimer,
                    backward_into_grads, host_number, outside_autocast, write_grads)
from ..models import GPT, GPTConfig
from ..second_order import calling_thread_backward, probe_like
from ..second_order.hessian_optimizer import accumulate_samples
from ..second_order.optim import AdaHessian, HessianOptimizer, SophiaH
from .context_parallel import ContextParallelPlan
from .hessian_refresh import HESSIAN_MODES, HessianRefresh
from .fsdp2 import FSDP2Steps

__all__ = ["LanguageModel", "HessianRefresh", "OPTIMIZERS"]

#: Accepted values of ``LanguageModel(optimizer=...)``.
OPTIMIZERS = ("sophiah", "adamw", "adahessian")


_CYCLE_WARNING = r"Using backward\(\) with create_graph=True"


# --------------------------------------------------------------------------- module


class LanguageModel(GraphedZeroGrad, LightningModule):
    """Next-token language modelling with :class:`ttt_flash.models.GPT`.

    Batches are ``(x, y)`` pairs of (B, N) token ids with ``y`` the next tokens of ``x``
    (:class:`~ttt_flash.lightning.data.ByteTextDataModule`). Weight decay applies to the matrices (2-D parameters)
    only, not to norm gains or biases.

    Args:
        gpt: the model: a :class:`~ttt_flash.models.GPT` (in a recipe ``gpt: {class_path:
            ttt_flash.models.GPT, init_args: {config: ...}}``) or its
            :class:`~ttt_flash.models.GPTConfig` (default: ``GPTConfig.tiny()``).
            ``attention="ttt_flash"`` makes every Hessian-vector product exact with O(N)
            memory; ``"math"`` materialises attention (exact, O(N²) memory).
        optimizer: ``"sophiah"``, ``"adamw"`` or ``"adahessian"``.
        lr: peak learning rate.
        betas: (β₁, β₂); ``None``: the optimizer's default ((0.965, 0.99) Sophia-H,
            (0.9, 0.999) AdamW and AdaHessian).
        weight_decay: decoupled weight decay of the matrices.
        rho: Sophia-H's ρ (clipping scale of the Hessian-preconditioned step).
        hessian_every: refresh the Hessian estimate every this many steps; ``None``: the
            optimizer's default (10 for Sophia-H, 1 for AdaHessian). Unused by AdamW.
        hessian_power: AdaHessian's exponent of the Hessian term.
        eps: the optimizer's ε; ``None``: its default (1e-15 Sophia-H, 1e-8 AdamW, 1e-4
            AdaHessian).
        warmup_steps: linear learning-rate warm-up from 0 over this many steps.
        min_lr_ratio: with ``schedule="cosine"``, the final learning rate as a fraction of ``lr``.
        schedule: ``"cosine"`` (decay to ``min_lr_ratio · lr`` over the run's optimizer
            steps, ``trainer.estimated_stepping_batches``) or ``"constant"``.
        hessian_mode: how the added :class:`HessianRefresh` takes its Hessian-vector
            products: ``"rev_rev"`` (through the step's ``create_graph`` graph) or
            ``"fwd_rev"`` (forward over reverse, less memory; :mod:`ttt_flash.second_order`).
        hessian_recompute: with ``hessian_mode="fwd_rev"``, recompute each transformer block
            in the refresh's products (``HessianRefresh(recompute="model.blocks")``): the
            refresh keeps only the blocks' inputs and their tangents (docs/forward-mode.md,
            "Memory").
        context_parallel: ranks per sequence under DDP (1: off). The W processes form W / P
            context-parallel groups of P consecutive ranks, data parallel across groups;
            each group trains on its first rank's batch, each rank on a block of its tokens
            (:class:`~ttt_flash.lightning.context_parallel.ContextParallelPlan`,
            docs/distributed.md).
        cuda_graph: on CUDA, capture the training step's forward and backward as a CUDA
            graph once per batch shape, and the Hessian-refresh step (forward, ``create_graph``
            backward, the Hutchinson products with the probes drawn in the graph from
            :class:`HessianRefresh`'s generator) as another, and replay them
            (docs/cuda-graphs.md). With Sophia-H or AdaHessian (built ``capturable=True``) each
            graph is the whole step: forward, backward, the Hessian refresh on its steps, the
            Trainer's gradient clipping and the optimizer update; the host only writes the
            step's learning rate and bias corrections into device tensors and replays. With
            AdamW the optimizer step stays eager. The CPU, DDP, context
            parallelism, gradient accumulation and ``hessian_mode="fwd_rev"`` run eagerly (one
            warning). Validation stays eager.

    Under ``--trainer.strategy=fsdp2`` (:class:`~ttt_flash.lightning.FSDP2Strategy`),
    ``configure_model`` shards each GPT block and the GPT with ``fully_shard``; a
    Hessian-refresh step holds the full weights from the batch's start to the optimizer step
    (:func:`ttt_flash.fsdp.unsharded`), the other steps are plain FSDP2 (docs/distributed.md).
    """

    #: (metric, mode) the best checkpoints are ranked by (ttt_flash.lightning.outputs.BestCheckpoints)
    val_metric = ("val/loss", "min")

    @property
    def schedule_spans_run(self) -> bool:
        """Whether the learning-rate schedule depends on the run's length (cosine decay over
        ``trainer.estimated_stepping_batches``): a resumed run must keep ``trainer.max_steps``."""
        return self.hparams.schedule == "cosine"

    def __init__(
        self,
        gpt: Union[GPTConfig, GPT] = GPTConfig.tiny(),
        optimizer: Literal["sophiah", "adamw", "adahessian"] = "sophiah",
        lr: float = 1e-3,
        betas: Optional[Tuple[float, float]] = None,
        weight_decay: float = 0.1,
        rho: float = 0.04,
        hessian_every: Optional[int] = None,
        hessian_power: float = 1.0,
        eps: Optional[float] = None,
        warmup_steps: int = 0,
        min_lr_ratio: float = 0.1,
        schedule: Literal["cosine", "constant"] = "cosine",
        hessian_mode: Literal["rev_rev", "fwd_rev"] = "rev_rev",
        context_parallel: int = 1,
        hessian_recompute: bool = False,
        cuda_graph: bool = False,
    ):
        super().__init__()
        if isinstance(gpt, Mapping):  # hparams of a checkpoint written through LightningCLI
            gpt = GPTConfig(**gpt)
        model = gpt if isinstance(gpt, GPT) else None
        gpt = gpt.config if model is not None else gpt
        if not isinstance(gpt, GPTConfig):
            raise TypeError(f"gpt must be a GPT or a GPTConfig, got {type(gpt).__name__}")
        if optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {optimizer!r}")
        if hessian_mode not in HESSIAN_MODES:
            raise ValueError(f"hessian_mode must be one of {HESSIAN_MODES}, got {hessian_mode!r}")
        if hessian_recompute and hessian_mode != "fwd_rev":
            raise ValueError(
                "hessian_recompute=True needs hessian_mode='fwd_rev' (reverse over reverse keeps "
                "the step's whole create_graph graph)"
            )
        if schedule not in ("cosine", "constant"):
            raise ValueError(f"schedule must be 'cosine' or 'constant', got {schedule!r}")
        if not lr > 0:
            raise ValueError(f"lr must be > 0, got {lr}")
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise ValueError(f"warmup_steps must be an int >= 0, got {warmup_steps!r}")
        if not 0.0 <= min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {min_lr_ratio}")
        if hessian_every is not None and (isinstance(hessian_every, bool) or not isinstance(hessian_every, int) or hessian_every < 1):
            raise ValueError(f"hessian_every must be an int >= 1 or None, got {hessian_every!r}")
        # The config is stored as a plain dict, so that checkpoints load with torch.load's
        # weights_only=True (the default) and load_from_checkpoint rebuilds it (Mapping above).
        self.save_hyperparameters(ignore=["gpt"])
        self.hparams["gpt"] = asdict(gpt)
        self.gpt_config = gpt
        self.model = GPT(gpt) if model is None else model
        self.context_parallel_plan = ContextParallelPlan(context_parallel)
        #: Set by :class:`HessianRefresh`: the next backward keeps its graph.
        self.hessian_refresh_pending = False
        # cuda_graph: the step time from CUDA events, one step late (no host synchronisation)
        self._timer, self._local = StepTimer(events=cuda_graph), LocalGradients()
        self._graphed = GraphedTraining(cuda_graph)
        self._late_loss = LateHostValue()  # cuda_graph: the progress bar's loss, one step late
        self._fsdp2 = FSDP2Steps()

    @property
    def second_order(self) -> bool:
        """Whether the optimizer needs Hessian refreshes."""
        return self.hparams.optimizer in ("sophiah", "adahessian")

    def forward(self, idx: Tensor) -> Tensor:
        """(B, N) token ids → (B, N, vocab) logits."""
        return self.model(idx)

    # ------------------------------------------------------------------ optimisation

    def configure_optimizers(self):
        hp = self.hparams
        decay = [p for p in self.model.parameters() if p.requires_grad and p.dim() >= 2]
        no_decay = [p for p in self.model.parameters() if p.requires_grad and p.dim() < 2]
        groups = [
            {"params": decay, "weight_decay": hp.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]
        kw = {}
        if hp.betas is not None:
            kw["betas"] = tuple(hp.betas)
        if hp.eps is not None:
            kw["eps"] = hp.eps
        if hp.hessian_every is not None and self.second_order:
            kw["k"] = hp.hessian_every
        if self.second_order:  # cuda_graph: the update is captured with the step (docs/cuda-graphs.md)
            kw["capturable"] = bool(hp.get("cuda_graph", False))
        if hp.optimizer == "sophiah":
            opt = SophiaH(groups, lr=hp.lr, rho=hp.rho, **kw)
        elif hp.optimizer == "adahessian":
            opt = AdaHessian(groups, lr=hp.lr, hessian_power=hp.hessian_power, **kw)
        else:
            opt = torch.optim.AdamW(groups, lr=hp.lr, **kw)
        if hp.schedule == "constant" and hp.warmup_steps == 0:
            return opt
        total = max(1, int(self.trainer.estimated_stepping_batches)) if self._trainer is not None else 1
        warmup, floor, cosine = hp.warmup_steps, hp.min_lr_ratio, hp.schedule == "cosine"

        def factor(step: int) -> float:
            if step < warmup:
                return (step + 1) / (warmup + 1)
            if not cosine:
                return 1.0
            progress = min(1.0, (step - warmup) / max(1, total - warmup))
            return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

        sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def configure_callbacks(self):
        if not self.second_order:
            return []
        trainer = self._trainer
        if trainer is not None and any(isinstance(c, HessianRefresh) for c in trainer.callbacks):
            return []  # the user's own HessianRefresh (e.g. a different every_k) stays
        recompute = "model.blocks" if self.hparams.get("hessian_recompute", False) else None
        return [HessianRefresh(mode=self.hparams.get("hessian_mode", "rev_rev"), recompute=recompute)]

    def backward(self, loss: Tensor, *args, **kwargs) -> None:
        """Lightning's backward (with ``create_graph`` before a Hessian refresh), on the calling
        thread like the refresh's products (:class:`ttt_flash.second_order.calling_thread_backward`)."""
        if self._graphed.take_backward():
            return  # the graph replayed this step's backward (and the Hessian refresh)
        with calling_thread_backward():
            if self.hessian_refresh_pending:
                with warnings.catch_warnings():
                    # The parameter <-> gradient cycle is broken by update_hessian(), which
                    # replaces p.grad with a detached copy.
                    warnings.filterwarnings("ignore", message=_CYCLE_WARNING)
                    super().backward(loss, *args, create_graph=True, **kwargs)
            else:
                super().backward(loss, *args, **kwargs)

    # ------------------------------------------------------------------ steps

    def hessian_loss(self, batch) -> Tensor:
        """The training loss of ``batch``, re-run by ``HessianRefresh(mode="fwd_rev")``."""
        x, y = self._check_batch(batch)
        return self.model.loss(x, y)

    def _check_batch(self, batch) -> Tuple[Tensor, Tensor]:
        if not isinstance(batch, (tuple, list)) or len(batch) != 2:
            raise TypeError("a batch must be an (x, y) pair of (B, N) token-id tensors")
        x, y = batch
        if x.shape != y.shape or x.dim() != 2:
            raise ValueError(f"x and y must both be (B, N), got {tuple(x.shape)} and {tuple(y.shape)}")
        return x, y

    def on_train_batch_start(self, batch, batch_idx) -> None:
        self._graphed_clipped = False
        self._timer.start(batch[0].is_cuda)
        if self._fsdp2.active and self.hessian_refresh_pending:
            self._fsdp2.begin()  # FSDP2: full parameters through the refresh step (docs/distributed.md)

    # ------------------------------------------------------------------ distributed (docs/distributed.md)

    def setup(self, stage: str) -> None:
        self.context_parallel_plan.setup(self.model)  # groups and the GPT switch (context_parallel > 1)

    def configure_model(self) -> None:
        # --trainer.strategy=fsdp2: each GPT block and the GPT sharded with fully_shard
        self._fsdp2.shard(self, self.model, "blocks")
        if self._fsdp2.active:
            hp = self.hparams
            if self.context_parallel_plan.active:
                raise ValueError("context_parallel > 1 runs under --trainer.strategy=ddp, not fsdp2")
            if self.second_order and hp.get("hessian_mode", "rev_rev") != "rev_rev":
                raise ValueError("under --trainer.strategy=fsdp2 the Hessian refresh takes hessian_mode='rev_rev' "
                                 "(the full parameters are held through the refresh step); set hessian_mode: rev_rev")
            if self.second_order and self.trainer.accumulate_grad_batches != 1:
                raise ValueError("under --trainer.strategy=fsdp2 a second-order optimizer needs "
                                 "accumulate_grad_batches=1 (or use --trainer.strategy=ddp)")

    def on_train_start(self) -> None:
        # Under DDP with a second-order optimizer: DDP's hooks cannot reduce a
        # backward(create_graph=True), so they are switched off; gradients stay local, the
        # Hessian refresh averages its estimate itself (update_hessian(weight=...)), and
        # on_before_optimizer_step (after HessianRefresh's, before clipping) averages the
        # gradients, weighted by each process's number of tokens. AdamW keeps DDP's own sync
        # (not with context parallelism: its shares are averaged the same explicit way).
        local = self.second_order or self.context_parallel_plan.active
        self._local.begin(self.trainer, local)
        self._graphed.reset()
        self._late_loss.reset()

    def on_before_optimizer_step(self, optimizer) -> None:
        if self._fsdp2.open:  # FSDP2 refresh step: the full gradients reduce-scattered to the shards
            self._fsdp2.full.reduce_gradients()
            self._fsdp2.end()
        self._local.average(self.model.parameters())

    def _loss(self, batch) -> Tuple[Tensor, Tensor, int, int]:
        """(loss to backpropagate, loss to log, gradient weight, batch size)."""
        x, y = self._check_batch(batch)
        if not self.context_parallel_plan.active:
            loss = self.model.loss(x, y)
            return loss, loss, x.numel(), x.shape[0]
        x, y, n = self.context_parallel_plan.shard(x, y)
        part, mean = self.context_parallel_plan.loss(self.model(x), y, n)
        return part, mean, n, x.shape[0]

    # ------------------------------------------------------------------ cuda_graph (docs/cuda-graphs.md)

    def on_load_checkpoint(self, checkpoint) -> None:
        self._graphed.reset()  # new optimizer state and probe generator: capture again

    def _graph_blocker(self) -> Optional[str]:
        if self._local.active or self.context_parallel_plan.active or self._fsdp2.active:
            return "DDP / FSDP2 / context parallelism"
        if self.trainer.accumulate_grad_batches != 1:
            return "gradient accumulation"
        if self.second_order and self.hparams.get("hessian_mode", "rev_rev") != "rev_rev":
            return "hessian_mode='fwd_rev'"
        return None

    def _graphed_grads(self, x: Tensor, y: Tensor) -> Tensor:
        """The loss and its gradients (written in place into ``p.grad``): the plain step's graph."""
        loss = self.model.loss(x, y)
        with outside_autocast(loss):
            backward_into_grads(loss, self.model.parameters())
        return loss.detach()

    def _refresher(self) -> Tuple[HessianOptimizer, "HessianRefresh"]:
        opt = self.trainer.optimizers[0]
        cb = next(c for c in self.trainer.callbacks if isinstance(c, HessianRefresh) and c.mode == "rev_rev")
        return opt, cb

    def _graphed_refresh(self, x: Tensor, y: Tensor):
        """The loss, its gradients (written into ``p.grad``) and the Hutchinson samples
        z ∘ (H z) of the optimizer's parameters (None where the loss does not reach one),
        averaged over the callback's ``n_samples`` probes: the refresh step's graph."""
        opt, cb = self._refresher()
        pairs = opt._trainable()
        params = [p for _, p in pairs]
        loss = self.model.loss(x, y)
        gen = cb._probe_generator(opt)
        acc = [None] * len(pairs)
        with outside_autocast(loss):
            grads = torch.autograd.grad(loss, params, create_graph=True, allow_unused=True)
            live = [i for i, g in enumerate(grads) if g is not None and g.requires_grad]
            for _ in range(cb.n_samples):
                z_all = [probe_like([p], g["probe"], gen)[0] for g, p in pairs]  # drawn as update_hessian draws
                hz = torch.autograd.grad([grads[i] for i in live], [params[i] for i in live],
                                         [z_all[i] for i in live], retain_graph=True, allow_unused=True)
                hz_all = [None] * len(pairs)
                for i, h in zip(live, hz):
                    hz_all[i] = torch.zeros_like(z_all[i]) if h is None else h
                accumulate_samples(acc, live, z_all, hz_all)
        write_grads(params, [torch.zeros_like(p) if g is None else g.detach() for p, g in zip(params, grads)])
        if cb.n_samples > 1 and live:
            torch._foreach_div_([acc[i] for i in live], float(cb.n_samples))
        return loss.detach(), acc

    def _clip_in_graph(self, opt) -> None:
        """The Trainer's gradient clipping (``gradient_clip_val``), as Lightning runs it after
        the closure: inside the whole-step graph, where ``configure_gradient_clipping`` skips it."""
        if self.trainer.gradient_clip_val:
            self.clip_gradients(opt, gradient_clip_val=self.trainer.gradient_clip_val,
                                gradient_clip_algorithm=self.trainer.gradient_clip_algorithm)

    def _graphed_update(self, x: Tensor, y: Tensor):
        """The plain step's whole graph: loss and gradients, clipping, the optimizer update
        (its device part; the host part ran before the replay)."""
        opt = self.trainer.optimizers[0]
        loss = self._graphed_grads(x, y)
        with outside_autocast(loss):
            self._clip_in_graph(opt)
            opt.device_step(opt._trainable())
        return loss, getattr(opt, "clip_fraction", None)

    def _graphed_refresh_update(self, x: Tensor, y: Tensor):
        """The Hessian-refresh step's whole graph: loss, gradients, the Hutchinson products,
        the estimate folded into the optimizer state, clipping, the optimizer update."""
        opt, _ = self._refresher()
        pairs = opt._trainable()
        loss, samples = self._graphed_refresh(x, y)
        live = [(pair, sample) for pair, sample in zip(pairs, samples) if sample is not None]
        with outside_autocast(loss):
            opt.device_refresh([pair for pair, _ in live], [sample for _, sample in live])
            self._clip_in_graph(opt)
            opt.device_step(pairs)
        return loss, getattr(opt, "clip_fraction", None)

    def _whole_step(self, opt) -> bool:
        """Whether the optimizer update is captured with the step (a capturable second-order
        optimizer)."""
        return isinstance(opt, HessianOptimizer) and all(g["capturable"] for g in opt.param_groups)

    def _graphed_whole_step(self, x: Tensor, y: Tensor, opt: HessianOptimizer) -> Tensor:
        name = "LanguageModel.training_step"
        pairs = opt._trainable()
        refresh = self.hessian_refresh_pending
        gens = []
        if refresh:
            _, cb = self._refresher()
            gens = [cb._probe_generator(opt)]
            opt.host_refresh(pairs)  # every parameter of the GPT is reached by its loss
        opt.host_step(pairs)  # counters; learning rate and bias corrections written into device tensors
        fn, kind = (self._graphed_refresh_update, "refresh_update") if refresh else (self._graphed_update, "update")
        loss, clip = self._graphed.run(fn, (x, y), [p for _, p in pairs], optimizers=[opt],
                                       name=name + (" (Hessian refresh)" if refresh else ""), kind=kind,
                                       generators=gens)
        if clip is not None:
            opt.clip_fraction = clip
        opt.skip_next_update()  # Lightning's optimizer.step(closure) now runs only the closure
        self._graphed_clipped = True
        if refresh:
            self.hessian_refresh_pending = False
            cb.refreshes += 1
        return loss.clone()

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None) -> None:
        if getattr(self, "_graphed_clipped", False):
            self._graphed_clipped = False  # clipped inside the whole-step graph
            return
        super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)

    def _graphed_step(self, x: Tensor, y: Tensor) -> Tensor:
        name = "LanguageModel.training_step"
        opt = self.trainer.optimizers[0]
        if self._whole_step(opt):
            return self._graphed_whole_step(x, y, opt)
        if not self.hessian_refresh_pending:
            return self._graphed.run(self._graphed_grads, (x, y), self.model.parameters(), name=name).clone()
        opt, cb = self._refresher()
        pairs = opt._trainable()
        loss, samples = self._graphed.run(self._graphed_refresh, (x, y), [p for _, p in pairs],
                                          name=name + " (Hessian refresh)", kind="refresh",
                                          generators=[cb._probe_generator(opt)])
        live = [(pair, sample) for pair, sample in zip(pairs, samples) if sample is not None]
        with torch.no_grad():  # HessianOptimizer.update_hessian's last part, on the graph's samples
            opt.host_refresh([pair for pair, _ in live])
            opt.device_refresh([pair for pair, _ in live], [sample for _, sample in live])
        self.hessian_refresh_pending = False
        cb.refreshes += 1
        return loss.clone()

    def training_step(self, batch, batch_idx: int) -> Tensor:
        graphed = self._graphed.enabled and self._graphed.usable(batch[0].is_cuda, self._graph_blocker())
        if graphed:
            x, y = self._check_batch(batch)
            loss = shown = self._graphed_step(x, y)
            weight, b = x.numel(), x.shape[0]
        else:
            loss, shown, weight, b = self._loss(batch)
        self._local.add(weight)
        self.log("train/loss", shown, prog_bar=not graphed, batch_size=b)
        if graphed:  # the progress bar reads its numbers on the host: the previous step's loss, no wait
            previous = self._late_loss.push(shown)
            if previous is not None:
                self.log("train/loss_prev", previous, prog_bar=True, logger=False, batch_size=b)
        self.log("train/lr", host_number(self.trainer.optimizers[0].param_groups[0]["lr"]), batch_size=b)
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        self._fsdp2.end()  # a no-op unless a step ended without its optimizer step
        self._timer.log(self, batch[0].is_cuda, batch[0].shape[0])
        opt = self.trainer.optimizers[0] if self.trainer.optimizers else None
        if isinstance(opt, SophiaH) and opt.clip_fraction is not None:
            self.log("train/clip_fraction", opt.clip_fraction, batch_size=batch[0].shape[0])

    def validation_step(self, batch, batch_idx: int) -> None:
        _, loss, _, b = self._loss(batch)
        self.log("val/loss", loss, prog_bar=True, batch_size=b, on_epoch=True, sync_dist=True)
        self.log("val/bits_per_token", loss / math.log(2), batch_size=b, on_epoch=True, sync_dist=True)

    def test_step(self, batch, batch_idx: int) -> None:
        _, loss, _, b = self._loss(batch)
        self.log("test/loss", loss, batch_size=b, on_epoch=True, sync_dist=True)
        self.log("test/bits_per_token", loss / math.log(2), batch_size=b, on_epoch=True, sync_dist=True)
