"""scripts/real_text_positions.py: the per-position loss of a TTT-E2E byte LM, the same model
without its update and a full-attention GPT on held-out text; a tiny CPU run of the whole path."""

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def script(monkeypatch):
    spec = importlib.util.spec_from_file_location("real_text_positions", ROOT / "scripts" / "real_text_positions.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "real_text_positions", module)
    spec.loader.exec_module(module)
    return module


def _args(script, **kw):
    import argparse

    a = dict(seed=0, window=4, n_layer=2, n_head=2, d_model=16, attention="math", rope_base=1e4, checkpoint=False,
             chunk=8, inner_lr=0.5)
    a.update(kw)
    return argparse.Namespace(**a)


def test_streaming_without_update_is_the_windowed_gpt(script):
    """Chunk by chunk with the update off gives exactly the sliding-window GPT over the whole
    document (one block: each chunk recomputes the window - 1 bytes before it, which is all a
    block sees); with the update, the first chunk is the same and later chunks differ."""
    a = _args(script, n_layer=1)
    x = torch.randint(0, 256, (2, 24))
    y = torch.randint(0, 256, (2, 24))
    plain = script.build("no_update", a).double()
    whole = F.cross_entropy(plain.model(x).flatten(0, 1), y.flatten(), reduction="none").view(2, 24)
    with torch.no_grad():
        torch.testing.assert_close(script.token_nll(plain, "no_update", x, y, create_graph=False), whole)
    ttt = script.build("ttt", a).double()  # the same initial weights
    with torch.enable_grad():
        adapted = script.token_nll(ttt, "ttt", x, y, create_graph=False)
    torch.testing.assert_close(adapted[:, :8], whole[:, :8])
    assert (adapted[:, 8:] - whole[:, 8:]).abs().max() > 1e-4


def test_ttt_training_loss_is_second_order_through_the_steps(script):
    """d loss / d log(inner lr) (reached only through the fast-weight steps) matches central
    differences in float64."""
    torch.manual_seed(0)
    ttt = script.build("ttt", _args(script)).double()
    x, y = torch.randint(0, 256, (1, 24)), torch.randint(0, 256, (1, 24))
    loss = script.token_nll(ttt, "ttt", x, y, create_graph=True).mean()
    (g,) = torch.autograd.grad(loss, [ttt.log_inner_lr])
    eps = 1e-6
    with torch.no_grad():
        values = []
        for sign in (1, -1):
            ttt.log_inner_lr += sign * eps
            with torch.enable_grad():
                values.append(script.token_nll(ttt, "ttt", x, y, create_graph=False).mean())
            ttt.log_inner_lr -= sign * eps
    torch.testing.assert_close(g, (values[0] - values[1]) / (2 * eps), rtol=1e-5, atol=1e-8)
    assert g.abs() > 1e-6


def test_log_bins_cover_every_position_once(script):
    bins = script.log_bins(131072, 24)
    assert bins[0][0] == 0 and bins[-1][1] == 131072
    assert all(b[0] == a[1] for a, b in zip(bins, bins[1:]))  # contiguous, disjoint
    widths = [hi - lo for lo, hi in bins]
    assert widths == sorted(widths) and widths[-1] > 1000 * widths[0]  # log-spaced


def test_refuses_bad_arguments(script, tmp_path, capsys):
    for argv, message in ((["--curriculum", "0:64,2:128"], "not at --eval-len"),
                          (["--curriculum", "0-64"], "FIRST_STEP:LENGTH"),
                          (["--models", "ttt,lstm"], "--models must name some of"),
                          (["--chunk", "64"], "must be shorter than the first training length"),
                          (["--docs", "100000"], "fewer than --docs x (--eval-len + 1)"),
                          (["--deadline", "-1"], "--deadline must be >= 0")):
        with pytest.raises(SystemExit):
            script.main(["--out", str(tmp_path), "--tiny", *argv])
        assert message in capsys.readouterr().err


def test_tiny_run_on_cpu_then_eval_only(script, tmp_path, capsys):
    """Three models trained on the stdlib bytes, evaluated per position: JSON, PNG, table; the
    checkpoints evaluate again to the same numbers."""
    assert script.main(["--out", str(tmp_path), "--tiny"]) == 0
    result = json.loads((tmp_path / "positions.json").read_text())
    assert list(result["models"]) == ["ttt", "no_update", "full"]
    assert result["bins"] == script.log_bins(256, 8)
    for name, m in result["models"].items():
        assert m["steps"] == 4 and len(m["bits_per_byte"]) == len(result["bins"])
        assert all(math.isfinite(v) and 0 < v < 9 for v in m["bits_per_byte"]), name  # untrained: about 8 bits
        assert (tmp_path / f"{name}.pt").is_file()
    assert result["models"]["ttt"]["inner_lr"] != pytest.approx(0.1, abs=1e-6)  # the step size learned (tiny: 0.1 start)
    assert result["models"]["ttt"]["params"] == result["models"]["full"]["params"] + 1  # + log inner lr
    if result.get("png"):
        assert (tmp_path / "positions.png").stat().st_size > 1000
    assert "| full |" in capsys.readouterr().out
    first = result["models"]
    assert script.main(["--out", str(tmp_path), "--tiny", "--eval-only"]) == 0
    again = json.loads((tmp_path / "positions.json").read_text())["models"]
    for name in first:
        assert again[name]["bits_per_byte"] == pytest.approx(first[name]["bits_per_byte"], rel=1e-6)


def test_interrupted_training_continues_exactly(script, tmp_path):
    import argparse

    a = argparse.Namespace(**{**script.TINY, "seed": 0, "rope_base": 1e4, "checkpoint": False, "inner_lr": 0.1,
                              "lr": 1e-3, "max_train_s": 0.0, "save_every": 0, "paths": None, "val_fraction": 0.05})
    a.curriculum = script.parse_curriculum(a.curriculum)
    a.out = tmp_path / "straight"
    a.out.mkdir()
    tokens = torch.randint(0, 256, (4096,), dtype=torch.uint8)
    straight = script.train("ttt", a, tokens, torch.device("cpu"))
    a.out = tmp_path / "split"
    a.out.mkdir()
    assert script.train("ttt", a, tokens, torch.device("cpu"), stop_after=3) is None  # crosses the curriculum switch
    assert (a.out / "ttt.partial.pt").is_file() and not (a.out / "ttt.pt").exists()
    split = script.train("ttt", a, tokens, torch.device("cpu"))
    assert not (a.out / "ttt.partial.pt").exists()
    assert split["steps"] == straight["steps"] == 4 and split["train_bytes"] == straight["train_bytes"]
    a.out = tmp_path / "deadline"
    a.out.mkdir()
    assert script.train("ttt", a, tokens, torch.device("cpu"), deadline=0.0) is None  # past it: one step, then a pause
    assert torch.load(a.out / "ttt.partial.pt")["state"]["step"] == 1 and not (a.out / "ttt.pt").exists()
    paused = script.train("ttt", a, tokens, torch.device("cpu"))
    assert paused["steps"] == 4
    for key, value in torch.load(a.out / "ttt.pt")["model"].items():
        torch.testing.assert_close(value, torch.load(tmp_path / "straight" / "ttt.pt")["model"][key], rtol=0, atol=0)
    one = torch.load(tmp_path / "straight" / "ttt.pt")["model"]
    two = torch.load(tmp_path / "split" / "ttt.pt")["model"]
    for key in one:
        torch.testing.assert_close(two[key], one[key], rtol=0, atol=0)


def test_one_process_per_model_gathers_every_model(script, tmp_path, capsys):
    """Models trained and evaluated by separate runs (--models one each) all reach positions.json
    and its table; a model evaluated with another setup is left out, with a note naming it."""
    for name in ("full", "ttt"):
        assert script.main(["--out", str(tmp_path), "--tiny", "--models", name, "--deadline", "600"]) == 0
        assert (tmp_path / f"{name}.eval.json").is_file()
    result = json.loads((tmp_path / "positions.json").read_text())
    assert list(result["models"]) == ["ttt", "full"]  # in the order of MODELS
    assert "| ttt |" in capsys.readouterr().out.split("| model |")[-1]
    alone = json.loads((tmp_path / "full.eval.json").read_text())["model"]
    assert result["models"]["full"]["bits_per_byte"] == alone["bits_per_byte"]
    # another number of bins: the earlier evaluations are not comparable and are left out
    assert script.main(["--out", str(tmp_path), "--tiny", "--models", "full", "--eval-only", "--bins", "4"]) == 0
    again = json.loads((tmp_path / "positions.json").read_text())
    assert list(again["models"]) == ["full"] and len(again["models"]["full"]["bits_per_byte"]) == 4
    assert "ttt.eval.json: evaluated with another configuration" in capsys.readouterr().out
