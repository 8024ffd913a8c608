"""Static tile table: (kernel, head-dim bucket, dtype class, GPU capability major) -> tiles.

No autotuning at call time: a lookup, with a safe default for unknown GPUs and a small
config for the Triton interpreter (CPU). Tiles were chosen from register/shared-memory
budgets (H100/H200: 228 KiB shared memory, 64K registers per SM), not from a sweep;
an offline sweep may replace entries here.

Kernels and the meaning of BLOCK_M / BLOCK_N (M always counts queries, N keys):

- ``fwd``       forward, one program per query tile (BLOCK_M) looping over key tiles.
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


#: Test hook: ``OVERRIDES[kind] = TileConfig(...)`` wins over the table.
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

# Hopper (capability 9), 16-bit inputs, keyed by BLOCK_D bucket (64 covers d <= 64).
_SM90_HALF = {
    64: {
        "fwd": TileConfig(128, 64, 4, 3),
        "bwd_pre": TileConfig(128, 64, 4, 1),
        "bwd_dq": TileConfig(128, 32, 4, 3),
        "bwd_dkdv": TileConfig(32, 128, 4, 3),
        "bob_row": TileConfig(64, 32, 8, 2),
        "bob_col": TileConfig(32, 64, 8, 2),
    },
    128: {
        "fwd": TileConfig(128, 64, 8, 3),
        "bwd_pre": TileConfig(128, 64, 4, 1),
        "bwd_dq": TileConfig(64, 64, 4, 3),
        "bwd_dkdv": TileConfig(32, 64, 4, 3),
        "bob_row": TileConfig(32, 32, 8, 2),
        "bob_col": TileConfig(32, 64, 8, 2),
    },
    256: {
        "fwd": TileConfig(64, 64, 8, 2),
        "bwd_pre": TileConfig(64, 64, 4, 1),
        "bwd_dq": TileConfig(32, 64, 8, 2),
        "bwd_dkdv": TileConfig(32, 64, 8, 2),
        "bob_row": TileConfig(16, 32, 8, 1),
        "bob_col": TileConfig(16, 32, 8, 1),
    },
}

# Ampere (capability 8: 164 KiB shared memory on A100, less on consumer parts).
_SM80_HALF = {
    64: {
        "fwd": TileConfig(128, 64, 4, 2),
        "bwd_pre": TileConfig(128, 64, 4, 1),
        "bwd_dq": TileConfig(64, 64, 4, 2),
        "bwd_dkdv": TileConfig(32, 64, 4, 2),
        "bob_row": TileConfig(64, 32, 8, 1),
        "bob_col": TileConfig(32, 64, 8, 1),
    },
    128: {
        "fwd": TileConfig(64, 64, 4, 2),
        "bwd_pre": TileConfig(64, 64, 4, 1),
        "bwd_dq": TileConfig(64, 32, 4, 2),
        "bwd_dkdv": TileConfig(32, 64, 8, 1),
        "bob_row": TileConfig(32, 32, 8, 1),
        "bob_col": TileConfig(32, 32, 8, 1),
    },
    256: {
        "fwd": TileConfig(32, 32, 4, 1),
        "bwd_pre": TileConfig(64, 32, 4, 1),
        "bwd_dq": TileConfig(32, 32, 4, 1),
        "bwd_dkdv": TileConfig(16, 32, 8, 1),
        "bob_row": TileConfig(16, 16, 8, 1),
        "bob_col": TileConfig(16, 16, 8, 1),
    },
}

# Safe default for any other GPU: small tiles, one stage.
_DEFAULT = {
    64: {k: TileConfig(64 if k in ("fwd", "bwd_pre") else 32, 32, 4, 1) for k in KINDS},
    128: {k: TileConfig(32, 32, 4, 1) for k in KINDS},
    256: {k: TileConfig(16, 16, 4, 1) for k in KINDS},
}


def _bucket(block_d: int) -> int:
    return 64 if block_d <= 64 else block_d


def _halve_for_fp32(cfg: TileConfig, kind: str) -> TileConfig:
    """float32 tiles take twice the shared memory: halve the looped-over block, >= 16."""
    if kind in ("bwd_dkdv", "bob_col"):
        return TileConfig(max(16, cfg.block_m // 2), cfg.block_n, cfg.num_warps, max(1, cfg.num_stages - 1))
    return TileConfig(cfg.block_m, max(16, cfg.block_n // 2), cfg.num_warps, max(1, cfg.num_stages - 1))


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def get_config(kind: str, block_d: int, dtype: torch.dtype, device: torch.device) -> TileConfig:
    """Tiles for ``kind`` at this head-dim bucket, dtype and device (no tuning, no caching)."""
    if kind in OVERRIDES:
        return OVERRIDES[kind]
    if interpreting() or device.type != "cuda":
        return _INTERPRETER[kind]
    major = torch.cuda.get_device_capability(device)[0]
    table = {9: _SM90_HALF, 10: _SM90_HALF, 8: _SM80_HALF}.get(major, _DEFAULT)
    cfg = table[_bucket(block_d)][kind]
    if dtype == torch.float32:
        cfg = _halve_for_fp32(cfg, kind)
    return cfg
