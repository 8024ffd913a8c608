"""scripts/ holds what a user reruns (the runners) and scripts/kernels/ what a maintainer of the
kernels reruns, each listed with its purpose in scripts/README.md; every script a doc or test
names exists; no script writes its own timing loop (ttt_flash.bench has it)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"


def _listed():
    return set(re.findall(r"^\| `([^`]+)` \| \S", (SCRIPTS / "README.md").read_text(), flags=re.M))


def _present():
    return {str(p.relative_to(SCRIPTS)) for folder in (SCRIPTS, SCRIPTS / "kernels") for p in folder.iterdir()
            if p.suffix in (".py", ".sh")}


def test_every_script_is_listed_with_a_purpose():
    present = _present()
    assert "kernels/chain_ab.py" in present and "house_ab.py" in present
    listed = _listed()
    assert present - listed == set(), f"scripts without a line in scripts/README.md: {sorted(present - listed)}"
    assert listed - present == set(), f"scripts/README.md lists missing scripts: {sorted(listed - present)}"


#: docs/benchmarks.md is the log of past runs, with the commands of their time.
NOT_CHECKED = {ROOT / "docs" / "benchmarks.md"}


def test_every_named_script_exists():
    # a script named by a guide, a test, a recipe or the code (`scripts/NAME.py`) is kept
    missing = []
    paths = [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]
    for folder in ("tests", "recipes", "ttt_flash", "kernels", "models", "scripts"):
        paths += [p for p in (ROOT / folder).rglob("*") if p.suffix in (".py", ".yaml", ".sh")]
    for path in paths:
        if path in NOT_CHECKED or path == Path(__file__):
            continue
        for name in re.findall(r"scripts/((?:kernels/)?\w+\.(?:py|sh))", path.read_text(errors="replace")):
            if not (SCRIPTS / name).exists():
                missing.append(f"{path.relative_to(ROOT)} names scripts/{name}")
    assert not missing, "\n".join(missing)


@pytest.mark.parametrize("script, args, message", [
    ("graph_bench.py", ["OUT", "--parts", "lm_module", "--lm-shapes", "1x"], "--lm-shapes: BATCHxSEQ_LEN pairs"),
    ("graph_bench.py", ["OUT", "--lm-shapes", "8x2048x3"], "--lm-shapes: BATCHxSEQ_LEN pairs"),
    ("kernels/host_phases.py", ["--out", "OUT", "--shapes", "1x1024,2x"], "--shapes takes BxN items"),
    ("kernels/host_phases.py", ["--out", "OUT", "--shapes", "0x1024c"], "--shapes takes BxN items"),
    ("kernels/launch_host.py", ["--out", "OUT", "--shapes", "1x1024,2x"], "--shapes takes BxN items"),
    ("kernels/host_phases.py", ["--out", "OUT", "--modes", "calling,thread"], "--modes takes calling and/or threads"),
    ("kernels/host_engine.py", ["OUT", "--sdp"], "at most one part, one of --sdpa, --floor, --jitter; got '--sdp'"),
    ("kernels/host_engine.py", ["--floor"], "OUT, the output folder, comes first"),
])
def test_shape_arguments_refuse_bad_values_before_any_work(script, args, message, tmp_path):
    # checked before the GPU is asked for, with the argument named and an example of the form
    args = [str(tmp_path) if a == "OUT" else a for a in args]
    out = subprocess.run([sys.executable, str(SCRIPTS / script), *args], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    assert out.returncode != 0
    assert message in out.stderr and "Traceback" not in out.stderr


def test_no_script_writes_its_own_timing_loop():
    # CUDA events and the chain's timing live in ttt_flash/bench/common.py (event_times, burst_ms)
    bad = [str(p.relative_to(ROOT)) for p in sorted(SCRIPTS.rglob("*.py"))
           if "Event(enable_timing" in p.read_text()]
    assert not bad, f"scripts timing with their own CUDA events (use ttt_flash.bench.common): {bad}"


def _prof_lm_step(*args):
    return subprocess.run([sys.executable, str(SCRIPTS / "prof_lm_step.py"), *args], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)


def test_prof_lm_step_parses_its_arguments_and_needs_cuda(tmp_path):
    out = _prof_lm_step("--help")
    assert out.returncode == 0 and "--out" in out.stdout and "--modes" in out.stdout
    out = _prof_lm_step("--out", str(tmp_path), "--shape", "1x")
    assert out.returncode != 0 and "BATCHxSEQ_LEN" in out.stderr and "Traceback" not in out.stderr
    out = _prof_lm_step("--out", str(tmp_path), "--modes", "eager,fast")
    assert out.returncode != 0 and "comma-separated modes" in out.stderr
    if not torch.cuda.is_available():
        out = _prof_lm_step("--out", str(tmp_path / "o"))
        assert out.returncode == 1 and "Traceback" not in out.stderr
        assert out.stderr.strip().splitlines() == ["prof_lm_step.py needs a CUDA GPU (it profiles the GPU training "
                                                   "step); torch sees none"]
        assert not (tmp_path / "o").exists()


def test_prof_lm_step_builds_the_recipe_module(tmp_path):
    sys.path.insert(0, str(SCRIPTS))
    try:
        import prof_lm_step
    finally:
        sys.path.remove(str(SCRIPTS))
    model, data, kw = prof_lm_step.build(str(ROOT / "recipes" / "sophia_gpt.yaml"), (1, 1024), 60, True, str(tmp_path))
    assert model.hparams.cuda_graph is True and model.hparams.optimizer == "sophiah" and model.hparams.hessian_every == 10
    assert model.gpt_config.n_layer == 12 and model.gpt_config.attention == "ttt_flash"
    assert (data.hparams.seq_len, data.hparams.batch_size, data.hparams.train_batches) == (1024, 1, 60)
    assert kw["precision"] == "bf16-mixed" and kw["gradient_clip_val"] == 1.0


def _lm_step_kernels(*args):
    return subprocess.run([sys.executable, str(SCRIPTS / "lm_step_kernels.py"), *args], capture_output=True,
                          text=True, timeout=120, cwd=ROOT)


def test_lm_step_kernels_census_splits_a_trace_into_steps_and_phases(tmp_path):
    """--census on a made-up trace: two runs of kernels apart by idle stream are two steps; the
    longer is the refresh; phases end at the loss kernel and at the first multi-tensor kernel."""
    import gzip
    import json

    def step(t0, names):
        return [{"cat": "kernel", "name": n, "ts": t0 + 10 * i, "dur": 5} for i, n in enumerate(names)]

    plain = ["gemm_a"] * 300 + ["nll_loss_forward"] + ["elementwise_kernel"] * 400 + ["multi_tensor_apply"] * 3
    refresh = ["gemm_a"] * 300 + ["softmax"] + ["elementwise_kernel"] * 900 + ["multi_tensor_apply"] * 5
    events = step(0, plain) + step(100_000, refresh) + [{"cat": "cpu_op", "name": "aten::mm", "ts": 1, "dur": 1}]
    trace = tmp_path / "graph.json.gz"
    with gzip.open(trace, "wt") as f:
        json.dump({"traceEvents": events}, f)
    out = _lm_step_kernels("--census", str(trace))
    assert out.returncode == 0, out.stderr
    census = json.loads(out.stdout)
    assert census["plain"]["kernels"] == 704 and census["refresh"]["kernels"] == 1206
    assert census["plain"]["phases"]["forward"]["kernels"] == 300
    assert census["plain"]["phases"]["backward"]["kernels"] == 401
    assert census["refresh"]["phases"]["clipping and optimizer"]["kernels"] == 5
    assert census["plain"]["by_kind"]["matmul"]["kernels"] == 300


def test_lm_step_kernels_needs_an_out_folder_or_a_trace_and_names_the_gpu():
    out = _lm_step_kernels()
    assert out.returncode == 2 and "give OUT" in out.stderr and "Traceback" not in out.stderr
    if not torch.cuda.is_available():
        out = _lm_step_kernels("somewhere")
        assert out.returncode == 2 and "needs a CUDA GPU" in out.stderr and "--census" in out.stderr
