"""``ttt-flash fit`` under DDP: two CPU processes (gloo), started as a user would, from a
folder other than the repository. Lightning's launcher starts rank 1 by re-running the
program; a hang must fail the test, so every run has a timeout."""

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

RECIPES = Path(__file__).resolve().parent.parent / "recipes"
TIMEOUT_S = 240


def run_cli(args, cwd, timeout=TIMEOUT_S):
    """Run the installed ``ttt-flash`` with ``args`` in ``cwd``; kill its whole process group
    (every rank) and fail on timeout. Returns the CompletedProcess (text)."""
    exe = shutil.which("ttt-flash") or os.path.join(os.path.dirname(sys.executable), "ttt-flash")
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_PORT")}
    env.setdefault("OMP_NUM_THREADS", "1")
    p = subprocess.Popen([exe, *args], cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, start_new_session=True)
    try:
        out, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, _ = p.communicate()
        pytest.fail(f"ttt-flash {' '.join(args)} hung for {timeout} s:\n{out[-3000:]}")
    return subprocess.CompletedProcess(p.args, p.returncode, out, None)


def test_fit_under_ddp_from_another_folder(tmp_path):
    r = run_cli(["fit", "--config", str(RECIPES / "maml_sinusoid.yaml"), "--trainer.fast_dev_run=true",
                 "--trainer.accelerator=cpu", "--trainer.devices=2", "--trainer.strategy=ddp",
                 "--trainer.enable_progress_bar=false"], cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:]
    assert "can't open file" not in r.stdout, r.stdout[-3000:]
    assert "GLOBAL_RANK: 1" in r.stdout, r.stdout[-3000:]  # rank 1 started and joined the group
    assert "max_steps=1` reached" in r.stdout, r.stdout[-3000:]
