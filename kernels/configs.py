"""Tile tables and thresholds of the kernels: data only (imports no kernel module).

No autotuning at call time: ``plan.py`` looks a call's tiles up here once per call shape (a
safe default for unknown GPUs, small tiles for the Triton interpreter). How each entry was
chosen (offline ptxas spill checks, ``python -m ttt_flash.kernels.tune`` sweeps and
``scripts/kernels/tile_check.py`` chain timings on an H200) is recorded in docs/benchmarks.md.

Kernel kinds and the meaning of BLOCK_M / BLOCK_N (M always counts queries, N keys):

- ``fwd``        forward, one program per query tile (BLOCK_M) looping over key tiles.
- ``bwd_dq``     first backward dQ, D = rowsum(dO∘O) and ρ, per query tile.
- ``bwd_dkdv``   first backward dK/dV, per key tile (BLOCK_N) looping over query tiles.
- ``bob_affine`` ``precise=False`` only: the affine BoB row pass (six tile x d accumulators).
- ``bob_col``    BoB column pass (two accumulators, four key-side tiles held).
- ``bob_stats``  BoB row statistics α, E + αD, ρ (no tile accumulators).
- ``bob_direct`` BoB row pass with α, E + αD known (two accumulators). For keys up to
  :data:`FUSED_ROW_MAX_KEYS` and equal tiles, statistics and direct sweeps are one launch.
- ``jvp``        the tangent forward (``attn_jvp``) and the tangent of a computed forward
  (``attn_tangent``): two tile x d accumulators, two query-side tiles.

On Hopper (sm_90) six passes have Gluon versions (``kernels/gluon/``): :data:`GLUON` lists
their tiles; ``gluon/scope.py`` says per call whether a pass can take it.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass
from typing import Iterator, Mapping, Optional

import torch

KINDS = ("fwd", "bwd_dq", "bwd_dkdv", "bob_affine", "bob_col", "bob_stats", "bob_direct", "jvp")


@dataclass(frozen=True)
class TileConfig:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    #: key-tile kernels (``bwd_dkdv``, ``bob_col``) only: compute in (queries x keys) tiles,
    #: the key-side tiles as B operands and the per-query vectors as row vectors, the P / dS /
    #: R / H tiles entering the key-side products transposed; False: (keys x queries) tiles.
    qmajor: bool = False


@dataclass(frozen=True)
class GluonConfig:
    """Launch parameters of a Gluon pass. The key-tile passes (``bwd_dkdv``, ``bob_col``)
    own ``block_n`` keys per program and step over ``block_m`` queries; the row passes
    (``fwd``, ``bob_stats``, ``bob_direct``) own ``block_m`` queries (16 per warp) and step
    over ``block_n`` keys."""

    block_n: int  #: keys per program (key-tile passes: block_n == 16·num_warps) or per step
    block_m: int  #: queries per step (key-tile passes) or per program (row passes)
    num_warps: int
    stages: int = 2  #: ring slots of the streamed tiles (``bwd_dkdv``: with consumers=2 only)
    warp_specialize: bool = False  #: one-warp TMA producer partition (not ``bwd_dkdv``)
    maxnreg: Optional[int] = None  #: ptxas register cap per thread (None: none)
    #: consumer partitions (2: two partitions of num_warps / 2 warps sharing one ring filled
    #: by a one-warp TMA producer; needs ``warp_specialize`` except ``bwd_dkdv``, which then
    #: always adds the producer): ``fwd``, ``bob_stats``, ``bob_direct``, ``bwd_dq``: each
    #: partition has half the query tile and the ring streams key-side tiles; ``bob_col``,
    #: ``bwd_dkdv``: each has half the key tile and the ring streams query-side tiles
    consumers: int = 1
    #: ``fwd`` with two consumers only: they take turns to issue their products
    pingpong: bool = False
    #: shortest sequence for which the Gluon pass is chosen (host time of the TMA
    #: descriptors against the pass's own time)
    min_keys: int = 0


_T = TileConfig

# --------------------------------------------------------------------------- Triton tiles

# Interpreter (CPU): small tiles so that short test sequences still span several tiles,
# with BLOCK_M != BLOCK_N in both directions to exercise the tile-range logic.
INTERPRETER = {
    "fwd": _T(32, 16, 4, 1),
    "bwd_dq": _T(32, 16, 4, 1),
    "bwd_dkdv": _T(16, 32, 4, 1, True),
    "bob_affine": _T(32, 16, 4, 1),
    "bob_col": _T(16, 32, 4, 1, True),
    "bob_stats": _T(16, 16, 4, 1),  # = bob_direct: one launch (statistics sweep first)
    "bob_direct": _T(16, 16, 4, 1),
    "jvp": _T(32, 16, 4, 1),
}

# Hopper / Blackwell datacenter (capability 9, 10), 16-bit inputs, keyed by BLOCK_D.
# Chosen without ptxas spills except bob_affine at d = 256 (docs/benchmarks.md).
SM90_HALF = {
    64: {
        "fwd": _T(128, 64, 8, 3),
        "bwd_dq": _T(128, 64, 8, 3),
        "bwd_dkdv": _T(128, 64, 4, 2, True),
        "bob_affine": _T(32, 64, 8, 2),
        "bob_col": _T(64, 64, 4, 2, True),
        "bob_stats": _T(128, 64, 8, 3),
        "bob_direct": _T(128, 64, 8, 3),
        "jvp": _T(128, 64, 8, 3),
    },
    128: {
        "fwd": _T(128, 64, 8, 3),
        "bwd_dq": _T(128, 64, 8, 3),
        "bwd_dkdv": _T(64, 64, 4, 2, True),
        "bob_affine": _T(16, 32, 8, 2),
        "bob_col": _T(32, 128, 8, 3),
        "bob_stats": _T(128, 64, 8, 2),
        "bob_direct": _T(128, 32, 8, 3),
        "jvp": _T(64, 32, 8, 2),
    },
    256: {
        "fwd": _T(64, 32, 8, 2),
        "bwd_dq": _T(32, 32, 4, 2),
        "bwd_dkdv": _T(32, 32, 8, 2),
        "bob_affine": _T(16, 16, 8, 1),
        "bob_col": _T(16, 16, 8, 1),
        "bob_stats": _T(16, 16, 8, 1),
        "bob_direct": _T(16, 16, 8, 1),
        "jvp": _T(32, 16, 8, 1),
    },
}
# d <= 32: the d = 64 tiles, except the BoB passes (the d = 64 BoB tiles spill there)
SM90_HALF[32] = dict(SM90_HALF[64], bob_affine=_T(64, 32, 8, 2), bob_col=_T(64, 64, 8, 2))
SM90_HALF[16] = dict(SM90_HALF[64], bob_affine=_T(64, 32, 8, 2), bob_col=_T(64, 32, 8, 2))

# float32 inputs with IEEE dots run on FMA units, not tensor cores: small tiles. The BoB and
# jvp passes spill at every tile size tried (sm_90); these spill least.
FP32 = {
    64: {
        "fwd": _T(64, 32, 4, 2),
        "bwd_dq": _T(64, 32, 8, 2),
        "bwd_dkdv": _T(32, 32, 8, 1),
        "bob_affine": _T(16, 32, 8, 1),
        "bob_col": _T(32, 16, 8, 1),
        "jvp": _T(32, 32, 8, 1),
    },
    128: {
        "fwd": _T(32, 32, 4, 2),
        "bwd_dq": _T(32, 32, 4, 2),
        "bwd_dkdv": _T(16, 32, 8, 1),
        "bob_affine": _T(16, 16, 8, 1),
        "bob_col": _T(16, 16, 8, 1),
        "jvp": _T(16, 32, 8, 1),
    },
    256: {
        "fwd": _T(32, 32, 4, 1),
        "bwd_dq": _T(16, 32, 4, 1),
        "bwd_dkdv": _T(16, 16, 8, 1),
        "bob_affine": _T(16, 16, 8, 1),
        "bob_col": _T(16, 16, 8, 1),
        "jvp": _T(16, 16, 8, 1),
    },
}
for _t in FP32.values():
    _t["bob_stats"] = _t["bob_direct"] = _t["bob_affine"]
FP32[32] = FP32[16] = FP32[64]

# Ampere / Ada (capability 8): same tiles, at most 2 stages (99 KiB shared memory on
# 8.6 / 8.9; the jvp kernels hold K, K̇, V, V̇ tiles per stage: 1 stage above d = 64);
# ptxas on sm_80 spilled the d = 64 dK/dV tile above, hence a smaller one.
SM80_HALF = {
    bucket: {kind: _T(c.block_m, c.block_n, c.num_warps,
                      min(c.num_stages, 2 if kind != "jvp" or bucket <= 64 else 1), c.qmajor)
             for kind, c in table.items()}
    for bucket, table in SM90_HALF.items()
}
for _b in (16, 32, 64):
    SM80_HALF[_b]["bwd_dkdv"] = _T(32, 64, 4, 2)

# Any other GPU: small tiles, one stage.
DEFAULT = {
    bd: {k: _T(bm, bn, 4, 1) for k in KINDS}
    for bd, (bm, bn) in {16: (32, 32), 32: (32, 32), 64: (32, 32), 128: (16, 32),
                         256: (16, 16)}.items()
}


def table_config(kind: str, block_d: int, dtype: torch.dtype, major: int) -> TileConfig:
    """The table's tiles for ``kind`` at this head-dim bucket, dtype and GPU capability
    major (a lookup; ``plan.tiles`` adds the overrides and the interpreter)."""
    if dtype == torch.float32:
        table = FP32 if major in (8, 9, 10) else DEFAULT
    else:
        table = {9: SM90_HALF, 10: SM90_HALF, 8: SM80_HALF}.get(major, DEFAULT)
    return table[block_d][kind]


# --------------------------------------------------------------------------- thresholds

#: Whether the backward passes scale the recomputed P by ρ = 1 / rowsum(P), measured by the
#: pass that sweeps each query row (first backward: dQ; BoB: statistics), per input dtype.
#: float32 needs it at large logits (|L|·2⁻²⁴ errors of L, amplified by the BoB). For 16-bit
#: inputs those errors stay below the inputs' own rounding, and the row sums cost time in the
#: dQ pass (docs/benchmarks.md): off.
ROWSUM_CORRECTION = {torch.float32: True, torch.float16: False, torch.bfloat16: False}

#: Longest key sequence for which the BoB statistics and direct row sweeps run in one launch
#: (when their tiles agree): short sequences are host-bound, so a launch less counts; long
#: ones run faster as two launches (docs/benchmarks.md).
FUSED_ROW_MAX_KEYS = 8192

# --------------------------------------------------------------------------- Gluon (sm_90)

#: Gluon passes on sm_90, keyed by (kind, head dim): the best tiles of the H200 sweeps
#: (``scripts/kernels/gluon_pass_sweep.py``, ``scripts/kernels/gluon_chain_ab.py``; docs/benchmarks.md).
#: The row passes (forward, dQ at d = 128, the BoB statistics and direct passes) run as two
#: 4-warp consumer partitions of 64 queries each that share one ring of key tiles filled by a
#: one-warp TMA producer (``consumers=2``): the forward with 128-key tiles, the statistics
#: pass with 64 (3 ring slots at d = 64), the direct pass with 64 keys at d = 64 and 32 at
#: d = 128 (its two (tile x d) float32 accumulators in 240 registers). The dQ pass at d = 64,
#: the dK/dV and column passes are faster in their earlier shapes (the Triton dQ; one
#: partition per key tile, 2 programs per SM; the column pass with its producer warp): the
#: two-consumer versions of those lost in the same sweep. GQA runs the same tiles.
#: ``min_keys``: below it the chain is host-bound and the Triton passes run.
GLUON = {
    ("fwd", 64): GluonConfig(128, 128, 8, stages=2, warp_specialize=True, consumers=2,
                             min_keys=16384),
    ("fwd", 128): GluonConfig(128, 128, 8, stages=2, warp_specialize=True, consumers=2,
                              min_keys=16384),
    ("bwd_dq", 128): GluonConfig(128, 128, 8, stages=2, warp_specialize=True, consumers=2,
                                 min_keys=16384),
    ("bwd_dkdv", 64): GluonConfig(64, 64, 4, min_keys=16384),
    ("bob_col", 64): GluonConfig(64, 64, 4, stages=2, warp_specialize=True, maxnreg=128,
                                 min_keys=16384),
    ("bob_stats", 64): GluonConfig(64, 128, 8, stages=3, warp_specialize=True, consumers=2,
                                   min_keys=16384),
    ("bob_direct", 64): GluonConfig(64, 128, 8, stages=2, warp_specialize=True, consumers=2,
                                    min_keys=16384),
    ("bwd_dkdv", 128): GluonConfig(64, 64, 4, min_keys=16384),
    ("bob_col", 128): GluonConfig(128, 32, 8, stages=2, warp_specialize=True, maxnreg=168,
                                  min_keys=16384),
    ("bob_stats", 128): GluonConfig(64, 128, 8, stages=2, warp_specialize=True, consumers=2,
                                    min_keys=16384),
    ("bob_direct", 128): GluonConfig(32, 128, 8, stages=3, warp_specialize=True, consumers=2,
                                     min_keys=16384),
}

#: head dims the Gluon kernels are written for
GLUON_HEAD_DIMS = (64, 128)
#: B·H_q·N bound of the Gluon kernels' int32 TMA row coordinates
GLUON_MAX_ROWS = 2 ** 31

#: triton versions (major, minor), inclusive, whose Gluon API the Gluon modules were
#: written against (3.6) and compiled with (3.9); outside: Triton.
GLUON_TRITON = ((3, 6), (3, 9))

# --------------------------------------------------------------------------- switches

_OVERRIDES: dict = {}
_GLUON_ON = [True]
#: bumped on every change of the switches below: part of the plan cache's key
_GENERATION = [0]


def generation() -> int:
    """A number that changes whenever :func:`tile_overrides` or :func:`use_gluon_passes`
    changes what a plan would be."""
    return _GENERATION[0]


def active_overrides() -> Mapping[str, TileConfig]:
    """The tile overrides in force (``{kind: TileConfig}``)."""
    return _OVERRIDES


@contextlib.contextmanager
def tile_overrides(overrides: Mapping[str, TileConfig]) -> Iterator[None]:
    """Use ``overrides[kind]`` instead of the table for those kernel kinds (any of
    :data:`KINDS`) inside the ``with`` block (offline sweeps, tests)::

        with tile_overrides({"bob_col": TileConfig(64, 64, 4, 2, True), "jvp": ...}):
            attn_bob(...)

    An override of a pass with a Gluon version selects its Triton kernel. Nests; the
    previous overrides come back on exit."""
    bad = set(overrides) - set(KINDS)
    if bad:
        raise ValueError(f"unknown kernel kinds {sorted(bad)}; kinds are {KINDS}")
    saved = dict(_OVERRIDES)
    _OVERRIDES.update(overrides)
    _GENERATION[0] += 1
    try:
        yield
    finally:
        _OVERRIDES.clear()
        _OVERRIDES.update(saved)
        _GENERATION[0] += 1


def read_tile_overrides(path: str) -> dict:
    """``{kind: TileConfig}`` from a JSON file ``{kind: [block_m, block_n, num_warps,
    num_stages(, qmajor)]}`` (what ``tune.py`` writes as ``*.best.json``), for
    :func:`tile_overrides`."""
    with open(path) as f:
        return {kind: TileConfig(*cfg) for kind, cfg in json.load(f).items()}


@contextlib.contextmanager
def use_gluon_passes(enabled: bool) -> Iterator[None]:
    """Turn the Gluon passes on or off inside the ``with`` block (A/B timings, tests)::

        with use_gluon_passes(False):
            flash_attention(...)  # Triton kernels everywhere

    Nests; the previous setting comes back on exit. On (the default) they still run only
    where ``gluon/scope.py`` finds the call in their scope."""
    saved = _GLUON_ON[0]
    _GLUON_ON[0] = bool(enabled)
    _GENERATION[0] += 1
    try:
        yield
    finally:
        _GLUON_ON[0] = saved
        _GENERATION[0] += 1


def gluon_passes_enabled() -> bool:
    """Whether :func:`use_gluon_passes` currently allows the Gluon passes."""
    return _GLUON_ON[0]


def interpreting() -> bool:
    """Whether the Triton interpreter runs the kernels (``TRITON_INTERPRET=1``): the one
    reader of that variable."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"
