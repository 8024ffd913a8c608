"""ttt-flash: exact double backward through softmax attention for test-time training
and meta-learning.

Public names:

* :func:`flash_attention` — attention in (B, H, N, D) layout, differentiable twice exactly.
* :func:`flash_attention_varlen` — the same over packed variable-length sequences.
* :class:`GradientMemoryAttention` — an attention layer whose memory slots are written by
  gradient steps through :func:`flash_attention` (:mod:`ttt_flash.memory`; imported on first use).
* ``__version__``.
"""

from . import _moved
from .attention import flash_attention, flash_attention_varlen

_moved.install()  # the old import paths of modules that moved into subpackages

__version__ = "0.1.0"

__all__ = ["flash_attention", "flash_attention_varlen", "GradientMemoryAttention", "__version__"]


def __getattr__(name: str):
    # The memory layer imports the models (docs/architecture.md): load it only when asked.
    if name == "GradientMemoryAttention":
        from .memory import GradientMemoryAttention

        return GradientMemoryAttention
    raise AttributeError(f"module 'ttt_flash' has no attribute {name!r}")
