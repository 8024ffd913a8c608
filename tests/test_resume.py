"""Exact resume of interrupted runs (ttt_flash.lightning.resume) through ``ttt-flash fit``.

For the MAML, GradMem and LM recipes at tiny sizes: a straight run of N steps saves a
checkpoint after every step; runs resumed from the checkpoint at an epoch boundary and from
one mid-epoch end with exactly the weights and optimizer state of the straight run, log the
same rows (same steps, same values) into the same folder, and raise no "not resumable"
warning. Subprocess tests: SIGTERM mid-run exits 143 with a resumable ``last.ckpt``; a process
killed (SIGKILL) while writing a checkpoint leaves the previous ``last.ckpt`` loadable.
"""

import csv
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch

from ttt_flash.cli import main

RECIPES = Path(__file__).resolve().parent.parent / "recipes"

pytestmark = pytest.mark.usefixtures("one_thread")

_EVERY_STEP = [
    "--trainer.callbacks.init_args.every_n_train_steps=1",
    "--trainer.callbacks.init_args.save_top_k=-1",
    "--trainer.callbacks.init_args.filename={step}",
    "--trainer.log_every_n_steps=1",
    "--trainer.enable_model_summary=false",
]

# name: (recipe, overrides (4 steps per epoch, 3 epochs), epoch-boundary step, mid-epoch step)
CASES = {
    "maml": ("maml_sinusoid", [
        "--data.init_args.train_batches=4", "--data.init_args.meta_batch_size=2",
        "--data.init_args.val_batches=1", "--trainer.max_epochs=3"]),
    "gradmem": ("gradmem_kv", [
        "--data.init_args.train_batches=4", "--data.init_args.batch_size=2", "--data.init_args.val_batches=1",
        "--data.init_args.num_pairs=2", "--model.init_args.net.init_args.memory_tokens=2",
        "--model.init_args.net.init_args.model.n_layer=1", "--model.init_args.net.init_args.model.d_model=16", "--model.init_args.net.init_args.model.n_head=2",
        "--trainer.max_epochs=3", "--trainer.val_check_interval=2", "--model.init_args.warmup_steps=3"]),
    "lm": ("sophia_gpt_tiny", [
        "--data.init_args.train_batches=4", "--data.init_args.batch_size=2", "--data.init_args.seq_len=16",
        "--data.init_args.max_bytes=20000", "--data.init_args.val_batches=1",
        "--model.init_args.gpt.n_layer=1", "--model.init_args.gpt.d_model=16", "--model.init_args.gpt.n_head=4",
        "--model.init_args.hessian_every=3", "--model.init_args.warmup_steps=2",
        "--trainer.max_steps=12", "--trainer.val_check_interval=2"]),
}


def _rows(path):
    with open(path, newline="") as f:
        # every column but wall-clock times (step_time_s, tokens_per_s, hessian_refresh_s)
        return [{k: v for k, v in r.items() if not k.endswith("_s")} for r in csv.DictReader(f)]


def _assert_same_state(a, b):
    assert a["global_step"] == b["global_step"]
    for name in a["state_dict"]:
        assert torch.equal(a["state_dict"][name], b["state_dict"][name]), name
    for sa, sb in zip(a["optimizer_states"], b["optimizer_states"]):
        for key in sa["state"]:
            for k, v in sa["state"][key].items():
                if torch.is_tensor(v):
                    assert torch.equal(v, sb["state"][key][k]), (key, k)


@pytest.mark.parametrize("case", sorted(CASES))
def test_resume_is_exact(case, tmp_path, monkeypatch):
    recipe, overrides = CASES[case]
    monkeypatch.chdir(tmp_path)
    argv = ["fit", "--config", str(RECIPES / f"{recipe}.yaml"), *overrides, *_EVERY_STEP]
    assert main(argv) == 0
    folder = tmp_path / "runs" / recipe
    reference = torch.load(folder / "checkpoints" / "last.ckpt", weights_only=True)
    reference_rows = _rows(folder / "metrics.csv")
    assert reference["global_step"] == 12
    for k in (4, 6):  # step 4 ends epoch 0; step 6 is mid-epoch 1
        shutil.copy(folder / "checkpoints" / f"step={k}.ckpt", tmp_path / f"k{k}.ckpt")
    for k in (4, 6):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert main([*argv, "--ckpt_path", str(tmp_path / f"k{k}.ckpt")]) == 0
        assert not [w for w in caught if "not resumable" in str(w.message)]
        _assert_same_state(reference, torch.load(folder / "checkpoints" / "last.ckpt", weights_only=True))
        assert _rows(folder / "metrics.csv") == reference_rows, f"resumed at step {k}"
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == [recipe]  # one log folder


def test_ckpt_path_last_resumes(tmp_path, monkeypatch):
    """``--ckpt_path last`` finds runs/NAME/checkpoints/last.ckpt and continues from it."""
    recipe, overrides = CASES["maml"]
    monkeypatch.chdir(tmp_path)
    argv = ["fit", "--config", str(RECIPES / f"{recipe}.yaml"), *overrides[:-1], "--trainer.enable_model_summary=false"]
    assert main([*argv, "--trainer.max_epochs=1"]) == 0
    first = torch.load(tmp_path / "runs" / recipe / "checkpoints" / "last.ckpt", weights_only=True)
    assert first["global_step"] == 4
    assert main([*argv, "--trainer.max_epochs=2", "--ckpt_path", "last"]) == 0
    second = torch.load(tmp_path / "runs" / recipe / "checkpoints" / "last.ckpt", weights_only=True)
    assert second["global_step"] == 8 and second["SinusoidDataModule"]["train_order"]["epoch"] == 1


_SCRIPT = """
import os, signal, sys
from ttt_flash.cli import main
from ttt_flash.lightning.maml import MAML
{patch}
sys.exit(main({argv!r}))
"""


def _script(argv, patch):
    return _SCRIPT.format(argv=argv, patch=textwrap.dedent(patch))


def _run(tmp_path, code, timeout=120):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    return subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, timeout=timeout,
                          capture_output=True, text=True)


def _maml_argv(epochs=3):
    recipe, overrides = CASES["maml"]
    return ["fit", "--config", str(RECIPES / f"{recipe}.yaml"), *overrides[:-1], f"--trainer.max_epochs={epochs}",
            "--trainer.enable_model_summary=false", "--trainer.callbacks.init_args.every_n_train_steps=2"]


def test_sigterm_exits_nonzero_with_resumable_checkpoint(tmp_path, monkeypatch):
    # The process sends itself SIGTERM during step 6 (mid-epoch 1; the last scheduled
    # checkpoint is step 4): it must finish step 6, write last.ckpt of step 6 and exit 143.
    patch = """
    step = MAML.training_step
    def training_step(self, batch, i):
        if self.global_step == 5:
            os.kill(os.getpid(), signal.SIGTERM)
        return step(self, batch, i)
    MAML.training_step = training_step
    """
    done = _run(tmp_path, _script(_maml_argv(), patch))
    assert done.returncode == 128 + signal.SIGTERM, done.stderr[-2000:]
    last = tmp_path / "runs" / "maml_sinusoid" / "checkpoints" / "last.ckpt"
    ckpt = torch.load(last, weights_only=True)
    assert ckpt["global_step"] == 6
    assert ckpt["SinusoidDataModule"]["train_order"] == {"epoch": 1, "position": 2}
    # Resumed, it ends where an uninterrupted run ends.
    monkeypatch.chdir(tmp_path)
    assert main([*_maml_argv(), "--ckpt_path", "last"]) == 0
    resumed = torch.load(last, weights_only=True)
    shutil.rmtree(tmp_path / "runs")
    assert main(_maml_argv()) == 0
    _assert_same_state(torch.load(last, weights_only=True), resumed)


def test_sigterm_with_checkpointing_off_ends_promptly_and_writes_no_checkpoint(tmp_path):
    # --trainer.enable_checkpointing=false on a recipe that lists a ModelCheckpoint: the run
    # starts (the recipe's checkpoint callback is dropped, not refused by Lightning), SIGTERM
    # ends it after the step in flight with 143, and no .ckpt file is written anywhere.
    patch = """
    step = MAML.training_step
    def training_step(self, batch, i):
        if self.global_step == 5:
            os.kill(os.getpid(), signal.SIGTERM)
        return step(self, batch, i)
    MAML.training_step = training_step
    """
    argv = [*_maml_argv(epochs=50), "--trainer.enable_checkpointing=false"]
    done = _run(tmp_path, _script(argv, patch))
    assert done.returncode == 128 + signal.SIGTERM, done.stderr[-2000:]
    assert "stopped by SIGTERM at step 6" in done.stdout + done.stderr, (done.stdout + done.stderr)[-2000:]
    assert not list(tmp_path.rglob("*.ckpt"))
    assert (tmp_path / "runs" / "maml_sinusoid" / "metrics.csv").is_file()


def test_sigkill_while_writing_a_checkpoint_leaves_last_ckpt_loadable(tmp_path):
    # The third checkpoint write writes half of its bytes to the file it is given, and the
    # process is killed (SIGKILL) there: last.ckpt must still be the complete second one.
    patch = """
    import io, torch
    import lightning.fabric.plugins.io.torch_io as torch_io
    save, calls = torch_io._atomic_save, [0]
    def dying_save(checkpoint, path):
        calls[0] += 1
        if calls[0] == 3:
            buf = io.BytesIO()
            torch.save(checkpoint, buf)
            with open(path, "wb") as out:
                out.write(buf.getvalue()[: len(buf.getvalue()) // 2])
            os.kill(os.getpid(), signal.SIGKILL)
        save(checkpoint, path)
    torch_io._atomic_save = dying_save
    """
    done = _run(tmp_path, _script(_maml_argv(), patch))
    assert done.returncode == -signal.SIGKILL, done.stderr[-2000:]
    ckpt = torch.load(tmp_path / "runs" / "maml_sinusoid" / "checkpoints" / "last.ckpt", weights_only=True)
    assert ckpt["global_step"] == 4  # the second checkpoint, complete


@pytest.mark.parametrize("case,stop", [("maml", "--trainer.max_epochs=1"), ("maml", "--trainer.max_steps=8"),
                                       ("maml", "--trainer.max_steps=6"),
                                       ("gradmem", "--trainer.max_steps=4"), ("lm", "--trainer.max_steps=4")])
def test_resume_from_the_end_of_training_is_exact(case, stop, tmp_path, monkeypatch):
    """A run that ended at an epoch end (``max_epochs``, or ``max_steps`` on an epoch's last
    batch) or mid-epoch (``max_steps``) and is continued with ``--ckpt_path last`` ends as one uninterrupted run: same
    weights, optimizer state and logged rows (epoch numbers included)."""
    recipe, overrides = CASES[case]
    monkeypatch.chdir(tmp_path)
    # max_steps in both runs: Lightning then restores its loops as for step-based training
    argv = ["fit", "--config", str(RECIPES / f"{recipe}.yaml"), *overrides, "--trainer.max_steps=12",
            "--trainer.log_every_n_steps=1", "--trainer.enable_model_summary=false",
            "--trainer.enable_progress_bar=false"]
    if case == "lm":  # the cosine schedule spans max_steps: the same learning rates in both runs
        argv.append("--model.init_args.schedule=constant")
    folder = tmp_path / "runs" / recipe
    assert main(argv) == 0
    reference = torch.load(folder / "checkpoints" / "last.ckpt", weights_only=True)
    reference_rows = _rows(folder / "metrics.csv")
    assert reference["global_step"] == 12
    shutil.rmtree(tmp_path / "runs")
    assert main([*argv, stop]) == 0
    assert main([*argv, "--ckpt_path", "last"]) == 0
    resumed = torch.load(folder / "checkpoints" / "last.ckpt", weights_only=True)
    _assert_same_state(reference, resumed)
    assert resumed["epoch"] == reference["epoch"]
    assert _rows(folder / "metrics.csv") == reference_rows


# --------------------------------------------------------------------------- chains of resumes

CASES["memory_layer"] = ("memory_layer_mqar", [
    "--data.init_args.train_batches=4", "--data.init_args.batch_size=2", "--data.init_args.val_batches=1",
    "--model.init_args.net.init_args.n_layer=1", "--model.init_args.net.init_args.d_model=16", "--model.init_args.net.init_args.heads=2",
    "--model.init_args.net.init_args.memory_slots=4", "--model.init_args.net.init_args.attention=math", "--model.init_args.warmup_steps=3",
    "--trainer.max_epochs=3", "--trainer.val_check_interval=2"])


def _stop_by_signal(monkeypatch, where: str, step: int):
    """Send this process SIGTERM during training step ``step`` (``where="train"``) or during
    the first validation after step ``step`` (``where="val"``)."""
    from ttt_flash.lightning.resume import ResumableCheckpoint

    def train(self, trainer, pl_module, batch, batch_idx, _step=ResumableCheckpoint.on_train_batch_start):
        _step(self, trainer, pl_module, batch, batch_idx)
        if trainer.global_step == step - 1:
            os.kill(os.getpid(), signal.SIGTERM)

    def val(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        if not trainer.sanity_checking and trainer.global_step == step and batch_idx == 0:
            os.kill(os.getpid(), signal.SIGTERM)

    if where == "train":
        monkeypatch.setattr(ResumableCheckpoint, "on_train_batch_start", train)
    else:
        monkeypatch.setattr(ResumableCheckpoint, "on_validation_batch_start", val, raising=False)


def _chain(argv, stops, folder):
    """Run ``argv`` stopped at each of ``stops`` in turn, each run resumed with ``--ckpt_path
    last``, then to its end. A stop is ("max_steps", S): the run ends at step S; ("train", S):
    SIGTERM during step S; ("val", S): SIGTERM during the validation after step S. Each run
    must end where it was told to."""
    for i, (kind, step) in enumerate([*stops, (None, None)]):
        more = ["--ckpt_path", "last"] if i else []
        with pytest.MonkeyPatch.context() as mp:
            if kind == "max_steps":
                more.append(f"--trainer.max_steps={step}")
            elif kind is not None:
                _stop_by_signal(mp, kind, step)
            code = main([*argv, *more])
        assert code == (143 if kind in ("train", "val") else 0), (kind, step)
        ckpt = torch.load(folder / "checkpoints" / "last.ckpt", weights_only=True)
        if step is not None:
            assert ckpt["global_step"] == step, (kind, step, ckpt["global_step"])
    return ckpt


# (recipe case, stops); every case has 4 batches per epoch and 12 steps
CHAINS = {
    "maml-epoch-ends": ("maml", [("max_steps", 4), ("max_steps", 8), ("train", 10)]),
    "maml-validation": ("maml", [("val", 4), ("val", 8), ("train", 9)]),
    "maml-mid-epoch": ("maml", [("train", 3), ("max_steps", 6), ("train", 11)]),
    "maml-mixed": ("maml", [("max_steps", 4), ("val", 8), ("train", 10)]),
    "memory_layer-mixed": ("memory_layer", [("val", 2), ("max_steps", 4), ("train", 7)]),
    "gradmem-mixed": ("gradmem", [("max_steps", 4), ("val", 6), ("train", 8)]),
    "lm-mixed": ("lm", [("train", 4), ("val", 6), ("train", 9)]),
}


@pytest.mark.parametrize("chain", sorted(CHAINS))
def test_chained_resumes_equal_a_straight_run(chain, tmp_path, monkeypatch):
    """Three stops in a row (epoch ends, SIGTERM during a validation, mid-epoch, mixed), each
    continued with ``--ckpt_path last``: the last run ends bitwise equal to an uninterrupted
    run, with the same rows in metrics.csv (validation rows included) and the same epoch."""
    case, stops = CHAINS[chain]
    recipe, overrides = CASES[case]
    monkeypatch.chdir(tmp_path)
    argv = ["fit", "--config", str(RECIPES / f"{recipe}.yaml"), *overrides, "--trainer.max_steps=12",
            "--trainer.log_every_n_steps=1", "--trainer.enable_model_summary=false",
            "--trainer.enable_progress_bar=false"]
    if case == "lm" and any(kind == "max_steps" for kind, _ in stops):  # the cosine schedule spans max_steps
        argv.append("--model.init_args.schedule=constant")
    folder = tmp_path / "runs" / recipe
    assert main(argv) == 0
    reference = torch.load(folder / "checkpoints" / "last.ckpt", weights_only=True)
    reference_rows = _rows(folder / "metrics.csv")
    assert reference["global_step"] == 12 and any(k.startswith("val/") for k in reference_rows[0])
    shutil.rmtree(tmp_path / "runs")
    resumed = _chain(argv, stops, folder)
    _assert_same_state(reference, resumed)
    assert resumed["epoch"] == reference["epoch"]
    assert resumed[[k for k in resumed if k.endswith("DataModule")][0]] == \
        reference[[k for k in reference if k.endswith("DataModule")][0]]
    assert _rows(folder / "metrics.csv") == reference_rows


def test_resume_from_a_best_checkpoint_is_exact(tmp_path, monkeypatch, caplog):
    """``--ckpt_path runs/NAME/checkpoints/best-step=S.ckpt`` (written after a validation by
    ttt-flash fit) continues as the uninterrupted run from step S: the same weights, epoch and
    data order; the rows logged after S move, with a warning, to metrics.from-step-S+1.csv;
    no last-v1.ckpt."""
    recipe, overrides = CASES["maml"]
    monkeypatch.chdir(tmp_path)
    argv = ["fit", "--config", str(RECIPES / f"{recipe}.yaml"), *overrides, "--trainer.log_every_n_steps=1",
            "--trainer.enable_model_summary=false", "--trainer.enable_progress_bar=false"]
    folder = tmp_path / "runs" / recipe
    assert main(argv) == 0
    reference = torch.load(folder / "checkpoints" / "last.ckpt", weights_only=True)
    reference_rows = _rows(folder / "metrics.csv")
    shutil.copy(folder / "checkpoints" / "best-step=4.ckpt", tmp_path / "best.ckpt")
    with caplog.at_level("WARNING"):
        assert main([*argv, "--ckpt_path", str(folder / "checkpoints" / "best-step=4.ckpt")]) == 0
    resumed = torch.load(folder / "checkpoints" / "last.ckpt", weights_only=True)
    _assert_same_state(reference, resumed)
    assert resumed["epoch"] == reference["epoch"]
    assert resumed["SinusoidDataModule"] == reference["SinusoidDataModule"]
    assert _rows(folder / "metrics.csv") == reference_rows
    moved = folder / "metrics.from-step-4.csv"
    assert moved.is_file() and "moved to runs/maml_sinusoid/metrics.from-step-4.csv" in caplog.text
    assert not [p.name for p in (folder / "checkpoints").iterdir() if "-v" in p.name]


def _state_key(ckpt):
    return next(k for k in ckpt["callbacks"] if k.startswith("ResumableCheckpoint"))


def test_resume_warns_about_another_process_count_or_run_length(tmp_path, monkeypatch, caplog):
    """A resume that cannot equal the uninterrupted run says so: a checkpoint of 2 processes
    resumed by 1, and a cosine schedule resumed with another trainer.max_steps."""
    recipe, overrides = CASES["lm"]
    monkeypatch.chdir(tmp_path)
    argv = ["fit", "--config", str(RECIPES / f"{recipe}.yaml"), *overrides, "--trainer.enable_model_summary=false",
            "--trainer.enable_progress_bar=false", "--model.init_args.schedule=cosine"]
    last = tmp_path / "runs" / recipe / "checkpoints" / "last.ckpt"
    assert main([*argv, "--trainer.max_steps=2"]) == 0
    with caplog.at_level("WARNING"):
        assert main([*argv, "--trainer.max_steps=3", "--ckpt_path", "last"]) == 0
    assert "2 steps long, this one is 3" in caplog.text and "trainer.max_steps" in caplog.text
    caplog.clear()
    ckpt = torch.load(last, weights_only=True)
    ckpt["callbacks"][_state_key(ckpt)]["world_size"] = 2
    torch.save(ckpt, tmp_path / "two.ckpt")
    with caplog.at_level("WARNING"):
        assert main([*argv, "--trainer.max_steps=4", "--model.init_args.schedule=constant", "--ckpt_path",
                     str(tmp_path / "two.ckpt")]) == 0
    assert "written by 2 processes, this run has 1" in caplog.text and "replays" in caplog.text
    assert "steps long" not in caplog.text  # a schedule that does not span the run: no warning
