"""Host time of recipes/sophia_gpt.yaml's LanguageModel training step through Lightning, eager and
with ``cuda_graph``: where a step's milliseconds go when the GPU work is a replayed graph.

The recipe's module and data (GPT-2 small shape, byte vocabulary, Sophia-H with a Hessian
refresh every 10 steps, bf16-mixed, gradient clipping, CSV logging every 10 steps) at one batch
shape, trained by a Lightning Trainer for ``--warmup`` + 2 x ``--steps`` + ``--census`` steps per
mode. After the warm-up (compilation, capture): the step wall time over ``--steps`` steps, as the
gap between the ends of consecutive training batches with no synchronisation added (median of
the plain steps, of the Hessian-refresh steps, and the mean); a cProfile of the next ``--steps``
steps (by own time, top 40; then by cumulative time); then, over ``--census`` steps, every
synchronising call PyTorch flags (``torch.cuda.set_sync_debug_mode("warn")``: ``.item()``,
blocking copies; not ``torch.cuda.synchronize()`` or CUDA-event waits) with its call site.

    python3 scripts/prof_lm_step.py --out OUT                         # batch 1 x 1,024, eager and graph
    python3 scripts/prof_lm_step.py --out OUT --modes graph --shape 8x2048

Writes OUT/prof_lm_step.json and OUT/prof_lm_step_<mode>.txt (mode: eager, graph) and prints a
table last. Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
MODES = {"eager": False, "graph": True}


def _shape(text: str):
    """"BxN" -> (B, N)."""
    try:
        b, n = (int(x) for x in text.split("x"))
    except ValueError:
        b = n = 0
    if b < 1 or n < 1:
        raise argparse.ArgumentTypeError(f"BATCHxSEQ_LEN of positive integers (e.g. 1x1024), got {text!r}")
    return b, n


def _modes(text: str):
    modes = [m for m in text.split(",") if m]
    if not modes or any(m not in MODES for m in modes):
        raise argparse.ArgumentTypeError(f"comma-separated modes out of {sorted(MODES)}, got {text!r}")
    return modes


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="scripts/prof_lm_step.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", required=True, help="folder for prof_lm_step.json and the profiles")
    p.add_argument("--recipe", default=str(ROOT / "recipes" / "sophia_gpt.yaml"), help="the LanguageModel recipe")
    p.add_argument("--shape", type=_shape, default=(1, 1024), help="BATCHxSEQ_LEN")
    p.add_argument("--modes", type=_modes, default=list(MODES), help="eager (cuda_graph false), graph (true)")
    p.add_argument("--warmup", type=int, default=10, help="steps before the timing (compilation, capture)")
    p.add_argument("--steps", type=int, default=20, help="steps timed, then steps profiled")
    p.add_argument("--census", type=int, default=10, help="steps whose synchronising calls are listed")
    return p


def build(recipe: str, shape, steps: int, cuda_graph: bool, logs: str):
    """The recipe's LanguageModel, data and Trainer arguments at ``shape`` for ``steps`` steps."""
    import yaml
    from lightning.pytorch.loggers import CSVLogger

    from ttt_flash.lightning import ByteTextDataModule, LanguageModel
    from ttt_flash.models import GPTConfig

    cfg = yaml.safe_load(Path(recipe).read_text())
    margs = dict(cfg["model"]["init_args"])
    margs["gpt"], margs["cuda_graph"] = GPTConfig(**margs["gpt"]), cuda_graph
    b, n = shape
    data = ByteTextDataModule(**{**cfg["data"]["init_args"], "seq_len": n, "batch_size": b, "max_bytes": 2**23,
                                 "train_batches": steps, "val_batches": 1})
    t = cfg["trainer"]
    trainer_kw = dict(precision=t.get("precision", "32-true"), gradient_clip_val=t.get("gradient_clip_val"),
                      log_every_n_steps=t.get("log_every_n_steps", 50), logger=CSVLogger(logs, name="", version="run"))
    return LanguageModel(**margs), data, trainer_kw


def _probe(warmup: int, steps: int, census_steps: int):
    """A callback: the end time of every training batch, a cProfile of batches
    [warmup + steps, warmup + 2 steps), the synchronising calls of the ``census_steps`` after."""
    import lightning.pytorch as pl

    from ttt_flash.bench.common import SyncCensus

    class Probe(pl.Callback):
        def __init__(self):
            self.ends, self.profile, self.census = [], cProfile.Profile(), SyncCensus()
            self.first_profiled, self.first_census = warmup + steps, warmup + 2 * steps

        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            if batch_idx == self.first_profiled:
                self.profile.enable()
            elif batch_idx == self.first_census:
                self.census.start()

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            self.ends.append((batch_idx, trainer.global_step - 1, time.perf_counter()))
            if batch_idx == self.first_census - 1:
                self.profile.disable()
            elif batch_idx == self.first_census + census_steps - 1:
                self.census.stop()

    return Probe()


def run_mode(mode: str, a) -> dict:
    import lightning.pytorch as pl

    steps = a.warmup + 2 * a.steps + a.census
    with tempfile.TemporaryDirectory() as logs:
        pl.seed_everything(0, verbose=False)
        model, data, trainer_kw = build(a.recipe, a.shape, steps, MODES[mode], logs)
        probe = _probe(a.warmup, a.steps, a.census)
        trainer = pl.Trainer(max_steps=steps, accelerator="gpu", devices=1, callbacks=[probe], enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, **trainer_kw)
        try:
            trainer.fit(model, data)
        finally:
            probe.census.stop()
            torch.cuda.synchronize()
    every = model.hparams.hessian_every or 10
    timed = [(step, t - t0) for (_, _, t0), (i, step, t) in zip(probe.ends, probe.ends[1:])
             if a.warmup <= i < a.warmup + a.steps]
    path = os.path.join(a.out, f"prof_lm_step_{mode}.txt")
    with open(path, "w") as f:
        f.write(f"{mode}: {a.steps} training steps from step {a.warmup + a.steps}, batch {a.shape[0]} x {a.shape[1]}\n")
        for order, top in (("tottime", 40), ("cumulative", 40)):
            buf = io.StringIO()
            pstats.Stats(probe.profile, stream=buf).sort_stats(order).print_stats(top)
            f.write(buf.getvalue())
    sites = collections.Counter(probe.census.calls).most_common()
    row = {"mode": mode, "cuda_graph": MODES[mode], "batch": a.shape[0], "n": a.shape[1], "steps": steps,
           "hessian_every": every,
           "plain_ms": 1e3 * statistics.median([dt for s, dt in timed if s % every]),
           "refresh_ms": 1e3 * statistics.median([dt for s, dt in timed if s % every == 0] or [float("nan")]),
           "mean_ms": 1e3 * sum(dt for _, dt in timed) / len(timed),
           "syncs_per_step": len(probe.census.calls) / max(1, a.census), "sync_sites": sites,
           "profile": os.path.basename(path)}
    if MODES[mode]:
        row["graphs"] = {k: len(g.graphs) for k, g in model._graphed.graphs.items()}
        row["eager_calls"] = {k: g.eager_calls for k, g in model._graphed.graphs.items()}
    return row


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    if min(a.warmup, a.steps, a.census) < 1:
        raise SystemExit("--warmup, --steps and --census take positive step counts")
    if not torch.cuda.is_available():
        raise SystemExit("prof_lm_step.py needs a CUDA GPU (it profiles the GPU training step); torch sees none")
    os.makedirs(a.out, exist_ok=True)
    rows = [run_mode(mode, a) for mode in a.modes]
    by_mode = {r["mode"]: r for r in rows}
    if {"eager", "graph"} <= set(by_mode):
        for key in ("plain_ms", "refresh_ms", "mean_ms"):
            by_mode["graph"][key.replace("_ms", "_speedup")] = by_mode["eager"][key] / by_mode["graph"][key]
    import lightning

    with open(os.path.join(a.out, "prof_lm_step.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "lightning": lightning.__version__,
                   "recipe": os.path.relpath(a.recipe, ROOT), "command": " ".join(["python3", *sys.argv]),
                   "rows": rows}, f, indent=1)
    print(f"{'mode':<7}{'plain ms':>10}{'refresh ms':>12}{'mean ms':>9}{'syncs/step':>12}  most frequent sync site")
    for r in rows:
        site = r["sync_sites"][0][0] if r["sync_sites"] else "-"
        print(f"{r['mode']:<7}{r['plain_ms']:10.2f}{r['refresh_ms']:12.2f}{r['mean_ms']:9.2f}{r['syncs_per_step']:12.1f}  {site}")
    if "plain_speedup" in by_mode.get("graph", {}):
        g = by_mode["graph"]
        print(f"graph vs eager: plain {g['plain_speedup']:.2f}x, refresh {g['refresh_speedup']:.2f}x, "
              f"mean {g['mean_speedup']:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
