"""What a ``ttt-flash fit`` run shows and leaves behind, beyond Lightning's defaults:

* :class:`RecipeProgressBar`: the rich progress bar without ``v_num`` (Lightning shows the
  logger's version there; with the recipes' named run folders it was the name's last 4
  characters). The run folder is printed by Lightning and written into the config.
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

from lightning.pytorch.callbacks import Callback, ModelCheckpoint, RichModelSummary, RichProgressBar

from .checkpoint_io import AtomicCheckpointWrites
from .curves import PLOT_EXTRA_MESSAGE, Series, plot_curves

__all__ = ["RecipeProgressBar", "RecipeModelSummary", "BestCheckpoints", "ValidationCurves", "val_metric_of"]

log = logging.getLogger(__name__)


class RecipeProgressBar(RichProgressBar):
    """:class:`~lightning.pytorch.callbacks.RichProgressBar` without the ``v_num`` field."""

    def get_metrics(self, trainer, pl_module) -> Dict[str, Any]:
        items = super().get_metrics(trainer, pl_module)
        items.pop("v_num", None)
        return items


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
            log.info("no val_curves.png: %s", PLOT_EXTRA_MESSAGE)
            return
        log.info("validation curves: %s", self.written)
