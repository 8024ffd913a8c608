"""What the Gluon (Hopper, sm_90) passes share: the guarded import of Gluon's Hopper ops, the
TMA copy names of the installed triton, the device check, the host-side set-up of the TMA
descriptors and row vectors, the argument checks of the public entry points, and the
query-tile ranges of the key-tile programs.

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

from .. import configs
from ..common import LOG2E
from ..host import device_capability

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

#: Gluon's Hopper ops and the list-form ``warp_specialize`` (what the warp-specialised passes need)
HAVE_PASSES = HAVE_GLUON and HAVE_WARP_SPECIALIZE

#: registers per thread of a warp-specialised kernel's one-warp TMA producer partition
PRODUCER_REGS = 24
#: registers per thread of the second consumer partition (``consumers=2``): what an SM's 64K
#: registers leave beside the producer and the first 4-warp consumer
CONSUMER_REGS = 240


def available(device=None, warp_specialize: bool = True) -> bool:
    """True where Gluon's Hopper ops import (and, with ``warp_specialize``, the list-form
    ``warp_specialize``) and the CUDA device is sm_90 (Hopper): a pass module's ``available``."""
    return HAVE_GLUON and (HAVE_WARP_SPECIALIZE or not warp_specialize) and hopper_device(device)


def hopper_device(device=None) -> bool:
    """True where ``device`` (default: the current CUDA device) is an sm_90 (Hopper) GPU."""
    if not torch.cuda.is_available():
        return False
    dev = torch.device("cuda") if device is None else torch.device(device)
    return dev.type == "cuda" and device_capability(dev.index) == (9, 0)


# --------------------------------------------------------------------------- host set-up


def tile_descriptors(tensors, block_rows: int, d: int, dtype: torch.dtype):
    """TMA descriptors of flat (rows, d) 16-bit tensors, each copying (block_rows, d) tiles."""
    gdt = gl.bfloat16 if dtype == torch.bfloat16 else gl.float16
    lay = gl.NVMMASharedLayout.get_default_for([block_rows, d], gdt)
    return [TensorDescriptor(x, list(x.shape), list(x.stride()), [block_rows, d], lay)
            for x in tensors]


def lse_log2(lse: torch.Tensor) -> torch.Tensor:
    """Flat L·log2e; rows that see no key (-inf) become +inf, so P = 0 there."""
    lse2 = lse.reshape(-1) * LOG2E
    return torch.where(lse2 == float("-inf"), float("inf"), lse2)


def flat(x: torch.Tensor) -> torch.Tensor:
    """A (B, H, N, d) tensor as contiguous (B·H·N, d) rows (copied only if not contiguous)."""
    return x.contiguous().view(-1, x.shape[-1])


# --------------------------------------------------------------------------- argument checks


def check_args(fn: str, q, k, tiles, vecs, outs, *, block_n: int, block_m: int,
               num_warps: int, per_warp: str, stages=None, available: bool) -> tuple:
    """Check the arguments of a public Gluon entry point ``fn`` and return (B, H_q, N, d).

    ``tiles``: (name, tensor, key_side) of the (B, H, N, d) inputs (key-side ones have
    H_kv heads); ``vecs``: (name, tensor) of the (B, H_q, N) float32 row vectors (None
    allowed where the name ends in '?'); ``outs``: (name, tensor, key_side) of the outputs
    to write into (contiguous). ``per_warp``: which tile holds 16 rows per warp
    ("block_n" for the key-tile passes, "block_m" for the row passes); ``available``: the
    pass's module can run here. Raises RuntimeError off sm_90 (or without the Gluon API)
    and ValueError naming the argument otherwise."""
    if not available:
        raise RuntimeError(f"{fn}: needs triton.experimental.gluon and an sm_90 GPU; use the "
                           "kernels' composers (attn_bwd, attn_bob) elsewhere")
    if q.dim() != 4 or k is None or k.dim() != 4:
        raise ValueError(f"{fn}: q and k must be (B, H, N, d), got shapes {tuple(q.shape)}, "
                         f"{None if k is None else tuple(k.shape)}")
    if q.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"{fn}: q must be bf16 or fp16, got {q.dtype}")
    b, h, n, d = q.shape
    hk = k.shape[1]
    if hk < 1 or h % hk:
        raise ValueError(f"{fn}: q's heads ({h}) must be a multiple of k's ({hk})")
    for name, x, key_side in list(tiles) + list(outs or ()):
        if x is None:
            raise ValueError(f"{fn}: {name} is None; this pass needs all three cotangents "
                             "(use attn_bob for the others)")
        want = (b, hk if key_side else h, n, d)
        if tuple(x.shape) != want or x.dtype != q.dtype or x.device != q.device:
            raise ValueError(f"{fn}: {name} must have shape {want}, q's dtype and device "
                             f"(got {tuple(x.shape)}, {x.dtype}, {x.device}); varlen is not "
                             "supported here")
    for name, x, _ in outs or ():
        if not x.is_contiguous():
            raise ValueError(f"{fn}: {name} must be contiguous")
    if d not in configs.GLUON_HEAD_DIMS:
        raise ValueError(f"{fn}: head dim must be one of {configs.GLUON_HEAD_DIMS}, got {d}")
    rows, other = (block_n, block_m) if per_warp == "block_n" else (block_m, block_n)
    if num_warps not in (4, 8) or rows != 16 * num_warps:
        raise ValueError(f"{fn}: need num_warps in (4, 8) and {per_warp} == 16*num_warps, "
                         f"got block_n={block_n}, block_m={block_m}, num_warps={num_warps}")
    if other not in (32, 64, 128) or (per_warp == "block_n" and block_n % block_m):
        raise ValueError(f"{fn}: block_n / block_m must be 32, 64 or 128 (a key-tile pass's "
                         f"block_m dividing block_n), got block_n={block_n}, block_m={block_m}")
    if stages is not None and stages not in (2, 3, 4):
        raise ValueError(f"{fn}: stages must be 2, 3 or 4, got {stages}")
    if n % block_n or n % block_m:
        other_name = "block_m" if per_warp == "block_n" else "block_n"
        raise ValueError(f"{fn}: sequence length must be a multiple of {per_warp}={rows} and "
                         f"of {other_name}={other}, got {n}")
    row_pass = per_warp == "block_m"  # the row passes read the row vectors in place
    for name, x in vecs:
        if x is None and name.endswith("?"):
            continue
        name = name.rstrip("?")
        if x is None or x.shape != (b, h, n) or x.dtype != torch.float32 or \
                x.device != q.device or (row_pass and not x.is_contiguous()):
            got = "None" if x is None else f"{x.dtype} {tuple(x.shape)} on {x.device}"
            raise ValueError(f"{fn}: {name} must be {'contiguous ' if row_pass else ''}float32 "
                             f"of shape {(b, h, n)} on {q.device}, got {got}")
    if b * h * n >= configs.GLUON_MAX_ROWS:
        raise ValueError(f"{fn}: B*H*N must be < 2**31 (int32 TMA coordinates), got {b * h * n}")
    return b, h, n, d


# --------------------------------------------------------------------------- tile ranges


if HAVE_GLUON:

    @gluon.jit
    def query_range(n0, N, BLOCK_M: gl.constexpr, CAUSAL: gl.constexpr):
        """First query row and number of query tiles that see key tile [n0, n0 + BLOCK_N)
        (causal: the query tiles before the key tile see none of its keys)."""
        if CAUSAL:
            lo = n0
        else:
            lo = n0 * 0
        return lo, (N - lo) // BLOCK_M

    @gluon.jit
    def query_pos(i, lo, n_tiles, BLOCK_M: gl.constexpr, GROUPS: gl.constexpr):
        """Position in the sequence of the first query of step ``i`` of a key-tile program's
        sweep over the query tiles of every head of its group (head i // n_tiles); with one
        head per group no division."""
        if GROUPS == 1:
            m0 = lo + i * BLOCK_M
        else:
            m0 = lo + (i % n_tiles) * BLOCK_M
        return m0

    @gluon.jit
    def query_row(qrow0, i, lo, n_tiles, N, BLOCK_M: gl.constexpr, GROUPS: gl.constexpr):
        """(flat row, position in the sequence) of the first query of step ``i`` (see
        :func:`query_pos`); ``qrow0`` is the group's first query row."""
        m0 = query_pos(i, lo, n_tiles, BLOCK_M, GROUPS)
        if GROUPS == 1:
            row = qrow0 + m0
        else:
            row = qrow0 + (i // n_tiles) * N + m0
        return row, m0

    @gluon.jit
    def row_tile(N, BLOCK_M: gl.constexpr, CAUSAL: gl.constexpr):
        """First query row of a row program's tile (causal: longest rows first)."""
        pid = gl.program_id(0)
        if CAUSAL:
            pid = N // BLOCK_M - 1 - pid
        return pid * BLOCK_M

    @gluon.jit
    def key_tiles(m0, N, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr):
        """Number of key tiles [0, n_tiles·BLOCK_N) that query tile [m0, m0 + BLOCK_M) sees."""
        if CAUSAL:
            n_tiles = (m0 + BLOCK_M + BLOCK_N - 1) // BLOCK_N
        else:
            n_tiles = N // BLOCK_N
        return n_tiles


#: The header of every pass module (``from .common import *``): the Gluon names its kernels
#: resolve (where Gluon imports; ``_tma_load`` / ``_tma_store`` are the installed triton's TMA
#: copies, the tile helpers above) and ``LOG2E``. Everything else is imported by name.
__all__ = ["LOG2E"]
if HAVE_GLUON:
    _tma_load, _tma_store = tma_load, tma_store
    __all__ += ["gluon", "gl", "fence_async_shared", "mbarrier", "tma", "warpgroup_mma", "warpgroup_mma_init",
                "warpgroup_mma_wait", "TensorDescriptor", "_tma_load", "_tma_store", "key_tiles", "row_tile",
                "query_pos", "query_range", "query_row"]
