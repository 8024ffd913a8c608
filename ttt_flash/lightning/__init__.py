"""Lightning integration (the only package that imports Lightning).

Public names:

* :class:`MAML`: MAML / FOMAML / Meta-SGD / ANIL meta-training (manual optimization).
* :class:`SinusoidDataModule`, :class:`InContextRegressionDataModule`: tasks generated on
  the fly (:mod:`ttt_flash.tasks`), seedable.
* :class:`LanguageModel`, :class:`ByteTextDataModule` (``data.py``), :class:`HessianRefresh`
  (``hessian_refresh.py``): GPT language
  modelling with Sophia-H / AdaHessian / AdamW on byte-level text (stdlib sources by default).
* :class:`GradMemKV`, :class:`TTTE2EMQAR`, :class:`MemoryLayerMQAR`,
  :class:`AssociativeRecallDataModule`: gradient-written memory, fast-weight test-time
  training and the memory layer on key-value retrieval / MQAR.
* :class:`ResumableCheckpoint`, :class:`ResumableCSVLogger`: ``last.ckpt`` written atomically, with what an exact resume
  needs beyond Lightning's own state; SIGTERM/SIGINT checkpoint and stop
  (:mod:`ttt_flash.lightning.resume`).
* :class:`FSDP2Strategy` (``--trainer.strategy=fsdp2``): FSDP2 sharding, second-order steps
  included (:mod:`ttt_flash.lightning.fsdp2`, docs/distributed.md).
"""

from .data import ByteTextDataModule, InContextRegressionDataModule, SinusoidDataModule
from .hessian_refresh import HessianRefresh
from .lm import LanguageModel
from .maml import MAML
from .memory import AssociativeRecallDataModule, GradMemKV, MemoryLayerMQAR, TTTE2EMQAR
from .resume import ResumableCheckpoint, ResumableCSVLogger
from .fsdp2 import FSDP2Strategy

__all__ = [
    "MAML",
    "SinusoidDataModule",
    "InContextRegressionDataModule",
    "LanguageModel",
    "ByteTextDataModule",
    "HessianRefresh",
    "GradMemKV",
    "TTTE2EMQAR",
    "MemoryLayerMQAR",
    "AssociativeRecallDataModule",
    "ResumableCheckpoint",
    "ResumableCSVLogger",
    "FSDP2Strategy",
]
