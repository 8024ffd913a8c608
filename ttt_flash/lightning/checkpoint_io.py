"""Checkpoint files and run folders of ``ttt-flash fit|validate|test``: what is checked before
a run starts, and how files are written.

* :func:`check_ckpt_path`, :func:`read_checkpoint`, :func:`checkpoint_settings`: a
  ``--ckpt_path`` that is a directory, empty, not a checkpoint, or a checkpoint of another
  model or data class is refused in one line; differing settings are listed.
* :class:`RunFolderLock`: one writer per run folder, whatever path (symbolic links
  included) reaches it.
* :func:`atomic_checkpoint_write`: a checkpoint is written to a temporary file in its folder,
  flushed to the disk (``fsync``) and renamed over the old file; a failed write (a full disk)
  removes the temporary file and raises :class:`CheckpointWriteError`, whose message names
  the file and what was kept.
"""

from __future__ import annotations

import contextlib
import inspect
import os
from typing import Any, Dict, List

import torch
from lightning.pytorch.cli import SaveConfigCallback

__all__ = ["save_hyperparameters_with_net", "check_ckpt_path", "read_checkpoint", "checkpoint_settings", "RunFolderLock", "run_in_folder",
           "CheckpointWriteError", "AtomicCheckpointWrites", "SaveConfigOnStart"]


def save_hyperparameters_with_net(module, net) -> None:
    """``module.save_hyperparameters()`` from the ``__init__`` of a module that takes its
    network as ``net``: a network passed as an ``nn.Module`` in Python is left out (its weights
    are in the checkpoint); one that LightningCLI composed from ``class_path`` and ``init_args``
    keeps that config, so that ``load_from_checkpoint`` rebuilds it."""
    frame = inspect.currentframe().f_back
    module.save_hyperparameters(ignore=["net"] if isinstance(net, torch.nn.Module) else None, frame=frame)
    if "_instantiator" in module.hparams and "net" not in module.hparams:  # the CLI's config, not the module
        module.save_hyperparameters(frame=frame)


def check_ckpt_path(argv) -> None:
    """Refuse, before anything is built, a ``--ckpt_path`` that names an empty or unreadable
    file (``torch.load`` would fail late with a bare ``EOFError``)."""
    argv = list(argv)
    path = None
    for i, arg in enumerate(argv):
        if arg == "--ckpt_path" and i + 1 < len(argv):
            path = argv[i + 1]
        elif arg.startswith("--ckpt_path="):
            path = arg.split("=", 1)[1]
    if path is None or path in ("last", "best", "hpc", "registry"):
        return
    if not os.path.exists(path):
        raise SystemExit(f"ttt-flash: error: --ckpt_path {path}: no such file; give a checkpoint file (e.g. "
                         "runs/NAME/checkpoints/last.ckpt), or --ckpt_path last to continue the recipe's run")
    if os.path.isdir(path):
        raise SystemExit(f"ttt-flash: --ckpt_path {path} is a directory; give the checkpoint file, e.g. "
                         f"{os.path.join(path, 'last.ckpt')}, or --ckpt_path last")
    if os.path.getsize(path) == 0:
        raise SystemExit(f"ttt-flash: --ckpt_path {path} is an empty file (0 bytes), not a checkpoint (was its "
                         "write interrupted?); give another checkpoint, or start without --ckpt_path")


def read_checkpoint(path: str) -> Dict[str, Any]:
    """``torch.load(path, weights_only=True)`` on the CPU, or a one-line ``SystemExit`` naming
    the file when it is not a readable checkpoint (random bytes, another format, a truncated
    file, objects that cannot be loaded safely)."""
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError as e:
        raise SystemExit(f"ttt-flash: error: --ckpt_path {path} cannot be read ({e.strerror})") from None
    if not (head.startswith(b"PK\x03\x04") or head[:1] == b"\x80"):  # torch's zip format, or a pickle
        raise SystemExit(f"ttt-flash: error: --ckpt_path {path} is not a checkpoint (not a PyTorch file); give a "
                         ".ckpt file written by ttt-flash fit")
    try:
        checkpoint = torch.load(path, weights_only=True, map_location="cpu")
    except Exception as e:  # noqa: BLE001 - any failure means the same thing to the user
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise SystemExit(f"ttt-flash: error: --ckpt_path {path} is not a readable checkpoint "
                         f"({type(e).__name__}: {first})") from None
    if not isinstance(checkpoint, dict) or "state_dict" not in checkpoint:
        raise SystemExit(f"ttt-flash: error: --ckpt_path {path} is not a Lightning checkpoint (no state_dict); "
                         "give a .ckpt file written by ttt-flash fit")
    return checkpoint


def _flat(value: Any, prefix: str = "") -> Dict[str, Any]:
    if isinstance(value, dict):
        out: Dict[str, Any] = {}
        for k, v in value.items():
            out.update(_flat(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: value}


def _same_class(a: str, b: str) -> bool:
    """Whether two class paths name one class (``pkg.Cls`` re-exported from ``pkg.mod.Cls``)."""
    import importlib

    if a == b:
        return True
    try:
        classes = [getattr(importlib.import_module(c.rpartition(".")[0]), c.rpartition(".")[2]) for c in (a, b)]
    except (ImportError, AttributeError, ValueError):
        return a.rpartition(".")[2] == b.rpartition(".")[2]
    return classes[0] is classes[1]


def checkpoint_settings(path: str, checkpoint: Dict[str, Any], config: Dict[str, Any]) -> List[str]:
    """Check a checkpoint against a run's configuration (``{"model": {"class_path", "init_args"},
    "data": {...}}`` as plain dicts). A checkpoint of another model or data class is refused
    (``SystemExit`` naming both classes). Returns, for each setting the checkpoint was written
    with that differs from this run's (which is kept), a line ``key: checkpoint X, this run Y``."""
    differences: List[str] = []
    for group, key in (("model", "hyper_parameters"), ("data", "datamodule_hyper_parameters")):
        saved = dict(checkpoint.get(key) or {})
        saved.pop("_instantiator", None)
        ours = config.get(group) or {}
        saved_class, our_class = saved.pop("_class_path", None), ours.get("class_path")
        if saved_class and our_class and not _same_class(saved_class, our_class):
            what = "model" if group == "model" else "data module"
            raise SystemExit(
                f"ttt-flash: error: --ckpt_path {path} holds a {saved_class} {what}, but this recipe's {what} is "
                f"{our_class}; give a checkpoint of this recipe (or the recipe the checkpoint was written by)")
        ours_flat = _flat(ours.get("init_args") or {})
        for name, value in sorted(_flat(saved).items()):
            if name in ours_flat and _differs(value, ours_flat[name]):
                differences.append(f"{group}.init_args.{name}: checkpoint {value!r}, this run {ours_flat[name]!r}")
    return differences


def _differs(a: Any, b: Any) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) != len(b) or any(_differs(x, y) for x, y in zip(a, b))
    if torch.is_tensor(a) or torch.is_tensor(b):
        return not (torch.is_tensor(a) and torch.is_tensor(b) and torch.equal(a, b))
    return a != b


# --------------------------------------------------------------------------- one writer per run folder


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by another user
        return True
    return True


class RunFolderLock:
    """One writer per run folder: ``.<name>.ttt-flash.lock`` next to the folder ``<name>``
    (outside it, so the folder's loggers see no foreign file) holds the process id, host and
    command of the run writing there, from :meth:`acquire` to :meth:`release` (also a context
    manager).

    The lock belongs to the folder's real path (symbolic links resolved), so a second run on
    the same folder, by whatever path, stops at :meth:`acquire` with a ``SystemExit`` naming
    the folder and the running process. A lock left by a process that no longer exists (killed,
    machine restarted) on this host is taken over; a lock of another host is never taken over
    (its process cannot be checked from here: the message says which file to remove).
    """

    def __init__(self, folder: str, command: str = "ttt-flash"):
        self.folder, self.command = os.path.normpath(str(folder)), command
        self.real = os.path.realpath(self.folder)
        parent, name = os.path.split(self.real)
        self.path = os.path.join(parent, f".{name}.ttt-flash.lock")
        self.held = False

    def _read(self) -> Dict[str, str]:
        try:
            with open(self.path) as f:
                return dict(line.rstrip("\n").split("=", 1) for line in f if "=" in line)
        except OSError:
            return {}

    def acquire(self) -> "RunFolderLock":
        import socket
        import time

        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        host = socket.gethostname()
        text = f"pid={os.getpid()}\nhost={host}\ncommand={self.command}\nstarted={time.strftime('%Y-%m-%d %H:%M:%S')}\n"
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                owner = self._read()
                pid = int(owner.get("pid", "0") or 0) if owner.get("pid", "").isdigit() else 0
                if owner.get("host", host) == host and (pid <= 0 or not _alive(pid)):
                    with contextlib.suppress(FileNotFoundError):  # a dead run's lock: take it over
                        os.remove(self.path)
                    continue
                where = f"process {pid}" + ("" if owner.get("host", host) == host else f" on host {owner['host']}")
                via = "" if self.real == os.path.abspath(self.folder) else f" (the folder {self.real})"
                raise SystemExit(
                    f"ttt-flash: error: the run folder {self.folder}{via} is in use by {where} "
                    f"({owner.get('command', '?')}, started {owner.get('started', '?')}); two runs writing to one "
                    f"folder mix their logs and checkpoints. Wait for it to end, stop it, or give this run another "
                    f"folder (e.g. --trainer.logger.init_args.version=NAME). If that process is gone, remove "
                    f"{self.path}.")
            with os.fdopen(fd, "w") as f:
                f.write(text)
            self.held = True
            return self
        raise SystemExit(f"ttt-flash: error: could not take the lock {self.path} (another run keeps taking it)")

    def release(self) -> None:
        if self.held and self._read().get("pid") == str(os.getpid()):
            with contextlib.suppress(FileNotFoundError):
                os.remove(self.path)
        self.held = False

    def __enter__(self) -> "RunFolderLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def run_in_folder(folder: str) -> List[str]:
    """What an earlier run left in the run folder ``folder``: the names among ``config.yaml``,
    ``metrics.csv`` and ``checkpoints/*.ckpt`` that exist (empty for a new folder)."""
    import glob

    found = [name for name in ("config.yaml", "metrics.csv") if os.path.isfile(os.path.join(folder, name))]
    found += sorted(os.path.relpath(p, folder) for p in glob.glob(os.path.join(glob.escape(folder), "checkpoints",
                                                                               "*.ckpt")))
    return found


# --------------------------------------------------------------------------- atomic writes

#: real path of each checkpoint this process wrote completely -> its global step
_written: Dict[str, int] = {}


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (e.g. no space left on the device); the message is
    one line naming the file and the checkpoints that were kept."""

    def __init__(self, path: str, error: OSError):
        kept = {p: s for p, s in _written.items() if os.path.dirname(p) == os.path.dirname(os.path.realpath(path))
                and os.path.isfile(p)}
        what = ", ".join(f"{os.path.basename(p)} (step {s})" for p, s in sorted(kept.items(), key=lambda x: x[1]))
        before = "its previous version is kept" if os.path.isfile(path) else "no partial file is left"
        super().__init__(error.errno, f"could not write the checkpoint {path} ({error.strerror or error}); "
                                      f"{before}; kept in {os.path.dirname(path) or '.'}: {what or 'no checkpoint'}")
        self.path = path

    def __str__(self) -> str:
        return self.strerror


def _fsync(path: str, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory and hasattr(os, "O_DIRECTORY") else 0))
    try:
        os.fsync(fd)
    except OSError:
        if not directory:  # some file systems cannot fsync a folder: the rename is still atomic
            raise
    finally:
        os.close(fd)


class AtomicCheckpointWrites:
    """Mixin for a :class:`~lightning.pytorch.callbacks.ModelCheckpoint`: each checkpoint is
    written to ``.NAME.ckpt.tmp`` in its folder, flushed to the disk (``fsync``) and renamed
    over ``NAME.ckpt`` (a process killed while writing leaves the previous complete file).
    A failed write removes the temporary file and raises :class:`CheckpointWriteError`.
    Files on a remote file system are written as ModelCheckpoint writes them."""

    def _save_checkpoint(self, trainer, filepath: str) -> None:
        from fsspec.implementations.local import LocalFileSystem

        if not isinstance(self._fs, LocalFileSystem):
            return super()._save_checkpoint(trainer, filepath)
        folder = os.path.dirname(filepath) or "."
        tmp = os.path.join(folder, f".{os.path.basename(filepath)}.tmp")
        try:
            super()._save_checkpoint(trainer, tmp)
            if trainer.is_global_zero:
                _fsync(tmp)
                os.replace(tmp, filepath)
                _fsync(folder, directory=True)
        except OSError as e:  # e.g. a full disk: leave no partial file (the previous checkpoint stays)
            with contextlib.suppress(OSError):
                os.remove(tmp)
            raise CheckpointWriteError(filepath, e) from e
        except BaseException:
            with contextlib.suppress(OSError):
                os.remove(tmp)
            raise
        if trainer.is_global_zero:
            _written[os.path.realpath(filepath)] = int(trainer.global_step)
        trainer.strategy.barrier("AtomicCheckpointWrites")
        self._last_checkpoint_saved = filepath


# --------------------------------------------------------------------------- the run's config


class SaveConfigOnStart(SaveConfigCallback):
    """LightningCLI's :class:`~lightning.pytorch.cli.SaveConfigCallback`, deferred: ``fit``
    writes ``config.yaml`` when training starts (after the checkpoint given by
    ``--ckpt_path`` has been loaded), so a run refused or failed before that leaves the
    run folder's ``config.yaml`` as it was; ``validate`` and ``test`` write one only into
    a folder that has none."""

    def setup(self, trainer, pl_module, stage: str) -> None:
        self._stage = stage

    def _save(self, trainer, pl_module, only_if_missing: bool) -> None:
        if self.already_saved:
            return
        if only_if_missing:
            folder = trainer.log_dir
            exists = bool(folder) and os.path.isfile(os.path.join(folder, self.config_filename))
            if trainer.strategy.broadcast(exists):
                self.already_saved = True
                return
        super().setup(trainer, pl_module, self._stage)

    def on_train_start(self, trainer, pl_module) -> None:
        self._save(trainer, pl_module, only_if_missing=False)

    def on_validation_start(self, trainer, pl_module) -> None:
        if trainer.state.fn == "validate":
            self._save(trainer, pl_module, only_if_missing=True)

    def on_test_start(self, trainer, pl_module) -> None:
        self._save(trainer, pl_module, only_if_missing=True)
