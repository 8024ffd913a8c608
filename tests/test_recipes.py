"""Every shipped recipe (recipes/*.yaml) parses with the ``ttt-flash`` CLI, has a comment on
every key, and builds its model and data; CPU recipes also run one ``fast_dev_run`` step.

Recipes named ``*_long.yaml`` or ``*_131k.yaml`` are long-context / GPU recipes: parsed and built
here, run with tiny overrides by tests/test_long_recipes.py and tests/test_131k_recipes.py.
A recipe whose ``trainer.accelerator`` is ``gpu``/``cuda`` runs its ``fast_dev_run`` only where
CUDA is available (skipped on the CPU). New recipes are picked up automatically.
"""

import re
from pathlib import Path

import pytest
import torch
import yaml

from ttt_flash.cli import main

RECIPE_DIR = Path(__file__).resolve().parent.parent / "recipes"
RECIPES = sorted(RECIPE_DIR.glob("*.yaml"))
CPU_RECIPES = [p for p in RECIPES if not p.name.endswith(("_long.yaml", "_131k.yaml"))]

_KEY = re.compile(r"^\s*(?:-\s+)?[\w.\-/]+\s*:")


pytestmark = pytest.mark.usefixtures("one_thread")


def _ids(paths):
    return [p.stem for p in paths]


def test_recipes_exist():
    assert {"maml_sinusoid", "maml_transformer", "maml_transformer_long"} <= {p.stem for p in RECIPES}


@pytest.mark.parametrize("path", RECIPES, ids=_ids(RECIPES))
def test_every_key_has_a_comment(path):
    lines = path.read_text().splitlines()
    missing = []
    for i, line in enumerate(lines):
        if _KEY.match(line) and "#" not in line and not (i and lines[i - 1].lstrip().startswith("#")):
            missing.append(f"{path.name}:{i + 1}: {line.strip()}")
    assert not missing, "keys without a comment:\n" + "\n".join(missing)


@pytest.mark.parametrize("path", RECIPES, ids=_ids(RECIPES))
def test_recipe_parses_and_builds(path, capsys, monkeypatch, tmp_path):
    from jsonargparse import ArgumentParser
    from lightning.pytorch import LightningDataModule, LightningModule

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        main(["fit", "--config", str(path), "--print_config"])
    assert e.value.code in (0, None)
    config = yaml.safe_load(capsys.readouterr().out)
    assert "model" in config and "trainer" in config
    # build the model and data (not the trainer: a GPU recipe's trainer needs a GPU)
    parser = ArgumentParser(exit_on_error=False)
    parser.add_subclass_arguments(LightningModule, "model")
    parser.add_subclass_arguments(LightningDataModule, "data", required=False)
    parts = {k: config[k] for k in ("model", "data") if config.get(k) is not None}
    built = parser.instantiate_classes(parser.parse_object(parts))
    assert isinstance(built.model, LightningModule)


def _needs_gpu(path) -> bool:
    trainer = (yaml.safe_load(path.read_text()) or {}).get("trainer") or {}
    return str(trainer.get("accelerator", "")).lower() in ("gpu", "cuda")


@pytest.mark.parametrize("path", CPU_RECIPES, ids=_ids(CPU_RECIPES))
def test_cpu_recipe_fast_dev_run(path, monkeypatch, tmp_path):
    if _needs_gpu(path) and not torch.cuda.is_available():
        pytest.skip(f"{path.name} asks for a GPU (trainer.accelerator)")
    monkeypatch.chdir(tmp_path)  # anything a recipe writes to a relative path lands here
    code = main([
        "fit", "--config", str(path),
        "--trainer.fast_dev_run=true",
        f"--trainer.default_root_dir={tmp_path}",
        "--trainer.enable_progress_bar=false",
    ])
    assert code == 0
