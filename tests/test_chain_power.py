"""scripts/kernels/chain_power.py on the CPU: its shape parser, the sampler's CSV reader, the
per-window statistics and the power-cap flag (the GPU run itself is in docs/benchmarks.md)."""

from __future__ import annotations

import importlib.util
import os
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


def _load():
    spec = importlib.util.spec_from_file_location(
        "chain_power", os.path.join(HERE, "..", "scripts", "kernels", "chain_power.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_parse_shapes():
    cp = _load()
    assert cp.parse_shapes("16384:12:12:64,16384:32:8:128") == [(16384, 12, 12, 64),
                                                                (16384, 32, 8, 128)]
    with pytest.raises(ValueError, match="N:H_q:H_kv:d"):
        cp.parse_shapes("16384:12:64")
    with pytest.raises(ValueError, match="multiple of H_kv"):
        cp.parse_shapes("16384:12:5:64")


def test_samples_windows_and_cap(tmp_path):
    cp = _load()
    t0 = time.time()
    stamp = lambda t: time.strftime("%Y/%m/%d %H:%M:%S", time.localtime(t)) + \
        f".{int((t % 1) * 1000):03d}"
    lines = [f"{stamp(t0 + i)}, {1980 - 100 * i} MHz, {600 + 30 * i:.2f} W, "
             f"{'0x0000000000000004' if i >= 2 else '0x0000000000000000'}" for i in range(4)]
    path = tmp_path / "s.csv"
    path.write_text("\n".join(lines + ["garbage line"]) + "\n")
    rows = cp.read_samples(str(path))
    assert len(rows) == 4 and rows[0][1] == 1980.0 and rows[3][2] == 690.0
    early = cp.window_stats(rows, [(t0 - 0.5, t0 + 1.5)])
    late = cp.window_stats(rows, [(t0 + 1.5, t0 + 3.5)])
    assert early["samples"] == 2 and early["sm_mhz"] == 1930.0
    assert late["sm_mhz_min"] == 1680.0 and late["watts"] == 675.0
    assert not cp.power_capped(early["reasons"]) and cp.power_capped(late["reasons"])
    assert cp.power_capped(["0x0000000000000024"]) and not cp.power_capped(["N/A"])
    assert cp.window_stats(rows, [(t0 + 10, t0 + 11)]) == {"samples": 0}
