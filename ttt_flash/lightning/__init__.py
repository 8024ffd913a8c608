"""Lightning integration (the only package that imports Lightning).

Public names:

* :class:`MAML`: MAML / FOMAML / Meta-SGD / ANIL meta-training (manual optimization).
* :class:`SinusoidDataModule`, :class:`InContextRegressionDataModule`: tasks generated on
  the fly (:mod:`ttt_flash.tasks`), seedable.
* :class:`NetConfig`, :class:`SinusoidMLP`, :class:`TinyTransformer`, :class:`GPTRegressor`:
  the networks MAML meta-trains.
* :class:`LanguageModel`, :class:`ByteTextDataModule`, :class:`HessianRefresh`: GPT language
  modelling with Sophia-H / AdaHessian / AdamW on byte-level text (stdlib sources by default).
"""

from .data import InContextRegressionDataModule, SinusoidDataModule
from .lm import ByteTextDataModule, HessianRefresh, LanguageModel
from .maml import MAML
from .nets import GPTRegressor, NetConfig, SinusoidMLP, TinyTransformer

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
]
