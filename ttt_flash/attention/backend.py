"""Which composers run a call: the Triton kernels or the PyTorch reference.

:func:`resolve_backend` turns the ``backend`` argument into the backend that runs (with the
errors of a backend the inputs cannot run on); :func:`backend_module` is the one table from a
resolved backend to its composer module, read by the autograd Functions and by the custom
operators alike.
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor

from . import reference

__all__ = ["BACKENDS", "resolve_backend", "backend_module"]

#: Accepted values of the ``backend`` argument.
BACKENDS = ("auto", "triton", "reference")

_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


_KERNELS = []  # the kernels module once imported (a per-call import statement costs host time)


def _triton_module():
    if _KERNELS:
        return _KERNELS[0]
    from .. import kernels  # imported lazily: importing triton is slow and optional on CPU

    _KERNELS.append(kernels)
    return kernels


def _interpreting() -> bool:
    # The one reader of TRITON_INTERPRET is kernels/configs.py (the Triton interpreter is a
    # kernels matter); backend="triton" imports the kernels anyway.
    return _triton_module().configs.interpreting()


def resolve_backend(backend: str, q: Tensor) -> str:
    """The backend that runs for ``backend`` ("auto", "triton" or "reference") on query ``q``
    (..., N, d): "auto" picks "triton" for CUDA float16/bfloat16/float32 inputs within the
    kernels' head-dim limit, else "reference". Raises for a backend the inputs cannot run on."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    head_dim = q.shape[-1]
    if backend == "auto":
        if q.is_cuda and q.dtype in _KERNEL_DTYPES:
            max_d = _triton_module().MAX_HEAD_DIM
            if head_dim > max_d:
                warnings.warn(
                    f"head dim {head_dim} exceeds the Triton kernels' maximum {max_d}; "
                    "using the (slower, exact) PyTorch reference backend",
                    stacklevel=3,
                )
                return "reference"
            return "triton"
        return "reference"
    if backend == "triton":
        if q.dtype not in _KERNEL_DTYPES:
            raise TypeError(
                f"backend='triton' supports float16, bfloat16 and float32 inputs, got {q.dtype}; "
                "use backend='reference' (or 'auto') for float64"
            )
        if not q.is_cuda and not _interpreting():
            raise RuntimeError(
                "backend='triton' needs CUDA tensors; on the CPU it runs only under the Triton "
                "interpreter: set TRITON_INTERPRET=1 in the environment before importing "
                "ttt_flash, or use backend='reference' (what 'auto' picks on the CPU)"
            )
        max_d = _triton_module().MAX_HEAD_DIM
        if head_dim > max_d:
            raise ValueError(
                f"head dim (q.shape[-1] = {head_dim}) is larger than the Triton kernels support "
                f"({max_d}); use backend='reference'"
            )
    return backend


def backend_module(backend: str):
    """The module whose ``attn_fwd``, ``attn_bwd``, ``attn_bob``, ``attn_tangent`` and ``attn_jvp``
    run a resolved backend: :mod:`ttt_flash.attention.reference` or the Triton kernels."""
    return reference if backend == "reference" else _triton_module()
