"""LightningModules and a DataModule for gradient-written memory on associative recall.

* :class:`AssociativeRecallDataModule`: key–value retrieval / MQAR batches generated on the
  fly (:class:`ttt_flash.tasks.AssociativeRecallTasks`), seedable, nothing downloaded.
* :class:`GradMemKV`: a GPT with :class:`ttt_flash.memory.GradMem` memory tokens.
* :class:`TTTE2EMQAR`: a sliding-window GPT with fast-weight MLPs
  (:class:`ttt_flash.memory.FastWeightTTT`).
* :class:`MemoryLayerMQAR`: a :class:`ttt_flash.memory.MemoryLM` (every token mixer a
  :class:`ttt_flash.memory.GradientMemoryAttention`).

Each module takes its network as ``net`` (in a recipe ``net: {class_path: ..., init_args:
...}``, composed by the CLI) and holds only the training settings: ``lr``, ``weight_decay``,
``warmup_steps``, ``context_parallel``, ``cuda_graph``.

Each module scores the queries of a batch twice and logs, per stage (``train``, ``val``,
``test``):

* ``{stage}/loss_pre``, ``{stage}/acc_pre``: before the context is written (the initial
  memory / fast weights / slots; the chance level of the task for a model that has no
  other access to the context),
* ``{stage}/loss_post``, ``{stage}/acc_post``: after it is written (the trained loss),
* ``{stage}/inner_loss``: the inner (write) loss before the first inner step,
* ``train/inner_lr``: the learned inner step size (mean over layers for the memory layer).

Training also logs ``train/step_time_s`` (wall clock of one optimizer step: forward, inner
loops, backward, update), ``train/tokens_per_s`` (context and query tokens of the batch per
second), ``train/context_len`` (the batch's context length: a ``curriculum`` grows it) and,
on CUDA, ``train/peak_mem_gib`` (``torch.cuda.max_memory_allocated`` during the
step). Validation/test run the inner loops with gradients enabled (outside
``inference_mode``) and keep no outer graph.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torch import Tensor, nn

from ._step import (GraphedTraining, GraphedZeroGrad, LocalGradients, StepTimer, backward_into_grads, host_number,
                    outside_autocast)
from .checkpoint_io import save_hyperparameters_with_net
from .context_parallel import ContextParallelPlan
from .curriculum import staged
from .data import GeneratedDataModule
from ..memory import FastWeightTTT, GradMem, MemoryLM
from ..second_order.grad import calling_thread_backward
from ..tasks import AssociativeRecallTasks, RecallBatch

__all__ = ["AssociativeRecallDataModule", "GradMemKV", "TTTE2EMQAR", "MemoryLayerMQAR"]

# --------------------------------------------------------------------------- data


class AssociativeRecallDataModule(GeneratedDataModule):
    """Associative-recall batches (:class:`ttt_flash.tasks.AssociativeRecallTasks`):
    ``num_queries: 1`` is key–value retrieval, more is MQAR.

    Every item of a loader is one :class:`ttt_flash.tasks.RecallBatch` of ``batch_size``
    sequences; batch ``i`` of a split comes from a generator seeded with (seed, split, i).
    Training batches are fresh every epoch; validation/test batches are the same every time.
    The training order's position is saved in checkpoints: a resumed run continues with the
    next unseen batch.

    Args:
        num_keys, num_values, num_pairs, num_queries, context_len: the task
            (vocabulary size ``num_keys + num_values + 1``; chance accuracy ``1/num_values``).
        batch_size: sequences per batch.
        train_batches: batches per training epoch.
        val_batches: batches per validation run.
        test_batches: batches of the test split.
        seed: seed of all sampling.
        num_workers: DataLoader worker processes.
        curriculum: training context lengths ``[[first_step, context_len], ...]``
            (:mod:`ttt_flash.lightning.curriculum`: short first; each stage's length is
            even and >= 2 · num_pairs); validation and test batches keep ``context_len``.
            None: every batch has ``context_len``.
    """

    def __init__(
        self,
        num_keys: int = 16,
        num_values: int = 16,
        num_pairs: int = 4,
        num_queries: int = 1,
        context_len: Optional[int] = None,
        batch_size: int = 32,
        train_batches: int = 1000,
        val_batches: int = 4,
        test_batches: int = 16,
        seed: int = 0,
        num_workers: int = 0,
        curriculum: Optional[List[List[int]]] = None,
    ):
        tasks = AssociativeRecallTasks(num_keys=num_keys, num_values=num_values, num_pairs=num_pairs,
                                       num_queries=num_queries, context_len=context_len)
        super().__init__(tasks, batch_size, train_batches, val_batches, test_batches, seed, num_workers,
                         batch_size_name="batch_size")
        self.save_hyperparameters()
        self.staged = staged(curriculum, lambda n: dataclasses.replace(self.tasks, context_len=n))

    @property
    def vocab_size(self) -> int:
        return self.tasks.vocab_size

    @property
    def chance(self) -> float:
        return self.tasks.chance


# --------------------------------------------------------------------------- shared module logic


class _RecallModule(GraphedZeroGrad, LightningModule):
    """Shared by the three modules: the network, metrics, logging, optimizer, throughput.

    Subclasses name their network's class (``net_type``) and implement
    ``_query_logits(batch, write)`` returning the (B, Q, vocab) query logits and the inner
    loss before the first step (or None)."""

    #: (metric, mode) the best checkpoints are ranked by (ttt_flash.lightning.outputs.BestCheckpoints)
    val_metric = ("val/loss_post", "min")
    #: the learning-rate schedule (a linear warmup) does not depend on the run's length
    schedule_spans_run = False

    #: the network class ``net`` must be
    net_type: type = nn.Module
    #: where a recipe sets the network's vocabulary size
    vocab_key = "model.init_args.net.init_args.vocab_size"

    def __init__(self, net: nn.Module, lr: float, weight_decay: float, warmup_steps: int,
                 context_parallel: int, cuda_graph: bool):
        super().__init__()
        if not isinstance(net, self.net_type):
            path = f"{self.net_type.__module__.rsplit('.', 1)[0]}.{self.net_type.__name__}"
            raise TypeError(f"{type(self).__name__}'s net must be a {path} (in a recipe: net: {{class_path: "
                            f"{path}, init_args: ...}}), got {type(net).__name__}")
        if not lr > 0:
            raise ValueError(f"lr must be > 0, got {lr}")
        if not weight_decay >= 0:
            raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
        save_hyperparameters_with_net(self, net)
        self.net = net
        self._timer, self._local = StepTimer(), LocalGradients()
        self._graphed = GraphedTraining(cuda_graph)
        #: context parallelism (docs/distributed.md)
        self.context_parallel_plan = ContextParallelPlan(context_parallel)

    def _query_logits(self, batch: RecallBatch, write: bool) -> Tuple[Tensor, Optional[Tensor]]:
        raise NotImplementedError

    def _inner_lr(self) -> Tensor:
        return self.net.inner_lr

    # ---------------------------------------------------------------- metrics

    def _metrics(self, batch: RecallBatch, train: bool) -> Dict[str, Tensor]:
        if not isinstance(batch, RecallBatch):
            raise TypeError(f"{type(self).__name__} expects ttt_flash.tasks.RecallBatch batches, got {type(batch).__name__}")
        batch = RecallBatch(*self.context_parallel_plan.broadcast(*batch))  # the group's batch (context_parallel > 1)
        targets = batch.query_targets
        out: Dict[str, Tensor] = {}
        # The loss in float32 for half-precision logits; float64 stays float64.
        upcast = lambda t: t.float() if t.dtype in (torch.float16, torch.bfloat16) else t  # noqa: E731
        with torch.no_grad():
            logits, _ = self._query_logits(batch, write=False)
            out["loss_pre"] = F.cross_entropy(upcast(logits).flatten(0, 1), targets.flatten())
            out["acc_pre"] = (logits.argmax(-1) == targets).float().mean()
        with torch.set_grad_enabled(train):
            logits, inner = self._query_logits(batch, write=True)
            out["loss_post"] = F.cross_entropy(upcast(logits).flatten(0, 1), targets.flatten())
        out["acc_post"] = (logits.detach().argmax(-1) == targets).float().mean()
        if inner is not None:
            out["inner_loss"] = inner
        return out

    def _log_all(self, stage: str, metrics: Dict[str, Tensor], batch_size: int, **kw) -> None:
        for name, value in metrics.items():
            self.log(f"{stage}/{name}", value.detach() if name == "loss_post" else value,
                     batch_size=batch_size, prog_bar=name in ("loss_post", "acc_post"),
                     sync_dist=stage != "train", **kw)  # val/test: the mean of every process

    # ---------------------------------------------------------------- distributed (docs/distributed.md)

    def setup(self, stage: str) -> None:
        # context_parallel > 1: the groups, and the network's GPT switched to its group. Every
        # rank of a group then trains on the group's first rank's batch (broadcast in _metrics),
        # each on its block of the written sequence; the loss and the logged metrics are the
        # same on every rank of a group, and the explicit averaging below (weight: the batch's
        # query targets, the same on every rank of a group) gives each group's gradient the
        # weight of its batch: the mean over a group of its ranks' shares is the group's
        # gradient (ttt_flash.memory.GradMem's docstring).
        self.context_parallel_plan.setup(self.net)

    def on_train_start(self) -> None:
        # Under DDP: its hooks cannot reduce a backward through the inner loops' autograd.grad
        # graphs correctly, so they are switched off; gradients stay local and are averaged
        # in on_before_optimizer_step, weighted by each process's number of query targets.
        self._local.begin(self.trainer)
        self._graphed.reset()

    def on_before_optimizer_step(self, optimizer) -> None:  # before gradient clipping
        self._local.average(self.parameters())

    # ---------------------------------------------------------------- cuda_graph (docs/cuda-graphs.md)

    def on_load_checkpoint(self, checkpoint) -> None:
        self._graphed.reset()

    def _graphed_metrics(self, *fields) -> Dict[str, Tensor]:
        """The training metrics of ``RecallBatch(*fields)`` and the gradients of ``loss_post``
        (written in place into ``p.grad``): what ``cuda_graph=True`` captures."""
        metrics = self._metrics(RecallBatch(*fields), train=True)
        with outside_autocast(metrics["loss_post"]):
            backward_into_grads(metrics["loss_post"], self.parameters())
        return {k: v.detach() for k, v in metrics.items()}

    def _graph_blocker(self) -> Optional[str]:
        if self._local.active or self.context_parallel_plan.active:
            return "DDP / context parallelism"
        if self.trainer.accumulate_grad_batches != 1:
            return "gradient accumulation"
        return None

    def backward(self, loss: Tensor, *args, **kwargs) -> None:
        """Lightning's backward, on the calling thread like the memory writes'
        (:class:`ttt_flash.second_order.calling_thread_backward`)."""
        if self._graphed.take_backward():
            return  # the graph replayed this step's backward
        with calling_thread_backward():
            super().backward(loss, *args, **kwargs)

    def training_step(self, batch: RecallBatch, batch_idx: int) -> Tensor:
        self._local.add(batch.query_targets.numel())
        if self._graphed.enabled and self._graphed.usable(batch.context.is_cuda, self._graph_blocker()):
            params = [p for p in self.parameters() if p.requires_grad]
            metrics = self._graphed.run(self._graphed_metrics, tuple(batch), params,
                                        name=f"{type(self).__name__}.training_step")
            metrics = {k: v.clone() for k, v in metrics.items()}  # overwritten by the next replay
        else:
            metrics = self._metrics(batch, train=True)
        self._log_all("train", metrics, batch.context.shape[0])
        self.log("train/inner_lr", self._inner_lr().detach(), batch_size=batch.context.shape[0])
        self.log("train/context_len", host_number(batch.context.shape[1]), batch_size=batch.context.shape[0])
        return metrics["loss_post"]

    def _evaluate(self, batch: RecallBatch, stage: str) -> None:
        # Lightning evaluates under inference_mode; the inner loops need autograd.
        with torch.inference_mode(False):
            batch = RecallBatch(*(x.clone() for x in batch))
            metrics = self._metrics(batch, train=False)
        self._log_all(stage, metrics, batch.context.shape[0], on_epoch=True)

    def validation_step(self, batch: RecallBatch, batch_idx: int) -> None:
        self._evaluate(batch, "val")

    def test_step(self, batch: RecallBatch, batch_idx: int) -> None:
        self._evaluate(batch, "test")

    # ---------------------------------------------------------------- vocabulary check

    def on_fit_start(self) -> None:
        data = getattr(self.trainer, "datamodule", None)
        need = getattr(data, "vocab_size", None)
        if need is not None and need > self.net.vocab_size:
            raise ValueError(
                f"the data has {need} token ids (num_keys + num_values + 1) but the network's "
                f"vocab_size is {self.net.vocab_size}; set {self.vocab_key} >= {need}"
            )

    # ---------------------------------------------------------------- optimizer

    def configure_optimizers(self):
        hp = self.hparams
        decay = [p for p in self.parameters() if p.requires_grad and p.dim() >= 2]
        rest = [p for p in self.parameters() if p.requires_grad and p.dim() < 2]
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": hp.weight_decay},
                                 {"params": rest, "weight_decay": 0.0}], lr=hp.lr, betas=(0.9, 0.95))
        warmup = max(1, hp.warmup_steps)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / warmup))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    # ---------------------------------------------------------------- throughput

    def on_train_batch_start(self, batch: RecallBatch, batch_idx: int) -> None:
        self._timer.start(batch.context.is_cuda)

    def on_train_batch_end(self, outputs, batch: RecallBatch, batch_idx: int) -> None:
        b = batch.context.shape[0]
        elapsed = self._timer.log(self, batch.context.is_cuda, b)
        if elapsed is not None:
            self.log("train/tokens_per_s", host_number(batch.num_tokens / elapsed), batch_size=b)


# --------------------------------------------------------------------------- the modules

class GradMemKV(_RecallModule):
    """Key–value retrieval with gradient-written memory tokens (:class:`ttt_flash.memory.GradMem`).

    The context is written into the network's memory tokens by its inner gradient steps on
    the context's LM loss (the value after each key); the queries are answered from
    ``[memory; query]``. Pre-write metrics read the initial memory.

    Args:
        net: the network, a :class:`ttt_flash.memory.GradMem` (in a recipe ``net: {class_path:
            ttt_flash.memory.GradMem, init_args: {model: {vocab_size: ..., n_layer: ...},
            memory_tokens: ..., inner_steps: ...}}``, ``model`` a
            :class:`~ttt_flash.models.GPTConfig` or a :class:`~ttt_flash.models.GPT`). Its
            vocabulary must cover the data's ``num_keys + num_values + 1`` token ids.
        context_parallel: ranks per sequence under DDP (1: off). The W processes form W / P
            context-parallel groups of P consecutive ranks, data parallel across groups; each
            group trains on its first rank's batch, each rank writing its block of the
            ``[memory; context]`` sequence (:class:`ttt_flash.memory.GradMem`,
            docs/distributed.md). Needs the GPT's ``attention="ttt_flash"`` and ``n_head`` >= P.
        lr, weight_decay, warmup_steps: AdamW (weight decay on matrices only) with linear warmup.
        cuda_graph: on CUDA, capture the training step's forward, inner loops and backward
            as a CUDA graph once per batch shape and replay it (docs/cuda-graphs.md); the
            optimizer step stays eager. The CPU, DDP, context parallelism and gradient
            accumulation run eagerly (one warning). Validation stays eager.
    """

    net_type = GradMem
    vocab_key = "model.init_args.net.init_args.model.vocab_size"

    def __init__(
        self,
        net: GradMem,
        lr: float = 1e-3,
        weight_decay: float = 0.0,
        warmup_steps: int = 50,
        context_parallel: int = 1,
        cuda_graph: bool = False,
    ):
        super().__init__(net, lr, weight_decay, warmup_steps, context_parallel, cuda_graph)

    def _query_logits(self, batch: RecallBatch, write: bool):
        if not write:
            return self.net.read(self.net.initial_memory(batch.query.shape[0]), batch.query), None
        memory, losses = self.net.write(batch.context, batch.context_targets)
        return self.net.read(memory, batch.query), (losses[0] if losses else None)


class TTTE2EMQAR(_RecallModule):
    """MQAR with end-to-end test-time training (:class:`ttt_flash.memory.FastWeightTTT`).

    The network's fast MLPs are updated on each chunk of the context by inner gradient steps
    of its next-token loss; attention is the GPT's sliding window, so the queries (after the
    context) see the early pairs only through the fast weights. Pre-adaptation metrics use
    the initial fast weights.

    Args:
        net: the network, a :class:`ttt_flash.memory.FastWeightTTT` (in a recipe ``net:
            {class_path: ttt_flash.memory.FastWeightTTT, init_args: {model: {vocab_size: ...,
            window: ...}, fast_layers: ..., chunk_size: ...}}``); its GPT needs a ``window``
            (the point of the task).
        context_parallel: as in :class:`GradMemKV`; each rank runs its block of every chunk's
            sequence (:class:`ttt_flash.memory.FastWeightTTT`).
        lr, weight_decay, warmup_steps, cuda_graph: as in :class:`GradMemKV`.
    """

    net_type = FastWeightTTT
    vocab_key = "model.init_args.net.init_args.model.vocab_size"

    def __init__(
        self,
        net: FastWeightTTT,
        lr: float = 1e-3,
        weight_decay: float = 0.0,
        warmup_steps: int = 50,
        context_parallel: int = 1,
        cuda_graph: bool = False,
    ):
        super().__init__(net, lr, weight_decay, warmup_steps, context_parallel, cuda_graph)

    def _query_logits(self, batch: RecallBatch, write: bool):
        if not write:
            return self.net.predict(None, batch.context, batch.query), None
        fast, losses = self.net.adapt(batch.context, batch.context_targets)
        return self.net.predict(fast, batch.context, batch.query), (losses[0] if losses else None)


class MemoryLayerMQAR(_RecallModule):
    """MQAR with :class:`ttt_flash.memory.GradientMemoryAttention` as every token mixer
    (:class:`ttt_flash.memory.MemoryLM`).

    The model reads ``[context; query]`` in chunks of the network's ``chunk_size``; each chunk
    sees the slots and itself, then is written into the slots. With ``context_len`` a
    multiple of ``chunk_size``, the queries reach the pairs only through the slots. Pre-write
    metrics run the same model with writes disabled.

    Args:
        net: the network, a :class:`ttt_flash.memory.MemoryLM` (in a recipe ``net:
            {class_path: ttt_flash.memory.MemoryLM, init_args: {vocab_size: ...,
            memory_slots: ..., chunk_size: ..., write_rule: ...}}``; its arguments are those
            of every memory layer).
        context_parallel: must be 1. The memory layer reads and writes its slots chunk after
            chunk, so a contiguous block of the sequence per rank would leave all but one rank
            idle (docs/distributed.md); use data parallelism.
        lr, weight_decay, warmup_steps, cuda_graph: as in :class:`GradMemKV`.
    """

    net_type = MemoryLM

    def __init__(
        self,
        net: MemoryLM,
        lr: float = 1e-3,
        weight_decay: float = 0.0,
        warmup_steps: int = 50,
        context_parallel: int = 1,
        cuda_graph: bool = False,
    ):
        if context_parallel != 1:
            raise ValueError(
                f"MemoryLayerMQAR does not take context_parallel={context_parallel!r} (only 1): the memory "
                "layer writes its slots chunk after chunk, so each chunk would run on one rank while the "
                "others wait (docs/distributed.md). Use data parallelism (--trainer.strategy=ddp), or "
                "GradMemKV / TTTE2EMQAR, which take context_parallel"
            )
        super().__init__(net, lr, weight_decay, warmup_steps, context_parallel, cuda_graph)

    def _inner_lr(self) -> Tensor:
        return torch.stack([block.attn.inner_lr for block in self.net.blocks]).mean()

    def _query_logits(self, batch: RecallBatch, write: bool):
        idx = torch.cat([batch.context, batch.query], dim=1)
        logits = self.net(idx, write=write)
        return logits[:, batch.context.shape[1]:], None

