"""Static tile table: (kernel, BLOCK_D, dtype class, GPU capability major) -> tiles, and the
choice between the atomic-free and the atomic passes.

No autotuning at call time: a lookup, with a safe default for unknown GPUs and a small
config for the Triton interpreter (CPU). How each entry was chosen (offline ptxas spill
checks, then ``python -m ttt_flash.kernels.tune`` sweeps and ``scripts/tile_check.py`` chain
timings on an H200) is recorded in docs/benchmarks.md. Known spills: the affine BoB row pass
at d = 256 (6 accumulators of BLOCK_M x 256 floats) and the float32 (IEEE, FMA) BoB passes.

Kernels and the meaning of BLOCK_M / BLOCK_N (M always counts queries, N keys):

- ``fwd``        forward, one program per query tile (BLOCK_M) looping over key tiles.
- ``bwd_dq``     first backward dQ, delta = rowsum(dO∘O) and the row-sum correction, per
  query tile.
- ``bwd_dkdv``   first backward dK/dV, per key tile (BLOCK_N) looping over query tiles.
- ``bwd_fused``  ``deterministic=False`` only: dK/dV per key tile with dQ added to a float32
  buffer by atomics (no dQ recomputation pass).
- ``bob_row``    ``precise=False`` only: the affine BoB row pass (six tile x d accumulators).
- ``bob_col``    BoB column pass (two accumulators, four key-side tiles held).
- ``bob_stats``  BoB row statistics α, E, ρ (no tile accumulators).
- ``bob_direct`` BoB row pass with α, E known (two accumulators). For keys up to
  :data:`FUSED_ROW_MAX_KEYS` and equal tiles, statistics and direct sweeps are one launch.
- ``bob_fused``  ``deterministic=False`` only: BoB key-tile pass with K̄, V̄ in registers and
  Q̄, dŌ added to float32 buffers by atomics (replaces ``bob_direct`` + ``bob_col``).

On Hopper (sm_90) four passes have Gluon versions (TMA, async ``warpgroup_mma``;
``gluon_dkdv.py``, ``gluon_bob_col.py``, ``gluon_bob_row.py`` for ``bob_stats`` and
``bob_direct``): :data:`GLUON` lists their tiles and
:func:`use_gluon` decides, per call, whether a pass takes the Gluon kernel or the Triton one
(the portable path: interpreter, other GPUs, and every input outside the Gluon kernel's
scope). :func:`use_gluon_passes` switches the Gluon passes off for comparison.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
from dataclasses import dataclass
from typing import Iterator, Mapping, Optional, Sequence

import torch

from .common import device_capability as _capability

KINDS = ("fwd", "bwd_dq", "bwd_dkdv", "bwd_fused", "bob_row", "bob_col", "bob_stats",
         "bob_direct", "bob_fused")


@dataclass(frozen=True)
class TileConfig:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    #: key-tile kernels (``bwd_dkdv``, ``bwd_fused``, ``bob_col``, ``bob_fused``) only:
    #: compute in (queries x keys) tiles, the key-side tiles as B operands and the per-query
    #: vectors as row vectors, the P / dS / R / H tiles entering the key-side products
    #: transposed; False: (keys x queries) tiles. The fused kernels require True.
    qmajor: bool = False


_OVERRIDES: dict = {}


@contextlib.contextmanager
def tile_overrides(overrides: Mapping[str, TileConfig]) -> Iterator[None]:
    """Use ``overrides[kind]`` instead of the table for those kernel kinds inside the
    ``with`` block (offline sweeps, tests)::

        with tile_overrides({"bob_col": TileConfig(64, 64, 4, 2, True)}):
            attn_bob(...)

    Nests; the previous overrides come back on exit."""
    bad = set(overrides) - set(KINDS)
    if bad:
        raise ValueError(f"unknown kernel kinds {sorted(bad)}; kinds are {KINDS}")
    saved = dict(_OVERRIDES)
    _OVERRIDES.update(overrides)
    try:
        yield
    finally:
        _OVERRIDES.clear()
        _OVERRIDES.update(saved)


def read_tile_overrides(path: str) -> dict:
    """``{kind: TileConfig}`` from a JSON file ``{kind: [block_m, block_n, num_warps,
    num_stages(, qmajor)]}`` (what ``tune.py`` writes as ``*.best.json``), for
    :func:`tile_overrides`."""
    with open(path) as f:
        return {kind: TileConfig(*cfg) for kind, cfg in json.load(f).items()}


# Interpreter (CPU): small tiles so that short test sequences still span several tiles,
# with BLOCK_M != BLOCK_N in both directions to exercise the tile-range logic.
_INTERPRETER = {
    "fwd": TileConfig(32, 16, 4, 1),
    "bwd_dq": TileConfig(32, 16, 4, 1),
    "bwd_dkdv": TileConfig(16, 32, 4, 1, True),
    "bwd_fused": TileConfig(16, 32, 4, 1, True),
    "bob_row": TileConfig(32, 16, 4, 1),
    "bob_col": TileConfig(16, 32, 4, 1, True),
    "bob_stats": TileConfig(16, 16, 4, 1),  # = bob_direct: one launch (statistics sweep first)
    "bob_direct": TileConfig(16, 16, 4, 1),
    "bob_fused": TileConfig(16, 32, 4, 1, True),
}

_T = TileConfig

# Hopper / Blackwell datacenter (capability 9, 10), 16-bit inputs, keyed by BLOCK_D.
# ptxas on sm_90 (causal + window, the most masking): no spills except bob_row at d = 256.
_SM90_HALF = {
    64: {
        "fwd": _T(128, 64, 8, 3),
        "bwd_dq": _T(128, 64, 8, 3),
        "bwd_dkdv": _T(128, 64, 4, 2, True),
        "bwd_fused": _T(32, 128, 8, 2, True),
        "bob_row": _T(32, 64, 8, 2),
        "bob_col": _T(64, 64, 4, 2, True),
        "bob_stats": _T(128, 64, 8, 3),
        "bob_direct": _T(128, 64, 8, 3),
        "bob_fused": _T(32, 128, 8, 2, True),
    },
    128: {
        "fwd": _T(128, 64, 8, 3),
        "bwd_dq": _T(128, 64, 8, 3),
        "bwd_dkdv": _T(64, 64, 4, 2, True),
        "bwd_fused": _T(32, 64, 4, 2, True),
        "bob_row": _T(16, 32, 8, 2),
        "bob_col": _T(32, 128, 8, 3),
        "bob_stats": _T(128, 64, 8, 2),
        "bob_direct": _T(128, 32, 8, 3),
        "bob_fused": _T(16, 64, 4, 2, True),
    },
    256: {
        "fwd": _T(64, 32, 8, 2),
        "bwd_dq": _T(32, 32, 4, 2),
        "bwd_dkdv": _T(32, 32, 8, 2),
        "bwd_fused": _T(32, 32, 8, 2, True),
        "bob_row": _T(16, 16, 8, 1),
        "bob_col": _T(16, 16, 8, 1),
        "bob_stats": _T(16, 16, 8, 1),
        "bob_direct": _T(16, 16, 8, 1),
        "bob_fused": _T(16, 16, 8, 1, True),
    },
}
# d <= 32: the d = 64 tiles, except the BoB passes (the d = 64 BoB tiles spill there)
_SM90_HALF[32] = dict(_SM90_HALF[64], bob_row=_T(64, 32, 8, 2), bob_col=_T(64, 64, 8, 2))
_SM90_HALF[16] = dict(_SM90_HALF[64], bob_row=_T(64, 32, 8, 2), bob_col=_T(64, 32, 8, 2))

# float32 inputs with IEEE dots run on FMA units, not tensor cores: small tiles. The BoB
# passes spill at every tile size tried (sm_90); these spill least.
_FP32 = {
    64: {
        "fwd": _T(64, 32, 4, 2),
        "bwd_dq": _T(64, 32, 8, 2),
        "bwd_dkdv": _T(32, 32, 8, 1),
        "bob_row": _T(16, 32, 8, 1),
        "bob_col": _T(32, 16, 8, 1),
    },
    128: {
        "fwd": _T(32, 32, 4, 2),
        "bwd_dq": _T(32, 32, 4, 2),
        "bwd_dkdv": _T(16, 32, 8, 1),
        "bob_row": _T(16, 16, 8, 1),
        "bob_col": _T(16, 16, 8, 1),
    },
    256: {
        "fwd": _T(32, 32, 4, 1),
        "bwd_dq": _T(16, 32, 4, 1),
        "bwd_dkdv": _T(16, 16, 8, 1),
        "bob_row": _T(16, 16, 8, 1),
        "bob_col": _T(16, 16, 8, 1),
    },
}
for _t in _FP32.values():
    _t["bob_stats"] = _t["bob_direct"] = _t["bob_row"]
    _t["bwd_fused"] = _T(_t["bwd_dkdv"].block_m, _t["bwd_dkdv"].block_n, _t["bwd_dkdv"].num_warps,
                         _t["bwd_dkdv"].num_stages, True)
    _t["bob_fused"] = _T(_t["bob_col"].block_m, _t["bob_col"].block_n, _t["bob_col"].num_warps,
                         _t["bob_col"].num_stages, True)
_FP32[32] = _FP32[16] = _FP32[64]

# Ampere / Ada (capability 8): same tiles, at most 2 stages (99 KiB shared memory on
# 8.6/8.9); ptxas on sm_80 spilled the d = 64 dK/dV tile above, hence a smaller one.
_SM80_HALF = {
    bucket: {kind: _T(c.block_m, c.block_n, c.num_warps, min(c.num_stages, 2), c.qmajor)
             for kind, c in table.items()}
    for bucket, table in _SM90_HALF.items()
}
for _b in (16, 32, 64):
    _SM80_HALF[_b]["bwd_dkdv"] = _T(32, 64, 4, 2)

# Any other GPU: small tiles, one stage.
_DEFAULT = {
    bd: {k: _T(bm, bn, 4, 1, k in ("bwd_fused", "bob_fused")) for k in KINDS}
    for bd, (bm, bn) in {16: (32, 32), 32: (32, 32), 64: (32, 32), 128: (16, 32),
                         256: (16, 16)}.items()
}

#: Whether the backward passes scale the recomputed P by ρ = 1 / rowsum(P), measured by the
#: pass that sweeps each query row (first backward: dQ; BoB: statistics), per input dtype.
#: float32 needs it at large logits (|L|·2⁻²⁴ errors of L, amplified by the BoB). For 16-bit
#: inputs those errors stay below the inputs' own rounding (PyTorch's bf16 math chain errs far
#: more at such logits), and on an H200 it cost 5 % of the bf16 chain at N = 65,536 (the dQ
#: pass's row sums): off (docs/benchmarks.md).
ROWSUM_CORRECTION = {torch.float32: True, torch.float16: False, torch.bfloat16: False}

#: Longest key sequence for which the BoB statistics and direct row sweeps run in one launch
#: (when their tiles agree): short sequences are host-bound, so a launch less counts; long
#: ones measured ~1 % faster with two launches (docs/benchmarks.md).
FUSED_ROW_MAX_KEYS = 8192

#: Shortest key sequence for which ``deterministic=False`` takes the atomic passes on a GPU,
#: per (kind, capability major, 16-bit): below it the extra launches (zeroing and casting the
#: float32 buffers) cost more host time than the saved recomputation gains. None: the atomic
#: pass is never the default there. float32 always takes the atomic-free first backward, whose
#: dQ pass measures the row sums of P (the fp32 large-logit correction).
ATOMIC_MIN_KEYS = {
    ("bwd", 9, True): None,
    ("bob", 9, True): None,
    ("bwd", 10, True): None,
    ("bob", 10, True): None,
}


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def get_config(kind: str, block_d: int, dtype: torch.dtype, device: torch.device) -> TileConfig:
    """Tiles for ``kind`` at this head-dim bucket, dtype and device (no tuning)."""
    if kind in _OVERRIDES:
        return _OVERRIDES[kind]
    if interpreting() or device.type != "cuda":
        return _INTERPRETER[kind]
    return _table_config(kind, block_d, dtype, device.index)


def fuse_row_sweeps(n_k: int, block_d: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the BoB statistics and direct sweeps run in one launch (see
    :data:`FUSED_ROW_MAX_KEYS`)."""
    return (n_k <= FUSED_ROW_MAX_KEYS
            and get_config("bob_stats", block_d, dtype, device)
            == get_config("bob_direct", block_d, dtype, device))


def use_atomics(op: str, n_k: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether ``deterministic=False`` takes the atomic pass of ``op`` ("bwd": dQ from the
    key-tile programs; "bob": the fused BoB key-tile pass) at this key length. The
    interpreter (CPU) always does, so that the tests run it."""
    if op == "bwd" and dtype == torch.float32:
        return False
    if interpreting() or device.type != "cuda":
        return True
    return _atomic_from(op, dtype, device.index) is not None and n_k >= _atomic_from(op, dtype, device.index)


@functools.lru_cache(maxsize=None)
def _atomic_from(op: str, dtype: torch.dtype, index):
    major = _capability(index)[0]
    return ATOMIC_MIN_KEYS.get((op, major, dtype != torch.float32))


@functools.lru_cache(maxsize=None)
def _table_config(kind: str, block_d: int, dtype: torch.dtype, index) -> TileConfig:
    # cached: the capability query costs more than a kernel launch's own bookkeeping
    major = _capability(index)[0]
    if dtype == torch.float32:
        table = _FP32 if major in (8, 9, 10) else _DEFAULT
    else:
        table = {9: _SM90_HALF, 10: _SM90_HALF, 8: _SM80_HALF}.get(major, _DEFAULT)
    return table[block_d][kind]


# --------------------------------------------------------------------------- Gluon (sm_90)


@dataclass(frozen=True)
class GluonConfig:
    """Launch parameters of a Gluon pass (``gluon_dkdv`` / ``gluon_bob_col`` /
    ``gluon_bob_stats`` / ``gluon_bob_direct`` keywords). The key-tile passes (``bwd_dkdv``,
    ``bob_col``) own ``block_n`` keys per program and step over ``block_m`` queries; the row
    passes (``bob_stats``, ``bob_direct``) own ``block_m`` queries (16 per warp) and step
    over ``block_n`` keys."""

    block_n: int  #: keys per program (key-tile passes: block_n == 16·num_warps) or per step
    block_m: int  #: queries per step (key-tile passes) or per program (row passes)
    num_warps: int
    stages: int = 2  #: ring slots of the streamed tiles (not ``bwd_dkdv``)
    warp_specialize: bool = False  #: one-warp TMA producer partition (not ``bwd_dkdv``)
    maxnreg: Optional[int] = None  #: ptxas register cap per thread (None: none)
    #: shortest sequence for which the Gluon pass is chosen (host time of the TMA
    #: descriptors against the pass's own time)
    min_keys: int = 0


#: Gluon passes on sm_90, keyed by (kind, head dim): the best tiles of the H200 sweeps
#: (docs/benchmarks.md, "Gluon (item 2)"): dK/dV 3.29 vs 3.60 ms, BoB column pass 5.72 vs
#: 7.05 ms at N = 16,384, H = 12, bf16 (Triton pass of the table in each case). In the
#: chain (both passes) on / off: 16,384 and 65,536 tokens 1.07-1.11x faster, 4,096 tokens
#: 2-5 % slower (host-bound there): hence ``min_keys``. The BoB row passes (64 queries x 64
#: keys / 4 warps, single partition, 2 slots): statistics 4.03 vs 4.42 ms (causal 2.05 vs
#: 2.20), direct 5.84 vs 6.32 ms (causal 3.20 vs 3.51) at the same shape, started at the same
#: ``min_keys``. d = 128: the fastest tiles without ptxas spills
#: (``scripts/gluon_compile_sm90.py``; the direct and column passes need 32-key or 32-query
#: steps there, their two (tile x 128) float32 accumulators taking 128 registers per
#: thread; the statistics pass has none and takes 128 queries x 64 keys / 8 warps) in
#: ``scripts/gluon_pass_sweep.py`` and ``scripts/gluon_chain_ab.py --variant`` at N = 16,384,
#: H = 8 (docs/benchmarks.md, "Gluon at d = 128 and GQA"): chain 35.6 -> 30.3 ms. GQA runs
#: the same tiles (the key-tile passes sweep the query tiles of every head of a kv head).
GLUON = {
    ("bwd_dkdv", 64): GluonConfig(64, 64, 4, min_keys=16384),
    ("bob_col", 64): GluonConfig(64, 64, 4, stages=2, warp_specialize=True, maxnreg=128,
                                 min_keys=16384),
    ("bob_stats", 64): GluonConfig(64, 64, 4, stages=2, min_keys=16384),
    ("bob_direct", 64): GluonConfig(64, 64, 4, stages=2, min_keys=16384),
    ("bwd_dkdv", 128): GluonConfig(64, 64, 4, min_keys=16384),
    ("bob_col", 128): GluonConfig(128, 32, 8, stages=2, warp_specialize=True, maxnreg=168,
                                  min_keys=16384),
    ("bob_stats", 128): GluonConfig(64, 128, 8, stages=2, min_keys=16384),
    ("bob_direct", 128): GluonConfig(32, 64, 4, stages=2, min_keys=16384),
}

#: triton versions (major, minor), inclusive, whose Gluon API the Gluon modules were
#: written against (3.6, the GPU machine's) and compiled with (3.9); outside: Triton.
GLUON_TRITON = ((3, 6), (3, 9))

_GLUON_ON = [True]


@contextlib.contextmanager
def use_gluon_passes(enabled: bool) -> Iterator[None]:
    """Turn the Gluon passes on or off inside the ``with`` block (A/B timings, tests)::

        with use_gluon_passes(False):
            flash_attention(...)  # Triton kernels everywhere

    Nests; the previous setting comes back on exit. On (the default) they still run only
    where :func:`use_gluon` finds the call in their scope."""
    saved = _GLUON_ON[0]
    _GLUON_ON[0] = bool(enabled)
    try:
        yield
    finally:
        _GLUON_ON[0] = saved


def gluon_passes_enabled() -> bool:
    """Whether :func:`use_gluon_passes` currently allows the Gluon passes."""
    return _GLUON_ON[0]


def use_gluon(kind: str, lay, dtype: torch.dtype, device: torch.device, *, window: bool,
              rowsum: bool, tensors: Sequence[Optional[torch.Tensor]],
              complete: bool = True) -> Optional[GluonConfig]:
    """The Gluon launch parameters for this call of pass ``kind`` ("bwd_dkdv", "bob_col",
    "bob_stats" or "bob_direct"), or None: take the Triton kernel.

    ``lay`` is the call's ``common.Layout``; ``window``: a causal sliding window is in use;
    ``rowsum``: the ρ row-sum correction is on; ``tensors``: the (B, H, N, d) tiles and
    (B, H, N) row vectors the pass reads and writes (each must be contiguous: no hidden
    copies); ``complete``: the caller's own conditions hold (``bwd_dkdv``: the atomic-free
    pass; ``bob_col``: precise mode, all three cotangents, both K̄ and V̄ wanted, no
    hi + lo split; ``bob_stats``: all three cotangents; ``bob_direct``: those, both Q̄ and
    dŌ wanted, no hi + lo split). Gluon is chosen only with all of: the passes on
    (:func:`use_gluon_passes`), no tile override for ``kind`` (:func:`tile_overrides`
    selects the Triton kernel), a CUDA device of capability 9.0 outside the interpreter,
    triton within :data:`GLUON_TRITON` and its Gluon Hopper API importable, bf16 / fp16,
    dense inputs with H_q a multiple of H_kv (MHA, GQA, MQA), N_q == N_k a multiple of the
    tiles and at least
    ``min_keys``, a head dim in :data:`GLUON`, B·H·N < 2³¹, full or causal attention without
    a window, no ρ."""
    cfg = GLUON.get((kind, lay.head_dim))
    if (cfg is None or not _GLUON_ON[0] or kind in _OVERRIDES or not complete or window
            or rowsum or dtype not in (torch.float16, torch.bfloat16)
            or device.type != "cuda" or interpreting()):
        return None
    n = lay.n_k
    if (lay.varlen or lay.h_kv < 1 or lay.h_q % lay.h_kv or lay.n_q != n
            or n < max(cfg.min_keys, 1)
            or n % cfg.block_n or n % cfg.block_m or lay.batch * lay.h_q * n >= 2 ** 31):
        return None
    if any(t is None or not t.is_contiguous() for t in tensors):
        return None
    if _capability(device.index) != (9, 0) or not _gluon_importable(kind):
        return None
    return cfg


def _triton_version() -> tuple:
    import triton

    return tuple(int(x) for x in triton.__version__.split(".")[:2])


@functools.lru_cache(maxsize=None)
def _gluon_importable(kind: str) -> bool:
    """triton in :data:`GLUON_TRITON` and the Gluon module of ``kind`` imports its API."""
    lo, hi = GLUON_TRITON
    try:
        if not lo <= _triton_version() <= hi:
            return False
    except ValueError:  # an unparsable version string
        return False
    if kind == "bwd_dkdv":
        from . import gluon_dkdv as mod
    elif kind == "bob_col":
        from . import gluon_bob_col as mod
    else:  # bob_stats, bob_direct
        from . import gluon_bob_row as mod
    return bool(mod.HAVE_GLUON)
