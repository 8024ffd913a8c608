"""The long-context recipes (recipes/*_long.yaml, docs/long-context.md) and what they use:
length curricula, the memory layer's write gate, GradMem's RoPE base, validation-curve plots
and the run script's verdicts. Every ``_long`` recipe has tiny shapes for ``--smoke`` (run by
tests/test_recipes.py: both curriculum stages)."""

import csv
import importlib.util
import sys
from pathlib import Path

import pytest
import torch
import yaml

from ttt_flash._smoke import TINY as TINY_OVERRIDES
from ttt_flash.lightning import InContextRegressionDataModule
from ttt_flash.lightning.curriculum import LengthCurriculum
from ttt_flash.lightning.curves import PLOT_EXTRA_MESSAGE, Series, plot_curves, read_curve
from ttt_flash.lightning.memory import AssociativeRecallDataModule, GradMemKV
from ttt_flash.memory import GradientMemoryAttention, GradMem
from ttt_flash.models import GPTConfig

ROOT = Path(__file__).resolve().parent.parent
RECIPES = ROOT / "recipes"

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = {f"{method}_long": args for method, args in TINY_OVERRIDES.items() if method != "sophia_gpt"}
LONG = sorted(RECIPES.glob("*_long.yaml"))


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



def test_every_long_recipe_has_tiny_overrides():
    assert {p.stem for p in LONG} == set(TINY)


@pytest.mark.parametrize("name", sorted(TINY))
def test_long_recipe_trains_up_to_its_validation_length(name):
    """At >= 32,768 tokens: the curriculum starts short and ends at the validation length."""
    data = _config(name)["data"]["init_args"]
    final = data.get("context_len") or data["seq_len"]
    stages = LengthCurriculum(data["curriculum"]).as_list()
    assert final >= 32768
    assert stages[-1][1] == final and stages[0][1] < final
    assert stages[-1][0] < data["train_batches"]  # the last stage is reached
    model = _model_args(_config(name))
    if name.startswith("memory_layer_mqar"):  # the queries are a chunk of their own: only the slots reach the pairs
        assert all(n % model["chunk_size"] == 0 for _, n in stages)
    if name == "ttt_e2e_mqar_long":  # attention sees a sliver of the context: the fast weights must carry it
        assert model["window"] * 1000 < final


# --------------------------------------------------------------------------- curriculum


def test_curriculum_length_at_and_errors():
    c = LengthCurriculum([[0, 8], [3, 16], [5, 32]])
    assert [c.length_at(i) for i in range(7)] == [8, 8, 8, 16, 16, 32, 32]
    with pytest.raises(ValueError, match=r"curriculum\[0\] must start at step 0"):
        LengthCurriculum([[1, 8]])
    with pytest.raises(ValueError, match=r"curriculum\[1\] starts at step 0"):
        LengthCurriculum([[0, 8], [0, 16]])
    with pytest.raises(ValueError, match=r"curriculum\[1\] must be a pair of ints"):
        LengthCurriculum([[0, 8], [2]])
    with pytest.raises(ValueError, match="non-empty list"):
        LengthCurriculum([])


def test_recall_data_curriculum_train_lengths_val_final():
    dm = AssociativeRecallDataModule(num_keys=8, num_values=8, num_pairs=2, num_queries=2, context_len=32,
                                     batch_size=2, train_batches=3, val_batches=2,
                                     curriculum=[[0, 8], [2, 16], [4, 32]])
    train = [b.context.shape[1] for b in dm.train_dataloader()]
    train += [b.context.shape[1] for b in dm.train_dataloader()]  # the next epoch continues the schedule
    assert train == [8, 8, 16, 16, 32, 32]
    assert [b.context.shape[1] for b in dm.val_dataloader()] == [32, 32]
    with pytest.raises(ValueError, match=r"curriculum\[0\] \(length 3\)"):  # odd: not (key, value) slots
        AssociativeRecallDataModule(num_pairs=1, context_len=8, curriculum=[[0, 3]])


def test_regression_data_curriculum_train_lengths_val_final():
    dm = InContextRegressionDataModule(dim=2, seq_len=16, support_size=1, query_size=1, meta_batch_size=1,
                                       train_batches=4, val_batches=1, curriculum=[[0, 4], [2, 16]])
    assert [b.support_inputs.shape[-2] for b in dm.train_dataloader()] == [4, 4, 16, 16]
    assert [b.query_inputs.shape[-2] for b in dm.val_dataloader()] == [16]


# --------------------------------------------------------------------------- models


def test_write_gate_starts_as_the_ungated_layer_and_learns():
    torch.manual_seed(0)
    gated = GradientMemoryAttention(16, 2, memory_slots=4, chunk_size=4, attention="math", write_gate=True).double()
    plain = GradientMemoryAttention(16, 2, memory_slots=4, chunk_size=4, attention="math").double()
    plain.load_state_dict({k: v for k, v in gated.state_dict().items() if not k.startswith("write_gate")})
    x = torch.randn(2, 12, 16, dtype=torch.float64)
    out = gated(x)
    torch.testing.assert_close(out, plain(x), rtol=0, atol=1e-12)  # β = 1 at initialisation
    out.square().sum().backward()  # second order through the writes reaches the gate
    assert gated.write_gate.weight.grad.abs().sum() > 0
    with torch.no_grad():  # a closed gate writes nothing: the output is the never-written layer's
        gated.write_gate.bias.fill_(-200.0)
    torch.testing.assert_close(gated(x), gated(x, write=False), rtol=0, atol=1e-12)


def test_gradmem_rope_base_reaches_the_gpt():
    net = GradMem(GPTConfig(vocab_size=17, n_layer=1, n_head=2, d_model=16, rope_base=1e6))
    assert GradMemKV(net).net.model.config.rope_base == 1e6


# --------------------------------------------------------------------------- curves


def _csv(path, rows):
    keys = sorted({k for r in rows for k in r})
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)
    return path


def test_read_curve_and_plot(tmp_path, monkeypatch):
    path = _csv(tmp_path / "metrics.csv", [{"step": 0, "train/loss": 1.0}, {"step": 9, "val/acc_post": 0.25},
                                           {"step": 19, "val/acc_post": 0.5}])
    assert read_curve(path, "val/acc_post") == ([9, 19], [0.25, 0.5])
    with pytest.raises(KeyError, match="columns are"):
        read_curve(path, "val/nope")
    series = [Series.parse(f"method={path}:val/acc_post")]
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        with pytest.raises(RuntimeError, match=r'pip install -e "\.\[plot\]"'):
            plot_curves(tmp_path / "c.png", series)
    else:
        assert plot_curves(tmp_path / "c.png", series, chance=0.1).stat().st_size > 1000
        monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
        with pytest.raises(RuntimeError) as e:
            plot_curves(tmp_path / "d.png", series)
        assert str(e.value) == PLOT_EXTRA_MESSAGE


def _script(monkeypatch):
    spec = importlib.util.spec_from_file_location("long_context_runs", ROOT / "scripts" / "long_context_runs.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "long_context_runs", module)  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_run_script_verdicts(tmp_path, monkeypatch):
    """The table's MET / NOT MET follow docs/long-context.md's targets."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # no plots needed
    s = _script(monkeypatch)
    runs = [r for r in s.RUNS if r.role != "variant"]

    def write(name, column, values, pre_column=None, pre=None):
        rows = [{"step": 10 * i + 9, column: v, **({pre_column: pre} if pre_column else {})}
                for i, v in enumerate(values)]
        rows.append({"step": 39, "train/step_time_s": 0.5, "train/context_len": 32768.0})
        (tmp_path / "runs" / name).mkdir(parents=True)
        _csv(tmp_path / "runs" / name / "metrics.csv", rows)

    write("ttt", "val/acc_post", [0.1, 0.9])          # >= 10 x 1/64 and above the baseline
    write("ttt_base", "val/acc_post", [0.0, 0.02])
    write("gradmem", "val/acc_post", [0.05, 0.12])    # below 10 x chance
    write("gradmem_base", "val/acc_post", [0.0, 0.0])
    write("memlayer", "val/acc_post", [0.3, 0.3])     # not above its baseline
    write("memlayer_base", "val/acc_post", [0.3, 0.3])
    write("maml", "val/loss_post", [0.5, 0.2], "val/loss_pre", 1.0)     # 80 % below pre, below first order
    write("maml_fo", "val/loss_post", [0.5, 0.25], "val/loss_pre", 1.0)
    summary = s.summarize(tmp_path, runs, {})
    met = {k: v["met"] for k, v in summary["recipes"].items()}
    assert met == {"ttt": True, "gradmem": False, "memlayer": False, "maml": True}
    text = s.table(summary)
    assert "TTT-E2E MQAR: method 0.9 vs baseline 0.02" in text and text.count("NOT MET") == 2


def _write_256_chunks(layer, x):
    """The slots after writing every chunk of ``x`` in turn (no outer graph)."""
    q, k, v = layer.qkv(x).view(x.shape[0], -1, 3, layer.heads, layer.head_dim).permute(2, 0, 3, 1, 4)
    slot_k = layer.slot_k.unsqueeze(0).expand(x.shape[0], -1, -1, -1)
    slot_v = layer.slot_v.unsqueeze(0).expand(x.shape[0], -1, -1, -1)
    c = layer.chunk_size
    for start in range(0, x.shape[1], c):
        slot_k, slot_v = layer.write(slot_k, slot_v, k[:, :, start:start + c], v[:, :, start:start + c])
    return slot_k, slot_v, v


def test_slot_normalized_write_stays_bounded_where_the_gradient_write_diverges():
    """256 writes with large projections and inputs (the 32,768-token recipe's count): the plain
    gradient write at the step the long recipe used (16) overflows; the slot-normalised write
    (its largest step, 1) keeps every slot finite and within the range of the values written."""
    torch.manual_seed(0)
    x = 3 * torch.randn(2, 256 * 8, 32)
    slots = {}
    for rule, lr in (("gradient", 16.0), ("slot_normalized", 1.0)):
        torch.manual_seed(0)
        layer = GradientMemoryAttention(32, 2, memory_slots=8, chunk_size=8, inner_lr=lr, attention="math",
                                        write_rule=rule)
        with torch.no_grad():
            layer.qkv.weight.mul_(30)  # grown projections: sharp addresses, large values
            slots[rule] = _write_256_chunks(layer, x)
    assert not torch.isfinite(slots["gradient"][1]).all()
    _, written, v = slots["slot_normalized"]
    assert torch.isfinite(written).all()
    assert written.abs().max() <= v.abs().max()


def test_slot_normalized_write_is_exact_for_a_lone_token_and_second_order():
    torch.manual_seed(0)
    layer = GradientMemoryAttention(8, 1, memory_slots=3, chunk_size=1, attention="math",
                                    write_rule="slot_normalized").double()
    with torch.no_grad():  # slot 0's key far ahead: a one-hot address
        layer.slot_k.zero_()
        layer.slot_k[0, 0, 0] = 1e3
    k = torch.zeros(1, 1, 1, 8, dtype=torch.float64)
    k[..., 0] = 1.0
    v = torch.randn(1, 1, 1, 8, dtype=torch.float64)
    slot_k = layer.slot_k.unsqueeze(0)
    _, slot_v = layer.write(slot_k, layer.slot_v.unsqueeze(0), k, v)
    torch.testing.assert_close(slot_v[0, 0, 0], v[0, 0, 0])  # η = 1, mass 1: v written exactly
    torch.testing.assert_close(slot_v[0, 0, 1:], torch.zeros(2, 8, dtype=torch.float64))  # others untouched
    # 64 tokens at one address: the slot takes their mean, not 64 steps' worth
    vs = torch.randn(1, 1, 64, 8, dtype=torch.float64)
    _, slot_v = layer.write(slot_k, layer.slot_v.unsqueeze(0), k.expand(1, 1, 64, 8), vs)
    torch.testing.assert_close(slot_v[0, 0, 0], vs[0, 0].mean(0))
    # the outer gradient goes through the write (second order) to the gate, keys and values
    gated = GradientMemoryAttention(16, 2, memory_slots=4, chunk_size=4, attention="math", write_gate=True,
                                    write_rule="slot_normalized").double()
    out = gated(torch.randn(2, 12, 16, dtype=torch.float64))
    out.square().sum().backward()
    assert gated.write_gate.weight.grad.abs().sum() > 0 and gated.slot_k.grad.abs().sum() > 0
    assert gated.log_inner_lr.grad is not None


def test_slot_normalized_write_refuses_bad_arguments():
    with pytest.raises(ValueError, match=r"write_rule must be one of \('gradient', 'slot_normalized'\)"):
        GradientMemoryAttention(16, 2, write_rule="normalized")
    with pytest.raises(ValueError, match=r"inner_lr=4.0.*inner_lr <= 1"):
        GradientMemoryAttention(16, 2, inner_lr=4.0, write_rule="slot_normalized")
