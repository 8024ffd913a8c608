"""Which calls the Gluon passes can take, and if not, why: one verifier per pass.

Each ``*_reason`` function returns None when its Gluon pass can take the call, else a short
sentence naming the first condition that fails. :mod:`ttt_flash.kernels.plan` asks them once
per call shape (its plans are cached), the Gluon launchers do not check again. Nothing here
imports Gluon until the last condition (the Gluon API importable), so the verifiers run on
any machine.

Common scope of the six passes (:func:`common_reason`): the passes switched on
(``configs.use_gluon_passes``), no tile override for the pass's kind (an override selects the
Triton kernel), a CUDA device of capability 9.0 outside the interpreter, triton within
``configs.GLUON_TRITON`` with its Gluon Hopper API importable, bf16 / fp16, dense inputs with
H_q a multiple of H_kv (MHA, GQA, MQA), N_q == N_k a multiple of the pass's tiles and at least
its ``min_keys``, a head dim with a ``configs.GLUON`` entry, B·H_q·N < 2³¹ (int32 TMA
coordinates), full or causal attention without a window, no ρ row-sum correction, every
tile input contiguous (no hidden copies).
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

from .. import configs

def _triton_version() -> tuple:
    import triton

    return tuple(int(x) for x in triton.__version__.split(".")[:2])


@functools.lru_cache(maxsize=None)
def importable(kind: str) -> bool:
    """triton within ``configs.GLUON_TRITON`` and the Gluon module of ``kind`` has its API."""
    lo, hi = configs.GLUON_TRITON
    try:
        if not lo <= _triton_version() <= hi:
            return False
    except ValueError:  # an unparsable version string
        return False
    from . import common

    if kind == "bwd_dkdv":
        return common.HAVE_GLUON
    return common.HAVE_GLUON and common.HAVE_WARP_SPECIALIZE  # the row and BoB passes


def common_reason(kind: str, lay, dtype: torch.dtype, capability, *, window: bool,
                  rowsum: bool, contiguous: bool) -> Optional[str]:
    """Why pass ``kind`` cannot take the call (the conditions shared by every Gluon pass),
    or None. ``lay``: the call's ``host.Layout``; ``capability``: the device's (major,
    minor), None off CUDA or under the interpreter; ``contiguous``: every tile input is."""
    cfg = configs.GLUON.get((kind, lay.head_dim))
    if not configs.gluon_passes_enabled():
        return "the Gluon passes are switched off (configs.use_gluon_passes(False))"
    if kind in configs.active_overrides():
        return f"a tile override for {kind!r} selects the Triton kernel"
    if capability is None:
        return "not a CUDA device (or the Triton interpreter is on)"
    if tuple(capability) != (9, 0):
        return f"the GPU's capability is {tuple(capability)}, the Gluon kernels need (9, 0)"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"dtype {dtype}: the Gluon kernels take bf16 / fp16"
    if cfg is None:
        return f"head dim {lay.head_dim}: no Gluon tiles for {kind!r} (configs.GLUON)"
    if lay.varlen:
        return "varlen inputs"
    if window:
        return "a sliding window"
    if rowsum:
        return "the ρ row-sum correction is on"
    n = lay.n_k
    if lay.h_kv < 1 or lay.h_q % lay.h_kv:
        return f"H_q = {lay.h_q} is not a multiple of H_kv = {lay.h_kv}"
    if lay.n_q != n:
        return f"N_q = {lay.n_q} differs from N_k = {n}"
    if n < max(cfg.min_keys, 1):
        return f"N = {n} is below the pass's min_keys = {cfg.min_keys}"
    if n % cfg.block_n or n % cfg.block_m:
        return f"N = {n} is not a multiple of the tiles ({cfg.block_m}, {cfg.block_n})"
    if lay.batch * lay.h_q * n >= configs.GLUON_MAX_ROWS:
        return "B·H_q·N reaches 2**31 (int32 TMA coordinates)"
    if not contiguous:
        return "a tile input is not contiguous"
    if not importable(kind):
        return (f"triton outside {configs.GLUON_TRITON} or its Gluon Hopper API does not "
                "import")
    return None


def fwd_reason(lay, dtype, capability, *, window, contiguous) -> Optional[str]:
    """The forward (``fwd``): the common scope only (it never applies the ρ correction)."""
    return common_reason("fwd", lay, dtype, capability, window=window, rowsum=False,
                         contiguous=contiguous)


def dq_reason(lay, dtype, capability, *, window, rowsum, contiguous) -> Optional[str]:
    """The first backward's dQ pass (``bwd_dq``, dQ and D): the common scope; it never forms
    ρ, so a call with the row-sum correction on stays with the Triton pass. ``contiguous``:
    q, k, v, O and dO all are."""
    return common_reason("bwd_dq", lay, dtype, capability, window=window, rowsum=rowsum,
                         contiguous=contiguous)


def dkdv_reason(lay, dtype, capability, *, window, rowsum, contiguous) -> Optional[str]:
    """The first backward's dK/dV pass (``bwd_dkdv``): the common scope only."""
    return common_reason("bwd_dkdv", lay, dtype, capability, window=window, rowsum=rowsum,
                         contiguous=contiguous)


def _bob_reason(precise, all_u) -> Optional[str]:
    if not precise:
        return "precise=False (the affine row pass)"
    if not all_u:
        return "a cotangent (U_Q, U_K or U_V) is None"
    return None


def bob_stats_reason(lay, dtype, capability, *, window, rowsum, contiguous, precise,
                     all_u) -> Optional[str]:
    """The BoB statistics pass (``bob_stats``): precise mode, all three cotangents."""
    return _bob_reason(precise, all_u) or common_reason(
        "bob_stats", lay, dtype, capability, window=window, rowsum=rowsum,
        contiguous=contiguous)


def bob_direct_reason(lay, dtype, capability, *, window, rowsum, contiguous, precise, all_u,
                      need_qb, need_dob, split) -> Optional[str]:
    """The BoB direct row pass (``bob_direct``): as the statistics pass, both Q̄ and dŌ
    wanted, no hi + lo split of R and H."""
    if not (need_qb and need_dob):
        return "Q̄ or dŌ is not wanted"
    if split:
        return "split_row=True (hi + lo products)"
    return _bob_reason(precise, all_u) or common_reason(
        "bob_direct", lay, dtype, capability, window=window, rowsum=rowsum,
        contiguous=contiguous)


def bob_col_reason(lay, dtype, capability, *, window, rowsum, contiguous, precise, all_u,
                   need_kb, need_vb, split) -> Optional[str]:
    """The BoB column pass (``bob_col``): precise mode, all three cotangents, both K̄ and V̄
    wanted, no hi + lo split."""
    if not (need_kb and need_vb):
        return "K̄ or V̄ is not wanted"
    if split:
        return "split_col=True (hi + lo products)"
    return _bob_reason(precise, all_u) or common_reason(
        "bob_col", lay, dtype, capability, window=window, rowsum=rowsum, contiguous=contiguous)
