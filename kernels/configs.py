"""Static tile table: (kernel, BLOCK_D, dtype class, GPU capability major) -> tiles.

No autotuning at call time: a lookup, with a safe default for unknown GPUs and a small
config for the Triton interpreter (CPU).

How the GPU entries were chosen: every candidate was compiled offline for sm_90 / sm_80
(Triton 3.9, ``triton.compile`` with a GPU target, no GPU needed) and ptxas' register and
local-memory (spill) use read with ``cuobjdump -res-usage``; among the candidates with no
spill, a large tile that still leaves >= ~1 program per SM at the GPT-2 shape (N=1024,
H=12) was kept. Speed was NOT measured: a sweep on the device (``triton.testing.do_bench``)
may replace entries. Known spills: the BoB row pass at d = 256 (6 accumulators of
BLOCK_M x 256 floats) at every tile size tried, and the float32 (IEEE, FMA) BoB passes.

Kernels and the meaning of BLOCK_M / BLOCK_N (M always counts queries, N keys):

- ``fwd``       forward, one program per query tile (BLOCK_M) looping over key tiles.
- ``bwd_dq``    first backward dQ and delta = rowsum(dO∘O), per query tile.
- ``bwd_dkdv``  first backward dK/dV, per key tile (BLOCK_N) looping over query tiles.
- ``bob_row``   BoB row pass (six tile x d accumulators: registers are tight).
- ``bob_col``   BoB column pass (two accumulators, four key-side tiles held).
- ``bob_stats`` ``precise=True`` only: row statistics α, E (no tile accumulators).
- ``bob_direct`` ``precise=True`` only: row pass with α, E known (two accumulators). When
  its tiles equal ``bob_stats``' the two are one launch: each program sweeps its keys twice.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

KINDS = ("fwd", "bwd_dq", "bwd_dkdv", "bob_row", "bob_col", "bob_stats", "bob_direct")


@dataclass(frozen=True)
class TileConfig:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    #: ``bwd_dkdv`` and ``bob_col`` only: compute in (queries x keys) tiles, the key-side
    #: tiles as B operands and the per-query vectors as row vectors, the P / dS / R / H tiles
    #: entering the key-side products transposed; False: (keys x queries) tiles.
    qmajor: bool = False


#: Test/tuning hook: ``OVERRIDES[kind] = TileConfig(...)`` wins over the table.
OVERRIDES: dict = {}


def load_overrides(path: str) -> None:
    """Fill OVERRIDES from a JSON file
    ``{kind: [block_m, block_n, num_warps, num_stages(, qmajor)]}`` (what ``tune.py`` writes as
    ``*.best.json``), to try sweep results without editing the table. Read at import from the
    ``TTT_FLASH_TILE_OVERRIDES`` environment variable."""
    import json

    with open(path) as f:
        for kind, cfg in json.load(f).items():
            OVERRIDES[kind] = TileConfig(*cfg)


if os.environ.get("TTT_FLASH_TILE_OVERRIDES"):
    load_overrides(os.environ["TTT_FLASH_TILE_OVERRIDES"])

# Interpreter (CPU): small tiles so that short test sequences still span several tiles,
# with BLOCK_M != BLOCK_N in both directions to exercise the tile-range logic.
_INTERPRETER = {
    "fwd": TileConfig(32, 16, 4, 1),
    "bwd_dq": TileConfig(32, 16, 4, 1),
    "bwd_dkdv": TileConfig(16, 32, 4, 1, True),
    "bob_row": TileConfig(32, 16, 4, 1),
    "bob_col": TileConfig(16, 32, 4, 1, True),
    "bob_stats": TileConfig(16, 16, 4, 1),  # = bob_direct: one launch (statistics sweep first)
    "bob_direct": TileConfig(16, 16, 4, 1),
}

_T = TileConfig

# Hopper / Blackwell datacenter (capability 9, 10), 16-bit inputs, keyed by BLOCK_D.
# ptxas on sm_90 (causal + window, the most masking): no spills except bob_row at d = 256.
_SM90_HALF = {
    # d <= 64: bwd_dkdv, bob_direct and bob_col from `python -m ttt_flash.kernels.tune
    # --head-dim 64 --dtype bfloat16 --seq-len 16384 --heads 12` on an H200 (2026-11-30):
    # bob_col 64x32/8 warps -> 64x64/4 warps took the BoB composer from 45.2 to 27.7 ms.
    # bwd_dkdv and bob_col in (queries x keys) tiles (qmajor, same sweep, 2026-11-30 second
    # session): dK/dV composer 6.54 -> 6.02 ms, BoB composer (without hi + lo split)
    # 20.2 -> 17.8 ms. bwd_dq and bob_direct 128x64/8 warps: chain at N=65,536 432 -> 426 and
    # 427 ms each (scripts/tile_check.py), no change at 16,384.
    64: {
        "fwd": _T(128, 64, 8, 3),
        "bwd_dq": _T(128, 64, 8, 3),
        "bwd_dkdv": _T(128, 64, 4, 2, True),
        "bob_row": _T(32, 64, 8, 2),
        "bob_col": _T(64, 64, 4, 2, True),
        "bob_stats": _T(128, 64, 8, 3),
        "bob_direct": _T(128, 64, 8, 3),
    },
    # 64 < d <= 128: fwd, bwd_dq, bwd_dkdv and the precise BoB passes from `python -m
    # ttt_flash.kernels.tune --head-dim 128 --dtype bfloat16 --seq-len 8192 --heads 8` on an
    # H200 (2026-11-30): the BoB composer went from 36.2 to ~26 ms; chain at N=16384, H=8:
    # 164.8 -> 39.6 ms. bwd_dkdv in (queries x keys) tiles (second sweep, 2026-11-30): the
    # first-backward composer 2.03 -> 1.75 ms at N=8192.
    128: {
        "fwd": _T(128, 64, 8, 3),
        "bwd_dq": _T(128, 64, 8, 3),
        "bwd_dkdv": _T(64, 64, 4, 2, True),
        "bob_row": _T(16, 32, 8, 2),
        "bob_col": _T(32, 128, 8, 3),
        "bob_stats": _T(128, 64, 8, 2),
        "bob_direct": _T(128, 32, 8, 3),
    },
    256: {
        "fwd": _T(64, 32, 8, 2),
        "bwd_dq": _T(32, 32, 4, 2),
        "bwd_dkdv": _T(32, 32, 8, 2),
        "bob_row": _T(16, 16, 8, 1),
        "bob_col": _T(16, 16, 8, 1),
        "bob_stats": _T(16, 16, 8, 1),
        "bob_direct": _T(16, 16, 8, 1),
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
    16: {k: _T(32, 32, 4, 1) for k in KINDS},
    32: {k: _T(32, 32, 4, 1) for k in KINDS},
    64: {k: _T(32, 32, 4, 1) for k in KINDS},
    128: {k: _T(16, 32, 4, 1) for k in KINDS},
    256: {k: _T(16, 16, 4, 1) for k in KINDS},
}


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def get_config(kind: str, block_d: int, dtype: torch.dtype, device: torch.device) -> TileConfig:
    """Tiles for ``kind`` at this head-dim bucket, dtype and device (no tuning)."""
    if kind in OVERRIDES:
        return OVERRIDES[kind]
    if interpreting() or device.type != "cuda":
        return _INTERPRETER[kind]
    return _table_config(kind, block_d, dtype, device.index)


@functools.lru_cache(maxsize=None)
def _table_config(kind: str, block_d: int, dtype: torch.dtype, index) -> TileConfig:
    # cached: the capability query costs more than a kernel launch's own bookkeeping
    major = torch.cuda.get_device_capability(index)[0]
    if dtype == torch.float32:
        table = _FP32 if major in (8, 9, 10) else _DEFAULT
    else:
        table = {9: _SM90_HALF, 10: _SM90_HALF, 8: _SM80_HALF}.get(major, _DEFAULT)
    return table[block_d][kind]
