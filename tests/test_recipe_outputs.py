"""What ``ttt-flash fit`` shows and writes beyond Lightning's defaults
(ttt_flash.lightning.outputs): no ``v_num`` in the progress bar, no FLOPs in the model summary,
the best-k checkpoints by the recipe's validation metric beside ``last.ckpt``, the
validation-curve PNG, and TensorBoard as an optional second logger."""

import csv
from pathlib import Path

import pytest

from ttt_flash.cli import main

RECIPES = Path(__file__).resolve().parent.parent / "recipes"

pytestmark = pytest.mark.usefixtures("one_thread")

TINY_MAML = ["--data.init_args.train_batches=3", "--data.init_args.meta_batch_size=2",
             "--data.init_args.val_batches=1", "--trainer.max_epochs=4"]


def _fit(monkeypatch, tmp_path, *extra):
    from lightning.pytorch import Trainer

    seen = []
    real_fit = Trainer.fit

    def fit(self, *args, **kwargs):
        seen.append(self)
        return real_fit(self, *args, **kwargs)

    monkeypatch.setattr(Trainer, "fit", fit)
    monkeypatch.chdir(tmp_path)
    assert main(["fit", "--config", str(RECIPES / "maml_sinusoid.yaml"), *TINY_MAML, *extra]) == 0
    assert len(seen) == 1
    return seen[0], tmp_path / "runs" / "maml_sinusoid"


def test_fit_writes_best_checkpoints_curves_and_shows_no_v_num(monkeypatch, tmp_path):
    from ttt_flash.lightning.outputs import BestCheckpoints, RecipeModelSummary, RecipeProgressBar, ValidationCurves

    monkeypatch.setattr("ttt_flash._recipe_cli._terminal", lambda: True)  # the rich bar is for terminals
    trainer, folder = _fit(monkeypatch, tmp_path)
    assert isinstance(trainer.progress_bar_callback, RecipeProgressBar)
    assert "v_num" not in trainer.progress_bar_callback.get_metrics(trainer, trainer.lightning_module)
    assert any(isinstance(c, RecipeModelSummary) for c in trainer.callbacks)

    best = [c for c in trainer.callbacks if isinstance(c, BestCheckpoints)]
    assert len(best) == 1 and best[0].monitor == "val/loss_post" and best[0].mode == "min"
    ckpts = folder / "checkpoints"
    assert (ckpts / "last.ckpt").is_file()
    kept = sorted(p.name for p in ckpts.glob("best-step=*.ckpt"))
    assert len(kept) == 3, kept  # 4 validations, the best 3 kept
    with open(folder / "metrics.csv", newline="") as f:
        vals = [(float(r["val/loss_post"]), int(r["step"])) for r in csv.DictReader(f) if r.get("val/loss_post")]
    assert len(vals) == 4
    worst_step = max(vals)[1]
    assert f"best-step={worst_step}.ckpt" not in kept
    assert float(best[0].best_model_score) == pytest.approx(min(vals)[0], rel=1e-6)

    curves = [c for c in trainer.callbacks if isinstance(c, ValidationCurves)]
    pytest.importorskip("matplotlib")
    assert curves and Path(curves[0].written).resolve() == (folder / "val_curves.png").resolve()
    assert (folder / "val_curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_without_the_progress_bar_the_summary_still_has_no_flops(monkeypatch, tmp_path):
    # the summary does not depend on the progress bar: with it off, Lightning's own summary
    # (FLOPs column and total) must not come back
    from lightning.pytorch.callbacks import ModelSummary

    from ttt_flash.lightning.outputs import RecipeModelSummary

    trainer, _ = _fit(monkeypatch, tmp_path, "--trainer.enable_progress_bar=false")
    summaries = [c for c in trainer.callbacks if isinstance(c, ModelSummary)]
    assert len(summaries) == 1 and isinstance(summaries[0], RecipeModelSummary)


def test_without_matplotlib_the_run_still_ends_well(monkeypatch, tmp_path):
    from ttt_flash.lightning import outputs

    def no_matplotlib(*args, **kwargs):
        raise RuntimeError(outputs.PLOT_EXTRA_MESSAGE)

    monkeypatch.setattr(outputs, "plot_curves", no_matplotlib)
    _, folder = _fit(monkeypatch, tmp_path, "--trainer.max_epochs=1")
    assert not (folder / "val_curves.png").exists() and (folder / "metrics.csv").is_file()


def test_a_recipe_with_its_own_monitor_keeps_it(monkeypatch, tmp_path):
    from ttt_flash.lightning.outputs import BestCheckpoints

    trainer, _ = _fit(monkeypatch, tmp_path, "--trainer.max_epochs=1",
                      "--trainer.callbacks.init_args.monitor=val/loss_pre", "--trainer.callbacks.init_args.save_top_k=1")
    assert not any(isinstance(c, BestCheckpoints) for c in trainer.callbacks)


def test_model_summary_has_no_flops():
    from rich import get_console

    from ttt_flash.lightning.outputs import RecipeModelSummary

    data = [(" ", ["0"]), ("Name", ["net"]), ("Type", ["SinusoidMLP"]), ("Params", ["1.7 K"]), ("Mode", ["train"]),
            ("FLOPs", ["0"])]
    with get_console().capture() as cap:
        RecipeModelSummary.summarize(data, 1700, 1700, 0.007, {"train": 3, "eval": 0}, total_flops=0)
    out = cap.get()
    assert "SinusoidMLP" in out and "Total params" in out and "1.7 K" in out
    assert "FLOP" not in out and "Flop" not in out


def test_tensorboard_option_adds_a_logger_in_the_run_folder(monkeypatch, tmp_path):
    import lightning.pytorch.loggers as loggers

    made = []
    monkeypatch.setattr(loggers, "TensorBoardLogger",
                        lambda **kw: made.append(kw) or loggers.CSVLogger(kw["save_dir"], name=kw["name"] + "_tb",
                                                                          version=kw["version"]))
    trainer, folder = _fit(monkeypatch, tmp_path, "--trainer.max_epochs=1", "--tensorboard=true")
    assert len(made) == 1 and len(trainer.loggers) == 2
    csv_logger = trainer.loggers[0]
    assert made[0]["save_dir"] == csv_logger.save_dir and made[0]["name"] == csv_logger.name
    assert made[0]["version"] == csv_logger.version
    assert trainer.logger is csv_logger  # the run folder (lock, checkpoints) stays the CSV log's
    assert (folder / "metrics.csv").is_file()


def test_tensorboard_off_by_default(monkeypatch, tmp_path):
    trainer, _ = _fit(monkeypatch, tmp_path, "--trainer.max_epochs=1")
    assert len(trainer.loggers) == 1


def test_tensorboard_missing_says_how_to_install(monkeypatch, tmp_path, capsys):
    import lightning.pytorch.loggers as loggers

    def missing(**kwargs):
        raise ModuleNotFoundError("Neither `tensorboard` nor `tensorboardX` is available.")

    monkeypatch.setattr(loggers, "TensorBoardLogger", missing)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        main(["fit", "--config", str(RECIPES / "maml_sinusoid.yaml"), *TINY_MAML, "--tensorboard=true"])
    assert "pip install 'ttt-flash[tensorboard]'" in str(e.value.code)
