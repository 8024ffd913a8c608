"""Multi-tensor optimizer updates: one launch updates every parameter of a list.

:func:`sophia_update_` applies Sophia-H's update (``ttt_flash.second_order.optim.SophiaH``) to
a list of float32 CUDA parameters in one pass over memory: each program reads a block of one
parameter, its gradient, its gradient EMA and its Hessian estimate, and writes the parameter
and the EMA back. The update as PyTorch operations reads and writes each tensor a dozen times;
here each is read once and two are written once. The clipped coordinates are counted per
tensor with integer atomics (exact, in any order).

Which tensor and offset each program takes comes from a table made on the host once per list of
tensors (their addresses and sizes) and copied to the device; tables are kept per list, so a
step that updates the same tensors (a training loop, a replayed CUDA graph) launches at once. A
table used while a CUDA graph is captured is kept as long as the process runs: the graph reads
it at every replay. Imports torch and triton only.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import List, Sequence, Tuple

import torch
import triton
import triton.language as tl

from .configs import interpreting
from .launch import launch

#: Elements of one tensor per program.
BLOCK = 2048

#: Tables kept for lists of tensors updated eagerly only (least recently used dropped first).
MAX_TABLES = 32

_TABLES: "OrderedDict[tuple, Tuple[torch.Tensor, int, int]]" = OrderedDict()
_CAPTURED: dict = {}  # tables a captured graph reads: never dropped


@triton.jit
def _sophia_update_kernel(table, counts, decay_ptr, neg_lr_ptr, n_tensors, beta1, one_minus_beta1, rho, eps,
                          DECAY: tl.constexpr, BLOCK: tl.constexpr):
    # table (int64): [p, grad, exp_avg, hessian] addresses per tensor, then the sizes, then per
    # program its tensor and first element
    pid = tl.program_id(0)
    head = 5 * n_tensors
    t = tl.load(table + head + 2 * pid)
    start = tl.load(table + head + 2 * pid + 1)
    n = tl.load(table + 4 * n_tensors + t)
    p_ptr = tl.load(table + 4 * t).to(tl.pointer_type(tl.float32))
    g_ptr = tl.load(table + 4 * t + 1).to(tl.pointer_type(tl.float32))
    m_ptr = tl.load(table + 4 * t + 2).to(tl.pointer_type(tl.float32))
    h_ptr = tl.load(table + 4 * t + 3).to(tl.pointer_type(tl.float32))
    offs = start + tl.arange(0, BLOCK)
    mask = offs < n
    p = tl.load(p_ptr + offs, mask=mask, other=0.0)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0)
    m = tl.load(m_ptr + offs, mask=mask, other=0.0)
    h = tl.load(h_ptr + offs, mask=mask, other=0.0)
    if DECAY:
        p = p * tl.load(decay_ptr)
    m = m * beta1
    m = m + one_minus_beta1 * g
    ratio = tl.minimum(tl.math.div_rn(tl.abs(m), tl.maximum(h * rho, eps)), 1.0)
    tl.atomic_add(counts + t, tl.sum(tl.where(mask & (ratio >= 1.0), 1, 0), 0))
    sign = tl.where(m > 0.0, 1.0, tl.where(m < 0.0, -1.0, 0.0))
    p = p + (sign * tl.load(neg_lr_ptr)) * ratio
    tl.store(p_ptr + offs, p, mask=mask)
    tl.store(m_ptr + offs, m, mask=mask)


def fused_update_applies(*lists: Sequence[torch.Tensor]) -> bool:
    """Whether :func:`sophia_update_` takes these lists: float32, contiguous, plain tensors (not
    a tensor subclass such as a DTensor) on one CUDA device, or CPU tensors under the Triton
    interpreter."""
    first = lists[0][0]
    if not (first.is_cuda or interpreting()):
        return False
    device = first.device
    return all(type(t) in (torch.Tensor, torch.nn.Parameter) and t.dtype == torch.float32 and t.device == device
               and t.is_contiguous() for ts in lists for t in ts)


def table_key(params, grads, exp_avgs, hessians) -> tuple:
    """The cache key of these tensors' table: per tensor, the four addresses and the size."""
    return tuple((p.data_ptr(), g.data_ptr(), m.data_ptr(), h.data_ptr(), p.numel())
                 for p, g, m, h in zip(params, grads, exp_avgs, hessians))


def _table(params, grads, exp_avgs, hessians) -> Tuple[torch.Tensor, int, int]:
    """(device table, number of tensors, number of programs) for these tensors."""
    key = table_key(params, grads, exp_avgs, hessians)
    capturing = params[0].is_cuda and torch.cuda.is_current_stream_capturing()
    hit = _CAPTURED.get(key) or _TABLES.get(key)
    if hit is not None:
        if key in _TABLES:
            _TABLES.move_to_end(key)
            if capturing:
                _CAPTURED[key] = _TABLES.pop(key)
        return hit
    if capturing:  # a new table would be copied from host memory inside the graph
        raise RuntimeError("sophia_update_: a new list of tensors while a CUDA graph is captured; run the "
                           "update once eagerly on the same tensors before capturing (a warm-up)")
    sizes = torch.tensor([k[4] for k in key], dtype=torch.int64)
    per_tensor = (sizes + BLOCK - 1) // BLOCK
    which = torch.repeat_interleave(torch.arange(len(key)), per_tensor)
    first = torch.cumsum(per_tensor, 0) - per_tensor
    blocks = torch.stack([which, (torch.arange(len(which)) - first[which]) * BLOCK], 1)
    host = torch.cat([torch.tensor([a for k in key for a in k[:4]], dtype=torch.int64), sizes, blocks.flatten()])
    device = params[0].device
    # pinned, so that the copy does not wait for the work queued on the stream
    table = host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host
    entry = (table, len(key), len(which))
    _TABLES[key] = entry
    while len(_TABLES) > MAX_TABLES:
        _TABLES.popitem(last=False)
    return entry


def sophia_update_(params: List[torch.Tensor], grads: List[torch.Tensor], exp_avgs: List[torch.Tensor],
                   hessians: List[torch.Tensor], decay: torch.Tensor, neg_lr: torch.Tensor, beta1: float,
                   rho: float, eps: float, weight_decay: bool) -> torch.Tensor:
    """Sophia-H's update of every tensor in ``params``, in place, in one launch.

    Per coordinate: ``p ← p · decay`` (if ``weight_decay``); ``m ← β₁ m + (1 − β₁) g``;
    ``ratio = min(|m| / max(ρ h, ε), 1)``; ``p ← p + sign(m) · neg_lr · ratio``.

    Args:
        params, grads, exp_avgs, hessians: T tensors each, float32, contiguous, on one device;
            the i-th of each has the shape of ``params[i]``. ``params`` and ``exp_avgs`` are
            written.
        decay, neg_lr: 0-dim float32 tensors on that device: 1 − lr·λ and −lr.
        beta1, rho, eps: β₁, ρ, ε.
        weight_decay: multiply the parameters by ``decay`` first.

    Returns:
        (T,) int32: each tensor's number of clipped coordinates (ratio = 1).
    """
    table, n_tensors, n_programs = _table(params, grads, exp_avgs, hessians)
    counts = torch.zeros(n_tensors, dtype=torch.int32, device=params[0].device)
    launch(_sophia_update_kernel, (n_programs,), table, counts, decay, neg_lr, n_tensors, beta1, 1 - beta1, rho, eps,
           DECAY=bool(weight_decay), BLOCK=BLOCK)
    return counts
