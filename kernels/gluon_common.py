"""What the Gluon (Hopper, sm_90) passes share: the guarded import of Gluon's Hopper ops, the
TMA copy names of the installed triton, and the device check.

Gluon and its Hopper ops exist from triton 3.5 on, and their API moves between versions:
triton 3.6 names the TMA copies ``async_copy_global_to_shared`` / ``async_copy_shared_to_global``,
later versions ``async_load`` / ``async_store`` (:data:`tma_load` / :data:`tma_store` are
whichever exists). ``gl.warp_specialize`` takes the list form
``[(default_fn, args), (worker_fn, args), ...], worker_num_warps, worker_num_regs`` in 3.6 and
3.9; earlier releases took the partitions as separate arguments, which the passes do not
support (:data:`HAVE_WARP_SPECIALIZE` is False there and the warp-specialised passes report
themselves unavailable).

Any import failure means "not available": :data:`HAVE_GLUON` is False and the Gluon names
are absent; the modules that use them define their kernels under ``if HAVE_GLUON:``.
"""

from __future__ import annotations

import torch

from .common import device_capability

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_init,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
    HAVE_GLUON = True
    HAVE_WARP_SPECIALIZE = hasattr(gl, "warp_specialize")
except Exception:  # noqa: BLE001 - any import failure means "not available"
    HAVE_GLUON = HAVE_WARP_SPECIALIZE = False

__all__ = ["HAVE_GLUON", "HAVE_WARP_SPECIALIZE", "LOG2E", "hopper_device"]

LOG2E = 1.4426950408889634


def hopper_device(device=None) -> bool:
    """True where ``device`` (default: the current CUDA device) is an sm_90 (Hopper) GPU."""
    if not torch.cuda.is_available():
        return False
    dev = torch.device("cuda") if device is None else torch.device(device)
    return dev.type == "cuda" and device_capability(dev.index) == (9, 0)
