"""A long-context recipe over several seeds: method and baseline per seed, min / median / max of
the target metric, and whether the target holds for the worst seed.

    python3 scripts/seed_runs.py --recipe recipes/ttt_e2e_mqar_131k.yaml --out DIR             # seeds 0, 1, 2 on GPU 0
    python3 scripts/seed_runs.py --recipe recipes/*_131k.yaml --out DIR --gpus 0,1,2,3,4,5,6,7  # every 131K recipe, a queue per GPU
    python3 scripts/seed_runs.py --recipe recipes/*_long.yaml --out DIR --gpus 0,1 --per-gpu 3  # the 32K recipes, 3 runs per GPU
    python3 scripts/seed_runs.py --recipe recipes/*_131k.yaml --out DIR --probe                 # step time and memory at the full length only
    python3 scripts/seed_runs.py --recipe recipes/*_131k.yaml --out DIR --probe --roles method --probe-steps 2  # the cheapest probe
    python3 scripts/seed_runs.py --recipe recipes/ttt_e2e_mqar_131k.yaml --out DIR --tiny       # the same plan on the CPU, tiny shapes
    python3 scripts/seed_runs.py --recipe recipes/ttt_e2e_mqar_131k.yaml --out DIR --tiny --in-process  # no process per run
    python3 scripts/seed_runs.py --recipe recipes/*_131k.yaml --out DIR --gpus 0,1 --deadline 540 --resume  # again: continue
    python3 scripts/seed_runs.py --recipe recipes/ttt_e2e_mqar_131k.yaml --out DIR --summarize-only
    python3 scripts/seed_runs.py --recipe recipes/maml_transformer_131k.yaml --out DIR --set trainer.precision=bf16-mixed  # an override of every run

Every run is ``ttt-flash fit --config RECIPE --seed_everything S --data.init_args.seed S`` (seed
S seeds the weights and the data), its CSV log under ``DIR/runs/<recipe>_s<S>/``; the baseline
``DIR/runs/<recipe>_base_s<S>/`` is the same run with the method's update switched off
(``inner_steps=0``; ``first_order=true`` for MAML), same steps and seed. The targets
(docs/long-context.md): query accuracy >= 10 x chance and above the same seed's baseline; for
MAML the post-adaptation loss <= 0.7 x the pre-adaptation loss and <= the same seed's first-order
loss. A recipe meets them when every seed does, i.e. the target holds for the minimum.

Runs start as GPU slots free up (``--gpus`` x ``--per-gpu`` slots; one at a time on the CPU
with ``--tiny``). ``--max-time`` replaces the recipes' own time cap (Lightning's ``max_time``,
which stops with a last validation). ``--deadline`` stops (SIGTERM, then SIGKILL) whatever
still runs, so that the summary is always written: a stopped run writes its ``last.ckpt``
first, and ``--resume`` continues it (and skips the runs that finished; ``max_time`` counts the
time already trained), so runs longer than one call can be split over calls. ``--probe`` runs
each recipe's method and baseline for a few steps at its final length only (no validation), to
check the recipe's time budget before the full runs.
Writes DIR/seeds.json (every run's curve, steps, step time and peak memory; per recipe the
values per seed, min / median / max and the verdicts), DIR/seeds.md, and prints the table last.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))  # scripts/_runs.py, also when loaded by path
from _runs import curve, stop_runs  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent

_MAML = "ttt_flash.lightning.MAML"
_TINY_COMMON = ["--trainer.accelerator=cpu", "--trainer.precision=32-true", "--trainer.max_steps=4",
                "--trainer.val_check_interval=2", "--data.init_args.val_batches=1", "--trainer.log_every_n_steps=1"]
# Tiny CPU shapes per model class (the curriculum's last stage starts at step 2, so both stages run).
_TINY = {
    "ttt_flash.lightning.memory.TTTE2EMQAR": [
        "--model.init_args.net.init_args.model.attention=math", "--model.init_args.net.init_args.chunk_size=16", "--model.init_args.net.init_args.model.window=4",
        "--data.init_args.context_len=64", "--data.init_args.curriculum=[[0,32],[2,64]]",
        "--data.init_args.batch_size=2"],
    "ttt_flash.lightning.memory.GradMemKV": [
        "--model.init_args.net.init_args.model.attention=math", "--data.init_args.context_len=64",
        "--data.init_args.curriculum=[[0,16],[2,64]]", "--data.init_args.batch_size=2"],
    "ttt_flash.lightning.memory.MemoryLayerMQAR": [
        "--model.init_args.net.init_args.attention=math", "--model.init_args.net.init_args.chunk_size=16", "--model.init_args.net.init_args.memory_slots=8",
        "--data.init_args.context_len=64", "--data.init_args.curriculum=[[0,32],[2,64]]",
        "--data.init_args.batch_size=2"],
    _MAML: ["--model.init_args.net.attention=math", "--data.init_args.seq_len=32",
            "--data.init_args.curriculum=[[0,16],[2,32]]"],
}
PROBE_STEPS = 3  # default steps per probe run; the first (Triton compilation, autotuning) is left out of the median


@dataclass
class Recipe:
    """What the runner needs to know of one recipe file."""

    path: Path
    name: str
    model_class: str
    kind: str  # "acc" (query accuracy against chance) or "maml" (query loss, pre vs post)
    metric: str
    pre_metric: str
    baseline: List[str]
    baseline_label: str
    context: int
    chance: Optional[float]
    curriculum: List[List[int]] = field(default_factory=list)
    train_batches: int = 0

    @classmethod
    def load(cls, path: Path) -> "Recipe":
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"--recipe {path}: no such file (give recipes/<name>.yaml)")
        config = yaml.safe_load(path.read_text())
        model_class = config["model"]["class_path"]
        if model_class not in _TINY:
            raise ValueError(f"--recipe {path}: its model {model_class} is none of {sorted(_TINY)}, "
                             f"which this runner knows the metric and baseline of")
        data = config["data"]["init_args"]
        context = int(data.get("context_len") or data["seq_len"])
        if model_class == _MAML:
            return cls(path, path.stem, model_class, "maml", "val/loss_post", "val/loss_pre",
                       ["--model.init_args.first_order=true"], "first order", context, None,
                       data.get("curriculum") or [[0, context]], int(data["train_batches"]))
        return cls(path, path.stem, model_class, "acc", "val/acc_post", "val/acc_pre",
                   ["--model.init_args.net.init_args.inner_steps=0"], "inner_steps 0", context, 1.0 / data["num_values"],
                   data.get("curriculum") or [[0, context]], int(data["train_batches"]))

    def tiny_context(self) -> int:
        """The final length of the ``--tiny`` overrides."""
        return 32 if self.kind == "maml" else 64

    def final_stage_steps(self) -> int:
        return self.train_batches - self.curriculum[-1][0]


@dataclass
class Run:
    name: str
    recipe: Recipe
    seed: int
    role: str  # "method" or "baseline"
    probe_steps: int = PROBE_STEPS
    extra: List[str] = field(default_factory=list)  # --set KEY=VALUE overrides of every run

    def overrides(self, probe: bool, tiny: bool) -> List[str]:
        out = [f"--seed_everything={self.seed}", f"--data.init_args.seed={self.seed}"]
        out += [f"--{kv}" for kv in self.extra]
        if self.role == "baseline":
            out += self.recipe.baseline  # after --set, so that the baseline's switch always holds
        if tiny:
            out += _TINY_COMMON + _TINY[self.recipe.model_class]
        if probe:
            length = self.recipe.tiny_context() if tiny else self.recipe.context
            out += [f"--data.init_args.curriculum=[[0,{length}]]", f"--trainer.max_steps={self.probe_steps}",
                    "--trainer.limit_val_batches=0", "--trainer.log_every_n_steps=1",
                    "--trainer.logger.init_args.flush_logs_every_n_steps=1"]  # every step on disk, even if stopped
        return out


def plan(recipes: List[Recipe], seeds: List[int], probe: bool, roles=("method", "baseline"),
         probe_steps: int = PROBE_STEPS, extra: Optional[List[str]] = None) -> List[Run]:
    """Every method run (recipes in the given order, then seeds), then every baseline: the
    methods cost most, so they start first (give the dearest recipe first)."""
    seeds = [seeds[0]] if probe else seeds
    runs = []
    for role in ("method", "baseline"):
        if role in roles:
            runs += [Run(f"{r.name}{'' if role == 'method' else '_base'}_s{s}", r, s, role, probe_steps,
                         list(extra or []))
                     for r in recipes for s in seeds]
    return runs


def last_checkpoint(runs_dir: Path, name: str) -> Optional[Path]:
    """The run's ``last.ckpt`` (written every few steps and when a deadline stops it), if any."""
    path = runs_dir / name / "checkpoints" / "last.ckpt"
    return path if path.is_file() else None


def command(run: Run, runs_dir: Path, max_time: str, probe: bool, tiny: bool, resume: bool = False) -> List[str]:
    """The run's ``ttt-flash fit`` command; with ``resume`` it continues from the run's
    ``last.ckpt`` where there is one (the same CSV log continues; ``max_time`` counts the time
    already trained)."""
    ckpt = last_checkpoint(runs_dir, run.name) if resume else None
    return [sys.executable, "-m", "ttt_flash.cli", "fit", "--config", str(run.recipe.path),
            f"--trainer.logger.init_args.save_dir={runs_dir}", f"--trainer.logger.init_args.version={run.name}",
            "--trainer.logger.init_args.flush_logs_every_n_steps=10", "--trainer.enable_progress_bar=false",
            *([f"--trainer.max_time={max_time}"] if max_time else []), *run.overrides(probe, tiny),
            *([f"--ckpt_path={ckpt}"] if ckpt else [])]


def to_run(runs: List[Run], results: Dict[str, dict], resume: bool) -> List[Run]:
    """With ``resume``: the runs that have not finished (no exit status 0 recorded)."""
    return [r for r in runs if not resume or results.get(r.name, {}).get("rc") != 0]


def run_in_process(runs: List[Run], out: Path, max_time: str, probe: bool, tiny: bool) -> Dict[str, dict]:
    """The runs one after another in this process (``ttt_flash.cli.main``, the same arguments as
    the subprocesses get): no interpreter start-up per run, for CPU smoke tests."""
    from contextlib import redirect_stderr, redirect_stdout

    from ttt_flash.cli import main as cli

    runs_dir = out / "runs"
    runs_dir.mkdir(parents=True, exist_ok=True)
    results = {}
    for run in runs:
        started = time.monotonic()
        with open(out / f"{run.name}.log", "w") as log, redirect_stdout(log), redirect_stderr(log):
            try:
                rc = cli(command(run, runs_dir, max_time, probe, tiny)[3:])
            except SystemExit as e:
                rc = e.code if isinstance(e.code, int) else 1
            except Exception as e:  # noqa: BLE001 - reported in the run's rc and log, the others still run
                print(f"{type(e).__name__}: {e}", file=log)
                rc = 1
        results[run.name] = {"rc": rc, "wall_s": round(time.monotonic() - started, 1), "gpu": "cpu"}
        print(f"{run.name} exited {rc} after {results[run.name]['wall_s']} s", flush=True)
    return results


def launch(runs: List[Run], out: Path, slots: List[str], max_time: str, deadline_s: float, probe: bool,
           tiny: bool, resume: bool = False, grace_s: float = 120.0) -> Dict[str, dict]:
    """Run everything, ``len(slots)`` at a time (a slot is a CUDA_VISIBLE_DEVICES value; on the
    CPU one slot); returns {name: {"rc", "wall_s", "gpu"}}. Runs still going at the deadline get
    SIGTERM (each finishes its step and writes last.ckpt), then SIGKILL after ``grace_s``; runs not
    started by then are left out."""
    runs_dir = out / "runs"
    runs_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    results: Dict[str, dict] = {}
    procs: Dict[str, tuple] = {}
    free = list(slots)
    pending = list(runs)

    def stamp() -> str:
        return f"[{time.monotonic() - t0:6.0f}s]"

    def reap(block: bool) -> None:
        for name, (proc, started, log, slot) in list(procs.items()):
            rc = proc.wait() if block else proc.poll()
            if rc is None:
                continue
            log.close()
            results[name] = {"rc": rc, "wall_s": round(time.monotonic() - started, 1), "gpu": slot}
            print(f"{stamp()} {name} exited {rc} after {results[name]['wall_s']} s", flush=True)
            free.append(slot)
            del procs[name]

    while pending or procs:
        while pending and free:
            run, slot = pending.pop(0), free.pop(0)
            env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"))
            if not tiny:
                env["CUDA_VISIBLE_DEVICES"] = slot
            log = open(out / f"{run.name}.log", "a" if resume else "w")
            cmd = command(run, runs_dir, max_time, probe, tiny, resume)
            print(f"{stamp()} {'resume' if any(c.startswith('--ckpt_path') for c in cmd) else 'start'} {run.name}"
                  + ("" if tiny else f" (GPU {slot})"), flush=True)
            proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)
            procs[run.name] = (proc, time.monotonic(), log, slot)
        reap(block=False)
        if time.monotonic() - t0 > deadline_s:
            stop_runs(procs, grace_s)
            reap(block=True)
            for run in pending:
                print(f"deadline: {run.name} never started", flush=True)
            break
        time.sleep(0.5)
    return results


# --------------------------------------------------------------------------- summary


def _median(values: List[float]) -> Optional[float]:
    return statistics.median(values) if values else None


def run_record(run: Run, runs_dir: Path, result: dict, probe: bool, tiny: bool = False) -> dict:
    """One run's numbers from its CSV log (step time: the median at the final length)."""
    final = run.recipe.tiny_context() if tiny else run.recipe.context
    csv = runs_dir / run.name / "metrics.csv"
    vsteps, values = curve(csv, run.recipe.metric)
    _, pre = curve(csv, run.recipe.pre_metric)
    tsteps, times = curve(csv, "train/step_time_s")
    _, peaks = curve(csv, "train/peak_mem_gib")
    lengths: Dict[int, float] = {}
    for column in ("train/context_len", "train/seq_len"):
        s, v = curve(csv, column)
        lengths.update(zip(s, v))
    at_final = [t for s, t in zip(tsteps, times) if lengths.get(s) == final and (not probe or s > 0)]
    return {
        "recipe": run.recipe.name, "seed": run.seed, "role": run.role,
        "overrides": run.overrides(probe, tiny),
        "rc": result.get("rc"), "wall_s": result.get("wall_s"), "gpu": result.get("gpu"),
        "stopped": result.get("rc") not in (None, 0),  # exited otherwise than done (deadline, crash): no verdict
        "steps": (max(tsteps) + 1) if tsteps else 0,
        "median_step_s_at_final_length": _median(at_final),
        "peak_mem_gib": max(peaks) if peaks else None,
        "val_steps": vsteps, "val": values, "val_pre": pre,
        "last": values[-1] if values else None, "last_pre": pre[-1] if pre else None,
    }


def _stats(values: List[Optional[float]]) -> dict:
    got = [v for v in values if v is not None]
    return {"min": min(got) if got else None, "median": _median(got), "max": max(got) if got else None,
            "n": len(got)}


def seed_verdict(recipe: Recipe, method: dict, baseline: Optional[dict]) -> bool:
    """Whether one seed meets the target (docs/long-context.md) against its own baseline."""
    m, b = method.get("last"), (baseline or {}).get("last")
    if m is None or b is None or method.get("stopped") or (baseline or {}).get("stopped"):
        return False  # a run that did not finish proves nothing, whatever its last validation said
    if recipe.kind == "acc":
        return m >= 10 * recipe.chance and m > b
    pre = method.get("last_pre")
    return pre is not None and m <= 0.7 * pre and m <= b


def summarize(recipes: List[Recipe], runs: List[Run], records: Dict[str, dict], probe: bool) -> dict:
    summary = {"probe": probe, "runs": records, "recipes": {}}
    for recipe in recipes:
        mine = [r for r in runs if r.recipe.name == recipe.name]
        seeds = sorted({r.seed for r in mine})
        entry = {"file": str(recipe.path.relative_to(ROOT)) if recipe.path.is_relative_to(ROOT) else str(recipe.path),
                 "context": recipe.context, "metric": recipe.metric, "kind": recipe.kind, "chance": recipe.chance,
                 "baseline": recipe.baseline_label, "seeds": seeds, "per_seed": {}}
        for seed in seeds:
            m = records.get(f"{recipe.name}_s{seed}", {})
            b = records.get(f"{recipe.name}_base_s{seed}", {})
            entry["per_seed"][seed] = {"method": m.get("last"), "baseline": b.get("last"), "pre": m.get("last_pre"),
                                       "met": seed_verdict(recipe, m, b),
                                       "stopped": [r for r, rec in (("method", m), ("baseline", b)) if rec.get("stopped")],
                                       "steps": m.get("steps"), "base_steps": b.get("steps"),
                                       "step_s": m.get("median_step_s_at_final_length"),
                                       "base_step_s": b.get("median_step_s_at_final_length"),
                                       "peak_mem_gib": m.get("peak_mem_gib"), "wall_s": m.get("wall_s"),
                                       "base_wall_s": b.get("wall_s")}
        per = entry["per_seed"].values()
        entry["method"] = _stats([p["method"] for p in per])
        entry["baseline_stats"] = _stats([p["baseline"] for p in per])
        if probe:
            step = _median([p["step_s"] for p in per if p["step_s"] is not None])
            entry["final_stage_steps"] = recipe.final_stage_steps()
            entry["final_stage_s"] = None if step is None else round(step * recipe.final_stage_steps(), 1)
            entry["met"] = None
        else:
            entry["met"] = bool(seeds) and all(p["met"] for p in per)
        summary["recipes"][recipe.name] = entry
    return summary


def _f(x, digits=4) -> str:
    return "—" if x is None else f"{x:.{digits}f}"


def _met(p: dict) -> str:
    stopped = p.get("stopped") or []
    if stopped:
        logged = p["steps" if stopped[0] == "method" else "base_steps"]
        return f"unfinished ({' and '.join(stopped)} stopped, logged to step {logged})"
    return "yes" if p["met"] else "no"


def table(summary: dict) -> str:
    if summary["probe"]:
        rows = ["| recipe | context | median step, method | median step, baseline | peak memory (method) | "
                "final-stage steps | final stage, method |", "| --- | --- | --- | --- | --- | --- | --- |"]
        for name, e in summary["recipes"].items():
            p = next(iter(e["per_seed"].values()), {})
            rows.append(f"| {name} | {e['context']:,} | {_f(p.get('step_s'), 3)} s | {_f(p.get('base_step_s'), 3)} s | "
                        f"{_f(p.get('peak_mem_gib'), 1)} GiB | {e['final_stage_steps']} | {_f(e['final_stage_s'], 0)} s |")
        return "\n".join(rows)
    rows = ["| recipe | context | metric | seed | method | baseline | pre | met | step at length | wall |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, e in summary["recipes"].items():
        for seed, p in e["per_seed"].items():
            rows.append(f"| {name} | {e['context']:,} | {e['metric']} | {seed} | {_f(p['method'])} | "
                        f"{_f(p['baseline'])} ({e['baseline']}) | {_f(p['pre'])} | {_met(p)} | "
                        f"{_f(p['step_s'], 3)} s | {p['wall_s']} s |")
    rows.append("")
    for name, e in summary["recipes"].items():
        m, b = e["method"], e["baseline_stats"]
        target = (f"target >= {10 * e['chance']:.4f} (10 x chance) and > baseline" if e["kind"] == "acc"
                  else "target post <= 0.7 x pre and <= first order")
        rows.append(f"{name}: method min / median / max {_f(m['min'])} / {_f(m['median'])} / {_f(m['max'])} "
                    f"over {m['n']} seeds; baseline {_f(b['min'])} / {_f(b['median'])} / {_f(b['max'])}; "
                    f"{target}: {'MET for every seed' if e['met'] else 'NOT MET'}"
                    + (f" ({unfinished} seed(s) with a run that did not finish: resume them with --resume)"
                       if (unfinished := sum(bool(p.get('stopped')) for p in e['per_seed'].values())) else ""))
    return "\n".join(rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipe", type=Path, nargs="+", required=True, help="recipe files (recipes/<name>.yaml)")
    p.add_argument("--out", type=Path, required=True, help="folder for runs/, logs, seeds.json, seeds.md")
    p.add_argument("--seeds", default="0,1,2", help="comma-separated seeds (weights and data)")
    p.add_argument("--gpus", default="0", help="comma-separated GPU indices to spread the runs over")
    p.add_argument("--per-gpu", type=int, default=1, help="runs at once per GPU (1: each run alone, honest times)")
    p.add_argument("--max-time", default="", help="Lightning max_time of every run (DD:HH:MM:SS; default: the recipe's)")
    p.add_argument("--deadline", type=float, default=float("inf"), help="seconds after which unfinished runs are stopped")
    p.add_argument("--grace", type=float, default=120.0,
                   help="seconds a run stopped at the deadline has to finish its step and write last.ckpt before SIGKILL")
    p.add_argument("--probe", action="store_true",
                   help="a few steps (--probe-steps) at the final length, no validation (seed: the first)")
    p.add_argument("--probe-steps", type=int, default=PROBE_STEPS,
                   help="steps per probe run (>= 2: the first, with compilation, is not timed)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a LightningCLI override for every run, method and baseline alike (repeatable), "
                        "e.g. --set trainer.precision=bf16-mixed; recorded in seeds.json")
    p.add_argument("--roles", default="method,baseline", help="which runs: method, baseline or both")
    p.add_argument("--tiny", action="store_true", help="CPU, tiny shapes, 4 steps, one run at a time (a dry run)")
    p.add_argument("--resume", action="store_true",
                   help="skip the runs that finished, continue the others from their last.ckpt (after a --deadline)")
    p.add_argument("--in-process", action="store_true", help="with --tiny: the runs in this process, one after another")
    p.add_argument("--summarize-only", action="store_true", help="no runs: summarize DIR/runs again")
    a = p.parse_args(argv)
    try:
        seeds = [int(s) for s in a.seeds.split(",") if s.strip()]
    except ValueError:
        p.error(f"--seeds must be comma-separated integers, got {a.seeds!r}")
    if not seeds:
        p.error("--seeds names no seed")
    if a.in_process and not a.tiny:
        p.error("--in-process is for --tiny runs (CPU smoke tests); GPU runs each get a process")
    if a.per_gpu < 1:
        p.error(f"--per-gpu must be >= 1, got {a.per_gpu}")
    try:
        recipes = [Recipe.load(path) for path in a.recipe]
    except (FileNotFoundError, ValueError) as e:
        p.error(str(e))
    roles = {r.strip() for r in a.roles.split(",") if r.strip()}
    if not roles or roles - {"method", "baseline"}:
        p.error(f"--roles must be method, baseline or both (comma-separated), got {a.roles!r}")
    if a.probe_steps < 2:
        p.error(f"--probe-steps must be >= 2 (the first step compiles and is not timed), got {a.probe_steps}")
    for kv in a.set:
        if "=" not in kv or kv.startswith("-") or not kv.split("=", 1)[0]:
            p.error(f"--set takes KEY=VALUE with a LightningCLI key and no leading dashes "
                    f"(e.g. --set trainer.precision=bf16-mixed), got {kv!r}")
    runs = plan(recipes, seeds, a.probe, roles, a.probe_steps, a.set)
    a.out.mkdir(parents=True, exist_ok=True)
    results_file = a.out / "results.json"
    results: Dict[str, dict] = json.loads(results_file.read_text()) if results_file.is_file() else {}
    if not a.summarize_only:
        slots = ["cpu"] if a.tiny else [g.strip() for g in a.gpus.split(",") if g.strip()] * a.per_gpu
        todo = to_run(runs, results, a.resume)
        if a.in_process:
            results.update(run_in_process(todo, a.out, a.max_time, a.probe, a.tiny))
        else:
            new = launch(todo, a.out, slots, a.max_time, a.deadline, a.probe, a.tiny, a.resume, a.grace)
            for name, r in new.items():  # a resumed run's wall time adds up over its calls
                before = results.get(name, {}).get("wall_s") if a.resume else None
                if before:
                    r["wall_s"] = round(r["wall_s"] + before, 1)
            results.update(new)
        results_file.write_text(json.dumps(results, indent=1))
    records = {r.name: run_record(r, a.out / "runs", results.get(r.name, {}), a.probe, a.tiny) for r in runs}
    summary = summarize(recipes, runs, records, a.probe)
    (a.out / "seeds.json").write_text(json.dumps(summary, indent=1))
    text = table(summary)
    (a.out / "seeds.md").write_text(text + "\n")
    print(text, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
