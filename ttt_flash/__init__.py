"""ttt-flash: exact double backward through softmax attention for test-time training
and meta-learning.

Public names:

* :func:`flash_attention` — attention in (B, H, N, D) layout, differentiable twice exactly.
* :func:`flash_attention_varlen` — the same over packed variable-length sequences.
* :class:`GradientMemoryAttention` — an attention layer whose memory slots are written by
  gradient steps through :func:`flash_attention` (:mod:`ttt_flash.memory`).
* ``__version__``.

The names are imported on first use, so ``import ttt_flash`` (and ``ttt-flash --help``) does not
import torch.
"""

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .attention import flash_attention, flash_attention_varlen
    from .memory import GradientMemoryAttention

__version__ = "0.1.0"

__all__ = ["flash_attention", "flash_attention_varlen", "GradientMemoryAttention", "__version__"]

_LAZY = {"flash_attention": ".attention", "flash_attention_varlen": ".attention",
         "GradientMemoryAttention": ".memory"}


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    if not name.startswith("_"):
        try:  # a submodule (``ttt_flash.attention`` after a bare ``import ttt_flash``)
            return importlib.import_module(f".{name}", __name__)
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise
    raise AttributeError(f"module 'ttt_flash' has no attribute {name!r}")


def __dir__():
    return sorted({*globals(), *__all__})
