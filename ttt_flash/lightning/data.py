"""LightningDataModules: few-shot tasks generated on the fly (:mod:`ttt_flash.tasks`), and
byte-level text for language modelling (:class:`ByteTextDataModule`).

Every item of a dataloader is one :class:`ttt_flash.tasks.MetaBatch` of
``meta_batch_size`` tasks (the loaders use ``batch_size=None``: the dataset already
yields meta-batches). Meta-batch ``i`` of a split is drawn from a generator seeded with
``(seed, split, i)``, so runs are reproducible and independent of ``num_workers``.
Validation and test meta-batches are the same every epoch (comparable curves); training
meta-batches are fresh every epoch (epoch ``e`` uses indices ``e·train_batches ...``).

:class:`ByteTextDataModule`: byte-level tokens (vocabulary 256) from text files, by default
the running Python's standard-library sources (no download); random windows for training,
fixed evenly spaced windows for validation.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Dict, List, Optional

import numpy as np
import torch
from lightning.pytorch import LightningDataModule
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from ..tasks import (ByteWindows, InContextRegressionTasks, SinusoidTasks, expand_paths, read_corpus,
                     stdlib_source_files)
from .curriculum import StagedTasks, staged
from .resume import EpochSampler, ResumableLoader

__all__ = ["SinusoidDataModule", "InContextRegressionDataModule", "GeneratedDataModule", "SeededBatches",
           "ByteTextDataModule"]

_SPLITS = {"train": 0, "val": 1, "test": 2}


class SeededBatches(Dataset):
    """Index ``i`` -> the ``i``-th batch of a split (any non-negative ``i``):
    ``tasks.sample(batch_size)`` from a generator seeded with (seed, split, i); with
    ``staged``, from the curriculum stage's tasks of batch ``i``. Shared by the data modules
    of :mod:`ttt_flash.lightning.data` and :mod:`ttt_flash.lightning.memory`."""

    def __init__(self, tasks, batch_size: int, seed: int, split: str, staged: Optional[StagedTasks] = None):
        self.tasks, self.batch_size, self.seed, self.split = tasks, batch_size, seed, _SPLITS[split]
        self.staged = staged

    def __getitem__(self, i: int):
        state = np.random.SeedSequence([self.seed, self.split, int(i)]).generate_state(1, dtype=np.uint64)[0]
        g = torch.Generator().manual_seed(int(state) & (2**63 - 1))
        tasks = self.tasks if self.staged is None else self.staged.at(int(i))
        return tasks.sample(self.batch_size, generator=g)


def _check_positive(**kwargs) -> None:
    for name, value in kwargs.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")


class GeneratedDataModule(LightningDataModule):
    """Batches of ``tasks`` generated on the fly (:class:`SeededBatches`): fresh training
    batches every epoch, the same validation and test batches every time, and the training
    order's position in checkpoints (a resumed run continues with the next unseen batch).
    ``staged``, set by a subclass, is the training split's length curriculum.
    ``batch_size_name`` names the batch size in errors."""

    def __init__(self, tasks, batch_size: int, train_batches: int, val_batches: int,
                 test_batches: int, seed: int, num_workers: int, batch_size_name: str = "meta_batch_size"):
        super().__init__()
        _check_positive(**{batch_size_name: batch_size}, train_batches=train_batches,
                        val_batches=val_batches, test_batches=test_batches)
        if num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {num_workers}")
        self.tasks = tasks
        self.batch_size, self.seed, self.num_workers = batch_size, seed, num_workers
        self.batches = {"train": train_batches, "val": val_batches, "test": test_batches}
        self._train_sampler = EpochSampler(train_batches, fresh=True)
        self.staged: Optional[StagedTasks] = None  # a length curriculum of the training split

    def _loader(self, split: str) -> DataLoader:
        sampler = self._train_sampler if split == "train" else EpochSampler(self.batches[split], fresh=False)
        return ResumableLoader(
            SeededBatches(self.tasks, self.batch_size, self.seed, split, self.staged if split == "train" else None),
            batch_size=None,
            sampler=sampler,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
            generator=torch.Generator().manual_seed(self.seed),
        )

    def state_dict(self) -> Dict[str, Any]:
        """The training order's position (epoch, batches delivered), saved in checkpoints."""
        return {"train_order": self._train_sampler.state_dict()}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        if "train_order" in state_dict:
            self._train_sampler.load_state_dict(state_dict["train_order"])

    def train_dataloader(self) -> DataLoader:
        return self._loader("train")

    def val_dataloader(self) -> DataLoader:
        return self._loader("val")

    def test_dataloader(self) -> DataLoader:
        return self._loader("test")


class SinusoidDataModule(GeneratedDataModule):
    """Sinusoid regression meta-batches (:class:`ttt_flash.tasks.SinusoidTasks`).

    Args:
        k_shot: support points per task (K).
        k_query: query points per task.
        meta_batch_size: tasks per meta-batch (per outer step).
        train_batches: meta-batches per training epoch (fresh tasks every epoch).
        val_batches: meta-batches per validation run (the same tasks every time).
        test_batches: meta-batches in the test split.
        seed: seed of all task sampling.
        num_workers: DataLoader worker processes (0: generate in the main process).
    """

    def __init__(self, k_shot: int = 10, k_query: int = 10, meta_batch_size: int = 25,
                 train_batches: int = 500, val_batches: int = 10, test_batches: int = 40,
                 seed: int = 0, num_workers: int = 0):
        super().__init__(SinusoidTasks(k_shot=k_shot, k_query=k_query), meta_batch_size,
                         train_batches, val_batches, test_batches, seed, num_workers)
        self.save_hyperparameters()


class InContextRegressionDataModule(GeneratedDataModule):
    """In-context linear regression meta-batches (:class:`ttt_flash.tasks.InContextRegressionTasks`).

    Inputs are (S, seq_len, dim + 2) token sequences: set the transformer's ``in_dim`` to
    ``dim + 2`` (:attr:`token_dim`) and use the ``incontext_mse`` loss.

    Args:
        dim: regression input dimension d.
        seq_len: context length in tokens (even).
        support_size: support sequences per task.
        query_size: query sequences per task.
        noise_std: label noise standard deviation.
        meta_batch_size, train_batches, val_batches, test_batches, seed, num_workers: as in
            :class:`SinusoidDataModule`.
        curriculum: training sequence lengths ``[[first_step, seq_len], ...]``
            (:mod:`ttt_flash.lightning.curriculum`: short first; each stage's length even);
            validation and test tasks keep ``seq_len``. None: every task has ``seq_len``.
    """

    def __init__(self, dim: int = 4, seq_len: int = 64, support_size: int = 4, query_size: int = 4,
                 noise_std: float = 0.0, meta_batch_size: int = 4, train_batches: int = 200,
                 val_batches: int = 5, test_batches: int = 20, seed: int = 0, num_workers: int = 0,
                 curriculum: Optional[List[List[int]]] = None):
        super().__init__(
            InContextRegressionTasks(dim=dim, seq_len=seq_len, support_size=support_size,
                                     query_size=query_size, noise_std=noise_std),
            meta_batch_size, train_batches, val_batches, test_batches, seed, num_workers,
        )
        self.staged = staged(curriculum, lambda n: dataclasses.replace(self.tasks, seq_len=n))
        self.save_hyperparameters()

    @property
    def token_dim(self) -> int:
        """Token width ``dim + 2``: the transformer's ``in_dim``."""
        return self.tasks.token_dim


class ByteTextDataModule(LightningDataModule):
    """Byte-level language-modelling data: tokens are the bytes of text files (vocabulary 256).

    The corpus is the concatenation of the files (each followed by a newline), capped at
    ``max_bytes``; the last ``val_fraction`` of it is the validation split (contiguous, so
    no window straddles the two). Batches are ``(x, y)`` pairs of (batch_size, seq_len)
    int64 tensors, ``y`` the next bytes of ``x``.

    Args:
        paths: text files, directories (all their files, recursively, sorted) or glob
            patterns, read in the given order. ``None``: the running Python's
            standard-library sources (:func:`ttt_flash.tasks.stdlib_source_files`): no download needed.
        seq_len: N, tokens per window.
        batch_size: windows per batch.
        max_bytes: corpus size cap (``None``: no cap).
        val_fraction: fraction of the corpus held out for validation, in (0, 1).
        train_batches: training batches per epoch; each epoch draws fresh random windows.
        val_batches: validation batches; the same evenly spaced windows every epoch.
        seed: seeds the training windows (window i of the run is a function of (seed, i)).
        num_workers: DataLoader workers.
    """

    def __init__(
        self,
        paths: Optional[List[str]] = None,
        seq_len: int = 256,
        batch_size: int = 8,
        max_bytes: Optional[int] = 8 * 2**20,
        val_fraction: float = 0.05,
        train_batches: int = 1000,
        val_batches: int = 16,
        seed: int = 0,
        num_workers: int = 0,
    ):
        super().__init__()
        for name, value in (("seq_len", seq_len), ("batch_size", batch_size), ("train_batches", train_batches),
                            ("val_batches", val_batches)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if max_bytes is not None and (isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 2):
            raise ValueError(f"max_bytes must be an int >= 2 or None, got {max_bytes!r}")
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0:
            raise ValueError(f"num_workers must be an int >= 0, got {num_workers!r}")
        if isinstance(paths, str):
            paths = [paths]
        self.save_hyperparameters()
        self.paths = paths
        self.train_tokens: Optional[Tensor] = None
        self.val_tokens: Optional[Tensor] = None
        self.files: List[Path] = []
        self._train_order = EpochSampler(train_batches * batch_size, fresh=True)

    def state_dict(self) -> Dict[str, Any]:
        """The training order's position (epoch, windows delivered), saved in checkpoints."""
        return {"train_order": self._train_order.state_dict()}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        if "train_order" in state_dict:
            self._train_order.load_state_dict(state_dict["train_order"])

    def setup(self, stage: Optional[str] = None) -> None:
        if self.train_tokens is not None:
            return
        hp = self.hparams
        self.files = stdlib_source_files() if self.paths is None else expand_paths(self.paths)
        corpus = read_corpus(self.files, hp.max_bytes)
        tokens = torch.frombuffer(bytearray(corpus), dtype=torch.uint8) if corpus else torch.zeros(0, dtype=torch.uint8)
        n_val = int(round(tokens.numel() * hp.val_fraction))
        self.train_tokens, self.val_tokens = tokens[: tokens.numel() - n_val], tokens[tokens.numel() - n_val :]
        need = hp.seq_len + 1
        for split, t in (("training", self.train_tokens), ("validation", self.val_tokens)):
            if t.numel() < need:
                raise ValueError(
                    f"the {split} split has {t.numel()} bytes, fewer than seq_len + 1 = {need} "
                    f"(corpus {tokens.numel()} bytes from {len(self.files)} files, val_fraction "
                    f"{hp.val_fraction}): give more text, a larger max_bytes or a shorter seq_len"
                )

    def train_dataloader(self) -> DataLoader:
        hp = self.hparams
        n = hp.train_batches * hp.batch_size
        ds = ByteWindows(self.train_tokens, hp.seq_len, hp.seed, random=True, count=n)
        return ResumableLoader(ds, batch_size=hp.batch_size, sampler=self._train_order, num_workers=hp.num_workers,
                               drop_last=True, generator=torch.Generator().manual_seed(hp.seed))

    def val_dataloader(self) -> DataLoader:
        hp = self.hparams
        n = hp.val_batches * hp.batch_size
        ds = ByteWindows(self.val_tokens, hp.seq_len, hp.seed, random=False, count=n)
        return DataLoader(ds, batch_size=hp.batch_size, shuffle=False, num_workers=hp.num_workers,
                          generator=torch.Generator().manual_seed(hp.seed))

    def test_dataloader(self) -> DataLoader:
        return self.val_dataloader()
