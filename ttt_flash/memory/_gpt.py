"""What the GPT-based mechanisms (:class:`~ttt_flash.memory.GradMem`,
:class:`~ttt_flash.memory.FastWeightTTT`) share: :func:`gpt_of`, so that each takes a GPT or
its config.

Imports :mod:`ttt_flash.models` only.
"""

from __future__ import annotations

from typing import Mapping, Union

from ..models import GPT, GPTConfig

__all__ = ["gpt_of"]


def gpt_of(model: Union[GPT, GPTConfig, Mapping]) -> GPT:
    """``model`` itself when it is a :class:`~ttt_flash.models.GPT`, else the GPT its
    :class:`~ttt_flash.models.GPTConfig` (or a mapping of its fields) builds."""
    if isinstance(model, Mapping):
        model = GPTConfig(**model)
    if isinstance(model, GPTConfig):
        return GPT(model)
    if not isinstance(model, GPT):
        raise TypeError(f"model must be a ttt_flash.models.GPT or a GPTConfig, got {type(model).__name__}")
    return model

