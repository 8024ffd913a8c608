"""The 131,072-token recipes (recipes/*_131k.yaml, docs/long-context.md): each has tiny shapes
for ``--smoke`` (run by tests/test_recipes.py), trains up to and validates at 131,072 tokens,
fits its 15-minute budget on paper, and stays the same model as its 32,768-token ``_long``
recipe."""

from pathlib import Path

import pytest
import yaml

from ttt_flash._smoke import TINY as TINY_OVERRIDES
from ttt_flash.lightning.curriculum import LengthCurriculum

ROOT = Path(__file__).resolve().parent.parent
RECIPES = ROOT / "recipes"

METHODS = ("ttt_e2e_mqar", "gradmem_kv", "memory_layer_mqar", "memory_layer_mqar16", "maml_transformer")
TINY = {f"{method}_131k": TINY_OVERRIDES[method] for method in METHODS}
SHIPPED = sorted(p.stem for p in RECIPES.glob("*_131k.yaml"))


def _config(name):
    return yaml.safe_load((RECIPES / f"{name}.yaml").read_text())

def _model_args(config):
    """The module's arguments and its network's (a GPT's included) in one dict: the recipe's
    ``model.init_args`` with ``net.init_args`` (and its ``model``), or a ``NetConfig`` ``net``,
    spread into it."""
    args = dict(config["model"]["init_args"])
    net = dict(args.pop("net", None) or {})
    net = dict(net.get("init_args") or {}) if "class_path" in net else net
    return {**args, **{k: v for k, v in net.items() if k != "model"}, **(net.get("model") or {})}



def _seconds(max_time: str) -> int:
    days, hours, minutes, seconds = (int(x) for x in max_time.split(":"))
    return ((days * 24 + hours) * 60 + minutes) * 60 + seconds


def test_the_four_methods_have_a_131k_recipe_with_tiny_overrides():
    assert SHIPPED == sorted(TINY) == sorted(
        ["ttt_e2e_mqar_131k", "gradmem_kv_131k", "memory_layer_mqar_131k", "memory_layer_mqar16_131k",
         "maml_transformer_131k"])


@pytest.mark.parametrize("name", sorted(TINY))
def test_131k_recipe_trains_up_to_and_validates_at_131072(name):
    config = _config(name)
    data, model, trainer = config["data"]["init_args"], _model_args(config), config["trainer"]
    final = data.get("context_len") or data["seq_len"]
    stages = LengthCurriculum(data["curriculum"]).as_list()
    assert final == 131072
    assert stages[-1][1] == final and stages[0][1] < final
    assert stages[-1][0] < data["train_batches"]  # the last stage is reached
    # a validation (at the full length) falls on the last step, so every run ends measured there
    assert data["train_batches"] % trainer["val_check_interval"] == 0
    assert _seconds(trainer["max_time"]) <= 15 * 60  # the budget: at most 15 minutes on one H200
    assert trainer["logger"]["init_args"]["version"] == name  # its own run folder
    if name.startswith("memory_layer_mqar"):  # the queries are a chunk of their own: only the slots reach the pairs
        assert all(n % model["chunk_size"] == 0 for _, n in stages)
    if name == "ttt_e2e_mqar_131k":  # attention sees a sliver of the context: the fast weights must carry it
        assert model["window"] * 1000 < final
    if name == "gradmem_kv_131k":  # the slowest RoPE rotations stay below those of the 32K recipe at 32,768
        long_base = _model_args(_config("gradmem_kv_long"))["rope_base"]
        assert model["rope_base"] ** (-13 / 16) * final <= long_base ** (-13 / 16) * 32768


@pytest.mark.parametrize("name", sorted(TINY))
def test_131k_recipe_is_the_long_recipe_stretched(name):
    """Same model class and shape as the 32,768-token recipe that met its targets; only the
    lengths, the batch, the step budget and (GradMem) the RoPE base differ."""
    ours, theirs = _config(name), _config(name.replace("_131k", "_long"))
    assert ours["model"]["class_path"] == theirs["model"]["class_path"]
    assert ours["model"]["init_args"]["net"].get("class_path") == theirs["model"]["init_args"]["net"].get("class_path")
    assert ours["data"]["class_path"] == theirs["data"]["class_path"]
    allowed = {"rope_base", "context_parallel"}
    ours_args, theirs_args = _model_args(ours), _model_args(theirs)
    for key, value in theirs_args.items():
        if key not in allowed:
            assert ours_args[key] == value, key
