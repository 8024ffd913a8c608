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

pytestmark = pytest.mark.slow  # each test starts two processes (README: the slow tests)

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



def test_smoke_under_ddp_from_another_folder(tmp_path):
    """--smoke with two DDP processes: rank 1, started from the command line without --smoke,
    runs as a smoke run too (the same callbacks on every rank), so the run ends."""
    r = run_cli(["fit", "--config", str(RECIPES / "maml_sinusoid.yaml"), "--smoke", "--trainer.accelerator=cpu",
                 "--trainer.devices=2", "--trainer.strategy=ddp", "--trainer.enable_progress_bar=false"], cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:]
    assert "GLOBAL_RANK: 1" in r.stdout, r.stdout[-3000:]
    assert "max_steps=2` reached" in r.stdout and "no checkpoint (--smoke)" in r.stdout, r.stdout[-3000:]
    assert not list(tmp_path.rglob("*.ckpt"))

def _rows(path):
    import csv

    with open(path, newline="") as f:  # every column but wall-clock times
        return [{k: v for k, v in r.items() if not k.endswith("_s")} for r in csv.DictReader(f)]


def test_resume_under_ddp_is_bitwise(tmp_path):
    """Two processes (gloo), 2 batches per process and epoch: a run stopped mid-epoch (step 3)
    and resumed to step 6 ends with the weights,
    optimizer state and logged rows of an uninterrupted 6-step run, and every epoch drew fresh
    batches (the processes' shards differ, and so do the epochs)."""
    import torch

    argv = ["fit", "--config", str(RECIPES / "maml_sinusoid.yaml"), "--data.init_args.train_batches=4",
            "--data.init_args.meta_batch_size=2", "--data.init_args.val_batches=2", "--trainer.max_epochs=3",
            "--trainer.accelerator=cpu", "--trainer.devices=2", "--trainer.strategy=ddp",
            "--trainer.log_every_n_steps=1", "--trainer.enable_progress_bar=false",
            "--trainer.enable_model_summary=false"]
    folder = tmp_path / "runs" / "maml_sinusoid"
    last = folder / "checkpoints" / "last.ckpt"

    def fit(*extra):
        r = run_cli([*argv, *extra], cwd=tmp_path)
        assert r.returncode == 0, r.stdout[-3000:]

    fit("--trainer.max_steps=6")
    reference, reference_rows = torch.load(last, weights_only=True), _rows(folder / "metrics.csv")
    assert reference["global_step"] == 6 and reference["epoch"] == 3
    losses = [r["train/loss_pre"] for r in reference_rows if r.get("train/loss_pre")]
    assert len(losses) == 6
    # the sampler of every process counted its own epochs (fresh batches every epoch)
    assert reference["SinusoidDataModule"]["train_order"] == {"epoch": 2, "position": 2}
    shutil.rmtree(tmp_path / "runs")
    for k in (3, 6):
        fit(f"--trainer.max_steps={k}", *(["--ckpt_path", "last"] if k > 3 else []))
        assert torch.load(last, weights_only=True)["global_step"] == k
    resumed = torch.load(last, weights_only=True)
    assert resumed["epoch"] == reference["epoch"]
    for name, value in reference["state_dict"].items():
        assert torch.equal(value, resumed["state_dict"][name]), name
    for sa, sb in zip(reference["optimizer_states"], resumed["optimizer_states"]):
        for key, state in sa["state"].items():
            for k, v in state.items():
                assert torch.equal(torch.as_tensor(v), torch.as_tensor(sb["state"][key][k])), (key, k)
    assert _rows(folder / "metrics.csv") == reference_rows


def test_sigterm_to_rank_0_stops_every_process_with_a_checkpoint(tmp_path):
    """``kill PID`` (SIGTERM to the process started, rank 0, only; what a container stop sends
    it): both processes stop at the same step, ``last.ckpt`` holds that step, the run exits
    143, and ``--ckpt_path last`` continues it."""
    import time

    import torch

    argv = ["fit", "--config", str(RECIPES / "maml_sinusoid.yaml"), "--data.init_args.train_batches=4",
            "--data.init_args.meta_batch_size=2", "--data.init_args.val_batches=2", "--trainer.max_epochs=1000",
            "--trainer.accelerator=cpu", "--trainer.devices=2", "--trainer.strategy=ddp",
            "--trainer.log_every_n_steps=1", "--trainer.enable_progress_bar=false",
            "--trainer.enable_model_summary=false"]
    exe = shutil.which("ttt-flash") or os.path.join(os.path.dirname(sys.executable), "ttt-flash")
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_PORT")}
    env.setdefault("OMP_NUM_THREADS", "1")
    p = subprocess.Popen([exe, *argv], cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, start_new_session=True)
    metrics = tmp_path / "runs" / "maml_sinusoid" / "metrics.csv"
    try:
        deadline = time.time() + TIMEOUT_S
        while time.time() < deadline and not (metrics.is_file() and metrics.read_text().count("\n") > 3):
            time.sleep(0.5)
        os.kill(p.pid, signal.SIGTERM)  # rank 0 only
        out, _ = p.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, _ = p.communicate()
        pytest.fail(f"the processes did not stop within 120 s of SIGTERM to rank 0:\n{out[-3000:]}")
    assert p.returncode == 143, out[-3000:]
    assert "sync_dist" not in out, out[-3000:]  # validation metrics are averaged over the processes
    last = torch.load(tmp_path / "runs" / "maml_sinusoid" / "checkpoints" / "last.ckpt", weights_only=True)
    step = last["global_step"]
    assert step > 0 and len(last["callbacks"][next(k for k in last["callbacks"] if "Resumable" in k)]["rng_ranks"]) == 2
    r = run_cli([*argv, f"--trainer.max_steps={step + 2}", "--ckpt_path", "last"], cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:]
    assert torch.load(tmp_path / "runs" / "maml_sinusoid" / "checkpoints" / "last.ckpt",
                      weights_only=True)["global_step"] == step + 2
