"""Run a CPU recipe as the docs quote it and keep what it measured in docs/results/.

    python scripts/cpu_recipe_results.py --recipe maml_sinusoid --test --out docs/results/cpu_maml_sinusoid.json
    python scripts/cpu_recipe_results.py --recipe imaml_regression --seed 1 --out docs/results/cpu_imaml_regression_seed1.json
    python scripts/cpu_recipe_results.py --recipe sophia_gpt_tiny --arg=--model.init_args.optimizer=adamw \
        --out docs/results/cpu_sophia_gpt_tiny_adamw.json

Runs ``OMP_NUM_THREADS=1 ttt-flash fit --config recipes/NAME.yaml`` (and, with ``--test``,
``ttt-flash test ... --ckpt_path last``) in a fresh working folder, and writes a JSON file
with the exact commands, the date, the versions, the wall time, every validation row of the
run's metrics.csv (step and ``val/...`` metrics), every logged training row (``train/...``),
the largest value of each training metric and the test metrics. The numbers the docs
quote from CPU recipes come from these files (tests/test_docs.py checks it).
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _rows(metrics_csv: Path, prefix: str):
    """Rows of ``metrics_csv`` that carry a ``prefix`` metric: {"step": S, name: value, ...}."""
    out = []
    with open(metrics_csv) as f:
        for row in csv.DictReader(f):
            values = {k: float(v) for k, v in row.items() if k.startswith(prefix) and v not in ("", None)}
            if values:
                out.append({"step": int(float(row.get("step") or 0)), **values})
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipe", required=True, help="recipe name in recipes/ (without .yaml)")
    p.add_argument("--seed", type=int, default=None,
                   help="--seed_everything and --data.init_args.seed (default: the recipe's)")
    p.add_argument("--arg", action="append", default=[], metavar="ARG",
                   help="one more ttt-flash argument for every command, e.g. --arg=--model.init_args.optimizer=adamw "
                        "(repeatable)")
    p.add_argument("--test", action="store_true", help="also run `ttt-flash test --ckpt_path last`")
    p.add_argument("--untrained", action="store_true",
                   help="also run `ttt-flash validate` on the initial weights first (its own run folder)")
    p.add_argument("--out", required=True, help="JSON file to write")
    a = p.parse_args(argv)

    recipe = ROOT / "recipes" / f"{a.recipe}.yaml"
    if not recipe.is_file():
        p.error(f"--recipe {a.recipe}: no recipes/{a.recipe}.yaml")
    bad = [x for x in a.arg if not x.startswith("--")]
    if bad:
        p.error(f"--arg {bad[0]}: expected a ttt-flash option such as --arg=--model.init_args.optimizer=adamw")
    extra = [] if a.seed is None else [f"--seed_everything={a.seed}", f"--data.init_args.seed={a.seed}"]
    extra += a.arg
    fit = ["ttt-flash", "fit", "--config", f"recipes/{a.recipe}.yaml", *extra]
    test = ["ttt-flash", "test", "--config", f"recipes/{a.recipe}.yaml", *extra, "--ckpt_path", "last"]
    untrained = ["ttt-flash", "validate", "--config", f"recipes/{a.recipe}.yaml", *extra,
                 "--trainer.logger.init_args.version=untrained"]
    exe = str(Path(sys.executable).with_name("ttt-flash"))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = {"recipe": a.recipe, "seed": a.seed,
              "commands": [f"OMP_NUM_THREADS=1 {shlex.join(c)}" for c in
                           [*([untrained] if a.untrained else []), fit, *([test] if a.test else [])]],
              "date": datetime.date.today().isoformat(), "machine": f"{platform.machine()}, {os.cpu_count()} cores"}
    import torch

    result["torch"] = torch.__version__
    with tempfile.TemporaryDirectory() as work:
        os.symlink(ROOT / "recipes", Path(work) / "recipes")
        if a.untrained:
            subprocess.run([exe, *untrained[1:]], cwd=work, env=env, check=True, stdout=subprocess.DEVNULL)
            rows = _rows(Path(work, "runs", "untrained", "metrics.csv"), "val/")
            result["untrained"] = rows[-1] if rows else {}
        t0 = time.perf_counter()
        subprocess.run([exe, *fit[1:]], cwd=work, env=env, check=True, stdout=subprocess.DEVNULL)
        result["fit_wall_s"] = round(time.perf_counter() - t0, 1)
        folder = next(p for p in Path(work, "runs").glob("*/metrics.csv") if p.parent.name != "untrained").parent
        result["validations"] = _rows(folder / "metrics.csv", "val/")
        result["train"] = _rows(folder / "metrics.csv", "train/")
        result["train_max"] = {}
        for row in result["train"]:
            for k, v in row.items():
                if k != "step":
                    result["train_max"][k] = max(v, result["train_max"].get(k, v))
        if a.test:
            subprocess.run([exe, *test[1:]], cwd=work, env=env, check=True, stdout=subprocess.DEVNULL)
            tests = _rows(folder / "metrics.csv", "test/")
            result["test"] = tests[-1] if tests else {}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: result[k] for k in ("recipe", "seed", "fit_wall_s")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
