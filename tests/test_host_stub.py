"""scripts/kernels/host_stub.py: the eager chain's host time on the CPU with every Triton launch
stubbed; the stub replaces and restores the composers' launch, the chain is host_phases.py's,
bad arguments are refused by name."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "kernels" / "host_stub.py"


def _run(*args, tmp_path):
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)


def test_times_every_phase_and_writes_json(tmp_path):
    r = _run("--iters", "3", "--warmup", "1", "--profile", "2", "--top", "5", "--out", str(tmp_path / "o"),
             tmp_path=tmp_path)
    assert r.returncode == 0, r.stderr
    data = json.loads((tmp_path / "o" / "host_stub.json").read_text())
    med = data["median_ms"]
    assert set(med) == {"fwd", "bwd", "inner", "bob", "total"} and all(v > 0 for v in med.values())
    assert "host ms per chain, launches stubbed" in r.stdout.splitlines()[-3]
    assert "function calls" in (tmp_path / "o" / "host_stub_profile.txt").read_text()


@pytest.mark.parametrize("flag,value", [("--iters", "0"), ("--rounds", "0"), ("--seq", "0"), ("--warmup", "-1")])
def test_refuses_bad_arguments_by_name(tmp_path, flag, value):
    r = _run(flag, value, tmp_path=tmp_path)
    assert r.returncode == 2 and f"{flag} must be >=" in r.stderr


def test_stub_replaces_and_restores_the_composers_launch(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    spec = importlib.util.spec_from_file_location("host_stub", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    from ttt_flash.kernels import bob, bwd, fwd, jvp
    from ttt_flash.kernels.launch import launch

    restore = module.stub_launches()
    try:
        assert all(m.launch is module._noop_launch for m in (fwd, bwd, bob, jvp))
    finally:
        restore()
    assert all(m.launch is launch for m in (fwd, bwd, bob, jvp))
