"""The host half of the kernels: what a composer does before a launch.

It sizes a call (:class:`Layout`), makes its tensors kernel-readable (:func:`prep`), turns
dense (B, H, N, D) and varlen (T, H, D) tensors into the kernels' views (:func:`view`: the
tuple (pointer, batch stride, head stride, token stride)), allocates outputs and row vectors,
and picks per-call flags (:func:`long_rows`, :func:`dot_precision`). The jit half is
``common.py``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch
import triton


#: The composers' per-call-shape caches (:func:`call_cache`), emptied by ``plan.clear_cache``.
CALL_CACHES: list = []
#: Most entries of one composer's cache; past it the cache is emptied and refilled.
CALL_CACHE_MAX = 1024

#: Test hook: when True, every output is allocated filled with NaN, so that an element a
#: kernel forgets to write fails loudly.
POISON_OUTPUTS = False


@dataclass(frozen=True)
class Layout:
    """Sizes of one attention call, dense or varlen, as the kernels see them."""

    varlen: bool
    batch: int
    h_q: int
    h_kv: int
    groups: int
    head_dim: int
    n_q: int  # dense length, or max_seqlen_q for varlen (grid size)
    n_k: int
    t_q: int  # total query tokens (B*N_q dense, T_q varlen)


def call_cache() -> dict:
    """A composer's cache of what a dense call's launches are (plan, grids, launch keywords),
    keyed by everything they depend on: the shapes and strides of the tensors the kernels
    read (after :func:`prep`), dtype, device, the flags, and ``configs.generation()``. A
    repeated call shape then skips the layout, plan and keyword building (host time)."""
    cache: dict = {}
    CALL_CACHES.append(cache)
    return cache


def remember(cache: dict, key, value):
    """``cache[key] = value`` (the cache emptied first when full); returns ``value``."""
    if len(cache) >= CALL_CACHE_MAX:
        cache.clear()
    cache[key] = value
    return value


def clear_call_caches() -> None:
    for cache in CALL_CACHES:
        cache.clear()


def strides(x: Optional[torch.Tensor]):
    """``x.stride()``, None for an absent ``x`` (a call cache key's part)."""
    return None if x is None else x.stride()


def shape(x: Optional[torch.Tensor]):
    """``x.shape``, None for an absent ``x`` (a call cache key's part)."""
    return None if x is None else x.shape


@functools.lru_cache(maxsize=None)
def _several_gpus() -> bool:
    """More than one visible CUDA device (fixed for the process): only then can q's device
    differ from the current one."""
    return torch.cuda.device_count() > 1


def on_input_device(fn):
    """Run a composer with q's CUDA device current: Triton launches on the current device."""

    @functools.wraps(fn)
    def wrapper(q, *args, **kwargs):
        if q.is_cuda and _several_gpus() and q.get_device() != torch.cuda.current_device():
            with torch.cuda.device(q.device):
                return fn(q, *args, **kwargs)
        return fn(q, *args, **kwargs)

    return wrapper


def _max_len(cu: torch.Tensor) -> int:
    return int((cu[1:] - cu[:-1]).max().item()) if cu.numel() > 1 else 0


def layout(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) -> Layout:
    if cu_seqlens_q is not None:
        batch = cu_seqlens_q.numel() - 1
        if max_seqlen_q is None:  # host sync: pass max_seqlen_* to avoid it
            max_seqlen_q = _max_len(cu_seqlens_q)
        if max_seqlen_k is None:
            max_seqlen_k = _max_len(cu_seqlens_k)
        h_q, h_kv = q.shape[1], k.shape[1]
        return Layout(True, batch, h_q, h_kv, h_q // h_kv, q.shape[-1], int(max_seqlen_q),
                      int(max_seqlen_k), q.shape[0])
    return _dense_layout(q.shape, k.shape)


@functools.lru_cache(maxsize=256)
def _dense_layout(q_shape, k_shape) -> Layout:
    """The dense call's Layout, made once per pair of shapes (host time per call)."""
    b, h_q, n_q, d = q_shape
    h_kv, n_k = k_shape[1], k_shape[2]
    return Layout(False, b, h_q, h_kv, h_q // h_kv, d, n_q, n_k, b * n_q)


def prep(x: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """Make ``x`` kernel-readable: unit stride along d and no stride-0 (expanded) dims."""
    if x is None or x.is_contiguous():
        return x
    if x.stride(-1) != 1 or any(s == 0 and n > 1 for s, n in zip(x.stride(), x.shape)):
        x = x.contiguous()
    return x


def rowvec_strides(lay: Layout):
    """(batch, head) strides of a contiguous row vector: (B, H, N) dense or (H, T) varlen."""
    if lay.varlen:
        return 0, lay.t_q
    return lay.h_q * lay.n_q, lay.n_q


def view(x: Optional[torch.Tensor], varlen: bool) -> Optional[tuple]:
    """The kernels' view of a tile tensor: (x, batch stride, head stride, token stride); None
    for an absent ``x`` (a cotangent or tangent not given, an output not wanted: a constexpr
    flag tells the kernel)."""
    if x is None:
        return None
    s = x.stride()
    if varlen:
        return x, 0, s[1], s[0]
    return x, s[0], s[1], s[2]


def new_empty(shape, dtype, device) -> torch.Tensor:
    """Uninitialised contiguous output (NaN-filled under POISON_OUTPUTS)."""
    if POISON_OUTPUTS:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def new_like(x: torch.Tensor) -> torch.Tensor:
    """``new_empty(x.shape, x.dtype, x.device)``, through ``empty_like`` (contiguous): the
    cheaper call (a ``torch.Size`` argument costs host time to parse)."""
    if POISON_OUTPUTS:
        return torch.full_like(x, float("nan"), memory_format=torch.contiguous_format)
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _rowvec_shape(lay: Layout) -> tuple:
    """Shape of a row vector (``lse``'s layout): (B, H_q, N_q) dense, (H_q, T_q) varlen."""
    return (lay.h_q, lay.t_q) if lay.varlen else (lay.batch, lay.h_q, lay.n_q)


def new_rowvec(lay: Layout, device) -> torch.Tensor:
    return new_empty(_rowvec_shape(lay), torch.float32, device)


def new_rowvecs(lay: Layout, device, count: int) -> tuple:
    """``count`` float32 row vectors in ``lse``'s layout, each contiguous, carved from one
    allocation (one allocator call instead of ``count``)."""
    return new_empty((count, *_rowvec_shape(lay)), torch.float32, device).unbind(0)


@functools.lru_cache(maxsize=None)
def block_d(head_dim: int) -> int:
    """The kernels' padded head dim: the next power of two, at least 16 (cached: Triton's
    ``next_power_of_2`` is a constexpr function whose host call costs microseconds)."""
    return max(16, triton.next_power_of_2(head_dim))


def cdiv(a: int, b: int) -> int:
    """``triton.cdiv`` for host integers (ceil(a / b)), without its constexpr-function call."""
    return -(-a // b)


def dot_precision(dtype: torch.dtype):
    """``tl.dot`` input precision: IEEE for float32 (no TF32), the default for 16-bit inputs."""
    if dtype == torch.float32:
        return "ieee"
    return None


def long_rows(lay: Layout, *tensors) -> bool:
    """True when an in-sequence row offset times a token stride may overflow int32."""
    n = max(lay.n_q, lay.n_k, 1)
    stride = max((t.stride(0 if lay.varlen else 2) for t in tensors if t is not None), default=1)
    return (n + 256) * stride + 256 >= 2**31


def cu_seqlens(cu_q: Optional[torch.Tensor], cu_k: Optional[torch.Tensor],
               like: torch.Tensor) -> Optional[tuple]:
    """The kernels' ``CU``: (cu_seqlens_q, cu_seqlens_k) as int32 on ``like``'s device for a
    varlen call, None for a dense one (its kernels compile without IS_VARLEN)."""
    if cu_q is None:
        return None
    return tuple(cu.to(device=like.device, dtype=torch.int32).contiguous() for cu in (cu_q, cu_k))


@functools.lru_cache(maxsize=None)
def device_capability(index) -> tuple:
    """(major, minor) compute capability of CUDA device ``index``, cached: the query costs
    more than a kernel launch's own bookkeeping."""
    return tuple(torch.cuda.get_device_capability(index))
