"""Second-order vs first-order memory writes in MAML over a gradient-memory network, several seeds.

Runs recipes/maml_memory_layer.yaml (CPU) once per seed and write order:

  exact        first_order=false (the network's): the writes keep their graph, the meta-gradient is the
               exact third derivative through attention
  first_order  first_order=true (the network's): the write gradients are constants (MAML stays second
               order everywhere else)

Each run seeds the weights and the tasks with the seed. Reads every run's CSV log and reports
the last validation losses before (loss_pre) and after (loss_post) adaptation, and the mean of
the last 20 training loss_post values; prints a table and writes OUT/results.json: the script's
command, each run's ``ttt-flash fit`` command and numbers, and per write order the mean and
sample standard deviation over the seeds (docs/memory.md quotes these; tests/test_docs.py checks
them against docs/results/maml_memory_layer_seeds_cpu.json).

    python scripts/maml_memory_layer_seeds.py --seeds 0,1,2 --out runs/maml_memory_layer_seeds
    python scripts/maml_memory_layer_seeds.py --out runs/mm_chunk4 -- --model.init_args.net.init_args.chunk_size=4

Arguments after ``--`` are passed to every ``ttt-flash fit`` run (recipe overrides).
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RECIPE = ROOT / "recipes" / "maml_memory_layer.yaml"


def _read(metrics: Path) -> dict:
    rows = list(csv.DictReader(metrics.open()))

    def last(key):
        vals = [float(r[key]) for r in rows if r.get(key) not in (None, "")]
        return vals[-1] if vals else float("nan")

    train = [float(r["train/loss_post"]) for r in rows if r.get("train/loss_post") not in (None, "")]
    return {
        "val_loss_pre": last("val/loss_pre"),
        "val_loss_post": last("val/loss_post"),
        "train_loss_post_last20": statistics.fmean(train[-20:]) if train else float("nan"),
    }


def main(argv=None) -> int:
    from ttt_flash.cli import main as cli

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="0,1,2", help="comma-separated seeds")
    ap.add_argument("--out", required=True, help="folder for the runs' logs and results.json")
    ap.add_argument("--max-epochs", type=int, default=None, help="override trainer.max_epochs")
    argv = sys.argv[1:] if argv is None else list(argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    args = ap.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for seed in (int(s) for s in args.seeds.split(",")):
        for name, first_order in (("exact", "false"), ("first_order", "true")):
            version = f"{name}_seed{seed}"
            start = time.perf_counter()
            argv_run = [
                "fit", "--config", str(RECIPE), f"--seed_everything={seed}", f"--data.init_args.seed={seed}",
                f"--model.init_args.net.init_args.first_order={first_order}",
                f"--trainer.logger.init_args.save_dir={out}", f"--trainer.logger.init_args.version={version}",
                f"--trainer.default_root_dir={out}", "--trainer.enable_progress_bar=false",
                "--trainer.callbacks=[]", "--trainer.enable_checkpointing=false",
            ]
            argv_run += extra
            if args.max_epochs is not None:
                argv_run.append(f"--trainer.max_epochs={args.max_epochs}")
            shown = [a.replace(str(RECIPE), "recipes/maml_memory_layer.yaml").replace(str(out), args.out)
                     for a in argv_run]
            code = cli(argv_run)
            if code not in (0, None):
                print(f"run {version} failed with exit code {code}", file=sys.stderr)
                return 1
            row = {"seed": seed, "writes": name, "command": f"OMP_NUM_THREADS=1 {shlex.join(['ttt-flash', *shown])}",
                   "wall_s": round(time.perf_counter() - start, 1), **_read(out / version / "metrics.csv")}
            results.append(row)
    import torch

    summary = {}
    for name in ("exact", "first_order"):
        runs = [r for r in results if r["writes"] == name]
        summary[name] = {k: statistics.fmean(r[k] for r in runs) for k in ("val_loss_pre", "val_loss_post")}
        if len(runs) > 1:
            summary[name]["val_loss_post_stdev"] = statistics.stdev(r["val_loss_post"] for r in runs)
    summary["exact_minus_first_order_val_loss_post"] = (summary["exact"]["val_loss_post"]
                                                        - summary["first_order"]["val_loss_post"])
    command = f"OMP_NUM_THREADS=1 python scripts/maml_memory_layer_seeds.py {shlex.join(argv)}"
    (out / "results.json").write_text(json.dumps(
        {"command": command, "date": datetime.date.today().isoformat(),
         "machine": f"{platform.machine()}, {os.cpu_count()} cores", "torch": torch.__version__,
         "overrides": extra, "runs": results, "summary": summary}, indent=1))
    print(f"\n{'seed':>4} {'writes':>12} {'val pre':>9} {'val post':>9} {'train post (last 20)':>21} {'wall s':>7}")
    for r in results:
        print(f"{r['seed']:>4} {r['writes']:>12} {r['val_loss_pre']:9.4f} {r['val_loss_post']:9.4f} "
              f"{r['train_loss_post_last20']:21.4f} {r['wall_s']:7.1f}")
    for name in ("exact", "first_order"):
        post = [r["val_loss_post"] for r in results if r["writes"] == name]
        print(f"mean val post, {name}: {statistics.fmean(post):.4f} over {len(post)} seeds")
    return 0


if __name__ == "__main__":
    sys.exit(main())
