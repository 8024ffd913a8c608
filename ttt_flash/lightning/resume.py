"""Exact resumption of interrupted runs: resumable samplers and loaders, and a checkpoint
callback that saves what Lightning does not.

* :class:`EpochSampler` + :class:`ResumableLoader`: the index order of the task DataModules
  (fresh indices every training epoch) with their position: epoch, and batches delivered in
  it. The loader is *stateful* in Lightning's sense (``state_dict`` / ``load_state_dict``),
  so a run resumed mid-epoch continues with the next unseen batch (no "dataloader is not
  resumable" warning), and the DataModules also save the position themselves, so a run
  resumed at an epoch boundary starts the next epoch rather than replaying epoch 0.
* :class:`ResumableCheckpoint`: a :class:`~lightning.pytorch.callbacks.ModelCheckpoint` that

  - writes ``last.ckpt`` by default, atomically (:mod:`ttt_flash.lightning.checkpoint_io`:
    a temporary file flushed to the disk and renamed over the old one; a run removes the
    temporary files that killed processes left in its checkpoint folder when it starts),
  - saves the global random states (torch CPU and CUDA, NumPy, Python ``random``; of every
    process under DDP) and puts them back just before the first resumed step,
  - keeps the logged step numbers of a resumed run equal to an uninterrupted run's, and lets
    a :class:`ResumableCSVLogger` with a fixed ``version`` continue the same ``metrics.csv``
    (rows the interrupted run wrote after the checkpoint move to ``metrics.from-step-S.csv``),
  - resumes from checkpoints written at the end of training (an epoch end or mid-epoch) as
    from any other, any number of times in a row, and warns when the resumed run cannot
    equal the uninterrupted one (another number of DDP processes, another run length under
    a schedule that spans the run),
  - on SIGTERM or SIGINT finishes the current training step (and a validation under way),
    writes ``last.ckpt`` and stops; under DDP a signal to one process stops all of them at
    the same step. ``ttt-flash fit`` then exits with status ``128 + signal`` (143 for
    SIGTERM, 130 for SIGINT), as a shell reports a process killed by that signal. A second
    SIGINT aborts at once.

Resume with ``ttt-flash fit --config recipes/NAME.yaml --ckpt_path last``: the recipes log to
``runs/NAME/`` and checkpoint to ``runs/NAME/checkpoints/last.ckpt``.
"""

from __future__ import annotations

import contextlib
import csv
import logging
import os
import random
import signal
import threading
import warnings
from typing import Any, Dict, Iterator, List, Literal, Optional, Tuple, Union

import numpy as np
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.fabric.loggers.logger import rank_zero_experiment
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from torch.utils.data import DataLoader, DistributedSampler, Sampler

from .checkpoint_io import (  # noqa: F401 - check_ckpt_path ... RunFolderLock: importable here as before
    AtomicCheckpointWrites, RunFolderLock, check_ckpt_path, checkpoint_settings, read_checkpoint,
)

log = logging.getLogger(__name__)

__all__ = ["EpochSampler", "ResumableLoader", "ResumableCheckpoint", "ResumableCSVLogger", "interrupt_exit_code",
           "check_ckpt_path", "RunFolderLock", "read_checkpoint", "checkpoint_settings"]


# --------------------------------------------------------------------------- data order


def _rank_and_world() -> Tuple[int, int]:
    """This process's rank and the number of processes (0, 1 without a process group)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class EpochSampler(DistributedSampler):
    """Indices ``range(n)`` every epoch, or, with ``fresh``, ``range(e·n, (e+1)·n)`` in epoch
    ``e`` (fresh items every epoch), with a position that can be saved and restored.

    The position (:meth:`state_dict`) is ``(epoch, position)``: the epoch under way and the
    number of its items delivered so far (counted by :class:`ResumableLoader` as it yields
    batches, so items prefetched by workers are not counted). Each new iteration starts the
    next epoch, except the first one after :meth:`load_state_dict`, which continues the saved
    epoch at the saved position (or starts the next epoch if the saved one was complete).

    Distributed (a ``torch.distributed`` process group of W processes when iteration starts),
    the sampler shards itself: process r takes the epoch's items ``r, r + W, r + 2W, ...``,
    ``ceil(n / W)`` of them (wrapping around to the epoch's first items when W does not divide
    ``n``), and the position counts this process's items. All processes step together, so
    their positions are equal: the one position saved by rank 0 restores every process. It is
    a ``DistributedSampler`` so that Lightning leaves it in place instead of wrapping it
    (``set_epoch`` is ignored: the sampler counts its own epochs).
    """

    def __init__(self, n: int, fresh: bool):
        Sampler.__init__(self)
        self.n, self.fresh = n, fresh
        self.epoch, self.position = 0, 0
        self._begun = False  # an iteration has started since construction / load
        self._resume = False

    @property
    def rank(self) -> int:
        return _rank_and_world()[0]

    @property
    def num_replicas(self) -> int:
        return _rank_and_world()[1]

    def set_epoch(self, epoch: int) -> None:
        """Ignored: the epoch advances when an iteration starts (see the class docstring)."""

    def __len__(self) -> int:
        return -(-self.n // self.num_replicas)

    def _begin(self) -> None:
        if self._begun and not self._resume:
            self.epoch, self.position = self.epoch + 1, 0
        elif self.position >= len(self):  # resumed after the last item of an epoch
            self.epoch, self.position = self.epoch + 1, 0
        self._begun, self._resume = True, False

    def __iter__(self) -> Iterator[int]:
        base = self.epoch * self.n if self.fresh else 0
        rank, world = _rank_and_world()
        if world == 1:
            return iter(range(base + self.position, base + self.n))
        return iter(base + (rank + world * j) % self.n for j in range(self.position, len(self)))

    def state_dict(self) -> Dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: Dict[str, int]) -> None:
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position <= self.n:
            raise ValueError(f"a sampler state must have epoch >= 0 and 0 <= position <= {self.n}, got {state}")
        self.epoch, self.position = epoch, position
        self._begun, self._resume = True, True


class ResumableLoader(DataLoader):
    """A :class:`~torch.utils.data.DataLoader` over an :class:`EpochSampler` whose position
    it saves and restores (Lightning's stateful-loader interface).

    Each yielded batch advances the sampler's position by the loader's ``batch_size``
    (1 with ``batch_size=None``). The state also holds the loader's own ``generator`` (the
    source of worker seeds; given one, iterating never draws from the global random state).
    """

    def _order(self) -> Optional[EpochSampler]:
        sampler = self.sampler
        return sampler if isinstance(sampler, EpochSampler) else None

    def __iter__(self):
        order = self._order()
        if order is None:  # the sampler was replaced (e.g. a distributed wrapper): no tracking
            return super().__iter__()
        order._begin()
        return self._track(super().__iter__(), order, self.batch_size or 1)

    @staticmethod
    def _track(batches, order: EpochSampler, per_batch: int):
        for batch in batches:
            order.position += per_batch
            yield batch

    def state_dict(self) -> Dict[str, Any]:
        order = self._order()
        state: Dict[str, Any] = {} if order is None else order.state_dict()
        if self.generator is not None:
            state["generator"] = self.generator.get_state()
        return state

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        order = self._order()
        if order is not None and "epoch" in state:
            order.load_state_dict(state)
        if self.generator is not None and "generator" in state:
            self.generator.set_state(state["generator"])


# --------------------------------------------------------------------------- random states


def _rng_state() -> Dict[str, Any]:
    """The global random states, as tensors and plain Python values (``weights_only``-loadable)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state: Dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(gauss)],
        "python": [random.getstate()[0], list(random.getstate()[1]), random.getstate()[2]],
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: Dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))
    if "cuda" in state and torch.cuda.is_available():
        cuda = state["cuda"]
        if len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda)


# --------------------------------------------------------------------------- signals

#: The signal that stopped the last run (set by :class:`ResumableCheckpoint`'s handlers).
_received: List[int] = []


def interrupt_exit_code() -> int:
    """Exit status of a run stopped by a signal: ``128 + signum`` (143 for SIGTERM, 130 for
    SIGINT), SIGTERM's when the signal is not known."""
    return 128 + (_received[-1] if _received else int(signal.SIGTERM))


# --------------------------------------------------------------------------- logger


def _write_rows(path: str, rows: List[Dict[str, str]]) -> List[str]:
    """Write ``rows`` as a CSV file (columns sorted) by a temporary file renamed over ``path``;
    returns the columns."""
    keys = sorted({k for r in rows for k in r})
    tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.tmp")
    with open(tmp, "w", newline="") as f:
        out = csv.DictWriter(f, fieldnames=keys)
        out.writeheader()
        out.writerows(rows)
    os.replace(tmp, path)
    return keys


class _ContinuingWriter(ExperimentWriter):
    """CSV writer that leaves an existing ``metrics.csv`` alone until the first save: a resumed
    run (:meth:`continue_from`) keeps its earlier rows, a fresh run replaces the file."""

    def _check_log_dir_exists(self) -> None:
        self._fresh = True  # decided by continue_from() or, failing that, at the first save

    def continue_from(self, step: int) -> None:
        """Keep the rows logged at steps before ``step`` (the first step the resumed run logs);
        rows of later steps (an earlier continuation of the run) move to
        ``metrics.from-step-STEP.csv`` beside it, with a warning."""
        self._fresh = False
        if not os.path.isfile(self.metrics_file_path):
            return
        with open(self.metrics_file_path, newline="") as f:
            rows = [r for r in csv.DictReader(f) if r.get("step", "") != ""]
        kept = [r for r in rows if int(float(r["step"])) < step]
        later = [r for r in rows if int(float(r["step"])) >= step]
        if later:
            moved = os.path.join(self.log_dir, f"metrics.from-step-{step}.csv")
            _write_rows(moved, later)
            log.warning(f"ttt-flash: warning: {len(later)} rows of metrics.csv (steps {step} on) were logged after "
                        f"the checkpoint this run continues from; they moved to {moved}, and this run logs those "
                        "steps again")
        self.metrics_keys = _write_rows(self.metrics_file_path, kept)

    def save(self) -> None:
        if self._fresh and self.metrics and os.path.isfile(self.metrics_file_path):
            os.remove(self.metrics_file_path)  # a new run in this folder: start a new file
        if self.metrics:
            self._fresh = False
        super().save()


class ResumableCSVLogger(CSVLogger):
    """:class:`~lightning.pytorch.loggers.CSVLogger` whose ``metrics.csv`` a resumed run
    continues: with :class:`ResumableCheckpoint`, the rows logged before the checkpoint stay
    and the resumed run appends its own (rows the interrupted run logged after the checkpoint
    are dropped). A run started without a checkpoint replaces the file, as CSVLogger does.
    Give it a fixed ``version`` (a folder name) so that a resumed run finds its folder.

    Args: as :class:`~lightning.pytorch.loggers.CSVLogger`.
    """

    @property
    @rank_zero_experiment
    def experiment(self) -> ExperimentWriter:
        if self._experiment is None:
            self._fs.makedirs(self.root_dir, exist_ok=True)
            self._experiment = _ContinuingWriter(log_dir=self.log_dir)
        return self._experiment


# --------------------------------------------------------------------------- loop state


def _as_last_batch_end(checkpoint: Dict[str, Any]) -> bool:
    """Rewrite, in place, the loop progress of a checkpoint written at the end of training
    (``max_epochs`` reached, or ``max_steps`` at an epoch end or mid-epoch: Lightning has then
    closed the epoch) into the progress of a checkpoint written at the end of the last batch
    trained: Lightning resumes the latter exactly, but counts the closed epoch twice for the
    former (the resumed run would log the next epoch under a number one too high, skip the
    rest of an unfinished epoch, and with ``max_epochs`` stop early). Returns True when the
    checkpoint was rewritten."""
    fit = (checkpoint.get("loops") or {}).get("fit_loop")
    if not isinstance(fit, dict):
        return False
    try:
        epochs, batches = fit["epoch_progress"], fit["epoch_loop.batch_progress"]
        steps = fit["epoch_loop.state_dict"]
        # an epoch closed and none started since (ready / started may lag behind in a checkpoint
        # of older versions, which did not count the first epoch after a restart), its batches done
        finished = (all(epochs[p]["processed"] == epochs[p]["completed"] > 0
                        and epochs[p]["ready"] <= epochs[p]["processed"] for p in ("total", "current"))
                    and len({*batches["current"].values()}) == 1 and batches["current"]["completed"] > 0
                    and len({*batches["total"].values()}) == 1)
        # a checkpoint written after the epoch's last batch, before the epoch closed (at the
        # validation that follows it: the best-step=S.ckpt files): Lightning would restart the
        # epoch's loader once more, skipping an epoch of data; as at the batch's end it does not
        after_last = (not finished and batches.get("is_last_batch") is True
                      and all(epochs[p]["ready"] == epochs[p]["started"] == epochs[p]["processed"] + 1
                              and epochs[p]["processed"] == epochs[p]["completed"] for p in ("total", "current"))
                      and len({*batches["current"].values()}) == 1 and batches["current"]["completed"] > 0
                      and len({*batches["total"].values()}) == 1)
    except (KeyError, TypeError, AttributeError):
        return False
    if after_last:
        for part in ("total", "current"):
            batches[part]["completed"] -= 1
        return True
    if not finished:
        return False
    for part in ("total", "current"):
        closed = epochs[part]["completed"]  # the progress at the last batch of epoch `closed - 1`
        epochs[part].update(ready=closed, started=closed, processed=closed - 1, completed=closed - 1)
        batches[part]["completed"] -= 1
    if isinstance(steps.get("_batches_that_stepped"), int):
        steps["_batches_that_stepped"] -= 1
    val = fit.get("epoch_loop.val_loop.batch_progress")
    if isinstance(val, dict) and isinstance(val.get("total"), dict):
        val["total"] = {k: 0 for k in val["total"]}
    return True


# --------------------------------------------------------------------------- the callback


class ResumableCheckpoint(AtomicCheckpointWrites, ModelCheckpoint):
    """:class:`~lightning.pytorch.callbacks.ModelCheckpoint` for exactly resumable runs
    (see the module docstring).

    Args:
        dirpath: checkpoint folder (None: ``<logger log_dir>/checkpoints``; with a logger of
            fixed ``version`` this is a stable place, so ``--ckpt_path last`` finds it).
        filename, monitor, mode, save_top_k, every_n_epochs, save_on_train_epoch_end: as in
            ModelCheckpoint (``save_top_k=0``: only ``last.ckpt``).
        every_n_train_steps: also save every this many optimizer steps (None: at the end of
            every epoch / validation, ModelCheckpoint's default).
        save_last: write ``last.ckpt`` (default True; ``"link"`` as in ModelCheckpoint).
        save_on_signal: on SIGTERM / SIGINT, finish the current step, write ``last.ckpt``
            and stop (the run raises Lightning's ``SIGTERMException``).
    """

    def __init__(
        self,
        dirpath: Optional[str] = None,
        filename: Optional[str] = None,
        monitor: Optional[str] = None,
        mode: str = "min",
        save_top_k: int = 0,
        every_n_train_steps: Optional[int] = None,
        every_n_epochs: Optional[int] = None,
        save_on_train_epoch_end: Optional[bool] = None,
        save_last: Union[bool, Literal["link"]] = True,
        save_on_signal: bool = True,
    ):
        super().__init__(dirpath=dirpath, filename=filename, monitor=monitor, mode=mode, save_top_k=save_top_k,
                         every_n_train_steps=every_n_train_steps, every_n_epochs=every_n_epochs,
                         save_on_train_epoch_end=save_on_train_epoch_end, save_last=save_last,
                         enable_version_counter=False)  # one last.ckpt, replaced (never last-v1.ckpt)
        self.save_on_signal = save_on_signal
        self._stepped: Optional[int] = None  # logging step after the last finished batch
        self._pending: Optional[Dict[str, Any]] = None  # loaded state, applied at the first resumed batch
        self._handlers: Dict[int, Any] = {}
        self._span: Optional[int] = None  # the run's trainer.estimated_stepping_batches (its schedules' span)
        self._loaded: Dict[str, Any] = {}  # what the checkpoint says of the run that wrote it

    # ------------------------------------------------------------------ state

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loop = trainer.fit_loop.epoch_loop
        # The value of Lightning's logging step once this batch is finished.
        self._stepped = loop._batches_that_stepped + (0 if loop._should_accumulate() else 1)
        with warnings.catch_warnings():
            # Manual optimization: the checkpoint holds the weights after the step, as a resume needs.
            warnings.filterwarnings("ignore", message=".*no pre-optimization state was saved")
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        if self.save_on_signal and self._agree_to_stop(trainer):
            trainer._signal_connector.received_sigterm = True  # Lightning stops after this step

    def state_dict(self) -> Dict[str, Any]:
        state = super().state_dict()
        trainer = getattr(self, "_trainer_ref", None)
        state["rng"] = _rng_state()
        rank, world = _rank_and_world()
        if world > 1:  # every process's random states (state_dict runs on every rank)
            import torch.distributed as dist

            states: List[Any] = [None] * world
            dist.all_gather_object(states, state["rng"])
            state["rng_ranks"] = states
        state["world_size"] = world
        if self._span is not None:
            state["stepping_batches"] = self._span
        if trainer is not None:
            stepped = self._stepped
            if stepped is None:
                stepped = trainer.fit_loop.epoch_loop._batches_that_stepped
            state["batches_that_stepped"] = stepped
            for lg in trainer.loggers:  # flush: the rows logged so far survive a kill
                if isinstance(getattr(lg, "_experiment", None), _ContinuingWriter):
                    lg.save()
        return state

    def setup(self, trainer, pl_module, stage: str) -> None:
        self._trainer_ref = trainer
        super().setup(trainer, pl_module, stage)
        if stage != "fit":  # validate / test add their rows to the run's metrics.csv
            for lg in trainer.loggers:
                if isinstance(lg, ResumableCSVLogger) and isinstance(lg.experiment, _ContinuingWriter):
                    lg.experiment._fresh = False
        self._remove_partial_files(trainer)

    def _remove_partial_files(self, trainer) -> None:
        """Remove the temporary files a process killed while writing a checkpoint left behind."""
        import glob

        from fsspec.implementations.local import LocalFileSystem

        if not trainer.is_global_zero or self.dirpath is None or not isinstance(self._fs, LocalFileSystem):
            return
        for path in glob.glob(os.path.join(glob.escape(str(self.dirpath)), f".*{self.FILE_EXTENSION}.tmp")):
            with contextlib.suppress(OSError):
                os.remove(path)

    def on_load_checkpoint(self, trainer, pl_module, checkpoint: Dict[str, Any]) -> None:
        _as_last_batch_end(checkpoint)
        state = checkpoint.get("callbacks", {}).get(self.state_key)
        if state is None:
            return
        self._pending = {k: state[k] for k in ("rng", "rng_ranks", "batches_that_stepped") if k in state}
        self._loaded = {"world_size": state.get("world_size", len(state.get("rng_ranks") or [None])),
                        "stepping_batches": state.get("stepping_batches")}
        if "batches_that_stepped" in state:
            for lg in trainer.loggers:
                writer = getattr(lg, "_experiment", None)
                if isinstance(writer, _ContinuingWriter):
                    writer.continue_from(int(state["batches_that_stepped"]))

    def on_train_start(self, trainer, pl_module) -> None:
        fit, epochs = trainer.fit_loop, trainer.fit_loop.epoch_progress.current
        if fit.restarted_mid_epoch and epochs.processed == epochs.ready:
            fit.reset_restart_stage()  # the restored epoch is already closed: the next starts afresh
        if self.save_on_signal:
            self._install_handlers(trainer)
        span = trainer.estimated_stepping_batches
        self._span = int(span) if span != float("inf") else None
        if self._loaded and trainer.is_global_zero:
            self._warn_changed(trainer)
        self._loaded = {}

    def _warn_changed(self, trainer) -> None:
        """Warn about a resume that cannot equal the interrupted run: another number of
        processes, or another length of a run whose learning rate follows a schedule."""
        world, saved = _rank_and_world()[1], self._loaded.get("world_size")
        if saved and saved != world:
            what = "replays items this epoch already gave" if world < saved else "skips items of this epoch"
            log.warning(f"ttt-flash: warning: the checkpoint was written by {saved} processes, this run has {world}: "
                        f"the position in an epoch counts items per process, so this run {what}; resume with "
                        f"{saved} processes for the data order of the uninterrupted run")
        span = self._loaded.get("stepping_batches")
        spans = getattr(trainer.lightning_module, "schedule_spans_run", bool(trainer.lr_scheduler_configs))
        if span is not None and self._span is not None and span != self._span and spans:
            log.warning(f"ttt-flash: warning: the checkpoint's run was {span} steps long, this one is {self._span} "
                        "(trainer.max_steps / max_epochs): its learning-rate schedule spans the run, so from here "
                        "the rates follow neither run's schedule; keep the same trainer.max_steps to resume exactly")

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self._pending is None:
            return
        if "batches_that_stepped" in self._pending:
            trainer.fit_loop.epoch_loop._batches_that_stepped = int(self._pending["batches_that_stepped"])
        rank, world = _rank_and_world()
        ranks = self._pending.get("rng_ranks")
        if ranks is not None and len(ranks) == world:
            _set_rng_state(ranks[rank])
        elif "rng" in self._pending:
            _set_rng_state(self._pending["rng"])
        self._pending = None

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        super().on_train_epoch_end(trainer, pl_module)
        # The epoch a resumed run restarted in is over: the next one starts as in an uninterrupted
        # run (Lightning keeps the restart stage, and would not count the next epoch as started).
        trainer.fit_loop.reset_restart_stage()
        trainer.fit_loop.epoch_loop.reset_restart_stage()

    # ------------------------------------------------------------------ signals
    # The handlers only note the signal. All processes agree to stop (an all-reduce of the
    # notes) at the end of each training batch and of each validation, so under DDP a signal to
    # one process stops every process at the same step, and a validation under way finishes
    # (its row is logged) before the run stops.

    def _install_handlers(self, trainer) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        _received.clear()

        def handler(signum, frame):
            if signum == signal.SIGINT and _received:
                raise KeyboardInterrupt  # a second Ctrl-C: stop now
            _received.append(signum)

        for sig in (signal.SIGTERM, signal.SIGINT):
            self._handlers[sig] = signal.getsignal(sig)
            signal.signal(sig, handler)

    def _agree_to_stop(self, trainer) -> bool:
        """Whether any process received a signal (every process calls this at the same point)."""
        stop = bool(_received)
        if _rank_and_world()[1] > 1:
            import torch.distributed as dist

            flag = torch.tensor([int(stop)], device=trainer.strategy.root_device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            stop = bool(flag.item())
            if stop and not _received:
                _received.append(int(signal.SIGTERM))
        return stop

    def _fitting(self, trainer) -> bool:
        return self.save_on_signal and trainer.state.fn == "fit" and not trainer.sanity_checking

    def on_validation_start(self, trainer, pl_module) -> None:
        if self._fitting(trainer):  # let the validation finish; the run stops after it
            trainer._signal_connector.received_sigterm = False

    def on_validation_end(self, trainer, pl_module) -> None:
        super().on_validation_end(trainer, pl_module)
        if self._fitting(trainer) and self._agree_to_stop(trainer):
            trainer._signal_connector.received_sigterm = True  # Lightning stops after this step

    def _restore_handlers(self) -> None:
        for sig, h in self._handlers.items():
            if threading.current_thread() is threading.main_thread() and h is not None:
                signal.signal(sig, h)
        self._handlers = {}

    def on_train_end(self, trainer, pl_module) -> None:
        self._restore_handlers()
        # The end of the run, whatever every_n_train_steps: --ckpt_path last continues from here.
        if self.save_last and not self._should_skip_saving_checkpoint(trainer):
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        from lightning.pytorch.utilities.exceptions import SIGTERMException

        self._restore_handlers()
        if isinstance(exception, SIGTERMException) and self.save_on_signal and self.dirpath is not None:
            path = os.path.join(self.dirpath, self.CHECKPOINT_NAME_LAST + self.FILE_EXTENSION)
            self.last_model_path = path
            self._save_checkpoint(trainer, path)
