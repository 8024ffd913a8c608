"""The ``ttt-flash`` command line."""

import logging
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import ttt_flash
from ttt_flash.cli import main


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"ttt-flash {ttt_flash.__version__}"


def test_help_lists_commands(capsys):
    assert main([]) == 0
    out = capsys.readouterr().out
    assert "usage: ttt-flash" in out and "check" in out


def test_unknown_command_fails():
    with pytest.raises(SystemExit) as e:
        main(["no-such-command"])
    assert e.value.code == 2


def test_check_help_describes_every_option(capsys, monkeypatch):
    import argparse

    seen = []
    real = argparse.ArgumentParser.parse_args

    def spy(self, *args, **kwargs):
        seen.append(self)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", spy)
    with pytest.raises(SystemExit) as e:
        main(["check", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    check = next(p for p in seen if p.prog == "ttt-flash check")
    options = [a for a in check._actions if a.option_strings and a.dest != "help"]
    assert len(options) >= 10
    for action in options:
        assert action.help and len(action.help) > 10, f"{action.option_strings} has no description"
        assert action.help.split("(")[0].split()[0] in out


def test_check_passes_and_prints_table(capsys):
    assert main(["check", "--seq-len", "19", "--head-dim", "8", "--window", "5"]) == 0
    out = capsys.readouterr().out
    assert "q_bar" in out and out.strip().endswith("OK")
    assert re.search(r"backend=auto \((triton|reference)\)", out)  # what "auto" ran


def test_console_script_is_installed():
    exe = shutil.which("ttt-flash")
    assert exe is not None, "pip install -e . should install the ttt-flash console script"
    r = subprocess.run([exe, "--version"], capture_output=True, text=True, check=True)
    assert r.stdout.strip() == f"ttt-flash {ttt_flash.__version__}"
    r = subprocess.run([sys.executable, "-m", "ttt_flash.cli", "--help"], capture_output=True, text=True, check=True)
    assert "check" in r.stdout


# --------------------------------------------------------------------------- fit / validate / test

RECIPES = Path(__file__).resolve().parent.parent / "recipes"
_WARNING_LINE = re.compile(r"\w+Warning\b|warnings\.warn|is deprecated|💡|Tip:|intended to run from within Python")


def test_fit_help_prints_no_warning_lines():
    r = subprocess.run([sys.executable, "-m", "ttt_flash.cli", "fit", "--help-all"], capture_output=True, text=True,
                       check=True, env={**os.environ, "PYTHONWARNINGS": "default"})
    assert r.stdout.startswith("usage: ttt-flash [options] fit"), r.stdout[:200]
    noisy = [line for line in (r.stdout + r.stderr).splitlines() if _WARNING_LINE.search(line)]
    assert not noisy, "\n".join(noisy)
    assert not r.stderr.strip(), r.stderr


def test_every_recipe_turns_the_progress_bar_on():
    for path in sorted(RECIPES.glob("*.yaml")):
        trainer = yaml.safe_load(path.read_text())["trainer"]
        assert trainer.get("enable_progress_bar") is True, path.name


class _Collect(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def test_fit_runs_quietly_with_a_rich_progress_bar(monkeypatch, tmp_path, recwarn):
    from lightning.pytorch import Trainer
    from lightning.pytorch.callbacks import RichProgressBar

    seen = []
    real_fit = Trainer.fit

    def fit(self, *args, **kwargs):
        seen.append(self.progress_bar_callback)
        return real_fit(self, *args, **kwargs)

    monkeypatch.setattr(Trainer, "fit", fit)
    monkeypatch.setattr("ttt_flash._recipe_cli._terminal", lambda: True)  # as in a terminal
    monkeypatch.chdir(tmp_path)
    collect = _Collect()
    logging.getLogger("lightning.pytorch").addHandler(collect)
    try:
        assert main(["fit", "--config", str(RECIPES / "maml_sinusoid.yaml"), "--trainer.fast_dev_run=true",
                     f"--trainer.default_root_dir={tmp_path}"]) == 0
    finally:
        logging.getLogger("lightning.pytorch").removeHandler(collect)
    assert len(seen) == 1 and isinstance(seen[0], RichProgressBar)
    assert any("fast_dev_run" in m for m in collect.messages)  # the handler does see Lightning's log
    assert not [m for m in collect.messages if "Tip" in m]
    assert not [m for m in collect.messages if "model summary callbacks" in m]  # no "... Skipping" notice
    # the two warnings every CLI call used to print (jsonargparse's DeprecationWarnings about
    # Lightning's calls are hidden outside pytest by Python's default filters)
    noisy = [str(w.message) for w in recwarn if "LeafSpec" in str(w.message) or "from within Python" in str(w.message)]
    assert not noisy


def test_unknown_recipe_key_gives_a_short_error(tmp_path, capsys):
    text = (RECIPES / "maml_sinusoid.yaml").read_text()
    assert "    inner_steps: 1 " in text
    bad = tmp_path / "typo.yaml"
    bad.write_text(text.replace("    inner_steps: 1 ", "    inner_stepz: 1 "))
    with pytest.raises(SystemExit) as e:
        main(["fit", "--config", str(bad)])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert 1 < len(err) <= 4, err
    assert "'model.init_args.inner_stepz'" in err[0] and f"{bad}:" in err[0] and "ttt_flash.lightning.MAML" in err[0]
    assert err[1].split(":", 1)[1].split(",")[0].strip() == "inner_steps"  # the closest key first
    # a trainer key on the command line
    with pytest.raises(SystemExit):
        main(["fit", "--config", str(RECIPES / "maml_sinusoid.yaml"), "--trainer.max_epochz=2"])
    err = capsys.readouterr().err
    assert "unknown key 'trainer.max_epochz' in the command line" in err and "max_epochs" in err
    assert len(err.strip().splitlines()) <= 4


def test_thread_default(monkeypatch):
    import torch

    from ttt_flash._recipe_cli import thread_default

    saved = torch.get_num_threads()
    torch.set_num_threads(2)  # not 1, whatever the environment (OMP_NUM_THREADS=1, test workers) set
    before = torch.get_num_threads()
    try:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        with thread_default() as n:
            assert torch.get_num_threads() == (before if torch.cuda.is_available() else 1)
            assert n == (None if torch.cuda.is_available() else 1)
        assert torch.get_num_threads() == before
        monkeypatch.setenv("OMP_NUM_THREADS", "3")
        with thread_default() as n:
            assert n is None and torch.get_num_threads() == before
    finally:
        torch.set_num_threads(saved)


def _error_lines(capsys, argv):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert 1 <= len(err) <= 4 and "usage:" not in "\n".join(err), err
    return err


def _recipe_with(tmp_path, old, new):
    text = (RECIPES / "maml_sinusoid.yaml").read_text()
    assert old in text
    path = tmp_path / "typo.yaml"
    path.write_text(text.replace(old, new, 1))
    line = next(n for n, row in enumerate(path.read_text().splitlines(), 1) if new.split("\n")[-1] in row)
    return path, line


def test_nested_and_group_level_typos_name_the_full_key_and_line(tmp_path, capsys):
    bad, line = _recipe_with(tmp_path, "        hidden: 40 ", "        hiddn: 40 ")
    err = _error_lines(capsys, ["fit", "--config", str(bad)])
    assert "'model.init_args.net.init_args.hiddn' of ttt_flash.models.SinusoidMLP" in err[0] and f"{bad}:{line}" in err[0]
    assert err[1].endswith(": hidden")  # the network's keys, not the root's
    bad, line = _recipe_with(tmp_path, "  init_args:                         # its typed __init__ arguments\n    net:",
                             "  init_argz:                         # its typed __init__ arguments\n    net:")
    err = _error_lines(capsys, ["fit", "--config", str(bad)])
    assert "'model.init_argz'" in err[0] and f"{bad}:{line - 1}" in err[0] and "init_args" in err[1]
    bad, line = _recipe_with(tmp_path, "  class_path: ttt_flash.lightning.SinusoidDataModule",
                             "  class_path: ttt_flash.lightning.SinusoidDataModule\n  seeed: 3")
    err = _error_lines(capsys, ["fit", "--config", str(bad)])
    assert "'data.seeed'" in err[0] and f"{bad}:{line}" in err[0]


def test_a_command_line_typo_is_blamed_on_the_command_line(capsys):
    recipe = str(RECIPES / "maml_sinusoid.yaml")
    err = _error_lines(capsys, ["fit", "--config", recipe, "--model.init_args.hidden=3"])  # 'hidden' is in the YAML
    assert "'model.init_args.hidden'" in err[0] and err[0].endswith("in the command line")
    err = _error_lines(capsys, ["fit", "--config", recipe, "--model.init_args.net.init_args.hiddn=3"])
    assert "'model.init_args.net.init_args.hiddn'" in err[0] and "the command line" in err[0]
    assert err[1].endswith(": hidden")


@pytest.mark.parametrize("recipe,old,new,key,owner,closest", [
    ("memory_layer_mqar", "        memory_slots: 8 ", "        memory_slotz: 8 ",
     "model.init_args.net.init_args.memory_slotz", "ttt_flash.memory.MemoryLM", "memory_slots"),
    ("gradmem_kv", "        memory_tokens: 4 ", "        memory_tokenz: 4 ",
     "model.init_args.net.init_args.memory_tokenz", "ttt_flash.memory.GradMem", "memory_tokens"),
    ("gradmem_kv", "          n_layer: 2 ", "          n_layr: 2 ",
     "model.init_args.net.init_args.model.n_layr", "ttt_flash.models.GPTConfig", "n_layer"),
    ("maml_memory_layer", "        write_lr: 1.0 ", "        write_lrr: 1.0 ",
     "model.init_args.net.init_args.write_lrr", "ttt_flash.models.MemoryRegressor", "write_lr"),
], ids=["memory_layer-net", "gradmem-net", "gradmem-net-gpt", "maml-net"])
def test_typos_under_a_net_class_path_name_the_full_key(recipe, old, new, key, owner, closest, tmp_path, capsys):
    """A key misspelt inside ``net: {class_path, init_args}`` (and one level deeper, the GPT of
    GradMem) is named with its full dotted path, the class that refused it, the recipe line or
    the command line, and the closest key of that class."""
    text = (RECIPES / f"{recipe}.yaml").read_text()
    assert old in text
    bad = tmp_path / "typo.yaml"
    bad.write_text(text.replace(old, new, 1))
    line = next(n for n, row in enumerate(bad.read_text().splitlines(), 1) if new in row)
    err = _error_lines(capsys, ["fit", "--config", str(bad)])
    assert err[0] == f"ttt-flash fit: error: unknown key '{key}' of {owner} in {bad}:{line}", err
    assert err[1] == f"  closest valid keys: {closest}", err
    flag = f"--{key}=2"  # the same typo on the command line
    err = _error_lines(capsys, ["fit", "--config", str(RECIPES / f"{recipe}.yaml"), flag])
    assert err[0] == f"ttt-flash fit: error: unknown key '{key}' of {owner} in the command line", err
    assert err[1] == f"  closest valid keys: {closest}", err


def test_wrong_types_get_the_typo_treatment(tmp_path, capsys):
    recipe = str(RECIPES / "maml_sinusoid.yaml")
    err = _error_lines(capsys, ["fit", "--config", recipe, "--model.init_args.inner_steps=two"])
    assert err[0].endswith("'model.init_args.inner_steps' of ttt_flash.lightning.MAML in the command line: "
                           "expected int, got 'two'")
    bad, line = _recipe_with(tmp_path, "    inner_lr: 0.01 ", "    inner_lr: fast ")
    err = _error_lines(capsys, ["fit", "--config", str(bad)])
    assert "'model.init_args.inner_lr'" in err[0] and f"{bad}:{line}" in err[0]
    assert "expected float, got 'fast'" in err[0]
    err = _error_lines(capsys, ["fit", "--config", recipe, "--trainer.max_epochs=two"])
    assert "'trainer.max_epochs' in the command line: expected int or None, got 'two'" in err[0]


@pytest.mark.parametrize("argv,words", [
    (["bench", "--seq-len", "-5"], "--seq-lens must be one or more lengths >= 1"),
    (["bench", "--heads", "3", "--kv-heads", "2"], "--kv-heads must be >= 1 and divide --heads (3)"),
    (["bench", "--window", "0", "--causal"], "--window must be >= 1"),
    (["check", "--window", "0"], "--window must be >= 1"),
    (["check", "--heads", "3", "--kv-heads", "2"], "--heads (3) must be a multiple of --kv-heads (2)"),
])
def test_bad_arguments_are_argument_errors(argv, words, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err and err.startswith("usage:")


# --------------------------------------------------------------------------- short messages


def _short_error(capsys, argv, most=3):
    """The stderr lines of a ``ttt-flash`` call that fails with status 2 (returned or raised);
    few lines, no usage text, no traceback."""
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    assert code == 2
    err = [line for line in capsys.readouterr().err.strip().splitlines() if line.strip()]
    assert 1 <= len(err) <= most and "usage:" not in "\n".join(err) and "Traceback" not in "\n".join(err), err
    return err


def test_config_file_errors_are_one_line(tmp_path, capsys):
    recipe = (RECIPES / "maml_sinusoid.yaml").read_text()
    cases = {
        "missing.yaml": (None, "no such file"),
        "empty.yaml": ("", "is empty"),
        "folder": ("DIR", "is a folder"),
        "broken.yaml": ("model: [unclosed\n", "broken.yaml:2:1: not valid YAML"),
        "list.yaml": ("- a\n- b\n", "is not a recipe"),
        "twice.yaml": (recipe + "seed_everything: 3\n", "key 'seed_everything' at line"),
        "nested.yaml": (recipe.replace("    inner_steps: 1 ", "    inner_steps: 1\n    inner_steps: 2 ", 1),
                        "key 'model.init_args.inner_steps' at line"),
    }
    for name, (text, words) in cases.items():
        path = tmp_path / name
        if text == "DIR":
            path.mkdir()
        elif text is not None:
            path.write_text(text)
        err = _short_error(capsys, ["fit", "--config", str(path)], most=1)
        assert err[0].startswith(f"ttt-flash fit: error: --config {path}") and words in err[0], (name, err)


def test_class_path_typo_names_the_line_and_the_class(tmp_path, capsys):
    bad, line = _recipe_with(tmp_path, "class_path: ttt_flash.lightning.MAML ", "class_path: ttt_flash.lightning.MAMl ")
    err = _short_error(capsys, ["fit", "--config", str(bad)])
    assert "cannot import class_path 'ttt_flash.lightning.MAMl'" in err[0] and f"{bad}:{line}" in err[0]
    assert err[1].strip() == "closest: ttt_flash.lightning.MAML"


@pytest.mark.parametrize("old,new,key,words", [
    ("    inner_lr: 0.01 ", "    inner_lr: -0.5 ", "model.init_args.inner_lr", "inner_lr must be >= 0, got -0.5"),
    ("        hidden: 40 ", "        hidden: 0 ", "model.init_args.net.init_args.hidden", "hidden must be >= 1, got 0"),
    ("    k_shot: 10 ", "    k_shot: 0 ", "data.init_args.k_shot", "k_shot must be >= 1, got 0"),
], ids=["inner_lr", "hidden", "k_shot"])
def test_values_refused_by_a_class_name_the_key_and_line(old, new, key, words, tmp_path, capsys):
    bad, line = _recipe_with(tmp_path, old, new)
    err = _short_error(capsys, ["fit", "--config", str(bad)], most=3)
    first = next(e for e in err if "error:" in e)
    assert f"refused '{key}' in {bad}:{line}: {words}" in first, err
    # the same value on the command line is blamed on the command line
    flag = "--" + key + "=" + new.split(":")[1].strip()
    err = _short_error(capsys, ["fit", "--config", str(RECIPES / "maml_sinusoid.yaml"), flag], most=3)
    assert f"refused '{key}' in the command line" in next(e for e in err if "error:" in e)


def test_callback_and_top_level_typos_name_the_line_and_the_closest_key(tmp_path, capsys):
    bad, line = _recipe_with(tmp_path, "every_n_train_steps: 50", "every_n_train_stepz: 50")
    err = _short_error(capsys, ["fit", "--config", str(bad)])
    assert "every_n_train_stepz" in err[0] and f"{bad}:{line}" in err[0] and "every_n_train_steps" in err[1]
    bad, line = _recipe_with(tmp_path, "\nmodel:", "\nmodle:")
    err = _short_error(capsys, ["fit", "--config", str(bad)])
    assert err[0] == f"ttt-flash fit: error: unknown key 'modle' in {bad}:{line}" and err[1].endswith(": model")


def test_gpu_only_settings_are_refused_in_one_line_without_cuda(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("the no-CUDA refusal")
    recipe = str(RECIPES / "maml_sinusoid.yaml")
    err = _short_error(capsys, ["fit", "--config", recipe, "--trainer.accelerator=gpu"], most=2)
    assert "trainer.accelerator is gpu (the command line) but this machine has no CUDA GPU" in err[-1]
    assert "--smoke" in err[-1] and "--trainer.accelerator=cpu" in err[-1]
    err = _short_error(capsys, ["fit", "--config", recipe, "--model.init_args.cuda_graph=true"], most=2)
    assert "cuda_graph is true" in err[-1] and "--model.init_args.cuda_graph=false" in err[-1]
    long = RECIPES / "gradmem_kv_131k.yaml"
    line = next(n for n, row in enumerate(long.read_text().splitlines(), 1) if row.startswith("  accelerator:"))
    err = _short_error(capsys, ["fit", "--config", str(long)], most=2)
    assert f"({long}:{line})" in err[-1]


def test_fit_help_is_short_and_names_smoke_and_the_full_help(capsys):
    assert main(["fit", "--help"]) == 0
    out = capsys.readouterr().out
    assert len(out.splitlines()) < 30
    for words in ("--smoke", "--print_config", "--help-all", "--ckpt_path", '".[plot]"'):
        assert words in out, words


def test_top_level_help_and_version_do_not_import_torch():
    code = ("import sys, contextlib, io\nimport ttt_flash.cli as c\n"
            "with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n    c.main(['--help'])\n"
            "assert 'torch' not in sys.modules, 'torch imported'\nimport ttt_flash\nprint(ttt_flash.__version__)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip() == ttt_flash.__version__, r.stderr


def test_bench_help_has_no_markup(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    out = capsys.readouterr().out
    assert "``" not in out and ":func:" not in out and "create_graph=True" in out


def test_the_last_line_names_the_run_folder_checkpoint_and_plot(monkeypatch, tmp_path, capsys):
    from ttt_flash import _recipe_cli
    from ttt_flash.lightning import curves, outputs

    monkeypatch.chdir(tmp_path)
    argv = ["fit", "--config", str(RECIPES / "maml_sinusoid.yaml"), "--trainer.max_steps=2",
            "--trainer.limit_val_batches=1", "--trainer.val_check_interval=2", "--trainer.max_epochs=1"]
    assert main(argv) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1] == ("ttt-flash fit: done; run folder runs/maml_sinusoid, checkpoint "
                       "runs/maml_sinusoid/checkpoints/last.ckpt, curves runs/maml_sinusoid/val_curves.png")
    assert (tmp_path / "runs/maml_sinusoid/val_curves.png").is_file()
    # after a signal: the step and how to resume
    assert _recipe_cli.run_report(stopped="SIGTERM") == (
        "ttt-flash fit: stopped by SIGTERM at step 2; run folder runs/maml_sinusoid, checkpoint "
        "runs/maml_sinusoid/checkpoints/last.ckpt (resume: --ckpt_path last), curves runs/maml_sinusoid/val_curves.png")

    def no_matplotlib(*args, **kwargs):
        raise RuntimeError(curves.PLOT_EXTRA_MESSAGE)

    monkeypatch.setattr(outputs, "plot_curves", no_matplotlib)
    assert main([*argv, "--trainer.logger.init_args.version=again"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.endswith('no val_curves.png: pip install -e ".[plot]" (matplotlib)'), last


def test_progress_off_a_terminal_is_plain_lines(monkeypatch, tmp_path, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("ttt_flash._recipe_cli._terminal", lambda: False)
    assert main(["fit", "--config", str(RECIPES / "maml_sinusoid.yaml"), "--smoke"]) == 0
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith("step ")]
    assert lines and re.match(r"step 1/2 · [\d.]+ it/s · 0:00:\d\d · train/loss_post [\d.]+", lines[0]), out
    assert re.search(r"^validation at step 2: val/loss_post [\d.]+ · val/loss_pre [\d.]+$", out, flags=re.M), out
    assert "•" not in out  # no rich bar (its fields are separated by •)


def test_smoke_marks_its_ranks_only_while_it_runs(monkeypatch, tmp_path):
    """A --smoke run sets SMOKE_RUN_ENV for the processes Lightning's DDP launcher starts and
    restores the environment afterwards; a process with it set and a LOCAL_RANK runs as a smoke
    run (no checkpoint) although its command line has no --smoke."""
    from ttt_flash import cli

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(cli.SMOKE_RUN_ENV, raising=False)
    seen = []
    real = cli._run_cli
    monkeypatch.setattr(cli, "_run_cli", lambda *a: (seen.append(os.environ.get(cli.SMOKE_RUN_ENV)), real(*a))[1])
    assert main(["fit", "--config", str(RECIPES / "maml_sinusoid.yaml"), "--smoke"]) == 0
    assert seen == ["1"] and cli.SMOKE_RUN_ENV not in os.environ
    # a rank of that run: the smoke overrides on its command line, no --smoke, the marker set
    from ttt_flash._smoke import insert_after_configs, smoke_overrides

    recipe = str(RECIPES / "maml_sinusoid.yaml")
    argv = ["fit", *insert_after_configs(["--config", recipe], smoke_overrides([recipe])),
            "--trainer.logger.init_args.version=rank1"]
    monkeypatch.setenv(cli.SMOKE_RUN_ENV, "1")
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert main(argv) == 0
    assert not list(tmp_path.rglob("*.ckpt"))  # ran as a smoke run: no checkpoints
    assert os.environ[cli.SMOKE_RUN_ENV] == "1"  # a value set before the run is left as it was
