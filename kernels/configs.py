"""Static tile table: (kernel, head-dim bucket, dtype class, GPU capability major) -> tiles.

No autotuning at call time: a lookup, with a safe default for unknown GPUs and a small
config for the Triton interpreter (CPU).

How the GPU entries were chosen: every candidate was compiled offline for sm_90 / sm_80
(Triton 3.9, ``triton.compile`` with a GPU target, no GPU needed) and ptxas' register and
local-memory (spill) use read with ``cuobjdump -res-usage``; among the candidates with no
spill, the one with the largest tiles that still gives >= ~1.5 programs per SM at the
GPT-2 shape (N=1024, H=12) was kept. Speed was NOT measured: an offline sweep on the
device (``triton.testing.do_bench``) may replace entries. Known spills: the BoB row pass
at d = 256 (6 accumulators of BLOCK_M x 256 floats) spills at every tile size tried.

Kernels and the meaning of BLOCK_M / BLOCK_N (M always counts queries, N keys):

- ``fwd``       forward, one program per query tile (BLOCK_M) looping over key tiles.
- ``bwd_pre``   delta = rowsum(dO∘O), per query tile (BLOCK_N unused).
- ``bwd_dq``    first backward dQ, per query tile.
- ``bwd_dkdv``  first backward dK/dV, per key tile (BLOCK_N) looping over query tiles.
- ``bob_row``   BoB row pass (six tile x d accumulators: registers are tight).
- ``bob_col``   BoB column pass (two accumulators, four key-side tiles held).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

KINDS = ("fwd", "bwd_pre", "bwd_dq", "bwd_dkdv", "bob_row", "bob_col")


@dataclass(frozen=True)
class TileConfig:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


#: Test/tuning hook: ``OVERRIDES[kind] = TileConfig(...)`` wins over the table.
OVERRIDES: dict = {}

# Interpreter (CPU): small tiles so that short test sequences still span several tiles,
# with BLOCK_M != BLOCK_N in both directions to exercise the tile-range logic.
_INTERPRETER = {
    "fwd": TileConfig(32, 16, 4, 1),
    "bwd_pre": TileConfig(32, 16, 4, 1),
    "bwd_dq": TileConfig(32, 16, 4, 1),
    "bwd_dkdv": TileConfig(16, 32, 4, 1),
    "bob_row": TileConfig(32, 16, 4, 1),
    "bob_col": TileConfig(16, 32, 4, 1),
}

_T = TileConfig

# Hopper / Blackwell datacenter (capability 9, 10), 16-bit inputs, keyed by BLOCK_D bucket
# (64 covers d <= 64). ptxas on sm_90: no spills except bob_row at d = 256.
_SM90_HALF = {
    64: {
        "fwd": _T(128, 64, 8, 3),
        "bwd_pre": _T(128, 64, 4, 1),
        "bwd_dq": _T(64, 64, 4, 3),
        "bwd_dkdv": _T(64, 64, 4, 3),
        "bob_row": _T(32, 64, 8, 2),
        "bob_col": _T(64, 32, 8, 2),
    },
    128: {
        "fwd": _T(64, 64, 4, 3),
        "bwd_pre": _T(64, 64, 4, 1),
        "bwd_dq": _T(64, 64, 4, 3),
        "bwd_dkdv": _T(32, 64, 8, 3),
        "bob_row": _T(16, 32, 8, 2),
        "bob_col": _T(32, 32, 8, 2),
    },
    256: {
        "fwd": _T(64, 64, 8, 2),
        "bwd_pre": _T(32, 64, 4, 1),
        "bwd_dq": _T(32, 64, 8, 2),
        "bwd_dkdv": _T(32, 32, 8, 2),
        "bob_row": _T(16, 16, 8, 1),
        "bob_col": _T(16, 16, 8, 1),
    },
}

# Ampere / Ada (capability 8): same tiles, at most 2 stages (99 KiB shared memory on
# 8.6/8.9); ptxas on sm_80 spilled the d <= 64 dK/dV tile above, hence a smaller one.
_SM80_HALF = {
    bucket: {kind: _T(c.block_m, c.block_n, c.num_warps, min(c.num_stages, 2))
             for kind, c in table.items()}
    for bucket, table in _SM90_HALF.items()
}
_SM80_HALF[64]["bwd_dkdv"] = _T(32, 64, 4, 2)

# Any other GPU: small tiles, one stage.
_DEFAULT = {
    64: {k: _T(32, 32, 4, 1) for k in KINDS},
    128: {k: _T(16, 32, 4, 1) for k in KINDS},
    256: {k: _T(16, 16, 4, 1) for k in KINDS},
}


def _bucket(block_d: int) -> int:
    return 64 if block_d <= 64 else block_d


def _for_fp32(cfg: TileConfig, kind: str) -> TileConfig:
    """float32 tiles take twice the registers and shared memory: halve the looped-over
    block (>= 16) and drop a stage."""
    if kind in ("bwd_dkdv", "bob_col"):
        return _T(max(16, cfg.block_m // 2), cfg.block_n, cfg.num_warps, max(1, cfg.num_stages - 1))
    return _T(cfg.block_m, max(16, cfg.block_n // 2), cfg.num_warps, max(1, cfg.num_stages - 1))


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def get_config(kind: str, block_d: int, dtype: torch.dtype, device: torch.device) -> TileConfig:
    """Tiles for ``kind`` at this head-dim bucket, dtype and device (no tuning)."""
    if kind in OVERRIDES:
        return OVERRIDES[kind]
    if interpreting() or device.type != "cuda":
        return _INTERPRETER[kind]
    major = torch.cuda.get_device_capability(device)[0]
    table = {9: _SM90_HALF, 10: _SM90_HALF, 8: _SM80_HALF}.get(major, _DEFAULT)
    cfg = table[_bucket(block_d)][kind]
    if dtype == torch.float32:
        cfg = _for_fp32(cfg, kind)
    return cfg
