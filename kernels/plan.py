"""The one place that decides which passes a call runs, and with which tiles.

The composers (``attn_fwd``, ``attn_bwd``, ``attn_bob``, ``attn_jvp``, ``attn_tangent``)
describe a call by hashable facts (its ``host.Layout``, dtype, device and flags) and read
back a plan (:func:`fwd`, :func:`bwd`, :func:`bob`): the Triton tiles of each pass
(``configs`` tables and overrides; the interpreter's small tiles off CUDA), whether a pass
runs as its Gluon kernel (the verifiers of ``gluon/scope.py``), and which BoB passes run at
all. Plans are cached per call shape, so a repeated call costs one dictionary lookup; the
cache key includes ``configs.generation()``, which changes with the tile overrides and the
Gluon switch. :func:`explain` returns the reasons a Gluon pass was not taken.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional, Tuple, Union

import torch

from . import configs
from .host import Layout, block_d, clear_call_caches, device_capability
from .gluon import scope

Tiles = Union[configs.TileConfig, configs.GluonConfig]


@dataclass(frozen=True)
class Pass:
    """One launch: ``kind`` (a ``configs.KINDS`` entry), its tiles, and whether the Gluon
    kernel runs it (``tiles`` is then a ``configs.GluonConfig``)."""

    kind: str
    tiles: Tiles
    gluon: bool = False


def capability(device: torch.device) -> Optional[Tuple[int, int]]:
    """The CUDA device's (major, minor), or None off CUDA and under the interpreter (where
    the interpreter's tiles apply and no Gluon pass runs)."""
    if configs.interpreting() or device.type != "cuda":
        return None
    return device_capability(device.index)


def _gluon_capability(device: torch.device) -> Optional[Tuple[int, int]]:
    """The capability the Gluon verifiers see (:func:`capability`; a seam for the CPU tests
    of the call sites, which tell it the tensors sit on an sm_90 GPU)."""
    return capability(device)


def tiles(kind: str, block_d: int, dtype: torch.dtype, device: torch.device) -> configs.TileConfig:
    """Triton tiles of ``kind``: the override if one is active, else the table's."""
    over = configs.active_overrides().get(kind)
    if over is not None:
        return over
    return _tiles(kind, block_d, dtype, device, configs.generation())


@functools.lru_cache(maxsize=None)
def _tiles(kind, block_d, dtype, device, generation) -> configs.TileConfig:
    cap = capability(device)
    if cap is None:
        return configs.INTERPRETER[kind]
    return configs.table_config(kind, block_d, dtype, cap[0])


# --------------------------------------------------------------------------- forward


def fwd(lay: Layout, dtype: torch.dtype, device: torch.device, *, window: bool,
        contiguous: bool) -> Pass:
    """The pass of ``attn_fwd``: Gluon on sm_90 where ``scope.fwd_reason`` allows (its
    ``tiles`` a ``configs.GluonConfig``), else the Triton forward's tiles. ``contiguous``:
    q, k, v all are."""
    return _fwd(lay, dtype, device, window, contiguous, configs.generation())


@functools.lru_cache(maxsize=4096)
def _fwd(lay, dtype, device, window, contiguous, generation) -> Pass:
    reason = scope.fwd_reason(lay, dtype, _gluon_capability(device), window=window,
                              contiguous=contiguous)
    if reason is None:
        return Pass("fwd", configs.GLUON[("fwd", lay.head_dim)], True)
    return Pass("fwd", tiles("fwd", block_d(lay.head_dim), dtype, device))


# --------------------------------------------------------------------------- first backward


@dataclass(frozen=True)
class BwdPlan:
    rowsum: bool  #: the dQ pass measures ρ and the dK/dV pass scales P by it
    dq: Pass  #: dQ, D = rowsum(dO∘O) (and ρ, Triton only)
    dkdv: Pass


def bwd(lay: Layout, dtype: torch.dtype, device: torch.device, *, window: bool,
        contiguous: bool, o_contiguous: bool = True) -> BwdPlan:
    """Passes of ``attn_bwd``: the dQ pass (it also writes D, and ρ where the row-sum
    correction is on; Gluon on sm_90 where ``scope.dq_reason`` allows), then dK/dV (Gluon on
    sm_90 where ``scope.dkdv_reason`` allows). ``contiguous``: q, k, v, dO all are;
    ``o_contiguous``: O is (read by the dQ pass only)."""
    return _bwd(lay, dtype, device, window, contiguous, o_contiguous, configs.generation())


@functools.lru_cache(maxsize=4096)
def _bwd(lay, dtype, device, window, contiguous, o_contiguous, generation) -> BwdPlan:
    rowsum = configs.ROWSUM_CORRECTION[dtype]
    bd = block_d(lay.head_dim)
    cap = _gluon_capability(device)
    reason = scope.dq_reason(lay, dtype, cap, window=window, rowsum=rowsum,
                             contiguous=contiguous and o_contiguous)
    if reason is None:
        dq = Pass("bwd_dq", configs.GLUON[("bwd_dq", lay.head_dim)], True)
    else:
        dq = Pass("bwd_dq", tiles("bwd_dq", bd, dtype, device))
    reason = scope.dkdv_reason(lay, dtype, cap, window=window, rowsum=rowsum,
                               contiguous=contiguous)
    if reason is None:
        dkdv = Pass("bwd_dkdv", configs.GLUON[("bwd_dkdv", lay.head_dim)], True)
    else:
        dkdv = Pass("bwd_dkdv", tiles("bwd_dkdv", bd, dtype, device))
    return BwdPlan(rowsum, dq, dkdv)


# --------------------------------------------------------------------------- BoB


@dataclass(frozen=True)
class BobPlan:
    """Passes of one ``attn_bob`` call, in launch order: ``stats`` (α, E + αD, ρ; None when
    the caller gave them or no later pass reads them), ``direct`` (Q̄, dŌ; a Triton direct
    pass with ``stats_first`` sweeps the statistics itself and writes them when
    ``write_stats``), ``affine`` (``precise=False``: Q̄, dŌ and the statistics in one row
    pass), ``col`` (K̄, V̄)."""

    rowsum: bool
    given: bool  #: the caller's α, E + αD (and ρ where needed) are used
    with_stats: bool  #: α, E + αD go through HBM (allocate them)
    need_e: bool  #: E is formed (Q̄ or K̄ wanted)
    col_kb: bool  #: K̄ is computed (by the column pass)
    col_vb: bool  #: V̄ is computed (it vanishes without U_Q and U_K)
    stats: Optional[Pass]
    direct: Optional[Pass]
    stats_first: bool
    write_stats: bool
    affine: Optional[Pass]
    col: Optional[Pass]


def bob(lay: Layout, dtype: torch.dtype, device: torch.device, *, window: bool,
        has_u: Tuple[bool, bool, bool], needs: Tuple[bool, bool, bool, bool], precise: bool,
        known: Tuple[bool, bool], split_row: bool, split_col: bool, contiguous: bool,
        rows_work: bool, cols_work: bool) -> BobPlan:
    """Passes of ``attn_bob``. ``has_u``: which of U_Q, U_K, U_V are given; ``needs``: which
    of (Q̄, K̄, V̄, dŌ) are wanted; ``known``: (α and E + αD given, ρ given) by the caller;
    ``contiguous``: every tile input is; ``rows_work`` / ``cols_work``: there are query rows
    / key rows to compute."""
    return _bob(lay, dtype, device, window, has_u, needs, precise, known, split_row,
                split_col, contiguous, rows_work, cols_work, configs.generation())


@functools.lru_cache(maxsize=4096)
def _bob(lay, dtype, device, window, has_u, needs, precise, known, split_row, split_col,
         contiguous, rows_work, cols_work, generation) -> BobPlan:
    need_qb, need_kb, need_vb, need_dob = needs
    has_g = has_u[0] or has_u[1]
    col_kb, col_vb = need_kb, need_vb and has_g  # V̄ = Hᵀ dO vanishes without G
    run_col = col_kb or col_vb
    rowsum = configs.ROWSUM_CORRECTION[dtype]
    half = dtype != torch.float32
    given = precise and known[0] and (not rowsum or known[1])
    need_e = need_qb or col_kb
    bd = block_d(lay.head_dim)
    cap = _gluon_capability(device)
    all_u = all(has_u)
    common = dict(window=window, rowsum=rowsum, contiguous=contiguous, precise=precise,
                  all_u=all_u)

    def triton_or_gluon(kind, reason):
        if reason is None:
            return Pass(kind, configs.GLUON[(kind, lay.head_dim)], True)
        return Pass(kind, tiles(kind, bd, dtype, device))

    stats = direct = affine = col = None
    stats_first = write_stats = False
    direct_wanted = need_qb or need_dob
    if not precise:
        if rows_work and (direct_wanted or run_col):
            affine = Pass("bob_affine", tiles("bob_affine", bd, dtype, device))
            write_stats = run_col
    else:
        stats_pass = triton_or_gluon("bob_stats", scope.bob_stats_reason(
            lay, dtype, cap, **common))
        direct_pass = triton_or_gluon("bob_direct", scope.bob_direct_reason(
            lay, dtype, cap, need_qb=need_qb, need_dob=need_dob, split=half and split_row,
            **common))
        if given:
            if rows_work and direct_wanted:
                direct = direct_pass
        elif rows_work and (direct_wanted or run_col):
            fuse = (lay.n_k <= configs.FUSED_ROW_MAX_KEYS
                    and tiles("bob_stats", bd, dtype, device)
                    == tiles("bob_direct", bd, dtype, device))
            if direct_wanted and fuse and not direct_pass.gluon:
                direct = direct_pass  # one launch: statistics sweep, then direct sweep
                stats_first, write_stats = True, run_col
            else:
                stats = stats_pass
                direct = direct_pass if direct_wanted else None
    if cols_work and run_col:
        col = triton_or_gluon("bob_col", scope.bob_col_reason(
            lay, dtype, cap, need_kb=col_kb, need_vb=col_vb, split=half and split_col,
            **common))
    return BobPlan(rowsum=rowsum, given=given, with_stats=run_col or precise, need_e=need_e,
                   col_kb=col_kb, col_vb=col_vb, stats=stats, direct=direct,
                   stats_first=stats_first, write_stats=write_stats, affine=affine, col=col)


def explain(kind: str, lay: Layout, dtype: torch.dtype, device: torch.device, **flags) -> str:
    """Why the Gluon pass ``kind`` does or does not take a call (for users and scripts);
    ``flags``: the keywords of its verifier in ``gluon/scope.py``::

        plan.explain("fwd", lay, torch.bfloat16, q.device, window=False, contiguous=True)

        plan.explain("bwd_dq", lay, torch.bfloat16, q.device, window=False, rowsum=False,
                     contiguous=True)

        plan.explain("bob_col", lay, torch.bfloat16, q.device, window=False, rowsum=False,
                     contiguous=True, precise=True, all_u=True, need_kb=True, need_vb=True,
                     split=False)
    """
    verifier = {"fwd": scope.fwd_reason, "bwd_dq": scope.dq_reason,
                "bwd_dkdv": scope.dkdv_reason,
                "bob_stats": scope.bob_stats_reason, "bob_direct": scope.bob_direct_reason,
                "bob_col": scope.bob_col_reason}[kind]
    reason = verifier(lay, dtype, _gluon_capability(device), **flags)
    return "Gluon" if reason is None else f"Triton: {reason}"


def clear_cache() -> None:
    """Forget every cached plan (after changing ``configs`` tables in place, in tests), and
    the composers' per-call-shape caches built from them (``host.call_cache``)."""
    clear_call_caches()
    _tiles.cache_clear()
    _fwd.cache_clear()
    _bwd.cache_clear()
    _bob.cache_clear()
    getattr(scope.importable, "cache_clear", lambda: None)()
