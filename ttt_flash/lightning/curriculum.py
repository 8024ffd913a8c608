"""Length curricula: training sequences that grow during training, short first.

A curriculum is a list of stages ``[[first_step, length], ...]``. Training batch ``i`` (the
data modules deliver batch ``i`` of their training order to optimizer step ``i``, across
epochs and resumes) has the length of the last stage whose ``first_step <= i``; validation
and test batches always have the data module's own (final) length, so a validation curve
is measured at the target length from the first check on. The schedule is a function of
the batch index, not of the trainer's state: it is deterministic, needs no callback, and
a resumed run or a worker process sees the same lengths.

Used by :class:`ttt_flash.lightning.memory.AssociativeRecallDataModule` (``context_len``)
and :class:`ttt_flash.lightning.InContextRegressionDataModule` (``seq_len``) through their
``curriculum`` argument. Each module logs the length it trained on (``train/context_len``,
``train/seq_len``), so the stages show in its metrics.csv.

Example::

    >>> from ttt_flash.lightning.curriculum import LengthCurriculum
    >>> c = LengthCurriculum([[0, 1024], [200, 4096], [400, 32768]])
    >>> c.length_at(0), c.length_at(199), c.length_at(200), c.length_at(10**6)
    (1024, 1024, 4096, 32768)
"""

from __future__ import annotations

import bisect
from typing import Callable, Dict, Generic, List, Optional, Sequence, TypeVar

__all__ = ["LengthCurriculum", "StagedTasks"]

T = TypeVar("T")


class LengthCurriculum:
    """Stages ``[[first_step, length], ...]`` of a length curriculum (see the module docstring).

    Args:
        stages: pairs of ints; the first stage starts at step 0, ``first_step`` strictly
            increases, every length is >= 1.
        what: the argument's name in error messages.

    Raises:
        ValueError: naming ``what`` and the stage, for a malformed schedule.
    """

    def __init__(self, stages: Sequence[Sequence[int]], what: str = "curriculum"):
        if isinstance(stages, (str, bytes)) or not isinstance(stages, Sequence) or len(stages) == 0:
            raise ValueError(f"{what} must be a non-empty list of [first_step, length] pairs, got {stages!r}")
        steps: List[int] = []
        lengths: List[int] = []
        for j, stage in enumerate(stages):
            if (not isinstance(stage, Sequence) or isinstance(stage, (str, bytes)) or len(stage) != 2
                    or any(isinstance(x, bool) or not isinstance(x, int) for x in stage)):
                raise ValueError(f"{what}[{j}] must be a pair of ints [first_step, length], got {stage!r}")
            step, length = int(stage[0]), int(stage[1])
            if j == 0 and step != 0:
                raise ValueError(f"{what}[0] must start at step 0 (the length of the first batches), got {stage!r}")
            if j > 0 and step <= steps[-1]:
                raise ValueError(
                    f"{what}[{j}] starts at step {step}, not after the previous stage's {steps[-1]}: "
                    f"first_step must strictly increase"
                )
            if length < 1:
                raise ValueError(f"{what}[{j}] has length {length}; lengths must be >= 1")
            steps.append(step)
            lengths.append(length)
        self.steps, self.lengths, self.what = steps, lengths, what

    def length_at(self, index: int) -> int:
        """The length of training batch ``index`` (>= 0)."""
        if index < 0:
            raise ValueError(f"a batch index must be >= 0, got {index}")
        return self.lengths[bisect.bisect_right(self.steps, index) - 1]

    def as_list(self) -> List[List[int]]:
        """The stages as ``[[first_step, length], ...]``."""
        return [[s, n] for s, n in zip(self.steps, self.lengths)]

    def __repr__(self) -> str:
        return f"LengthCurriculum({self.as_list()})"


class StagedTasks(Generic[T]):
    """One task generator per distinct length of a curriculum, built (and validated) up
    front by ``make(length)``; :meth:`at` returns the one for a training batch index."""

    def __init__(self, curriculum: LengthCurriculum, make: Callable[[int], T]):
        self.curriculum = curriculum
        self._tasks: Dict[int, T] = {}
        for j, length in enumerate(curriculum.lengths):
            if length not in self._tasks:
                try:
                    self._tasks[length] = make(length)
                except ValueError as e:
                    raise ValueError(f"{curriculum.what}[{j}] (length {length}): {e}") from None

    def at(self, index: int) -> T:
        return self._tasks[self.curriculum.length_at(index)]


def staged(stages: Optional[Sequence[Sequence[int]]], make: Callable[[int], T],
           what: str = "curriculum") -> Optional[StagedTasks[T]]:
    """``StagedTasks(LengthCurriculum(stages, what), make)``, or None without stages."""
    if stages is None:
        return None
    return StagedTasks(LengthCurriculum(stages, what), make)
