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


# --------------------------------------------------------------------------- checkpoints given by path


@pytest.fixture(scope="module")
def maml_ckpt(tmp_path_factory):
    """A checkpoint of the tiny MAML recipe (hidden width 40, inner_steps 1)."""
    folder = tmp_path_factory.mktemp("maml")
    cwd = os.getcwd()
    os.chdir(folder)
    try:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        assert main(_maml("--trainer.max_steps=2")) == 0
        torch.set_num_threads(threads)
    finally:
        os.chdir(cwd)
    path = folder / "maml.ckpt"
    os.replace(folder / "runs" / "maml_sinusoid" / "checkpoints" / "last.ckpt", path)
    return path


def test_ckpt_path_file_keeps_the_command_line_settings_and_lists_the_checkpoints(tmp_path, monkeypatch, capsys,
                                                                                maml_ckpt):
    monkeypatch.chdir(tmp_path)
    more = ["--trainer.max_epochs=2", "--trainer.max_steps=3", "--ckpt_path", str(maml_ckpt)]
    assert main(_maml("--model.init_args.inner_steps=2", *more)) == 0
    err = capsys.readouterr().err
    assert "model.init_args.inner_steps: checkpoint 1, this run 2" in err and str(maml_ckpt) in err
    resumed = torch.load(tmp_path / "runs" / "maml_sinusoid" / "checkpoints" / "last.ckpt", weights_only=True)
    assert resumed["hyper_parameters"]["inner_steps"] == 2 and resumed["global_step"] == 3
    # a setting that changes the weights' shapes: a short error, not a traceback
    with pytest.raises(SystemExit) as e:
        main(_maml("--model.init_args.net.init_args.hidden=20", *more))
    assert "do not fit this run's model" in str(e.value.code) and "size mismatch" in str(e.value.code)
    assert "model.init_args.net.init_args.hidden: checkpoint 40, this run 20" in capsys.readouterr().err


def test_checkpoint_of_another_recipe_is_refused_before_loading(tmp_path, monkeypatch, maml_ckpt):
    # the MAML recipe's checkpoint, recorded as written by a GradMem run (its class path)
    ckpt = torch.load(maml_ckpt, weights_only=True)
    ckpt["hyper_parameters"]["_class_path"] = "ttt_flash.lightning.memory.GradMemKV"
    other = tmp_path / "gradmem.ckpt"
    torch.save(ckpt, other)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        main(_maml("--ckpt_path", str(other)))
    message = str(e.value.code)
    assert "GradMemKV" in message and "MAML" in message and str(other) in message
    assert not (tmp_path / "runs").exists()  # refused before anything ran


@pytest.mark.parametrize("content", ["random", "truncated"])
def test_a_file_that_is_not_a_checkpoint_gets_one_line(tmp_path, monkeypatch, maml_ckpt, content):
    bad = tmp_path / "bad.ckpt"
    data = maml_ckpt.read_bytes()
    bad.write_bytes(os.urandom(4096) if content == "random" else data[: len(data) // 2])
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        main(_maml("--ckpt_path", str(bad)))
    message = str(e.value.code)
    assert len(message.splitlines()) == 1 and str(bad) in message and "checkpoint" in message
    assert "weights_only=False" not in message


# --------------------------------------------------------------------------- partial checkpoint files


@pytest.mark.parametrize("which", ["last", "best"])
def test_a_full_disk_gives_one_line_and_leaves_no_partial_file(tmp_path, monkeypatch, which):
    """A checkpoint write that fails for want of space (last.ckpt, or a best-step=S.ckpt that
    ttt-flash fit adds) leaves the previous files whole, no partial file, and one line naming
    the file and what was kept."""
    import errno

    import lightning.fabric.plugins.io.torch_io as torch_io

    save, calls = torch_io._atomic_save, []

    def full_disk(checkpoint, path):  # half the bytes, then no space left
        calls.append(os.path.basename(str(path)))
        if len(calls) > 2 and (which == "last") == ("last" in calls[-1]):
            with open(path, "wb") as f:
                f.write(b"PK\x03\x04" + b"\0" * 100)
            raise OSError(errno.ENOSPC, "No space left on device")
        save(checkpoint, path)

    monkeypatch.setattr(torch_io, "_atomic_save", full_disk)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        main(_maml("--trainer.max_epochs=4", "--trainer.callbacks.init_args.every_n_train_steps=1"))
    message = str(e.value.code)
    folder = tmp_path / "runs" / "maml_sinusoid" / "checkpoints"
    names = sorted(p.name for p in folder.iterdir())
    assert len(message.splitlines()) == 1 and "No space left on device" in message, message
    assert f"checkpoint runs/maml_sinusoid/checkpoints/{'last.ckpt' if which == 'last' else 'best-step='}" in message
    assert "kept" in message and "last.ckpt (step " in message
    assert not [n for n in names if n.startswith(".")], names  # no temporary file
    for name in names:  # every file left is a whole checkpoint
        torch.load(folder / name, weights_only=True)
    assert "last.ckpt" in names


def test_partial_files_of_a_killed_run_are_removed_at_the_next_start(tmp_path, monkeypatch):
    folder = tmp_path / "runs" / "maml_sinusoid" / "checkpoints"
    folder.mkdir(parents=True)
    (folder / ".last.ckpt.tmp").write_bytes(b"PK\x03\x04 half")
    (folder / ".step=3.ckpt.tmp").write_bytes(b"PK\x03\x04 half")  # a top-k checkpoint's
    (folder / "notes.txt").write_text("kept")
    monkeypatch.chdir(tmp_path)
    assert main(_maml("--trainer.max_steps=1")) == 0
    assert sorted(p.name for p in folder.iterdir()) == ["last.ckpt", "notes.txt"]


# --------------------------------------------------------------------------- one folder, one run


def _snapshot(folder: Path):
    """Every file under ``folder`` with its bytes."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture
def finished_run(tmp_path, monkeypatch):
    """A finished tiny MAML run in tmp_path/runs/maml_sinusoid (run from tmp_path)."""
    monkeypatch.chdir(tmp_path)
    assert main(_maml()) == 0
    return tmp_path / "runs" / "maml_sinusoid"


@pytest.mark.parametrize("how", ["runs-link", "version-link"])
def test_a_second_writer_through_a_symbolic_link_is_refused(finished_run, tmp_path, other_process, how):
    """The lock is the folder's, whatever path reaches it: a run through a linked runs/ folder,
    or through runs/OTHER linking to the running run's folder, is refused and writes nothing."""
    _write_lock(finished_run, other_process)
    if how == "runs-link":
        (tmp_path / "alias").symlink_to(tmp_path / "runs")
        extra = ["--trainer.logger.init_args.save_dir=alias"]
    else:
        (tmp_path / "runs" / "other").symlink_to(finished_run)
        extra = ["--trainer.logger.init_args.version=other"]
    before = _snapshot(finished_run)
    for more in ([], ["--ckpt_path", "last"]):
        with pytest.raises(SystemExit) as e:
            main(_maml(*extra, *more))
        message = str(e.value.code)
        assert "in use" in message and f"process {other_process}" in message and str(finished_run) in message
        assert _snapshot(finished_run) == before


def test_a_fresh_run_into_a_used_folder_is_refused(finished_run):
    before = _snapshot(finished_run)
    with pytest.raises(SystemExit) as e:
        main(_maml("--trainer.max_epochs=2"))
    message = str(e.value.code)
    assert len(message.splitlines()) == 1 and "--ckpt_path last" in message and "runs/maml_sinusoid" in message
    assert "checkpoints/last.ckpt" in message
    assert _snapshot(finished_run) == before


def test_failed_runs_leave_the_folder_as_it_was(finished_run, capsys):
    """A --ckpt_path that does not exist, and a --ckpt_path last whose weights do not fit
    the changed model, stop with a short error and change nothing in the run folder
    (config.yaml included)."""
    before = _snapshot(finished_run)
    with pytest.raises(SystemExit) as e:
        main(_maml("--ckpt_path", "nosuch.ckpt"))
    assert len(str(e.value.code).splitlines()) == 1 and "nosuch.ckpt" in str(e.value.code)
    assert _snapshot(finished_run) == before
    with pytest.raises(SystemExit) as e:
        main(_maml("--trainer.max_epochs=2", "--ckpt_path", "last", "--model.init_args.net.init_args.hidden=80"))
    err = capsys.readouterr().err
    assert "model.init_args.net.init_args.hidden: checkpoint 40, this run 80" in err  # the warning the error points to
    assert "listed above" in str(e.value.code) and "size mismatch" in str(e.value.code)
    assert _snapshot(finished_run) == before


def test_test_and_validate_keep_the_run_folder(finished_run):
    """``ttt-flash test|validate --ckpt_path last`` add their rows to metrics.csv; the
    training rows and config.yaml stay."""
    config = (finished_run / "config.yaml").read_bytes()
    rows = (finished_run / "metrics.csv").read_text().splitlines()
    for command in ("validate", "test"):
        argv = _maml("--ckpt_path", "last")
        argv[0] = command
        assert main([a for a in argv if a != "--trainer.max_epochs=1"]) == 0
    assert (finished_run / "config.yaml").read_bytes() == config
    after = (finished_run / "metrics.csv").read_text().splitlines()
    assert len(after) > len(rows) and any("test/" in line for line in after[:1])


# --------------------------------------------------------------------------- library calls on odd input


def test_a_learned_inner_lr_gone_nan_stops_the_step():
    from ttt_flash.meta import MAML

    net = torch.nn.Linear(2, 1)
    maml = MAML(net, lr=torch.nn.Parameter(torch.tensor(0.1)))
    x, y = torch.randn(4, 2), torch.randn(4, 1)
    learner = maml.clone()
    learner.adapt(torch.nn.functional.mse_loss(learner(x), y))  # a finite lr: fine
    with torch.no_grad():
        maml.lr.fill_(float("nan"))
    learner = maml.clone()
    with pytest.raises(ValueError, match=r"MAML\.lr is nan"):
        learner.adapt(torch.nn.functional.mse_loss(learner(x), y))


@pytest.mark.parametrize("empty", ["support", "query"])
def test_empty_support_or_query_sets_are_refused(empty):
    from ttt_flash.meta import imaml_meta_gradient, inner_loop

    net = torch.nn.Linear(2, 1)
    full, none = (torch.randn(4, 2), torch.randn(4, 1)), (torch.randn(0, 2), torch.randn(0, 1))
    loss = torch.nn.functional.mse_loss
    if empty == "support":
        with pytest.raises(ValueError, match=r"support_batch is empty \(a tensor of shape \(0, 2\)\)"):
            inner_loop(net, None, loss, none, steps=1, lr=0.1)
    with pytest.raises(ValueError, match=f"{empty}_batch is empty"):
        imaml_meta_gradient(net, None, loss, none if empty == "support" else full,
                            none if empty == "query" else full, steps=1, lr=0.1, lam=1.0)


@pytest.mark.parametrize("layout", ["bhnd", "bnhd", None])
def test_flash_attention_on_the_meta_device_gives_meta_outputs(layout):
    from ttt_flash import flash_attention

    q = torch.empty(2, 4, 16, 8, device="meta")
    k = v = torch.empty(2, 4 if layout == "bnhd" else 2, 16, 8, device="meta")  # bhnd: grouped-query heads
    o, lse = flash_attention(q, k, v, causal=True, layout=layout, return_lse=True)
    assert o.device.type == "meta" and lse.device.type == "meta" and lse.dtype == torch.float32
    if layout == "bnhd":  # (B, N, H, D): 4 positions, 16 heads
        assert o.shape == (2, 4, 16, 8) and lse.shape == (2, 16, 4)
    else:
        assert o.shape == (2, 4, 16, 8) and lse.shape == (2, 4, 16)


def test_flash_attention_on_empty_sequences_does_not_warn_about_the_layout():
    import warnings

    from ttt_flash import flash_attention

    q = torch.randn(1, 4, 0, 8, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert flash_attention(q, q, q).shape == (1, 4, 0, 8)
