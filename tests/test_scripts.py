"""scripts/ holds what a user or a maintainer reruns, each listed with its purpose in
scripts/README.md, and every script a doc or test names exists."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"


def _listed():
    return set(re.findall(r"^\| `([^`]+)` \| \S", (SCRIPTS / "README.md").read_text(), flags=re.M))


def test_every_script_is_listed_with_a_purpose():
    present = {p.name for p in SCRIPTS.iterdir() if p.suffix in (".py", ".sh")}
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
        for name in re.findall(r"scripts/(\w+\.(?:py|sh))", path.read_text(errors="replace")):
            if not (SCRIPTS / name).exists():
                missing.append(f"{path.relative_to(ROOT)} names scripts/{name}")
    assert not missing, "\n".join(missing)


@pytest.mark.parametrize("script, args, message", [
    ("graph_bench.py", ["OUT", "--parts", "lm_module", "--lm-shapes", "1x"], "--lm-shapes: BATCHxSEQ_LEN pairs"),
    ("graph_bench.py", ["OUT", "--lm-shapes", "8x2048x3"], "--lm-shapes: BATCHxSEQ_LEN pairs"),
    ("host_phases.py", ["--out", "OUT", "--shapes", "1x1024,2x"], "--shapes takes BxN items"),
    ("host_phases.py", ["--out", "OUT", "--shapes", "0x1024c"], "--shapes takes BxN items"),
])
def test_shape_arguments_refuse_bad_values_before_any_work(script, args, message, tmp_path):
    # checked before the GPU is asked for, with the argument named and an example of the form
    args = [str(tmp_path) if a == "OUT" else a for a in args]
    out = subprocess.run([sys.executable, str(SCRIPTS / script), *args], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    assert out.returncode != 0
    assert message in out.stderr and "Traceback" not in out.stderr
