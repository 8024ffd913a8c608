"""ttt-flash: exact double backward through softmax attention for test-time training
and meta-learning.

Public names:

* :func:`flash_attention` — attention in (B, H, N, D) layout, differentiable twice exactly.
* :func:`flash_attention_varlen` — the same over packed variable-length sequences.
* ``__version__``.
"""

from .attention import flash_attention, flash_attention_varlen

__version__ = "0.1.0"

__all__ = ["flash_attention", "flash_attention_varlen", "__version__"]
