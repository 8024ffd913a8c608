"""What a ``ttt-flash fit`` run shows and leaves behind, beyond Lightning's defaults:

* :class:`RecipeProgressBar`: the rich progress bar without ``v_num`` (Lightning shows the
  logger's version there; with the recipes' named run folders it was the name's last 4
  characters). The run folder is printed by Lightning and written into the config.
* :class:`LineProgress`: where the output is not a terminal (a file, a pipe, a job log), a
  plain line every ``every_s`` seconds (30) and at the end of training: step, speed and the
  logged metrics; one line per validation.
* :class:`RecipeModelSummary`: the rich model summary without the FLOPs column and the
  "Total FLOPs" line (Lightning counts FLOPs only with an ``example_input_array``: 0 here).
* :class:`BestCheckpoints`: the best ``k`` checkpoints by the module's validation metric
  (``val_metric``: name and ``"min"``/``"max"``), beside ``last.ckpt``, as ``best-step=S.ckpt``.
* :class:`ValidationCurves`: at the end of ``fit``, ``val_curves.png`` in the run folder: every
  ``val/...`` metric of the CSV log against the step (with matplotlib; else a note).

The ``ttt-flash`` command adds them (``ttt_flash._recipe_cli``); a recipe that lists its own
progress bar, model summary or monitoring checkpoint keeps its own.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Dict, List, Optional, Tuple

from lightning.pytorch.callbacks import Callback, ModelCheckpoint, ProgressBar, RichModelSummary, RichProgressBar

from .checkpoint_io import AtomicCheckpointWrites
from .curves import PLOT_EXTRA_MESSAGE, Series, plot_curves

__all__ = ["RecipeProgressBar", "LineProgress", "RecipeModelSummary", "BestCheckpoints", "ValidationCurves", "val_metric_of"]

log = logging.getLogger(__name__)


class RecipeProgressBar(RichProgressBar):
    """:class:`~lightning.pytorch.callbacks.RichProgressBar` without the ``v_num`` field."""

    def get_metrics(self, trainer, pl_module) -> Dict[str, Any]:
        items = super().get_metrics(trainer, pl_module)
        items.pop("v_num", None)
        return items


class LineProgress(ProgressBar):
    """Progress as plain lines, for output that is not a terminal (a rich bar there prints
    once, at the end): ``step 120/3000 · 3.21 it/s · 0:00:37 · train/loss_post 0.512`` every
    ``every_s`` seconds, after the first step and at the end of training, and
    ``validation at step S: val/... x`` after each validation."""

    def __init__(self, every_s: float = 30.0, stream=None):
        super().__init__()
        if every_s < 0:
            raise ValueError(f"every_s must be >= 0 (seconds between lines), got {every_s}")
        self.every_s = float(every_s)
        self._stream = stream
        self._enabled = True
        self._start: Optional[float] = None
        self._last: Optional[float] = None
        self._start_step = 0

    def disable(self) -> None:
        self._enabled = False

    def enable(self) -> None:
        self._enabled = True

    def _write(self, line: str) -> None:
        import sys

        stream = self._stream or sys.stdout
        stream.write(line + "\n")
        stream.flush()

    def _metrics(self, trainer, pl_module, prefix: str) -> str:
        items = self.get_metrics(trainer, pl_module)
        parts = []
        for k, v in items.items():
            if not k.startswith(prefix):
                continue
            parts.append(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}")
        return " · ".join(parts)

    def on_train_start(self, trainer, pl_module) -> None:
        import time

        self._start = self._last = time.monotonic()
        self._start_step = trainer.global_step

    def _line(self, trainer, pl_module, now: float) -> str:
        import datetime

        done = trainer.global_step - self._start_step
        elapsed = max(now - (self._start or now), 1e-9)
        total = trainer.max_steps if trainer.max_steps and trainer.max_steps > 0 else None
        if total is None:
            try:
                estimated = trainer.estimated_stepping_batches
                total = int(estimated) if estimated != float("inf") else None
            except Exception:  # no loader length (an iterable dataset): show the step only
                total = None
        step = f"step {trainer.global_step}/{total}" if total else f"step {trainer.global_step}"
        parts = [step, f"{done / elapsed:.2f} it/s", str(datetime.timedelta(seconds=int(elapsed)))]
        metrics = self._metrics(trainer, pl_module, "train/")
        return " · ".join(parts + ([metrics] if metrics else []))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        import time

        if not self._enabled or not trainer.is_global_zero:
            return
        now = time.monotonic()
        first = trainer.global_step - self._start_step == 1
        if first or now - (self._last or now) >= self.every_s:
            self._last = now
            self._write(self._line(trainer, pl_module, now))

    def on_train_end(self, trainer, pl_module) -> None:
        import time

        if self._enabled and trainer.is_global_zero and trainer.global_step > self._start_step:
            self._write(self._line(trainer, pl_module, time.monotonic()))

    def on_validation_end(self, trainer, pl_module) -> None:
        if not self._enabled or not trainer.is_global_zero or trainer.sanity_checking:
            return
        values = {k: v for k, v in trainer.callback_metrics.items() if k.startswith("val/")}
        if values:
            shown = " · ".join(f"{k} {float(v):.4g}" for k, v in sorted(values.items()) if v.numel() == 1)
            self._write(f"validation at step {trainer.global_step}: {shown}")


class RecipeModelSummary(RichModelSummary):
    """:class:`~lightning.pytorch.callbacks.RichModelSummary` without FLOPs (column and total)."""

    @staticmethod
    def summarize(summary_data: List[Tuple[str, List[str]]], total_parameters: int, trainable_parameters: int,
                  model_size: float, total_training_modes: Dict[str, int], total_flops: int = 0,
                  **summarize_kwargs: Any) -> None:
        from lightning.pytorch.utilities.model_summary.model_summary import (
            get_formatted_model_size, get_human_readable_count,
        )
        from rich import get_console
        from rich.table import Table

        columns = [(name, values) for name, values in summary_data if name != "FLOPs"]
        table = Table(header_style=summarize_kwargs.get("header_style", "bold magenta"))
        for name, _ in columns:
            table.add_column(name, justify="right" if name in ("Params", "Params per Device") else "left",
                             style="dim" if name == " " else None)
        for row in zip(*(values for _, values in columns)):
            table.add_row(*map(str, row))
        console = get_console()
        console.print(table)
        totals = Table.grid(expand=True)
        totals.add_column()
        for label, value in (
            ("Trainable params", get_human_readable_count(int(trainable_parameters))),
            ("Non-trainable params", get_human_readable_count(int(total_parameters - trainable_parameters))),
            ("Total params", get_human_readable_count(int(total_parameters))),
            ("Total estimated model params size (MB)", get_formatted_model_size(model_size)),
            ("Modules in train mode", total_training_modes["train"]),
            ("Modules in eval mode", total_training_modes["eval"]),
        ):
            totals.add_row(f"[bold]{label}[/]: {value}")
        console.print(totals)


def val_metric_of(module) -> Optional[Tuple[str, str]]:
    """``(metric, mode)`` the module names as its validation metric (attribute ``val_metric``),
    or None. ``mode`` is ``"min"`` or ``"max"``."""
    value = getattr(module, "val_metric", None)
    if value is None:
        return None
    metric, mode = value
    if mode not in ("min", "max"):
        raise ValueError(f"{type(module).__name__}.val_metric mode must be 'min' or 'max', got {mode!r}")
    return metric, mode


class BestCheckpoints(AtomicCheckpointWrites, ModelCheckpoint):
    """The ``save_top_k`` best checkpoints by ``monitor`` (``best-step=S.ckpt``), saved after
    each validation, atomically (:class:`~ttt_flash.lightning.checkpoint_io.AtomicCheckpointWrites`);
    no ``last.ckpt`` (the run's :class:`~ttt_flash.lightning.ResumableCheckpoint`
    writes that). Its state (the best paths and scores) travels in every checkpoint, so a
    resumed run keeps ranking against the same best."""

    def __init__(self, monitor: str, mode: str = "min", save_top_k: int = 3, dirpath: Optional[str] = None):
        if save_top_k < 1:
            raise ValueError(f"save_top_k must be >= 1 (the number of best checkpoints kept), got {save_top_k}")
        super().__init__(dirpath=dirpath, filename="best-step={step}", monitor=monitor, mode=mode,
                         save_top_k=save_top_k, save_last=False, save_on_train_epoch_end=False,
                         auto_insert_metric_name=False, enable_version_counter=False)


class ValidationCurves(Callback):
    """At the end of ``fit``, every ``val/...`` metric of the run's CSV log plotted against
    the step into ``<run folder>/val_curves.png`` (one curve per metric). Without matplotlib, one log line says how to get it."""

    def __init__(self, filename: str = "val_curves.png"):
        self.filename = filename
        self.written: Optional[str] = None
        self.missing: Optional[str] = None  # why no plot was written (matplotlib missing)

    def on_fit_end(self, trainer, pl_module) -> None:
        if not trainer.is_global_zero or trainer.logger is None:
            return
        folder = getattr(trainer.logger, "log_dir", None)  # None for fast_dev_run's DummyLogger
        csv_path = os.path.join(folder, "metrics.csv") if folder else None
        if not csv_path or not os.path.isfile(csv_path):
            return
        with open(csv_path) as f:
            header = f.readline().strip().split(",")
        metrics = sorted(c for c in header if c.startswith("val/"))
        if not metrics:
            return
        try:
            self.written = str(plot_curves(os.path.join(folder, self.filename),
                                           [Series(m, csv_path, m) for m in metrics],
                                           title=f"validation: {os.path.basename(os.path.normpath(folder))}",
                                           ylabel="validation metric"))
        except RuntimeError as e:
            if str(e) != PLOT_EXTRA_MESSAGE:
                raise
            self.missing = PLOT_EXTRA_MESSAGE
            log.info("no val_curves.png: %s", PLOT_EXTRA_MESSAGE)
            return
        log.info("validation curves: %s", self.written)
