"""Moved: the MAML networks are nn.Modules and live in :mod:`ttt_flash.models.regressors`.

This module re-exports them so that recipes and code written against
``ttt_flash.lightning.nets`` keep working.
"""

from ..models.regressors import ATTENTIONS, GPTRegressor, NetConfig, SinusoidMLP, TinyTransformer

__all__ = ["NetConfig", "SinusoidMLP", "TinyTransformer", "GPTRegressor", "ATTENTIONS"]
