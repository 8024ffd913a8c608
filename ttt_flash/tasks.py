"""On-the-fly few-shot task generators (nothing is downloaded).

Each generator's ``sample(num_tasks, generator)`` returns a :class:`MetaBatch`: a meta-batch
of ``num_tasks`` independent tasks, each with a support set (what the inner loop adapts
on) and a query set (what the adapted model is scored on). Tensors are ready for a model:
``batch.task(t)`` gives ``(support, query)`` as ``(inputs, target)`` pairs, the batch
format of :mod:`ttt_flash.meta`.

* :class:`SinusoidTasks`: sinusoid regression of Finn et al. (2017). Task: ``y = A sin(x − φ)``
  with ``A ~ U[0.1, 5]``, ``φ ~ U[0, π]``; inputs ``x ~ U[−5, 5]``; K-shot support, K_q-shot
  query. Inputs and targets have shape (K, 1).
* :class:`InContextRegressionTasks`: few-shot in-context linear regression (Garg et al.,
  2022) as a MAML task family for sequence models. Task: a weight vector ``w ~ N(0, I/d)``.
  Each *sequence* of the task holds ``P = seq_len / 2`` points ``(x_i, y_i)``,
  ``x_i ~ N(0, I_d)``, ``y_i = w·x_i + ε`` (``ε ~ N(0, noise_std²)``), laid out as
  ``seq_len`` tokens of width ``d + 2``, alternating

  - x-token ``[x_i, 0, 0]`` (even positions 0, 2, ...): the model predicts ``y_i`` here,
  - y-token ``[0…0, y_i, 1]`` (odd positions), which reveals ``y_i`` to later positions.

  With causal attention the prediction at point ``i`` sees the ``i − 1`` earlier pairs of
  the same sequence: the model can regress in context, and MAML can additionally adapt
  its weights to ``w`` on the support sequences. The support and query sets are
  ``support_size`` and ``query_size`` sequences drawn with the same ``w``; targets have
  shape (S, P) and are scored by :func:`incontext_mse`. ``seq_len`` is the context length
  in tokens (32,768 in the long-context recipe).

Every shape below is for one meta-batch of ``T`` tasks.

The byte corpus (``ByteTextDataModule``'s data, no Lightning here):
:func:`stdlib_source_files` (the running Python's standard-library sources: nothing to
download), :func:`expand_paths`, :func:`read_corpus` and :class:`ByteWindows` (next-byte
windows as a ``torch.utils.data.Dataset``).
"""

from __future__ import annotations

import glob
import math
import numbers
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import List, NamedTuple, Optional, Sequence, Tuple

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset

from ._checks import check_int

__all__ = [
    "MetaBatch",
    "SinusoidTasks",
    "InContextRegressionTasks",
    "incontext_mse",
    "stdlib_source_files",
    "expand_paths",
    "read_corpus",
    "ByteWindows",
]


class MetaBatch(NamedTuple):
    """A meta-batch of ``T`` tasks. Leading dimension of every tensor: the task.

    Attributes:
        support_inputs: (T, K, ...) inputs of each task's support set.
        support_targets: (T, K, ...) targets of the support set.
        query_inputs: (T, K_q, ...) inputs of each task's query set.
        query_targets: (T, K_q, ...) targets of the query set.
        task_params: (T, ...) the hidden task parameters (sinusoid: (A, φ); in-context
            regression: ``w``), for inspection and tests; None if not known.
    """

    support_inputs: Tensor
    support_targets: Tensor
    query_inputs: Tensor
    query_targets: Tensor
    task_params: Optional[Tensor] = None

    @property
    def num_tasks(self) -> int:
        return self.support_inputs.shape[0]

    def task(self, t: int) -> Tuple[Tuple[Tensor, Tensor], Tuple[Tensor, Tensor]]:
        """``((support_inputs, support_targets), (query_inputs, query_targets))`` of task ``t``."""
        return (
            (self.support_inputs[t], self.support_targets[t]),
            (self.query_inputs[t], self.query_targets[t]),
        )


def _check_range(name: str, r) -> None:
    if len(r) != 2 or not all(isinstance(a, numbers.Real) and math.isfinite(a) for a in r) or r[0] > r[1]:
        raise ValueError(f"{name} must be a finite (low, high) pair with low <= high, got {r!r}")


def _uniform(shape, low: float, high: float, generator, dtype) -> Tensor:
    return torch.rand(shape, generator=generator, dtype=torch.float64).mul_(high - low).add_(low).to(dtype)


@dataclass(frozen=True)
class SinusoidTasks:
    """Sinusoid regression tasks ``y = A sin(x − φ)`` (Finn et al., 2017).

    Attributes:
        k_shot: support points per task (K).
        k_query: query points per task (K_q).
        amplitude: range of ``A`` (uniform).
        phase: range of ``φ`` (uniform).
        x_range: range of the inputs ``x`` (uniform).
    """

    k_shot: int = 10
    k_query: int = 10
    amplitude: Tuple[float, float] = (0.1, 5.0)
    phase: Tuple[float, float] = (0.0, math.pi)
    x_range: Tuple[float, float] = (-5.0, 5.0)

    def __post_init__(self):
        check_int("k_shot", self.k_shot, 1)
        check_int("k_query", self.k_query, 1)
        _check_range("amplitude", self.amplitude)
        _check_range("phase", self.phase)
        _check_range("x_range", self.x_range)

    def sample(self, num_tasks: int, generator: Optional[torch.Generator] = None,
               dtype: torch.dtype = torch.float32) -> MetaBatch:
        """A meta-batch: inputs and targets of shape (T, K, 1) / (T, K_q, 1);
        ``task_params`` (T, 2) = (A, φ). Sampled on the CPU from ``generator``."""
        check_int("num_tasks", num_tasks, 1)
        amp = _uniform((num_tasks, 1, 1), *self.amplitude, generator, torch.float64)
        phase = _uniform((num_tasks, 1, 1), *self.phase, generator, torch.float64)
        x = _uniform((num_tasks, self.k_shot + self.k_query, 1), *self.x_range, generator, torch.float64)
        y = amp * torch.sin(x - phase)
        k = self.k_shot
        x, y = x.to(dtype), y.to(dtype)
        params = torch.cat([amp, phase], dim=-1).reshape(num_tasks, 2).to(dtype)
        return MetaBatch(x[:, :k], y[:, :k], x[:, k:], y[:, k:], params)


@dataclass(frozen=True)
class InContextRegressionTasks:
    """Few-shot in-context linear regression sequences (see the module docstring).

    Attributes:
        dim: input dimension ``d`` of the regression; tokens have width ``d + 2``.
        seq_len: context length in tokens (even): ``seq_len / 2`` (x, y) points per sequence.
        support_size: sequences per task in the support set (S).
        query_size: sequences per task in the query set (S_q).
        noise_std: standard deviation of the label noise ε.
    """

    dim: int = 4
    seq_len: int = 64
    support_size: int = 4
    query_size: int = 4
    noise_std: float = 0.0

    def __post_init__(self):
        check_int("dim", self.dim, 1)
        check_int("seq_len", self.seq_len, 2)
        if self.seq_len % 2:
            raise ValueError(f"seq_len must be even (an x-token and a y-token per point), got {self.seq_len}")
        check_int("support_size", self.support_size, 1)
        check_int("query_size", self.query_size, 1)
        if not (isinstance(self.noise_std, numbers.Real) and self.noise_std >= 0):
            raise ValueError(f"noise_std must be a float >= 0, got {self.noise_std!r}")

    @property
    def token_dim(self) -> int:
        """Width of a token: ``dim + 2`` (x, y, is-y flag)."""
        return self.dim + 2

    @property
    def num_points(self) -> int:
        """(x, y) pairs per sequence: ``seq_len // 2``."""
        return self.seq_len // 2

    def sample(self, num_tasks: int, generator: Optional[torch.Generator] = None,
               dtype: torch.dtype = torch.float32) -> MetaBatch:
        """A meta-batch: inputs (T, S, seq_len, dim + 2), targets (T, S, seq_len / 2) (support;
        S_q for the query); ``task_params`` (T, dim) = ``w``. Sampled on the CPU."""
        check_int("num_tasks", num_tasks, 1)
        d, p = self.dim, self.num_points
        s = self.support_size + self.query_size
        w = torch.randn(num_tasks, d, generator=generator, dtype=torch.float64) / math.sqrt(d)
        x = torch.randn(num_tasks, s, p, d, generator=generator, dtype=torch.float64)
        y = torch.einsum("tspd,td->tsp", x, w)
        if self.noise_std > 0:
            y = y + self.noise_std * torch.randn(y.shape, generator=generator, dtype=torch.float64)
        tokens = torch.zeros(num_tasks, s, self.seq_len, d + 2, dtype=torch.float64)
        tokens[:, :, 0::2, :d] = x
        tokens[:, :, 1::2, d] = y
        tokens[:, :, 1::2, d + 1] = 1.0
        tokens, y = tokens.to(dtype), y.to(dtype)
        k = self.support_size
        return MetaBatch(tokens[:, :k], y[:, :k], tokens[:, k:], y[:, k:], w.to(dtype))


def incontext_mse(pred: Tensor, target: Tensor) -> Tensor:
    """Mean squared error of the predictions at the x-tokens of in-context regression sequences.

    Args:
        pred: (..., seq_len, 1) or (..., seq_len) model outputs, one per token.
        target: (..., seq_len / 2) the ``y_i``.

    Returns:
        scalar: mean over points of ``(pred[..., 2i] − y_i)²``.
    """
    if pred.dim() == target.dim() + 1 and pred.shape[-1] == 1:
        pred = pred[..., 0]
    if pred.shape[:-1] != target.shape[:-1] or pred.shape[-1] != 2 * target.shape[-1]:
        raise ValueError(
            f"incontext_mse expects pred (..., 2P[, 1]) and target (..., P), got pred "
            f"{tuple(pred.shape)} and target {tuple(target.shape)}"
        )
    return torch.nn.functional.mse_loss(pred[..., 0::2], target)


# =========================================================================== associative recall
#
# Token-sequence tasks for gradient-written memory and test-time training (ttt_flash.memory):
# key–value retrieval (one query) and multi-query associative recall (MQAR, Arora et al.,
# 2023). Vocabulary of a task with K keys and V values:
#
#   [0, K)          keys
#   [K, K + V)      values
#   K + V           FILL: filler between pairs (long contexts with few pairs)
#
# A context is ``context_len / 2`` two-token slots ``(key, value)``; ``num_pairs`` of them
# (distinct keys, random values, random slots) hold pairs, the others hold ``(FILL, FILL)``.
# The queries are ``num_queries`` of the stored keys (distinct when possible); the target of
# query token j is the value stored with it. ``context_targets`` are the next-token targets
# of the context restricted to the predictable ones (at a key: its value), ``-100`` (the
# ``ignore_index`` of ``lm_loss``) elsewhere: the next key is random and carries nothing to
# store. Chance accuracy of a query is ``1 / V``.


class RecallBatch(NamedTuple):
    """A batch of associative-recall sequences (leading dimension: the sequence).

    Attributes:
        context: (B, L) int64 tokens: key/value slots.
        context_targets: (B, L) int64: the value at each key position, ``-100`` elsewhere.
        query: (B, Q) int64: keys whose values are asked for.
        query_targets: (B, Q) int64: the value of each query key.
    """

    context: Tensor
    context_targets: Tensor
    query: Tensor
    query_targets: Tensor

    @property
    def num_tokens(self) -> int:
        """Context and query tokens of the whole batch (for throughput)."""
        return self.context.numel() + self.query.numel()


@dataclass(frozen=True)
class AssociativeRecallTasks:
    """Associative-recall sequences (layout above). :class:`KeyValueRetrievalTasks` and
    :class:`MQARTasks` are this with one and with several queries.

    Attributes:
        num_keys: key vocabulary K (``num_pairs <= num_keys``: keys are distinct).
        num_values: value vocabulary V; chance accuracy is 1 / V.
        num_pairs: stored pairs per context.
        num_queries: queries per sequence (at most ``num_pairs`` distinct; more repeat keys).
        context_len: context length in tokens (even, >= 2 · num_pairs); ``None`` means
            ``2 · num_pairs`` (no filler).
    """

    num_keys: int = 16
    num_values: int = 16
    num_pairs: int = 4
    num_queries: int = 1
    context_len: Optional[int] = None

    def __post_init__(self):
        check_int("num_keys", self.num_keys, 1)
        check_int("num_values", self.num_values, 2)
        check_int("num_pairs", self.num_pairs, 1)
        check_int("num_queries", self.num_queries, 1)
        if self.num_pairs > self.num_keys:
            raise ValueError(f"num_pairs ({self.num_pairs}) must be <= num_keys ({self.num_keys}): keys are distinct")
        if self.context_len is not None:
            check_int("context_len", self.context_len, 2)
            if self.context_len % 2 or self.context_len < 2 * self.num_pairs:
                raise ValueError(
                    f"context_len must be even and >= 2 · num_pairs = {2 * self.num_pairs}, got {self.context_len}"
                )

    @property
    def length(self) -> int:
        """Context length L in tokens."""
        return 2 * self.num_pairs if self.context_len is None else self.context_len

    @property
    def vocab_size(self) -> int:
        """Number of token ids: keys, values and FILL."""
        return self.num_keys + self.num_values + 1

    @property
    def fill_token(self) -> int:
        return self.num_keys + self.num_values

    @property
    def chance(self) -> float:
        """Accuracy of guessing a value: 1 / num_values."""
        return 1.0 / self.num_values

    def sample(self, batch_size: int, generator: Optional[torch.Generator] = None) -> RecallBatch:
        """A :class:`RecallBatch` of ``batch_size`` independent sequences, sampled on the CPU."""
        check_int("batch_size", batch_size, 1)
        b, p, q = batch_size, self.num_pairs, self.num_queries
        slots = self.length // 2
        keys = torch.rand(b, self.num_keys, generator=generator).argsort(-1)[:, :p]
        values = torch.randint(0, self.num_values, (b, p), generator=generator) + self.num_keys
        if slots == p:
            where = torch.arange(p).expand(b, p)
        else:  # random slots, kept in increasing order
            where = torch.rand(b, slots, generator=generator).argsort(-1)[:, :p].sort(-1).values
        pair_keys = torch.full((b, slots), self.fill_token, dtype=torch.long)
        pair_values = pair_keys.clone()
        pair_keys.scatter_(1, where, keys)
        pair_values.scatter_(1, where, values)
        context = torch.stack([pair_keys, pair_values], dim=-1).reshape(b, 2 * slots)
        context_targets = torch.full_like(context, -100)
        is_pair = pair_keys != self.fill_token
        context_targets[:, 0::2] = torch.where(is_pair, pair_values, -100)
        # queries: a permutation of the stored pairs, repeated if num_queries > num_pairs
        order = torch.rand(b, p, generator=generator).argsort(-1)
        order = order.repeat(1, -(-q // p))[:, :q]
        query = keys.gather(1, order)
        query_targets = values.gather(1, order)
        return RecallBatch(context, context_targets, query, query_targets)


@dataclass(frozen=True)
class KeyValueRetrievalTasks(AssociativeRecallTasks):
    """Key–value retrieval: store ``num_pairs`` pairs, ask for the value of one stored key."""

    num_queries: int = 1


@dataclass(frozen=True)
class MQARTasks(AssociativeRecallTasks):
    """Multi-query associative recall: ask for the values of ``num_queries`` stored keys."""

    num_pairs: int = 8
    num_queries: int = 8


__all__ += ["RecallBatch", "AssociativeRecallTasks", "KeyValueRetrievalTasks", "MQARTasks"]


# --------------------------------------------------------------------------- byte corpus

_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


def stdlib_source_files() -> List[Path]:
    """The running Python's standard-library ``*.py`` files, sorted by relative path.

    From ``sysconfig.get_paths()["stdlib"]``, skipping ``site-packages``/``dist-packages``
    (third-party code) and ``__pycache__``. The order is deterministic for one Python
    installation.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise FileNotFoundError(f"the standard library directory {root} does not exist; pass paths=[...] instead")
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS and not d.startswith(".")]
        files.extend(Path(dirpath) / f for f in filenames if f.endswith(".py"))
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def expand_paths(paths: Sequence[str]) -> List[Path]:
    """Files named by ``paths``: files as given, directories' files recursively (sorted,
    hidden ones skipped), glob patterns' matches (sorted). Raises ``FileNotFoundError`` for an
    entry that names nothing, or when nothing is found."""
    out: List[Path] = []
    for entry in paths:
        p = Path(entry).expanduser()
        if p.is_file():
            out.append(p)
        elif p.is_dir():
            found = []
            for dirpath, dirnames, filenames in os.walk(p):
                dirnames[:] = [d for d in dirnames if not d.startswith(".")]
                found.extend(Path(dirpath) / f for f in filenames if not f.startswith("."))
            out.extend(sorted(found, key=lambda q: q.relative_to(p).as_posix()))
        elif any(ch in entry for ch in "*?["):
            out.extend(Path(m) for m in sorted(glob.glob(str(p), recursive=True)) if Path(m).is_file())
        else:
            raise FileNotFoundError(f"{entry!r} is not a file, a directory or a glob pattern that matches a file")
    if not out:
        raise FileNotFoundError(f"paths={list(paths)!r} match no file")
    return out


def read_corpus(files: Sequence[Path], max_bytes: Optional[int] = None) -> bytes:
    """The files' bytes concatenated in order, each followed by a newline, cut at ``max_bytes``."""
    chunks, total = [], 0
    for f in files:
        if max_bytes is not None and total >= max_bytes:
            break
        data = Path(f).read_bytes() + b"\n"
        chunks.append(data)
        total += len(data)
    corpus = b"".join(chunks)
    return corpus if max_bytes is None else corpus[:max_bytes]


class ByteWindows(Dataset):
    """Windows of a 1-D byte-token tensor as next-token pairs. Item i → (x, y), each (seq_len,) int64: bytes [s, s + N) and [s + 1, s + N + 1).

    ``random``: s drawn from a generator seeded with (seed, i), so any index is a fresh,
    reproducible window whatever the number of workers. Otherwise s is the i-th of
    ``count`` evenly spaced starts."""

    def __init__(self, tokens: Tensor, seq_len: int, seed: int, random: bool, count: int):
        self.tokens, self.seq_len, self.seed, self.random, self.count = tokens, seq_len, seed, random, count
        self.last_start = tokens.numel() - seq_len - 1

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int) -> Tuple[Tensor, Tensor]:
        if self.random:
            state = np.random.SeedSequence([self.seed, int(i)]).generate_state(1, dtype=np.uint64)[0]
            start = int(state % np.uint64(self.last_start + 1))
        else:
            start = 0 if self.count == 1 else (int(i) * self.last_start) // (self.count - 1)
        w = self.tokens[start : start + self.seq_len + 1].long()
        return w[:-1], w[1:]
