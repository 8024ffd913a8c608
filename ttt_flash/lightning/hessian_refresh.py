"""The Hessian-refresh callback of second-order language modelling: on the steps where the
estimate is due, the module's backward runs with ``create_graph=True`` and, before the optimizer
step, the optimizer's Hutchinson estimate is refreshed from that graph
(:meth:`ttt_flash.second_order.optim.SophiaH.update_hessian`). :class:`~ttt_flash.lightning.lm.LanguageModel`
adds one by itself when its optimizer is second-order and the Trainer has none."""

from __future__ import annotations

import contextlib
import time
from typing import List, Optional, Tuple

import torch
from lightning.pytorch import Callback
from torch import Tensor

from ..fsdp import update_hessian as fsdp_update_hessian
from ..second_order.optim import HessianOptimizer
from ._step import host_number

__all__ = ["HessianRefresh", "HESSIAN_MODES"]

#: Accepted values of ``HessianRefresh(mode=...)`` / ``LanguageModel(hessian_mode=...)``.
HESSIAN_MODES = ("rev_rev", "fwd_rev")

def _grad_weight(pl_module) -> Optional[int]:
    """This process's share of the global batch under DDP (None: no share recorded)."""
    local = getattr(pl_module, "_local", None)
    return getattr(local, "weight", None) or None


class HessianRefresh(Callback):
    """Refresh a second-order optimizer's Hessian estimate on schedule, from the training
    step's own loss graph (exact second-order products; no extra forward pass).

    On a refresh step the callback sets ``pl_module.hessian_refresh_pending = True`` before
    the batch; the module's ``backward`` must then run ``loss.backward(create_graph=True)``
    (:class:`LanguageModel` does). Before the optimizer step (``on_before_optimizer_step``,
    i.e. before gradient clipping) it calls ``optimizer.update_hessian()``, which takes the
    Hutchinson product through that graph and frees it. With gradient accumulation every
    micro-batch of the step keeps its graph, and the estimate is that of the summed loss.

    Args:
        every_k: refresh every ``every_k`` optimizer steps (global steps 0, k, 2k, ...).
            ``None``: when the optimizer says so (its ``hessian_due``, i.e. its own ``k``).
        n_samples: Hutchinson probes per refresh (each one Hessian-vector product).
        seed: seed of the callback's own probe generator (on the parameters' device);
            ``None``: ``torch.initial_seed()`` (the run's ``seed_everything`` seed). The
            generator's state and the refresh count are saved in checkpoints, so a resumed
            run draws the probes the uninterrupted run would have drawn.
        mode: ``"rev_rev"`` (default): products through the step's ``create_graph`` graph,
            as above. ``"fwd_rev"``: forward over reverse (:mod:`ttt_flash.second_order`); the
            step's backward stays first-order and, before the optimizer step, each probe
            re-runs ``pl_module.hessian_loss(batch)`` on the step's (last) batch, keeping
            no ``create_graph`` graph (less memory, one more forward and backward; with
            dropout the re-run draws fresh masks).
        recompute: ``mode="fwd_rev"`` only: submodule names of the LightningModule whose
            calls are recomputation units in each product (e.g. ``"model.blocks"``: every
            transformer block of :class:`LanguageModel`): a product then keeps only each
            block's inputs and their tangents and recomputes the block in its backward pass
            (:mod:`ttt_flash.second_order.recomputation`; the refresh's peak memory falls to a few
            blocks' activations, for about one more forward per product).

    Optimizers without ``update_hessian`` (e.g. AdamW) are left alone. Automatic
    optimization only; fp16 loss scaling is not supported (the estimate would be scaled):
    use ``precision="bf16-mixed"`` or 32-bit.
    """

    def __init__(self, every_k: Optional[int] = None, n_samples: int = 1, seed: Optional[int] = None,
                 mode: str = "rev_rev", recompute=None):
        if every_k is not None and (isinstance(every_k, bool) or not isinstance(every_k, int) or every_k < 1):
            raise ValueError(f"every_k must be an int >= 1 or None, got {every_k!r}")
        if isinstance(n_samples, bool) or not isinstance(n_samples, int) or n_samples < 1:
            raise ValueError(f"n_samples must be an int >= 1, got {n_samples!r}")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise ValueError(f"seed must be an int or None, got {seed!r}")
        if mode not in HESSIAN_MODES:
            raise ValueError(f"mode must be one of {HESSIAN_MODES}, got {mode!r}")
        if recompute is not None and mode != "fwd_rev":
            raise ValueError(
                f"HessianRefresh(recompute={recompute!r}) needs mode='fwd_rev' (reverse over reverse "
                "keeps the step's whole create_graph graph, recomputed or not)"
            )
        self.every_k, self.n_samples, self.seed, self.mode = every_k, n_samples, seed, mode
        self.recompute = recompute
        self._batch = None
        #: Number of refreshes done.
        self.refreshes = 0
        self._refresh_s = 0.0
        self._generator: Optional[torch.Generator] = None
        self._generator_state: Optional[Tuple[str, Tensor]] = None  # loaded, applied on first use

    def _probe_generator(self, optimizer) -> torch.Generator:
        device = next(p.device for g in optimizer.param_groups for p in g["params"])
        if self._generator is None or self._generator.device.type != device.type:
            self._generator = torch.Generator(device=device)
            self._generator.manual_seed(torch.initial_seed() if self.seed is None else self.seed)
            if self._generator_state is not None and self._generator_state[0] == device.type:
                self._generator.set_state(self._generator_state[1])
            self._generator_state = None
        return self._generator

    def state_dict(self) -> dict:
        """Refresh count and probe-generator state (checkpointed by Lightning)."""
        state = {"refreshes": self.refreshes}
        if self._generator is not None:
            state["generator"] = (self._generator.device.type, self._generator.get_state())
        elif self._generator_state is not None:  # loaded, not yet used: saved again as loaded
            state["generator"] = self._generator_state
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        self.refreshes = int(state_dict.get("refreshes", 0))
        self._generator = None
        self._generator_state = state_dict.get("generator")

    @staticmethod
    def _second_order(trainer) -> List[HessianOptimizer]:
        return [o for o in trainer.optimizers if hasattr(o, "update_hessian")]

    def on_fit_start(self, trainer, pl_module) -> None:
        if self._second_order(trainer) and str(trainer.precision) in ("16-mixed", "16", "16-true"):
            raise ValueError(
                f"HessianRefresh does not support precision={trainer.precision!r} (fp16 loss scaling "
                "would scale the Hessian estimate): use 'bf16-mixed' or '32-true'"
            )

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        opts = self._second_order(trainer)
        if not opts:
            due = False
        elif self.every_k is not None:
            due = trainer.global_step % self.every_k == 0
        else:
            due = any(o.hessian_due for o in opts)
        # fwd_rev: the backward stays first-order; the batch is kept for the refresh
        pl_module.hessian_refresh_pending = due and self.mode == "rev_rev"
        self._batch = batch if due and self.mode == "fwd_rev" else None

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if self.mode == "fwd_rev":
            self._refresh_fwd_rev(trainer, pl_module, optimizer)
            return
        if not getattr(pl_module, "hessian_refresh_pending", False) or not hasattr(optimizer, "update_hessian"):
            return
        cuda = any(p.is_cuda for g in optimizer.param_groups for p in g["params"])
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        try:
            fsdp2 = getattr(pl_module, "_fsdp2", None)
            if fsdp2 is not None and fsdp2.open:  # FSDP2: through the full parameters' graph (ttt_flash.fsdp)
                fsdp_update_hessian(optimizer, fsdp2.full, n_samples=self.n_samples,
                                    generator=self._probe_generator(optimizer))
            else:
                # weight: this process's share of the global batch under DDP (docs/distributed.md).
                optimizer.update_hessian(n_samples=self.n_samples, generator=self._probe_generator(optimizer),
                                         weight=_grad_weight(pl_module))
        except ValueError as e:
            raise RuntimeError(
                f"HessianRefresh: {e}. The LightningModule's backward must call "
                "loss.backward(create_graph=True) while `self.hessian_refresh_pending` is True "
                "(ttt_flash.lightning.lm.LanguageModel does)"
            ) from e
        if cuda:
            torch.cuda.synchronize()
        pl_module.hessian_refresh_pending = False
        self.refreshes += 1
        self._refresh_s = time.perf_counter() - start

    def _refresh_fwd_rev(self, trainer, pl_module, optimizer) -> None:
        batch = self._batch
        if batch is None or not hasattr(optimizer, "update_hessian"):
            return
        if not callable(getattr(pl_module, "hessian_loss", None)):
            raise RuntimeError(
                "HessianRefresh(mode='fwd_rev') re-runs the loss for each probe and needs "
                f"{type(pl_module).__name__}.hessian_loss(batch) -> scalar loss "
                "(ttt_flash.lightning.lm.LanguageModel has one); or use mode='rev_rev'"
            )
        cuda = any(p.is_cuda for g in optimizer.param_groups for p in g["params"])
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        # the training step's precision (e.g. bf16-mixed autocast), as the step's own graph has
        precision = getattr(trainer, "precision_plugin", None)
        with precision.forward_context() if precision is not None else contextlib.nullcontext():
            optimizer.update_hessian(lambda: pl_module.hessian_loss(batch), n_samples=self.n_samples,
                                     generator=self._probe_generator(optimizer),
                                     weight=_grad_weight(pl_module),
                                     mode="fwd_rev", module=pl_module, recompute=self.recompute)
        if cuda:
            torch.cuda.synchronize()
        self._batch = None
        self.refreshes += 1
        self._refresh_s = time.perf_counter() - start

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        # Logged every batch (0 without a refresh), so that no row repeats a stale value.
        if self._second_order(trainer):
            pl_module.log("train/hessian_refresh_s", host_number(self._refresh_s), on_step=True, on_epoch=False,
                          batch_size=1)
        self._refresh_s = 0.0
