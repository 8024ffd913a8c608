"""Reliability of ``ttt-flash fit``: one writer per run folder, checkpoints that do not fit the
recipe, partial checkpoint files (docs/reliability.md)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ttt_flash.cli import main
from ttt_flash.lightning.resume import RunFolderLock

RECIPES = Path(__file__).resolve().parent.parent / "recipes"

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = ["--data.init_args.train_batches=2", "--data.init_args.meta_batch_size=2", "--data.init_args.val_batches=1",
        "--trainer.max_epochs=1", "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false"]


def _maml(*extra):
    return ["fit", "--config", str(RECIPES / "maml_sinusoid.yaml"), *TINY, *extra]


@pytest.fixture
def other_process():
    """A live process that is not this one (its id stands for a run in progress)."""
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    yield p.pid
    p.kill()
    p.wait()


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _write_lock(folder: Path, pid: int) -> Path:
    lock = RunFolderLock(str(folder))
    os.makedirs(os.path.dirname(lock.path), exist_ok=True)
    with open(lock.path, "w") as f:
        f.write(f"pid={pid}\nhost={os.uname().nodename}\ncommand=ttt-flash fit\nstarted=then\n")
    return Path(lock.path)


def test_second_run_on_a_folder_stops_at_start(tmp_path, monkeypatch, other_process):
    monkeypatch.chdir(tmp_path)
    lock = _write_lock(tmp_path / "runs" / "maml_sinusoid", other_process)
    with pytest.raises(SystemExit) as e:
        main(_maml())
    message = str(e.value.code)
    assert "runs/maml_sinusoid" in message and f"process {other_process}" in message and "in use" in message
    folder = tmp_path / "runs" / "maml_sinusoid"
    assert not (folder / "metrics.csv").exists() and not (folder / "config.yaml").exists()
    assert not (folder / "checkpoints").exists()
    assert lock.read_text().startswith(f"pid={other_process}\n")  # the running process keeps its lock


def test_a_dead_process_lock_is_taken_over_and_released(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    lock = _write_lock(tmp_path / "runs" / "maml_sinusoid", _dead_pid())
    assert main(_maml()) == 0
    assert (tmp_path / "runs" / "maml_sinusoid" / "checkpoints" / "last.ckpt").is_file()
    assert not lock.exists()  # released at the end of the run


def test_lock_is_one_per_folder(tmp_path):
    with RunFolderLock(str(tmp_path / "a")) as held:
        assert Path(held.path).read_text().startswith(f"pid={os.getpid()}\n")
        with RunFolderLock(str(tmp_path / "b")):  # another folder: free
            pass
        code = ("import sys; from ttt_flash.lightning.resume import RunFolderLock; "
                f"RunFolderLock({str(tmp_path / 'a')!r}).acquire()")
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
        assert r.returncode == 1 and f"process {os.getpid()}" in r.stderr and str(tmp_path / "a") in r.stderr
    assert not Path(held.path).exists()
