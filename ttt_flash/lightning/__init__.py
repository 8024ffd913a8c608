"""Lightning integration (the only package that imports Lightning).

Public names:

* :class:`MAML`: MAML / FOMAML / Meta-SGD / ANIL meta-training (manual optimization).
* :class:`SinusoidDataModule`, :class:`InContextRegressionDataModule`: tasks generated on
  the fly (:mod:`ttt_flash.tasks`), seedable.
* :class:`NetConfig`, :class:`SinusoidMLP`, :class:`TinyTransformer`, :class:`GPTRegressor`:
  the networks MAML meta-trains, re-exported from :mod:`ttt_flash.models` (where they live).
* :class:`LanguageModel`, :class:`ByteTextDataModule`, :class:`HessianRefresh`: GPT language
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

from .data import InContextRegressionDataModule, SinusoidDataModule
from .lm import ByteTextDataModule, HessianRefresh, LanguageModel
from .maml import MAML
from .memory import AssociativeRecallDataModule, GradMemKV, MemoryLayerMQAR, TTTE2EMQAR
from ..models import GPTRegressor, NetConfig, SinusoidMLP, TinyTransformer  # moved; re-exported
from .resume import ResumableCheckpoint, ResumableCSVLogger
from .fsdp2 import FSDP2Strategy

__all__ = [
    "MAML",
    "SinusoidDataModule",
    "InContextRegressionDataModule",
    "NetConfig",
    "SinusoidMLP",
    "TinyTransformer",
    "GPTRegressor",
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
