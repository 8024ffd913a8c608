"""Training steps of a memory recipe on one GPU and context parallel across P GPUs, and the
causal attention chain on 2 GPUs against one: the context-parallel measurements of the
memory models (docs/benchmarks.md, docs/distributed.md).

``steps``: a recipe's LightningModule and DataModule (``recipes/gradmem_kv_long.yaml`` by
default, read with PyYAML; no LightningCLI) through a plain ``lightning.pytorch.Trainer``
for ``--steps`` optimizer steps, with ``context_parallel=P`` under DDP when ``--devices`` > 1.
Per step: wall clock (CUDA-synchronised, from the callback's batch start to its batch end)
and peak allocated memory on every rank; the median skips step 1 (kernel compilation).
No checkpoints, no logger, no validation. Writes a JSON file, prints one line::

    python scripts/cp_memory_steps.py steps --devices 1 --steps 20 --json gm1.json
    python scripts/cp_memory_steps.py steps --devices 2 --context-parallel 2 --steps 20 --json gm2.json

``all``: everything for one ``nvidia-h200-x2`` call, logs and JSON under ``--out``:
(A) at once, the recipe on GPU 0 alone and the causal chain on GPU 1 alone
(``ttt-flash bench --context-parallel 1 --no-cp-baseline``: one process over the whole
sequence); (B) the recipe on both GPUs with ``context_parallel=2``; (C) the causal chain on
both GPUs (``ttt-flash bench --context-parallel 2 --no-cp-baseline``); then a table. Each
phase gets a time limit within ``--deadline-s``. ``--cpu``: the same code paths at tiny sizes
on the CPU (gloo), to try the script before a GPU call::

    python scripts/cp_memory_steps.py all --out /tmp/cp_mem_cpu --cpu
    python scripts/cp_memory_steps.py all --out "$OUT"          # nvidia-h200-x2
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]

# ``--cpu``: tiny settings that run every code path of ``all`` in seconds on the CPU.
_GPT = "net.init_args.model."  # the GradMem's GPT in the recipe's model.init_args
CPU_MODEL = [_GPT + "vocab_size=13", _GPT + "n_layer=1", _GPT + "n_head=2", _GPT + "d_model=16",
             "net.init_args.memory_tokens=3", _GPT + "checkpoint=true"]
CPU_DATA = ["num_keys=8", "num_values=4", "num_pairs=2", "context_len=30"]
CPU_BENCH = ["--device", "cpu", "--seq-lens", "33,65", "--heads", "2", "--head-dim", "8", "--dtype", "float64",
             "--rep-ms", "1"]
GPU_BENCH = ["--seq-lens", "262144,1048576", "--dtype", "bfloat16", "--heads", "12", "--head-dim", "64"]


# --------------------------------------------------------------------------- steps


def _import(path: str):
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def _overridden(args: dict, pairs) -> dict:
    """``args`` with each ``dotted.key=value`` of ``pairs`` set (YAML values; nested keys such as
    ``net.init_args.memory_tokens`` reach into the recipe's network)."""
    import copy

    out = copy.deepcopy(args)
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep:
            raise SystemExit(f"an override must be key=value, got {pair!r}")
        *path, leaf = key.split(".")
        node = out
        for part in path:
            node = node.setdefault(part, {})
        node[leaf] = yaml.safe_load(value)
    return out


def _module(class_path: str, init_args: dict):
    """The LightningModule as the CLI composes it (its ``net:`` built from class_path and init_args)."""
    from jsonargparse import ArgumentParser
    from lightning.pytorch import LightningModule

    parser = ArgumentParser(exit_on_error=False)
    parser.add_subclass_arguments(LightningModule, "model")
    config = parser.parse_object({"model": {"class_path": class_path, "init_args": init_args}})
    return parser.instantiate_classes(config).model


def _step_stats_callback(path: str, meta: dict):
    import lightning.pytorch as pl
    import torch
    import torch.distributed as dist

    class StepStats(pl.Callback):
        """Per step: seconds and peak allocated GiB on this rank; rank 0 writes the JSON."""

        def __init__(self):
            self.times, self.peaks, self.losses = [], [], []
            self._t0 = None

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if torch.cuda.is_available() and trainer.strategy.root_device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            self._t0 = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            cuda = trainer.strategy.root_device.type == "cuda"
            if cuda:
                torch.cuda.synchronize()
            self.times.append(time.perf_counter() - self._t0)
            self.peaks.append(torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0)
            loss = trainer.callback_metrics.get("train/loss_post")
            self.losses.append(None if loss is None else float(loss))
            if trainer.global_rank == 0:
                print(f"step {len(self.times)}: {self.times[-1]:.3f} s, peak {self.peaks[-1]:.2f} GiB, "
                      f"loss_post {self.losses[-1]}", flush=True)

        def on_train_end(self, trainer, pl_module):
            mine = {"times": self.times, "peak": max(self.peaks, default=0.0)}
            ranks = [mine]
            if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
                ranks = [None] * dist.get_world_size()
                dist.all_gather_object(ranks, mine)
            if trainer.global_rank != 0:
                return
            times = self.times[1:] or self.times
            cuda = trainer.strategy.root_device.type == "cuda"
            result = dict(meta, steps=len(self.times), step_time_s=self.times, loss_post=self.losses,
                          median_step_s=statistics.median(times), mean_step_s=statistics.fmean(times),
                          peak_gib_per_rank=[r["peak"] for r in ranks],
                          device_name=torch.cuda.get_device_name() if cuda else "cpu",
                          torch=torch.__version__, date=time.strftime("%Y-%m-%d"))
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_text(json.dumps(result, indent=1))
            peaks = ", ".join(f"{p:.2f}" for p in result["peak_gib_per_rank"])
            print(f"{meta['devices']} device(s), context_parallel={meta['context_parallel']}: median step "
                  f"{result['median_step_s']:.3f} s (steps 2..{len(self.times)}), peak GiB per rank [{peaks}]; "
                  f"wrote {path}", flush=True)

    return StepStats()


def run_steps(a) -> int:
    import lightning.pytorch as pl

    recipe = yaml.safe_load(Path(a.config).read_text())
    model_cfg, data_cfg = recipe["model"], recipe["data"]
    model_args = _overridden(model_cfg.get("init_args") or {}, a.model_arg)
    data_args = _overridden(data_cfg.get("init_args") or {}, a.data_arg)
    if a.context_parallel > 1:
        model_args["context_parallel"] = a.context_parallel
    # one batch per rank and step; a group trains on its first rank's batch
    data_args["train_batches"] = max(int(data_args.get("train_batches", 1)), a.steps * a.devices)
    precision = a.precision or (recipe.get("trainer") or {}).get("precision", "32-true")
    pl.seed_everything(int(recipe.get("seed_everything", 0)))
    model = _module(model_cfg["class_path"], model_args)
    data = _import(data_cfg["class_path"])(**data_args)
    meta = dict(config=str(a.config), devices=a.devices, context_parallel=a.context_parallel, precision=precision,
                model=model_cfg["class_path"], model_args=model_args, data_args=data_args)
    trainer = pl.Trainer(accelerator=a.accelerator, devices=a.devices,
                         strategy="ddp" if a.devices > 1 else "auto", precision=precision, max_steps=a.steps,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
                         callbacks=[_step_stats_callback(a.json, meta)])
    trainer.fit(model, data)
    return 0


# --------------------------------------------------------------------------- all


def _launch(cmd, log: Path, env_extra: dict):
    env = dict(os.environ, **env_extra)
    f = open(log, "w")
    f.write("$ " + " ".join(cmd) + "\n")
    f.flush()
    proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True)
    return proc, f, time.perf_counter()


def _wait(jobs, limit_s: float) -> dict:
    """Wait for every (name, proc, file, start) until ``limit_s`` from now; a job still
    running then is stopped (its process group: it and the processes it started)."""
    end = time.perf_counter() + limit_s
    status = {}
    for name, proc, f, start in jobs:
        try:
            rc = proc.wait(timeout=max(1.0, end - time.perf_counter()))
            status[name] = {"rc": rc, "s": round(time.perf_counter() - start, 1)}
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            status[name] = {"rc": "timeout", "s": round(time.perf_counter() - start, 1)}
        f.close()
        print(f"[{name}] {status[name]}", flush=True)
    return status


def _load(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _table(out: Path, status: dict) -> str:
    gm1, gm2 = _load(out / "gm1.json"), _load(out / "gm2.json")
    b1, b2 = _load(out / "bench1" / "bench_cp.json"), _load(out / "bench2" / "bench_cp.json")
    lines = []
    cfg = (gm2 or gm1 or {}).get("config", "?")
    ctx = (gm2 or gm1 or {}).get("data_args", {}).get("context_len", "?")
    lines.append(f"{cfg} (context_len {ctx}): median step s (steps 2..n), peak GiB per GPU")
    for name, r in (("1 GPU", gm1), ("2 GPUs, context_parallel=2", gm2)):
        if r is None:
            lines.append(f"  {name}: no result ({status.get(name, {})})")
        else:
            peaks = ", ".join(f"{p:.2f}" for p in r["peak_gib_per_rank"])
            lines.append(f"  {name}: {r['median_step_s']:.3f} s over {r['steps']} steps, peak [{peaks}]")
    if gm1 and gm2:
        lines.append(f"  speed-up: {gm1['median_step_s'] / gm2['median_step_s']:.2f}x")
    if b1 and b2:
        c = b2["config"]
        lines.append(f"chain causal={c['causal']} {c['dtype']} H={c['heads']} d={c['head_dim']}: "
                     f"correctness 1 GPU {'ok' if b1['check']['ok'] else 'FAILED'}, "
                     f"2 GPUs {'ok' if b2['check']['ok'] else 'FAILED'}")
        lines.append(f"  {'N':>9} {'2 GPUs ms':>11} {'1 GPU ms':>11} {'speed-up':>9}  peak GiB per GPU (1 GPU)")
        one = {r["N"]: r for r in b1["rows"]}
        for r in b2["rows"]:
            o = one.get(r["N"], {})
            if "ms_cp" not in r or "ms_cp" not in o:
                lines.append(f"  {r['N']:>9} {r.get('error', 'missing')}")
                continue
            peaks = ", ".join(f"{p:.2f}" for p in r.get("peak_gib_per_rank", []))
            p1 = ", ".join(f"{p:.2f}" for p in o.get("peak_gib_per_rank", []))
            lines.append(f"  {r['N']:>9} {r['ms_cp']:>11.1f} {o['ms_cp']:>11.1f} {o['ms_cp'] / r['ms_cp']:>8.2f}x  "
                         f"[{peaks}] ([{p1}])")
    else:
        lines.append(f"chain: no result (1 GPU: {status.get('chain 1 GPU')}, 2 GPUs: {status.get('chain 2 GPUs')})")
    return "\n".join(lines)


def run_all(a) -> int:
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    t_end = time.perf_counter() + a.deadline_s
    me = [sys.executable, str(Path(__file__).resolve()), "steps", "--config", a.config]
    bench = [sys.executable, "-m", "ttt_flash.cli", "bench", "--causal", "--no-cp-baseline"]
    if a.cpu:
        me += ["--accelerator", "cpu", "--precision", "32-true", "--model-arg", *CPU_MODEL, "--data-arg", *CPU_DATA]
        bench += CPU_BENCH
    else:
        bench += GPU_BENCH
    left = lambda cap: max(1.0, min(cap, t_end - time.perf_counter()))  # noqa: E731
    status = {}
    # (A) one GPU each: the recipe on GPU 0, the one-process chain on GPU 1
    jobs = [("1 GPU", *_launch(me + ["--devices", "1", "--steps", str(a.steps_one), "--json", str(out / "gm1.json")],
                               out / "log_gm1.txt", {"CUDA_VISIBLE_DEVICES": "0"})),
            ("chain 1 GPU", *_launch(bench + ["--context-parallel", "1", "--out", str(out / "bench1")],
                                     out / "log_bench1.txt", {"CUDA_VISIBLE_DEVICES": "1"}))]
    status.update(_wait(jobs, left(a.phase_a_s)))
    # (B) the recipe context parallel over both GPUs
    jobs = [("2 GPUs, context_parallel=2", *_launch(
        me + ["--devices", "2", "--context-parallel", "2", "--steps", str(a.steps), "--json", str(out / "gm2.json")],
        out / "log_gm2.txt", {}))]
    status.update(_wait(jobs, left(a.phase_b_s)))
    # (C) the chain over both GPUs
    jobs = [("chain 2 GPUs", *_launch(bench + ["--context-parallel", "2", "--out", str(out / "bench2")],
                                      out / "log_bench2.txt", {}))]
    status.update(_wait(jobs, left(a.phase_c_s)))
    print(_table(out, status), flush=True)
    ok = all(s["rc"] == 0 for s in status.values())
    return 0 if ok else 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("steps", help="one recipe run (one or P processes)")
    s.add_argument("--config", default=str(ROOT / "recipes" / "gradmem_kv_long.yaml"))
    s.add_argument("--devices", type=int, default=1)
    s.add_argument("--context-parallel", type=int, default=1)
    s.add_argument("--steps", type=int, default=20)
    s.add_argument("--accelerator", default="gpu")
    s.add_argument("--precision", default=None, help="default: the recipe's trainer.precision")
    s.add_argument("--model-arg", nargs="*", help="model.init_args overrides, dotted.key=value (YAML values)")
    s.add_argument("--data-arg", nargs="*", help="init_args overrides, key=value (YAML values)")
    s.add_argument("--json", required=True)
    s = sub.add_parser("all", help="everything for one nvidia-h200-x2 call")
    s.add_argument("--config", default=str(ROOT / "recipes" / "gradmem_kv_long.yaml"))
    s.add_argument("--out", required=True)
    s.add_argument("--steps", type=int, default=20, help="steps on 2 GPUs")
    s.add_argument("--steps-one", type=int, default=12, help="steps on 1 GPU (the median skips the first)")
    s.add_argument("--cpu", action="store_true", help="tiny sizes on the CPU (gloo), to try the script")
    s.add_argument("--deadline-s", type=float, default=540.0)
    s.add_argument("--phase-a-s", type=float, default=240.0)
    s.add_argument("--phase-b-s", type=float, default=170.0)
    s.add_argument("--phase-c-s", type=float, default=130.0)
    a = p.parse_args(argv)
    return run_steps(a) if a.cmd == "steps" else run_all(a)


if __name__ == "__main__":
    sys.exit(main())
