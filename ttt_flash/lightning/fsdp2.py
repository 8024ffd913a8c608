"""FSDP2 under Lightning: a strategy for data-parallel sharding, and what the package's
LightningModules do around a second-order step on a sharded model (:mod:`ttt_flash.fsdp`,
docs/distributed.md).

* :class:`FSDP2Strategy` (``--trainer.strategy=fsdp2``): Lightning's
  ``ModelParallelStrategy`` with every process in one data-parallel dimension (no tensor
  parallelism), a full (one-file) checkpoint by default, and a ``start_method`` (``"fork"``
  runs the processes from a notebook or a test, as ``ddp_fork`` does). It runs on GPUs (NCCL)
  and on the CPU (gloo). The modules' ``configure_model`` shards their network with
  :func:`ttt_flash.fsdp.shard_blocks` over the data-parallel mesh.
* :class:`FSDP2Steps`: held by a LightningModule; :meth:`~FSDP2Steps.shard` in
  ``configure_model``, :meth:`~FSDP2Steps.begin` / :meth:`~FSDP2Steps.end` around a step
  that needs second order (the full parameters are held in between).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import warnings
from typing import Literal, Optional

from lightning.pytorch.strategies import ModelParallelStrategy, StrategyRegistry
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher, _WorkerOutput
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn

from ..fsdp import Unsharded, fsdp_modules, shard_blocks, unsharded

__all__ = ["FSDP2Strategy", "FSDP2Steps"]


class FSDP2Strategy(ModelParallelStrategy):
    """``ModelParallelStrategy`` for FSDP2 alone: all processes shard the model's parameters
    (``data_parallel_size`` = the number of processes, ``tensor_parallel_size`` = 1).

    Args:
        save_distributed_checkpoint: ``False`` (default): checkpoints are one file with the
            full weights and optimizer state (assembled on rank 0; ``--ckpt_path last``
            resumes from it); ``True``: a folder with one shard per process.
        start_method: ``"popen"`` (default: the command relaunches itself once per process),
            ``"fork"`` or ``"spawn"`` (processes started from the running Python).
        process_group_backend: ``None``: NCCL on GPUs, gloo on the CPU.
        reshard_after_forward: FSDP2's policy on first-order steps (``fully_shard``'s
            argument): ``True`` frees each block's full weights after its forward (least
            memory), ``False`` keeps them until its backward (one all-gather less per block).
            Second-order steps hold every full weight either way (docs/distributed.md).
    """

    strategy_name = "fsdp2"

    def __init__(self, save_distributed_checkpoint: bool = False,
                 start_method: Literal["popen", "fork", "spawn"] = "popen",
                 process_group_backend: Optional[str] = None, reshard_after_forward: bool = True, **kwargs):
        super().__init__(data_parallel_size="auto", tensor_parallel_size=1,
                         save_distributed_checkpoint=save_distributed_checkpoint,
                         process_group_backend=process_group_backend, **kwargs)
        if start_method not in ("popen", "fork", "spawn"):
            raise ValueError(f"start_method must be 'popen', 'fork' or 'spawn', got {start_method!r}")
        if not isinstance(reshard_after_forward, bool):
            raise TypeError(f"reshard_after_forward must be a bool, got {type(reshard_after_forward).__name__}")
        self._start_method = start_method
        self.reshard_after_forward = reshard_after_forward

    def _configure_launcher(self) -> None:
        if self._start_method == "popen":
            return super()._configure_launcher()
        self._launcher = _StartedLauncher(self, start_method=self._start_method)

    def load_checkpoint(self, checkpoint_path, weights_only=None):
        # torch.distributed.checkpoint creates a missing optimizer state by a step on zero
        # gradients, which Sophia-H / AdaHessian refuse before a Hessian estimate: their state
        # is created here instead, then overwritten by the checkpoint's
        for opt in self.optimizers:
            init = getattr(opt, "_init_state", None)
            if init is not None and not opt.state:
                for group in opt.param_groups:
                    for p in group["params"]:
                        if p.requires_grad:
                            init(p)
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        for opt in self.optimizers:
            host = getattr(opt, "_host", None)
            if isinstance(host, dict):
                host.clear()  # capturable counters were overwritten in place: read them again
        return checkpoint

    def setup_environment(self) -> None:
        self._data_parallel_size = self.num_nodes * self.num_processes
        super().setup_environment()


class _StartedLauncher(_MultiProcessingLauncher):
    """Lightning's fork/spawn launcher, handing the trained weights back to the main process
    as full tensors (the workers hold DTensor shards, which do not travel as such)."""

    def _collect_rank_zero_results(self, trainer, results):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = get_model_state_dict(trainer.lightning_module,
                                    options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if self._strategy.local_rank != 0:
            return None
        cb = trainer.checkpoint_callback
        best = getattr(cb, "best_model_path", None) if cb is not None else None
        weights_path = None
        if trainer.state.fn == TrainerFn.FITTING:
            weights_path = os.path.join(tempfile.mkdtemp(), ".temp.ckpt")
            self._strategy.checkpoint_io.save_checkpoint(full, weights_path)
        return _WorkerOutput(best, weights_path, trainer.state, results, self.get_extra_results(trainer))


StrategyRegistry.register("fsdp2", FSDP2Strategy, description="FSDP2 (fully_shard) data parallelism, "
                          "second order included (ttt_flash.fsdp)", override=True)
StrategyRegistry.register("fsdp2_fork", FSDP2Strategy, description="fsdp2, processes forked", start_method="fork",
                          override=True)


class FSDP2Steps:
    """What a LightningModule does for FSDP2: shard its network in ``configure_model`` and
    hold the full parameters through the steps that need second order.

    Without a device mesh (any strategy but :class:`FSDP2Strategy` /
    ``ModelParallelStrategy``) :meth:`shard` does nothing and :attr:`active` stays False.
    """

    def __init__(self):
        self.net: Optional[nn.Module] = None
        self.full: Optional[Unsharded] = None
        self._stack: Optional[contextlib.ExitStack] = None

    @property
    def active(self) -> bool:
        """Whether the network is sharded with FSDP2."""
        return self.net is not None

    def shard(self, module, net: nn.Module, blocks: Optional[str] = "blocks") -> None:
        """``configure_model``: shard ``net`` (each child of ``net.<blocks>``, then ``net``)
        over the strategy's data-parallel mesh; idempotent."""
        mesh = getattr(module, "device_mesh", None)
        if mesh is None:
            return
        if fsdp_modules(net):
            self.net = net
            return
        names = mesh.mesh_dim_names or ()
        if "tensor_parallel" in names and mesh["tensor_parallel"].size() != 1:
            raise ValueError(
                f"{type(module).__name__} shards with FSDP2 over the data-parallel dimension only; the "
                f"strategy's tensor_parallel_size is {mesh['tensor_parallel'].size()}: use "
                "--trainer.strategy=fsdp2 (ttt_flash.lightning.FSDP2Strategy)")
        dp = mesh["data_parallel"] if "data_parallel" in names else mesh
        trainer = getattr(module, "_trainer", None)
        policy = getattr(getattr(trainer, "strategy", None), "reshard_after_forward", True)
        shard_blocks(net, blocks, mesh=dp, reshard_after_forward=policy)
        # FSDP2 warns at every forward whose output is a view (a Linear on (B, N, d) inputs), in
        # case the caller modifies it in place; the package's modules never do
        warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(.*\) returned a view tensor")
        self.net = net

    def begin(self) -> Unsharded:
        """Hold the full parameters (:func:`ttt_flash.fsdp.unsharded`) until :meth:`end`."""
        if self._stack is not None:
            return self.full
        stack = contextlib.ExitStack()
        self.full = stack.enter_context(unsharded(self.net))
        self._stack = stack
        return self.full

    @property
    def open(self) -> bool:
        return self._stack is not None

    def end(self) -> None:
        """Reshard (and restore FSDP2's settings); a no-op when nothing is held."""
        stack, self._stack, self.full = self._stack, None, None
        if stack is not None:
            stack.close()
