"""Softmax attention, differentiable to any order exactly.

The modules, in the order a call meets them:

* ``api.py``: :func:`flash_attention`, :func:`flash_attention_varlen`, the public functions;
* ``checks.py``: the validation of their arguments (the one check site of both routes);
* ``backend.py``: the backend that runs (``"triton"`` or ``"reference"``) and its composers;
* ``functions.py``: the one dispatch (``_apply``) and the ``torch.autograd.Function`` s of
  every derivative order;
* ``ops.py``: the ``torch.library`` custom operators that ``torch.compile`` traces;
* ``reference/``: the exact chunked PyTorch implementation (the oracle, the CPU path);
* ``registry.py``: the attention implementations by the names recipes use (``"ttt_flash"``,
  ``"math"``, ``"sdpa"``); imported by name, as it reaches up to context parallelism.
"""

from .api import flash_attention, flash_attention_varlen
from .backend import BACKENDS, backend_module, resolve_backend
from .checks import LAYOUTS

__all__ = ["flash_attention", "flash_attention_varlen", "BACKENDS", "LAYOUTS", "resolve_backend",
           "backend_module"]
