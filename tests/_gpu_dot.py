"""The Triton interpreter's float32 ``tl.dot`` as the GPU computes it.

On the GPU a float32 ``tl.dot(a, b, acc, input_precision="ieee")`` is a chain of fused
multiply-adds per output element, k = 0, 1, ... in order, starting from ``acc``: the same
product rounds the same way in every kernel, whatever the tile shape. The interpreter (Triton
3.6 to 3.9) calls ``numpy.matmul``, i.e. BLAS, whose rounding of one element depends on the
shapes of the whole product: a score S = τ q·k recomputed by passes with different tiles then
differs by up to a few units in the last place of |S| between passes. At |S| ~ 1,000 that is
~1e-4 in P, more than PyTorch's own float32 error on the same inputs, so the float32
large-logit tests would measure the host's BLAS kernels instead of the kernels' arithmetic.

:func:`install` makes the interpreter's float32 x float32 products an in-order chain of
multiply-adds (the product is exact in float64, the sum rounds to float32 once per step:
bitwise the GPU's fma except in rare double-rounding ties), vectorised over the output tile.
"""

from __future__ import annotations

import numpy as np


def fma_chain_matmul(a: np.ndarray, b: np.ndarray, acc: np.ndarray) -> np.ndarray:
    """a (M, K) @ b (K, N) + acc (M, N), float32, one multiply-add per k in order."""
    # terms with a zero column of a or row of b add an exact 0 (a padded head dim, masked rows)
    live = np.flatnonzero(a.any(axis=0) & b.any(axis=1))
    prods = a[:, live].astype(np.float64)[:, :, None] * b[live].astype(np.float64)[None]
    out = np.array(acc, dtype=np.float32, copy=True)
    for kk in range(live.size):
        out = (out + prods[:, kk]).astype(np.float32)
    return out


def install() -> bool:
    """Route the interpreter's 2-D float32 ``tl.dot`` through :func:`fma_chain_matmul`;
    other dtypes keep the interpreter's own product. False where the interpreter has no
    ``InterpreterBuilder.create_dot`` to wrap (then nothing changes)."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return False
    builder = getattr(interpreter, "InterpreterBuilder", None)
    real = getattr(builder, "create_dot", None)
    if real is None or getattr(real, "_ttt_flash_fma_chain", False):
        return real is not None

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        x, y, acc = a.data, b.data, d.data
        if (x.dtype == np.float32 and y.dtype == np.float32 and acc.dtype == np.float32
                and x.ndim == 2 and y.ndim == 2):
            return interpreter.TensorHandle(fma_chain_matmul(x, y, acc), d.dtype.scalar)
        return real(self, a, b, d, input_precision, max_num_imprecise_acc)

    create_dot._ttt_flash_fma_chain = True
    builder.create_dot = create_dot
    return True
