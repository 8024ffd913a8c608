"""What ``ttt-flash fit|validate|test`` adds to LightningCLI: a quiet start, short errors
for unknown recipe keys, and one CPU thread by default.

* LightningCLI runs on ``sys.argv = [<the ttt-flash script>, *argv]``, as it is meant to from a
  console script (its ``args=`` parameter is for calls from Python, and warns when a command
  line is present too). ``sys.argv[0]`` is the absolute path of the installed ``ttt-flash``
  script: Lightning's DDP launcher starts the other ranks by re-running ``sys.argv[0]``, so a
  bare name would be looked up in the working directory and fail.
* Lightning's "💡 Tip" adverts and torch's ``isinstance(treespec, LeafSpec)`` deprecation
  warning (raised inside Lightning) are filtered.
* A key that no class accepts (``inner_stepz``, ``net.hiddn``, a misspelt ``init_args``) or a
  value of the wrong type (``inner_steps: two``) fails in a few lines that name the full key,
  where it was given (the recipe file and line, or the command line) and the closest valid
  keys or the type expected, instead of the full usage text.
* ``trainer.enable_progress_bar: true`` (every shipped recipe) shows Lightning's
  ``RichProgressBar`` (steps, speed, logged metrics) unless the recipe names its own progress
  bar callback; the CSV logs are unchanged.
* One run per run folder: ``fit``, ``validate`` and ``test`` hold
  :class:`~ttt_flash.lightning.checkpoint_io.RunFolderLock` on the logger's folder while they
  run (a second run on the same folder, by whatever path, stops at start with an error naming
  the running process), and ``fit`` without ``--ckpt_path`` into a folder that holds an
  earlier run stops with a one-line error. ``config.yaml`` is written once training starts
  (:class:`~ttt_flash.lightning.checkpoint_io.SaveConfigOnStart`).
* On a machine without CUDA, unless ``OMP_NUM_THREADS`` is set, torch runs one thread:
  the recipes' steps are small, and several threads spinning on a few cores make a MAML
  step many times slower (README, "Speed on the CPU").
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import sys
import warnings
from typing import Iterator, List, Optional, Sequence

from ._cli_errors import gpu_only_message, refused_message, unknown_key_message

__all__ = ["recipe_cli", "script_path", "quiet_lightning", "rich_progress_bar", "thread_default", "unknown_key_message"]

_TIP = "💡 Tip"
_LIGHTNING_LOGGERS = (
    "lightning.pytorch.utilities.rank_zero",
    "lightning.fabric.utilities.rank_zero",
    "lightning_utilities.core.rank_zero",
)


class _DropAdverts(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(_TIP)


def quiet_lightning() -> None:
    """Filter Lightning's adverts and the known third-party deprecation (idempotent)."""
    warnings.filterwarnings(
        "ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated", category=FutureWarning
    )
    for name in _LIGHTNING_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropAdverts) for f in logger.filters):
            logger.addFilter(_DropAdverts())


@contextlib.contextmanager
def thread_default() -> Iterator[Optional[int]]:
    """One torch thread while the block runs, on a machine without CUDA where
    ``OMP_NUM_THREADS`` is unset (that variable, when set, decides). Yields the thread count
    set, or None when it was left alone."""
    import torch

    if os.environ.get("OMP_NUM_THREADS") or torch.cuda.is_available():
        yield None
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield 1
    finally:
        torch.set_num_threads(before)


def rich_progress_bar(trainer_config: dict):
    """A ``RichProgressBar`` (without ``v_num``: :class:`~ttt_flash.lightning.outputs.RecipeProgressBar`)
    for a trainer config that enables the progress bar (Lightning's default) and names no
    progress bar callback; None otherwise, or without ``rich``."""
    from lightning.pytorch.callbacks import ProgressBar

    if trainer_config.get("enable_progress_bar") is False:
        return None
    callbacks = trainer_config.get("callbacks") or []
    if any(isinstance(c, ProgressBar) for c in (callbacks if isinstance(callbacks, list) else [callbacks])):
        return None
    try:
        from .lightning.outputs import RecipeProgressBar

        return RecipeProgressBar()
    except (ImportError, ModuleNotFoundError):  # rich not installed: Lightning's default bar
        return None


def _terminal() -> bool:
    try:
        return sys.stdout.isatty()
    except (AttributeError, ValueError):
        return False


def line_progress(trainer_config: dict):
    """For output that is not a terminal: a :class:`~ttt_flash.lightning.outputs.LineProgress`
    (a plain line every 30 s) where the progress bar is enabled and the config names no
    progress bar callback; None otherwise."""
    from lightning.pytorch.callbacks import ProgressBar

    from .lightning.outputs import LineProgress

    if trainer_config.get("enable_progress_bar") is False:
        return None
    if any(isinstance(c, ProgressBar) for c in _listed(trainer_config.get("callbacks"))):
        return None
    return LineProgress()


def script_path() -> str:
    """The absolute path of the ``ttt-flash`` console script that is running, or of the one
    installed next to this Python, or on ``PATH``; ``"ttt-flash"`` when there is none.

    Lightning's DDP launcher starts ranks 1.. as ``python <sys.argv[0]> <args>`` (resolved
    against the working directory) when the program was not started with ``python -m``."""
    import shutil

    started = sys.argv[0] if sys.argv else ""
    if os.path.basename(started).startswith("ttt-flash") and os.path.isfile(started):
        return os.path.abspath(started)
    beside = os.path.join(os.path.dirname(sys.executable), "ttt-flash")
    if os.path.isfile(beside):
        return beside
    return shutil.which("ttt-flash") or "ttt-flash"


def _plain(value):
    """A jsonargparse Namespace (nested) as plain dicts."""
    if hasattr(value, "as_dict"):
        value = value.as_dict()
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _plain(dataclasses.asdict(value))
    return value


def run_folder(trainer) -> Optional[str]:
    """The folder a run writes its logs (and, by default, checkpoints) to: the first logger's
    ``log_dir``; None without a logger."""
    logger = trainer.logger
    if logger is None:
        return None
    try:
        folder = logger.log_dir
    except (AttributeError, TypeError):
        return None
    return folder if isinstance(folder, str) and "://" not in folder else None


#: the checkpoints whose differing settings this process listed (in a warning)
SETTINGS_LISTED: List[str] = []


def _last_checkpoint(trainer, folder: str) -> Optional[str]:
    """The ``last.ckpt`` that ``--ckpt_path last`` loads: in a checkpoint callback's folder, or
    ``<run folder>/checkpoints``; None if there is none."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    folders = [c.dirpath for c in trainer.callbacks if isinstance(c, ModelCheckpoint) and c.dirpath]
    for place in [*folders, os.path.join(folder, "checkpoints")]:
        path = os.path.join(str(place), "last.ckpt")
        if os.path.isfile(path):
            return path
    return None


TENSORBOARD_MISSING = ("--tensorboard needs the tensorboard package, which is not installed: "
                       "pip install 'ttt-flash[tensorboard]'")


def _listed(callbacks) -> list:
    return list(callbacks) if isinstance(callbacks, (list, tuple)) else ([callbacks] if callbacks else [])


def recipe_callbacks(trainer_config: dict, model) -> list:
    """Callbacks the ``ttt-flash`` command adds to a recipe's trainer (docs in
    :mod:`ttt_flash.lightning.outputs`): the progress bar and model summary (when enabled and
    not named by the recipe), the best-k checkpoints by the model's ``val_metric`` (when
    checkpointing is on and no callback of the recipe monitors a metric) and the
    validation-curve PNG at the end of ``fit``."""
    from lightning.pytorch.callbacks import ModelCheckpoint, ModelSummary

    from .lightning.outputs import BestCheckpoints, RecipeModelSummary, ValidationCurves, val_metric_of

    callbacks = _listed(trainer_config.get("callbacks"))
    added = []
    bar = rich_progress_bar(trainer_config) if _terminal() else line_progress(trainer_config)
    if bar is not None:
        added.append(bar)
    if trainer_config.get("enable_model_summary") is not False and not any(
            isinstance(c, ModelSummary) for c in callbacks):
        added.append(RecipeModelSummary())
    metric = val_metric_of(model) if model is not None else None
    if (metric is not None and trainer_config.get("enable_checkpointing") is not False
            and not any(isinstance(c, ModelCheckpoint) and c.monitor for c in callbacks)):
        added.append(BestCheckpoints(monitor=metric[0], mode=metric[1]))
    added.append(ValidationCurves())
    return added


def tensorboard_logger(logger):
    """A TensorBoard logger writing into the same run folder as ``logger`` (the recipe's CSV
    logger): its ``save_dir``, ``name`` and ``version``. Raises ``SystemExit`` with the
    install line without the tensorboard package."""
    from lightning.pytorch import loggers

    if logger is None:
        raise SystemExit("ttt-flash: error: --tensorboard needs the recipe's trainer.logger (it writes beside it)")
    try:
        return loggers.TensorBoardLogger(save_dir=logger.save_dir, name=logger.name or "", version=logger.version,
                                         default_hp_metric=False)
    except ModuleNotFoundError:
        raise SystemExit("ttt-flash: error: " + TENSORBOARD_MISSING) from None


#: The trainer of the last run started by :func:`recipe_cli` (for the line printed at its end).
LAST_RUN: dict = {}


def _shown(path: str) -> str:
    rel = os.path.relpath(path)
    return rel if not rel.startswith("..") else os.path.abspath(path)


def run_report(stopped: Optional[str] = None) -> Optional[str]:
    """One line about the run :func:`recipe_cli` last ran: its folder, its ``last.ckpt`` and
    the validation-curve plot (or how to get one); ``stopped`` names a signal that ended it.
    None without a run, off rank zero, or without a run folder."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from .lightning.outputs import ValidationCurves

    trainer = LAST_RUN.get("trainer")
    if trainer is None or not trainer.is_global_zero:
        return None
    folder = run_folder(trainer)
    if folder is None:
        return None
    sub = LAST_RUN.get("subcommand") or "run"
    parts = [f"run folder {_shown(folder)}"]
    if sub == "fit":
        dirs = [c.dirpath for c in trainer.callbacks if isinstance(c, ModelCheckpoint) and c.dirpath]
        last = next((os.path.join(str(d), "last.ckpt") for d in [*dirs, os.path.join(folder, "checkpoints")]
                     if os.path.isfile(os.path.join(str(d), "last.ckpt"))), None)
        if LAST_RUN.get("smoke"):
            parts.append("no checkpoint (--smoke)")
        elif last:
            parts.append(f"checkpoint {_shown(last)}" + (" (resume: --ckpt_path last)" if stopped else ""))
        else:
            parts.append("no checkpoint written")
        curves = next((c for c in trainer.callbacks if isinstance(c, ValidationCurves)), None)
        if curves is not None and curves.written:
            parts.append(f"curves {_shown(curves.written)}")
        elif curves is not None and curves.missing:
            parts.append('no val_curves.png: pip install -e ".[plot]" (matplotlib)')
    head = f"ttt-flash {sub}: stopped by {stopped} at step {trainer.global_step}" if stopped else f"ttt-flash {sub}: done"
    return head + "; " + ", ".join(parts)


def recipe_cli(argv: Sequence[str], smoke: bool = False):
    """A LightningCLI subclass that runs on ``ttt-flash <argv>`` as described in the module
    docstring; construct it with LightningCLI's own arguments (no ``args=``). ``smoke``: a
    ``--smoke`` run (``argv`` holds its overrides already): no checkpoints are written, and its
    run folder is emptied first."""
    import lightning.pytorch
    from jsonargparse import ActionConfigFile
    from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

    argv = list(argv)
    prog = "ttt-flash " + argv[0] if argv else "ttt-flash"

    class _Parser(LightningArgumentParser):
        def error(self, message: str, ex: Optional[Exception] = None):
            if self.exit_on_error:
                short = unknown_key_message(message, argv, getattr(ex, "subcommand_parser", None) or self, prog)
                if short is not None:
                    sys.stderr.write(short + "\n")
                    sys.exit(2)
            super().error(message, ex)

    class RecipeCLI(LightningCLI):
        def __init__(self, *args, **kwargs):
            quiet_lightning()
            saved = sys.argv
            sys.argv = [script_path(), *argv]
            try:
                with thread_default():
                    super().__init__(*args, **kwargs)
            finally:
                sys.argv = saved

        def before_instantiate_classes(self) -> None:
            super().before_instantiate_classes()
            if self.subcommand:
                message = gpu_only_message(self.config[self.subcommand], argv, prog)
                if message:
                    sys.stderr.write(message + "\n")
                    sys.exit(2)

        def instantiate_classes(self) -> None:
            try:
                super().instantiate_classes()
            except (ValueError, TypeError, AssertionError) as e:
                config = _plain(self.config[self.subcommand]) if self.subcommand else _plain(self.config)
                short = refused_message(e, config, argv, prog)
                if short is None:
                    raise
                sys.stderr.write(short + "\n")
                sys.exit(2)

        def _parse_ckpt_path(self) -> None:
            # LightningCLI's own version replaces the command line's model settings with the
            # checkpoint's for a --ckpt_path FILE (not for "last"); here the recipe and the
            # command line always decide, and the checkpoint's differing settings are listed.
            if not self.config.get("subcommand"):
                return
            path = self.config[self.config.subcommand].get("ckpt_path")
            if path and os.path.isfile(str(path)):
                self._report_settings(str(path))

        def _report_settings(self, path: str) -> None:
            from .lightning.resume import checkpoint_settings, read_checkpoint

            config = self.config[self.config.subcommand]
            plain = {g: _plain(config.get(g)) for g in ("model", "data")}
            differences = checkpoint_settings(path, read_checkpoint(path), plain)
            if differences:
                SETTINGS_LISTED.append(path)
                sys.stderr.write(
                    f"ttt-flash: warning: --ckpt_path {path} was written with other settings; this run keeps its "
                    "own (the recipe and the command line decide, as with --ckpt_path last) and loads the "
                    "checkpoint's weights and training state:\n  " + "\n  ".join(differences) + "\n")

        def _run_subcommand(self, subcommand: str) -> None:
            from .lightning.checkpoint_io import RunFolderLock, run_in_folder

            folder = run_folder(self.trainer)
            if folder is None or not self.trainer.is_global_zero:
                return super()._run_subcommand(subcommand)
            with RunFolderLock(folder, command=f"ttt-flash {subcommand}"):
                ckpt_path = self._prepare_subcommand_kwargs(subcommand).get("ckpt_path")
                if subcommand == "fit" and ckpt_path is None:
                    used = run_in_folder(folder)
                    if used:
                        raise SystemExit(
                            f"ttt-flash: error: the run folder {folder} holds an earlier run ({', '.join(used[:4])}"
                            f"{', ...' if len(used) > 4 else ''}); continue it with --ckpt_path last, give this "
                            "run another folder (--trainer.logger.init_args.version=NAME), or remove the folder")
                if ckpt_path == "last":
                    last = _last_checkpoint(self.trainer, folder)
                    if last is not None:
                        self._report_settings(last)
                super()._run_subcommand(subcommand)

        def instantiate_trainer(self, **kwargs):
            from lightning.pytorch.callbacks import ModelCheckpoint, ModelSummary

            config = {**self._get(self.config_init, "trainer", default={}), **kwargs}
            if smoke:  # no checkpoints: the smoke run only shows that the recipe runs
                kwargs["enable_checkpointing"] = config["enable_checkpointing"] = False
            if config.get("enable_checkpointing") is False:
                # checkpointing off (--trainer.enable_checkpointing=false or --smoke) also drops the
                # recipe's ModelCheckpoint, which Lightning would refuse beside it
                config["callbacks"] = [c for c in _listed(config.get("callbacks")) if not isinstance(c, ModelCheckpoint)]
                kwargs["callbacks"] = config["callbacks"]
            added = recipe_callbacks(config, getattr(self, "model", None))
            if added:
                kwargs["callbacks"] = [*_listed(config.get("callbacks")), *added]
            if any(isinstance(c, ModelSummary) for c in _listed(kwargs.get("callbacks", config.get("callbacks")))):
                kwargs["enable_model_summary"] = False  # the summary is in the callbacks: no default one to add
            if self._get(self.config, "tensorboard", default=False):
                logger = config.get("logger")
                first = logger[0] if isinstance(logger, (list, tuple)) and logger else logger
                kwargs["logger"] = [*(_listed(logger) if first is not None else []), tensorboard_logger(first)]
            trainer = super().instantiate_trainer(**kwargs)
            LAST_RUN.clear()
            LAST_RUN.update(trainer=trainer, subcommand=self.subcommand, smoke=smoke)
            if smoke and trainer.is_global_zero:
                folder = run_folder(trainer)
                if folder and os.path.basename(os.path.normpath(folder)).startswith("smoke-") and os.path.isdir(folder):
                    import shutil

                    shutil.rmtree(folder)
            return trainer

        def init_parser(self, **kwargs) -> LightningArgumentParser:
            kwargs.setdefault("dump_header", [f"lightning.pytorch=={lightning.pytorch.__version__}"])
            parser = _Parser(**kwargs)
            parser.add_argument(
                "-c", "--config", action=ActionConfigFile, help="Path to a configuration file in json or yaml format."
            )
            parser.add_argument(
                "--tensorboard", type=bool, default=False,
                help="also log to TensorBoard, into the run folder beside the CSV log (needs the tensorboard "
                     "extra: pip install 'ttt-flash[tensorboard]'); view with: tensorboard --logdir runs")
            return parser

    return RecipeCLI
