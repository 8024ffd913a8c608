"""Every shipped recipe (recipes/*.yaml) parses with the ``ttt-flash`` CLI, has a comment on
every key, builds its model and data, and runs with ``--smoke`` on the CPU (two steps at tiny
sizes, ttt_flash/_smoke.py). New recipes are picked up automatically.
"""

import re
from pathlib import Path

import pytest
import torch
import yaml

from ttt_flash.cli import main

RECIPE_DIR = Path(__file__).resolve().parent.parent / "recipes"
RECIPES = sorted(RECIPE_DIR.glob("*.yaml"))

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


@pytest.mark.parametrize("path", RECIPES, ids=_ids(RECIPES))
def test_every_recipe_runs_with_smoke_on_the_cpu(path, monkeypatch, tmp_path, capsys):
    """README: ``ttt-flash fit --config recipes/NAME.yaml --smoke`` tries any recipe (GPU and
    131,072-token ones included) on the CPU in seconds: two steps, a validation, the curves,
    no checkpoint, one line at the end naming the run folder."""
    monkeypatch.chdir(tmp_path)  # anything a recipe writes to a relative path lands here
    assert main(["fit", "--config", str(path), "--smoke"]) == 0
    out = capsys.readouterr().out
    folder = tmp_path / "runs" / f"smoke-{path.stem}"
    assert f"ttt-flash fit: done; run folder runs/smoke-{path.stem}, no checkpoint (--smoke)" in out
    rows = (folder / "metrics.csv").read_text().splitlines()
    assert rows and any(h.startswith("val/") for h in rows[0].split(","))
    assert not list(tmp_path.rglob("*.ckpt"))
    assert "validation at step 2:" in out  # plain progress lines: the output is not a terminal


def test_smoke_covers_every_long_and_gpu_recipe():
    """Every recipe that does not fit the CPU at its own size has tiny shapes in the table."""
    from ttt_flash._smoke import TINY, method_of

    big = [p.stem for p in RECIPES if p.stem.endswith(("_long", "_131k")) or p.stem == "sophia_gpt"]
    assert big and all(method_of(name) in TINY for name in big), big


# --------------------------------------------------------------------------- memory recipes: the injected network

MEMORY_RECIPES = [p for p in RECIPES if p.stem.startswith(("memory_layer_mqar", "gradmem_kv", "ttt_e2e_mqar"))]


def _built_model(path, capsys, monkeypatch, tmp_path):
    """The recipe's LightningModule as ``ttt-flash fit`` builds it (the config it prints,
    composed by the parser after ``seed_everything``), and that config."""
    from jsonargparse import ArgumentParser
    from lightning.pytorch import LightningModule

    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit):
        main(["fit", "--config", str(path), "--print_config"])
    config = yaml.safe_load(capsys.readouterr().out)
    parser = ArgumentParser(exit_on_error=False)
    parser.add_subclass_arguments(LightningModule, "model")
    namespace = parser.parse_object({"model": config["model"]})
    torch.manual_seed(config["seed_everything"])
    return parser.instantiate_classes(namespace).model, config


def _explicit_network(path):
    """The recipe's network written out by hand from the YAML's values."""
    from ttt_flash.memory import FastWeightTTT, GradMem, MemoryLM
    from ttt_flash.models import GPT, GPTConfig

    args = dict(yaml.safe_load(path.read_text())["model"]["init_args"]["net"]["init_args"])
    if path.stem.startswith("memory_layer_mqar"):
        return MemoryLM(**args)
    gpt = GPT(GPTConfig(**args.pop("model")))
    return (GradMem if path.stem.startswith("gradmem_kv") else FastWeightTTT)(gpt, **args)


@pytest.mark.parametrize("path", MEMORY_RECIPES, ids=_ids(MEMORY_RECIPES))
def test_memory_recipe_builds_the_network_it_writes_out(path, capsys, monkeypatch, tmp_path):
    """A memory recipe's ``net: {class_path, init_args}`` builds exactly the network written out
    by hand from its values: the same parameters, the same initial weights given the seed
    (bit for bit), the same query logits on one batch (the small recipes)."""
    from ttt_flash.tasks import AssociativeRecallTasks

    model, config = _built_model(path, capsys, monkeypatch, tmp_path)
    torch.manual_seed(config["seed_everything"])
    net = _explicit_network(path)
    assert type(model.net) is type(net)
    built, explicit = model.net.state_dict(), net.state_dict()
    assert list(built) == list(explicit)
    for name, value in explicit.items():
        assert torch.equal(built[name], value), name
    assert model.net.vocab_size >= 1 + config["data"]["init_args"]["num_keys"] + config["data"]["init_args"]["num_values"]
    if path.stem.endswith(("_long", "_131k")):
        return  # too long for the CPU; the weights above are the whole network
    data = config["data"]["init_args"]
    tasks = AssociativeRecallTasks(num_keys=data["num_keys"], num_values=data["num_values"],
                                   num_pairs=data["num_pairs"], num_queries=data["num_queries"])
    batch = tasks.sample(2, generator=torch.Generator().manual_seed(1))
    built_logits = model._query_logits(batch, write=True)[0]
    model.net = net
    torch.testing.assert_close(built_logits, model._query_logits(batch, write=True)[0], rtol=0, atol=0)


_NET = "--model.init_args.net.init_args."


@pytest.mark.parametrize("recipe,overrides", [
    ("gradmem_kv", [_NET + "model.attention=math", _NET + "model.n_layer=1", "--data.init_args.batch_size=2"]),
    ("maml_sinusoid", [_NET + "hidden=8", "--data.init_args.meta_batch_size=2"]),
], ids=["gradmem_kv", "maml_sinusoid"])
def test_a_checkpoint_rebuilds_its_injected_network(recipe, overrides, monkeypatch, tmp_path):
    """A run's checkpoint keeps the network's ``class_path`` and ``init_args`` (set from the
    command line too): ``load_from_checkpoint`` rebuilds the same network with the same weights."""
    monkeypatch.chdir(tmp_path)
    assert main(["fit", "--config", str(RECIPE_DIR / f"{recipe}.yaml"), *overrides, "--trainer.max_steps=2",
                 "--trainer.limit_val_batches=1", "--trainer.val_check_interval=1.0",
                 "--trainer.enable_progress_bar=false"]) == 0
    path = tmp_path / "runs" / recipe / "checkpoints" / "last.ckpt"
    checkpoint = torch.load(path, weights_only=True)
    net = checkpoint["hyper_parameters"]["net"]
    assert net["class_path"] in ("ttt_flash.memory.GradMem", "ttt_flash.models.SinusoidMLP")
    model = _module_class(checkpoint).load_from_checkpoint(path)
    assert type(model.net).__name__ == net["class_path"].rsplit(".", 1)[1]
    state = model.state_dict()
    assert state.keys() == checkpoint["state_dict"].keys()
    assert all(torch.equal(state[k], v) for k, v in checkpoint["state_dict"].items())


def _module_class(checkpoint):
    import importlib

    module, _, name = checkpoint["hyper_parameters"]["_class_path"].rpartition(".")
    return getattr(importlib.import_module(module), name)


def _header_commands():
    """(recipe, command) for every ``#   ttt-flash fit|test|validate ...`` line of a recipe's
    header (its comment before the first key)."""
    out = []
    for path in RECIPES:
        for line in path.read_text().splitlines():
            if not line.startswith("#"):
                break
            m = re.match(r"#\s+(ttt-flash (?:fit|test|validate) .*?)(?:\s+#.*)?$", line)
            if m:
                out.append((path.stem, m.group(1)))
    return out


def _print_config(argv, capsys):
    try:
        code = main([*argv, "--print_config"])
    except SystemExit as e:
        code = e.code
    return code, capsys.readouterr()


def test_every_recipe_header_command_parses(monkeypatch, tmp_path, capsys):
    """The commands a recipe's header prints name only keys and values the recipe accepts
    (``--print_config`` parses them without running); a misspelt key would fail here."""
    import shlex

    monkeypatch.chdir(RECIPE_DIR.parent)
    commands = _header_commands()
    assert len(commands) >= 50
    bad = []
    for recipe, command in commands:
        code, out = _print_config(shlex.split(command)[1:], capsys)
        if code not in (0, None):
            bad.append(f"recipes/{recipe}.yaml: {command}: exit {code}: {out.err.strip()[-300:]}")
    assert not bad, "\n".join(bad)
    code, out = _print_config(["fit", "--config", "recipes/maml_sinusoid.yaml", "--model.init_args.inner_lrr=0.1"],
                              capsys)
    assert code == 2 and "inner_lrr" in out.err
