"""scripts/seed_runs.py: a recipe over seeds (method and baseline per seed), min / median / max of
its target metric and the verdict for the worst seed; a tiny CPU run of the whole path."""

import csv
import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TTT = ROOT / "recipes" / "ttt_e2e_mqar_131k.yaml"
MAML = ROOT / "recipes" / "maml_transformer_131k.yaml"

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def script(monkeypatch):
    spec = importlib.util.spec_from_file_location("seed_runs", ROOT / "scripts" / "seed_runs.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "seed_runs", module)  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _write(runs_dir, name, column, values, pre_column=None, pre=None, step_s=0.5, length=131072.0):
    rows = [{"step": 10 * i + 9, column: v, **({pre_column: pre} if pre_column else {})} for i, v in enumerate(values)]
    rows.append({"step": 39, "train/step_time_s": step_s, "train/context_len": length, "train/peak_mem_gib": 3.0})
    keys = sorted({k for r in rows for k in r})
    (runs_dir / name).mkdir(parents=True)
    with open(runs_dir / name / "metrics.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)


def test_min_median_max_and_the_worst_seed_decides(script, tmp_path):
    recipe = script.Recipe.load(TTT)
    assert (recipe.kind, recipe.metric, recipe.baseline, recipe.chance) == (
        "acc", "val/acc_post", ["--model.init_args.net.init_args.inner_steps=0"], 1 / 64)
    runs = script.plan([recipe], [0, 1, 2], probe=False)
    assert [r.name for r in runs] == [f"ttt_e2e_mqar_131k{b}_s{s}" for b in ("", "_base") for s in (0, 1, 2)]
    assert runs[4].overrides(False, False) == ["--seed_everything=1", "--data.init_args.seed=1",
                                                "--model.init_args.net.init_args.inner_steps=0"]  # seeds weights and data
    runs_dir = tmp_path / "runs"
    for seed, (m, b) in enumerate([(0.9, 0.02), (0.5, 0.01), (0.1, 0.0)]):  # seed 2 below 10 x chance
        _write(runs_dir, f"ttt_e2e_mqar_131k_s{seed}", "val/acc_post", [0.05, m])
        _write(runs_dir, f"ttt_e2e_mqar_131k_base_s{seed}", "val/acc_post", [0.0, b])
    records = {r.name: script.run_record(r, runs_dir, {"rc": 0, "wall_s": 1.0}, probe=False) for r in runs}
    summary = script.summarize([recipe], runs, records, probe=False)
    e = summary["recipes"]["ttt_e2e_mqar_131k"]
    assert e["method"] == {"min": 0.1, "median": 0.5, "max": 0.9, "n": 3}
    assert [p["met"] for p in e["per_seed"].values()] == [True, True, False]
    assert e["met"] is False and e["per_seed"][0]["step_s"] == 0.5
    assert "0.1000 / 0.5000 / 0.9000 over 3 seeds" in script.table(summary)
    assert "NOT MET" in script.table(summary)


def test_a_stopped_run_gets_no_verdict(script, tmp_path):
    """A run stopped at the deadline (or crashed) is reported unfinished, whatever its last
    validation said, and the recipe is not met until it is resumed to the end."""
    recipe = script.Recipe.load(TTT)
    runs = script.plan([recipe], [0, 1], probe=False)
    runs_dir = tmp_path / "runs"
    for seed in (0, 1):
        _write(runs_dir, f"ttt_e2e_mqar_131k_s{seed}", "val/acc_post", [0.05, 0.9])
        _write(runs_dir, f"ttt_e2e_mqar_131k_base_s{seed}", "val/acc_post", [0.0, 0.02])
    rc = {"ttt_e2e_mqar_131k_s1": 143}  # seed 1's method was stopped by SIGTERM
    records = {r.name: script.run_record(r, runs_dir, {"rc": rc.get(r.name, 0), "wall_s": 1.0}, probe=False)
               for r in runs}
    summary = script.summarize([recipe], runs, records, probe=False)
    e = summary["recipes"]["ttt_e2e_mqar_131k"]
    assert [p["met"] for p in e["per_seed"].values()] == [True, False] and e["met"] is False
    assert e["per_seed"][1]["stopped"] == ["method"] and e["per_seed"][0]["stopped"] == []
    text = script.table(summary)
    assert "unfinished (method stopped, logged to step 40)" in text
    assert "NOT MET (1 seed(s) with a run that did not finish" in text
    records["ttt_e2e_mqar_131k_s1"] = script.run_record(runs[1], runs_dir, {"rc": 0}, probe=False)  # resumed to the end
    assert script.summarize([recipe], runs, records, probe=False)["recipes"]["ttt_e2e_mqar_131k"]["met"] is True


def test_set_overrides_every_run_and_the_baseline_switch_wins(script, tmp_path, capsys):
    recipe = script.Recipe.load(MAML)
    runs = script.plan([recipe], [1], probe=False, extra=["trainer.precision=bf16-mixed", "model.init_args.first_order=false"])
    assert runs[0].overrides(False, False) == ["--seed_everything=1", "--data.init_args.seed=1",
                                                "--trainer.precision=bf16-mixed", "--model.init_args.first_order=false"]
    assert runs[1].overrides(False, False)[-2:] == ["--model.init_args.first_order=false",
                                                     "--model.init_args.first_order=true"]  # the last one wins
    cmd = script.command(runs[0], tmp_path, "", probe=False, tiny=False)
    assert "--trainer.precision=bf16-mixed" in cmd
    for bad in ("--trainer.precision=bf16-mixed", "trainer.precision", "=x"):
        with pytest.raises(SystemExit):
            script.main(["--recipe", str(MAML), "--out", str(tmp_path), f"--set={bad}", "--summarize-only"])
        assert "--set takes KEY=VALUE" in capsys.readouterr().err


def test_maml_target_is_pre_and_first_order_of_the_same_seed(script, tmp_path):
    recipe = script.Recipe.load(MAML)
    assert recipe.baseline == ["--model.init_args.first_order=true"] and recipe.kind == "maml"
    runs = script.plan([recipe], [0, 1], probe=False)
    runs_dir = tmp_path / "runs"
    _write(runs_dir, "maml_transformer_131k_s0", "val/loss_post", [0.5, 0.2], "val/loss_pre", 1.0)
    _write(runs_dir, "maml_transformer_131k_base_s0", "val/loss_post", [0.5, 0.3], "val/loss_pre", 1.0)
    _write(runs_dir, "maml_transformer_131k_s1", "val/loss_post", [0.5, 0.2], "val/loss_pre", 1.0)
    _write(runs_dir, "maml_transformer_131k_base_s1", "val/loss_post", [0.5, 0.1], "val/loss_pre", 1.0)  # first order wins
    records = {r.name: script.run_record(r, runs_dir, {}, probe=False) for r in runs}
    e = script.summarize([recipe], runs, records, probe=False)["recipes"]["maml_transformer_131k"]
    assert [p["met"] for p in e["per_seed"].values()] == [True, False] and e["met"] is False


def test_refuses_bad_arguments(script, tmp_path, capsys):
    for argv, message in ((["--recipe", str(TTT), "--seeds", "a,b"], "--seeds must be comma-separated integers"),
                          (["--recipe", str(tmp_path / "nope.yaml")], "no such file"),
                          (["--recipe", str(ROOT / "recipes" / "sophia_gpt_tiny.yaml")], "this runner knows"),
                          (["--recipe", str(TTT), "--in-process"], "--in-process is for --tiny"),
                          (["--recipe", str(TTT), "--roles", "method,other"], "--roles must be"),
                          (["--recipe", str(TTT), "--probe", "--probe-steps", "1"], "--probe-steps must be >= 2")):
        with pytest.raises(SystemExit):
            script.main([*argv, "--out", str(tmp_path / "o")])
        assert message in capsys.readouterr().err


def test_tiny_seed_run_on_cpu(script, tmp_path, capsys):
    """The whole path at tiny size: two seeds, method and baseline, CSVs, JSON and the table."""
    assert script.main(["--recipe", str(TTT), "--out", str(tmp_path), "--tiny", "--in-process", "--seeds", "0,1"]) == 0
    summary = json.loads((tmp_path / "seeds.json").read_text())
    runs = summary["runs"]
    assert sorted(runs) == ["ttt_e2e_mqar_131k_base_s0", "ttt_e2e_mqar_131k_base_s1",
                            "ttt_e2e_mqar_131k_s0", "ttt_e2e_mqar_131k_s1"]
    assert all(r["rc"] == 0 and len(r["val"]) == 2 and r["steps"] == 4 for r in runs.values())
    assert all(r["median_step_s_at_final_length"] > 0 for r in runs.values())
    assert runs["ttt_e2e_mqar_131k_s0"]["val"] != runs["ttt_e2e_mqar_131k_s1"]["val"]  # another seed, another run
    base = runs["ttt_e2e_mqar_131k_base_s0"]  # no update: the adapted model is the initial one
    assert "--model.init_args.net.init_args.inner_steps=0" in base["overrides"] and base["val"] == base["val_pre"]
    entry = summary["recipes"]["ttt_e2e_mqar_131k"]
    assert entry["method"]["n"] == 2 and entry["method"]["min"] <= entry["method"]["median"] <= entry["method"]["max"]
    assert capsys.readouterr().out.rstrip().endswith((tmp_path / "seeds.md").read_text().rstrip().splitlines()[-1])


def test_tiny_probe_measures_the_final_length(script, tmp_path):
    assert [r.name for r in script.plan([script.Recipe.load(MAML)], [0, 1], True, {"method"})] == [
        "maml_transformer_131k_s0"]  # a probe: the first seed; --roles method: no baseline
    assert script.main(["--recipe", str(MAML), "--out", str(tmp_path), "--tiny", "--in-process", "--probe"]) == 0
    summary = json.loads((tmp_path / "seeds.json").read_text())
    assert sorted(summary["runs"]) == ["maml_transformer_131k_base_s0", "maml_transformer_131k_s0"]
    run = summary["runs"]["maml_transformer_131k_s0"]
    assert run["steps"] == script.PROBE_STEPS and run["val"] == []  # no validation in a probe
    assert "--data.init_args.curriculum=[[0,32]]" in run["overrides"]  # the final (tiny) length only
    entry = summary["recipes"]["maml_transformer_131k"]
    assert entry["final_stage_steps"] == 6 and entry["final_stage_s"] > 0
    assert "final-stage steps" in (tmp_path / "seeds.md").read_text()


def test_resume_skips_finished_runs_and_continues_from_last_ckpt(script, tmp_path):
    recipe = script.Recipe.load(TTT)
    runs = script.plan([recipe], [0], probe=False)
    results = {"ttt_e2e_mqar_131k_s0": {"rc": 0}, "ttt_e2e_mqar_131k_base_s0": {"rc": 143}}  # the baseline was stopped
    assert [r.name for r in script.to_run(runs, results, resume=True)] == ["ttt_e2e_mqar_131k_base_s0"]
    assert len(script.to_run(runs, results, resume=False)) == 2
    runs_dir = tmp_path / "runs"
    assert not any(c.startswith("--ckpt_path") for c in script.command(runs[1], runs_dir, "00:00:15:00", False, False, True))
    ckpt = runs_dir / "ttt_e2e_mqar_131k_base_s0" / "checkpoints" / "last.ckpt"
    ckpt.parent.mkdir(parents=True)
    ckpt.write_bytes(b"")
    cmd = script.command(runs[1], runs_dir, "00:00:15:00", False, False, True)
    assert cmd[-1] == f"--ckpt_path={ckpt}" and f"--trainer.logger.init_args.version={runs[1].name}" in cmd
    assert not any(c.startswith("--ckpt_path") for c in script.command(runs[1], runs_dir, "00:00:15:00", False, False))
    # the recipe's own max_time stays unless --max-time replaces it
    assert not any(c.startswith("--trainer.max_time") for c in script.command(runs[0], runs_dir, "", False, False))
    assert "--trainer.max_time=00:00:05:00" in script.command(runs[0], runs_dir, "00:00:05:00", False, False)
