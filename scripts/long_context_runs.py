"""Method and baseline of the four long-context recipes (recipes/*_long.yaml) in one go, several
runs per GPU at once, then one PNG of validation curves per recipe and the table of
docs/long-context.md.

    python3 scripts/long_context_runs.py --out DIR                 # all runs on 2 GPUs (~8 minutes)
    python3 scripts/long_context_runs.py --out DIR --tiny          # the same plan on the CPU, tiny shapes, one at a time
    python3 scripts/long_context_runs.py --out DIR --summarize-only  # table and PNGs from DIR/runs again
    python3 scripts/long_context_runs.py --out DIR --only memlayer,memlayer_base  # a subset of the runs, at once

Every run is ``ttt-flash fit --config recipes/<recipe>_long.yaml`` with its CSV log under
``DIR/runs/<name>/`` plus the run's own overrides: the baselines switch the method's update
off (``inner_steps=0``; first-order for MAML), same steps and seed; the variants are the other
configurations tried. ``--max-time`` caps every run (Lightning's ``max_time``: it stops with a
last validation); ``--deadline`` stops (SIGTERM, then SIGKILL) whatever still runs so that the
summary is always written. Writes DIR/<recipe>.png, DIR/summary.json, DIR/table.md and
DIR/long_context.tar.gz (logs, CSVs, PNGs, summary), and prints the table last.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/_runs.py, also when loaded by path
from _runs import curve, stop_runs  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Recipe:
    key: str
    file: str
    title: str
    metric: str  # the validation metric compared between method and baseline
    kind: str  # "acc" (higher is better, against chance) or "maml" (loss, pre vs post)
    tiny: List[str] = field(default_factory=list)  # CPU overrides of --tiny

    def chance(self) -> Optional[float]:
        if self.kind != "acc":
            return None
        data = yaml.safe_load((ROOT / "recipes" / self.file).read_text())["data"]["init_args"]
        return 1.0 / data["num_values"]

    def context(self) -> int:
        data = yaml.safe_load((ROOT / "recipes" / self.file).read_text())["data"]["init_args"]
        return int(data.get("context_len") or data.get("seq_len"))


@dataclass
class Run:
    name: str
    recipe: str
    role: str  # "method", "baseline" or "variant"
    gpu: int
    overrides: List[str] = field(default_factory=list)
    label: str = ""


_TINY_COMMON = ["--trainer.accelerator=cpu", "--trainer.max_steps=4", "--trainer.val_check_interval=2",
                "--data.init_args.val_batches=1", "--trainer.log_every_n_steps=1"]

RECIPES: Dict[str, Recipe] = {r.key: r for r in [
    Recipe("ttt", "ttt_e2e_mqar_long.yaml", "TTT-E2E MQAR", "val/acc_post", "acc",
           ["--model.init_args.net.init_args.model.attention=math", "--model.init_args.net.init_args.chunk_size=16", "--model.init_args.net.init_args.model.window=4",
            "--data.init_args.context_len=64", "--data.init_args.curriculum=[[0,32],[2,64]]",
            "--data.init_args.batch_size=2"]),
    Recipe("gradmem", "gradmem_kv_long.yaml", "GradMem KV retrieval", "val/acc_post", "acc",
           ["--trainer.precision=32-true", "--model.init_args.net.init_args.model.attention=math", "--data.init_args.context_len=64",
            "--data.init_args.curriculum=[[0,16],[2,64]]", "--data.init_args.batch_size=2"]),
    Recipe("memlayer", "memory_layer_mqar_long.yaml", "GradientMemoryAttention MQAR", "val/acc_post", "acc",
           ["--model.init_args.net.init_args.attention=math", "--model.init_args.net.init_args.chunk_size=16",
            "--model.init_args.net.init_args.memory_slots=8", "--data.init_args.context_len=64",
            "--data.init_args.curriculum=[[0,32],[2,64]]", "--data.init_args.batch_size=2"]),
    Recipe("maml", "maml_transformer_long.yaml", "MAML in-context regression", "val/loss_post", "maml",
           ["--model.init_args.net.attention=math", "--data.init_args.seq_len=32",
            "--data.init_args.curriculum=[[0,16],[2,32]]"]),
]}

OFF = ["--model.init_args.net.init_args.inner_steps=0"]

# GPU 0 holds second-order MAML (compute-bound, float32) and small launch-bound runs; GPU 1
# holds GradMem (compute-bound: full attention at 32,768), first-order MAML and the memory
# layer's runs.
RUNS: List[Run] = [
    Run("maml", "maml", "method", 0, [], "second order"),
    Run("maml_fo", "maml", "baseline", 1, ["--model.init_args.first_order=true"], "first order"),
    Run("ttt", "ttt", "method", 0, [], "inner_steps 1"),
    Run("ttt_base", "ttt", "baseline", 0, OFF, "inner_steps 0"),
    Run("gradmem", "gradmem", "method", 1, [], "inner_steps 1"),
    Run("gradmem_base", "gradmem", "baseline", 0, OFF, "inner_steps 0"),
    Run("memlayer", "memlayer", "method", 1, [], "inner_steps 1"),
    Run("memlayer_base", "memlayer", "baseline", 0, OFF, "inner_steps 0"),
    Run("memlayer_grad", "memlayer", "variant", 1,
        ["--model.init_args.net.init_args.write_rule=gradient"], "plain gradient write"),
]


def command(run: Run, runs_dir: Path, max_time: str, tiny: bool) -> List[str]:
    recipe = RECIPES[run.recipe]
    cmd = [sys.executable, "-m", "ttt_flash.cli", "fit", "--config", str(ROOT / "recipes" / recipe.file),
           f"--trainer.logger.init_args.save_dir={runs_dir}", f"--trainer.logger.init_args.version={run.name}",
           "--trainer.logger.init_args.flush_logs_every_n_steps=10", "--trainer.enable_progress_bar=false",
           f"--trainer.max_time={max_time}", *run.overrides]
    if tiny:
        cmd += _TINY_COMMON + recipe.tiny
    return cmd


def launch(runs: List[Run], out: Path, max_time: str, deadline_s: float, tiny: bool) -> Dict[str, dict]:
    """Start the runs (all at once on GPUs; one at a time with ``tiny``), wait, return
    {name: {"rc", "wall_s"}}; runs still going at the deadline get SIGTERM, then SIGKILL."""
    runs_dir = out / "runs"
    runs_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    results: Dict[str, dict] = {}
    procs = {}

    def start(run: Run):
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"))
        if not tiny:
            env["CUDA_VISIBLE_DEVICES"] = str(run.gpu)
        log = open(out / f"{run.name}.log", "w")
        print(f"[{time.monotonic() - t0:6.0f}s] start {run.name} (GPU {run.gpu})" if not tiny else
              f"[{time.monotonic() - t0:6.0f}s] start {run.name}", flush=True)
        proc = subprocess.Popen(command(run, runs_dir, max_time, tiny), cwd=ROOT, env=env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        procs[run.name] = (proc, time.monotonic(), log)

    def reap(block: bool) -> None:
        for name, (proc, started, log) in list(procs.items()):
            rc = proc.wait() if block else proc.poll()
            if rc is None:
                continue
            log.close()
            results[name] = {"rc": rc, "wall_s": round(time.monotonic() - started, 1)}
            print(f"[{time.monotonic() - t0:6.0f}s] {name} exited {rc} after {results[name]['wall_s']} s", flush=True)
            del procs[name]

    pending = list(runs)
    while pending or procs:
        while pending and (not tiny or not procs):
            start(pending.pop(0))
        reap(block=False)
        if time.monotonic() - t0 > deadline_s:
            stop_runs(procs, grace_s=15)
            reap(block=True)
            break
        time.sleep(1)
    return results


def _steps_and_step_time(csv: Path, length: int):
    """(optimizer steps run, median train/step_time_s at the final length)."""
    from ttt_flash.lightning.curves import read_curve

    try:
        steps, times = read_curve(csv, "train/step_time_s")
    except (FileNotFoundError, KeyError):
        return 0, None
    lengths = {}
    for column in ("train/context_len", "train/seq_len"):
        try:
            s, v = read_curve(csv, column)
            lengths.update(zip(s, v))
        except KeyError:
            pass
    at_length = sorted(t for s, t in zip(steps, times) if lengths.get(s) == length)
    median = at_length[len(at_length) // 2] if at_length else None
    return (max(steps) + 1 if steps else 0), median


def summarize(out: Path, runs: List[Run], results: Dict[str, dict]) -> dict:
    """Table rows, verdicts and PNGs from the runs' CSV logs; returns the summary dict."""
    from ttt_flash.lightning.curves import Series, plot_curves

    runs_dir = out / "runs"
    summary = {"runs": {}, "recipes": {}}
    for run in runs:
        recipe = RECIPES[run.recipe]
        csv = runs_dir / run.name / "metrics.csv"
        steps, step_time = _steps_and_step_time(csv, recipe.context())
        vsteps, values = curve(csv, recipe.metric)
        _, pre = curve(csv, "val/loss_pre" if recipe.kind == "maml" else "val/acc_pre")
        summary["runs"][run.name] = {
            "recipe": run.recipe, "role": run.role, "label": run.label, "overrides": run.overrides,
            "steps": steps, "median_step_s_at_final_length": step_time,
            "wall_s": results.get(run.name, {}).get("wall_s"), "rc": results.get(run.name, {}).get("rc"),
            "val_steps": vsteps, "val": values, "val_pre": pre,
        }
    for key, recipe in RECIPES.items():
        mine = [r for r in runs if r.recipe == key]
        method = next((r for r in mine if r.role == "method"), None)
        base = next((r for r in mine if r.role == "baseline"), None)
        if method is None:
            continue
        m = summary["runs"][method.name]
        b = summary["runs"][base.name] if base else {"val": [], "val_pre": []}
        entry = {"title": recipe.title, "context": recipe.context(), "metric": recipe.metric,
                 "method": m["val"][-1] if m["val"] else None, "baseline": b["val"][-1] if b["val"] else None}
        if recipe.kind == "acc":
            chance = recipe.chance()
            entry["chance"] = chance
            entry["met"] = (entry["method"] is not None and entry["baseline"] is not None
                            and entry["method"] >= 10 * chance and entry["method"] > entry["baseline"])
        else:
            entry["pre"] = m["val_pre"][-1] if m["val_pre"] else None
            entry["met"] = (entry["method"] is not None and entry["pre"] is not None and entry["baseline"] is not None
                            and entry["method"] <= 0.7 * entry["pre"] and entry["method"] <= entry["baseline"])
        series = [Series(f"{r.label} ({r.role})", str(runs_dir / r.name / "metrics.csv"), recipe.metric,
                         "-" if r.role == "method" else "--" if r.role == "baseline" else ":")
                  for r in mine if summary["runs"][r.name]["val"]]
        if recipe.kind == "maml" and m["val_pre"]:
            series.append(Series("second order, before adaptation", str(runs_dir / method.name / "metrics.csv"),
                                 "val/loss_pre", "-."))
        png = out / f"{recipe.file.replace('.yaml', '')}.png"
        if series:
            try:
                plot_curves(png, series, title=f"{recipe.title}, {recipe.context():,} tokens (validation)",
                            ylabel=recipe.metric, chance=entry.get("chance"), logy=recipe.kind == "maml")
                entry["png"] = png.name
            except RuntimeError as e:  # matplotlib missing: say so, keep the table
                print(e, flush=True)
        summary["recipes"][key] = entry
    return summary


def table(summary: dict) -> str:
    rows = ["| recipe | context | run | steps | wall | median step at length | val metric | chance / pre |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for key, entry in summary["recipes"].items():
        for name, run in summary["runs"].items():
            if run["recipe"] != key:
                continue
            value = run["val"][-1] if run["val"] else None
            ref = (f"{entry['chance']:.4f}" if entry.get("chance") is not None else
                   f"pre {run['val_pre'][-1]:.4f}" if run["val_pre"] else "")
            st = run["median_step_s_at_final_length"]
            rows.append(
                f"| {entry['title']} | {entry['context']:,} | {name} ({run['label']}, {run['role']}) | {run['steps']} | "
                f"{run['wall_s']} s | {'' if st is None else f'{st:.3f} s'} | "
                f"{entry['metric']} {'—' if value is None else f'{value:.4f}'} | {ref} |")
    rows.append("")
    for key, entry in summary["recipes"].items():
        rows.append(f"{entry['title']}: method {entry['method']} vs baseline {entry['baseline']}"
                    + (f" (chance {entry['chance']:.4f}, target >= {10 * entry['chance']:.4f})" if entry.get("chance")
                       else f" (pre {entry.get('pre')}, target post <= 0.7 pre and <= first order)")
                    + f": {'MET' if entry['met'] else 'NOT MET'}")
    return "\n".join(rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="folder for runs/, logs, PNGs, summary, tarball")
    p.add_argument("--max-time", default="00:00:07:00", help="Lightning max_time of every run (DD:HH:MM:SS)")
    p.add_argument("--deadline", type=float, default=480.0, help="seconds after which unfinished runs are stopped")
    p.add_argument("--only", default="", help="comma-separated run names (default: all)")
    p.add_argument("--tiny", action="store_true", help="CPU, tiny shapes, 4 steps, one run at a time (a dry run)")
    p.add_argument("--summarize-only", action="store_true", help="no runs: summarize DIR/runs")
    a = p.parse_args(argv)
    runs = [r for r in RUNS if not a.only or r.name in a.only.split(",")]
    a.out.mkdir(parents=True, exist_ok=True)
    results = {}
    if not a.summarize_only:
        results = launch(runs, a.out, a.max_time, a.deadline, a.tiny)
        (a.out / "results.json").write_text(json.dumps(results, indent=1))
    elif (a.out / "results.json").is_file():
        results = json.loads((a.out / "results.json").read_text())
    summary = summarize(a.out, runs, results)
    (a.out / "summary.json").write_text(json.dumps(summary, indent=1))
    text = table(summary)
    (a.out / "table.md").write_text(text + "\n")
    with tarfile.open(a.out / "long_context.tar.gz", "w:gz") as tar:
        for path in sorted(a.out.rglob("*")):
            if path.is_file() and path.suffix in (".csv", ".log", ".png", ".json", ".md", ".yaml"):
                tar.add(path, arcname=str(path.relative_to(a.out)))
    print(text, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
