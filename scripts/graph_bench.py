"""Every number of the CUDA-graph benchmark (docs/cuda-graphs.md) in one run: the parts of
``ttt-flash bench --graph`` (the chain eager / host / kernel / replayed / first-order SDPA flash
at 1K and 4K, causal and not, and B=8 2K causal; the MAML meta-step at N = 512 and 2,048:
ttt-flash eager and replayed, the same loop with SDPA math, higher + SDPA math; a GPT-2-small
step and Hessian-vector-product step at batch 1 / 1,024 and batch 8 / 2,048, eager and
replayed) and two more through Lightning on the GPU, each with cuda_graph false and true:
``maml``: recipes/maml_transformer.yaml (steps/s, the first 20 logged training losses);
``lm_module``: recipes/sophia_gpt.yaml's LanguageModel (Sophia-H, bf16-mixed, gradient clipping at
1.0) at batch 1 / 1,024 and batch 8 / 2,048 tokens: the plain and the Hessian-refresh steps' times,
eager and with cuda_graph (each step one replayed graph: forward, backward, refresh, clipping,
optimizer update), and whether the logged losses are identical.

    python3 scripts/graph_bench.py OUT_DIR [--parts chain,meta,lm,maml,lm_module] [--seq-lens 1024,4096] ...

Writes OUT_DIR/bench_graph.json and prints a table last.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import List

import torch

from ttt_flash.bench.graph import PARTS, bench_row, build_parser, main


def graph_counts(model) -> dict:
    """Graphs captured and eager fallbacks of a module's ``cuda_graph`` cache, per step kind."""
    cache = model._graphed.graphs
    return {"graphs": {k: len(g.graphs) for k, g in cache.items()},
            "eager_calls": {k: g.eager_calls for k, g in cache.items()}}


def maml_rows(recipe: str = "recipes/maml_transformer.yaml", steps: int = 60, logged: int = 20,
              progress: bool = True) -> List[dict]:
    """The recipe's MAML module and data on the GPU, ``cuda_graph`` false then true: steps/s
    (median over the steps after the first 10) and the first ``logged`` training losses."""
    import yaml
    import lightning.pytorch as pl

    from ttt_flash.lightning import MAML
    from ttt_flash.models import NetConfig
    from ttt_flash.lightning.data import InContextRegressionDataModule, SinusoidDataModule

    cfg = yaml.safe_load(Path(recipe).read_text())
    margs = dict(cfg["model"]["init_args"])
    margs["net"] = NetConfig(**margs["net"])
    dcls = {"InContextRegressionDataModule": InContextRegressionDataModule,
            "SinusoidDataModule": SinusoidDataModule}[cfg["data"]["class_path"].rsplit(".", 1)[-1]]

    class Record(pl.Callback):
        def __init__(self):
            self.losses, self.times = [], []

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            self.losses.append(float(outputs["loss"]))
            self.times.append(time.perf_counter())

    rows = []
    for flag in (False, True):
        row = {"part": "maml", "recipe": recipe, "cuda_graph": flag, "steps": steps}
        with bench_row(row, rows, progress):
            pl.seed_everything(cfg.get("seed_everything", 0), verbose=False)
            model = MAML(**margs, cuda_graph=flag)
            data = dcls(**{**cfg["data"]["init_args"], "train_batches": steps})
            rec = Record()
            trainer = pl.Trainer(max_steps=steps, accelerator="gpu", devices=1, logger=False, callbacks=[rec],
                                 enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                                 limit_val_batches=0)
            trainer.fit(model, data)
            gaps = [b - a for a, b in zip(rec.times[10:], rec.times[11:])]
            row["steps_per_s"] = 1.0 / statistics.median(gaps)
            row["losses"] = rec.losses[:logged]
            if flag:
                row.update(graph_counts(model))
    if len(rows) == 2 and "losses" in rows[0] and "losses" in rows[1]:
        rows[1]["speedup"] = rows[1]["steps_per_s"] / rows[0]["steps_per_s"]
        rows[1]["losses_identical"] = rows[0]["losses"] == rows[1]["losses"]
        rows[1]["losses_max_rel_diff"] = max(abs(a - b) / max(abs(a), 1e-30) for a, b in zip(rows[0]["losses"], rows[1]["losses"]))
    return rows


def lm_module_rows(shapes=((1, 1024), (8, 2048)), steps: int = 26, every: int = 5, progress: bool = True) -> List[dict]:
    """recipes/sophia_gpt.yaml's LanguageModel (GPT-2 small shape, byte vocabulary, Sophia-H,
    bf16-mixed) at each (batch, seq_len), cuda_graph false then true: the median time of the
    plain steps and of the Hessian-refresh steps (every ``every`` steps), after the first
    ``every + 1`` steps (compilation, capture), the logged losses, and with cuda_graph the
    speed-ups and ``losses_identical`` (bitwise). A step is timed from a synchronisation at its
    start to one at its end, as Lightning runs it (the module's own loop, clipping at 1.0)."""
    import lightning.pytorch as pl

    from ttt_flash.lightning import ByteTextDataModule, LanguageModel
    from ttt_flash.models import GPTConfig

    class Record(pl.Callback):
        def __init__(self):
            self.rows = []

        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            torch.cuda.synchronize()
            self._t, self._step = time.perf_counter(), trainer.global_step

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            torch.cuda.synchronize()
            self.rows.append((self._step, time.perf_counter() - self._t, float(outputs["loss"])))

    rows = []
    for b, n in shapes:
        pair = []
        for flag in (False, True):
            row = {"part": "lm_module", "batch": b, "n": n, "cuda_graph": flag, "steps": steps}
            with bench_row(row, pair, progress):
                pl.seed_everything(0, verbose=False)
                model = LanguageModel(GPTConfig.gpt2_small(vocab_size=256, attention="ttt_flash"), optimizer="sophiah",
                                      lr=3e-4, betas=(0.965, 0.99), weight_decay=0.2, rho=0.04, hessian_every=every,
                                      warmup_steps=10, cuda_graph=flag)
                data = ByteTextDataModule(seq_len=n, batch_size=b, max_bytes=2**23, train_batches=steps, val_batches=1)
                rec = Record()
                trainer = pl.Trainer(max_steps=steps, accelerator="gpu", devices=1, precision="bf16-mixed", logger=False,
                                     callbacks=[rec], enable_checkpointing=False, enable_progress_bar=False,
                                     enable_model_summary=False, limit_val_batches=0, gradient_clip_val=1.0)
                trainer.fit(model, data)
                late = [(s, t) for s, t, _ in rec.rows if s > every]
                row["plain_ms"] = 1e3 * statistics.median([t for s, t in late if s % every])
                row["refresh_ms"] = 1e3 * statistics.median([t for s, t in late if s % every == 0])
                row["losses"] = [loss for _, _, loss in rec.rows]
                if flag:
                    row.update(graph_counts(model))
                    row["whole_step"] = set(model._graphed.graphs) == {"update", "refresh_update"}
        if all("plain_ms" in r for r in pair):
            pair[1]["losses_identical"] = pair[0]["losses"] == pair[1]["losses"]
            pair[1]["plain_speedup"] = pair[0]["plain_ms"] / pair[1]["plain_ms"]
            pair[1]["refresh_speedup"] = pair[0]["refresh_ms"] / pair[1]["refresh_ms"]
            pair[1]["losses_max_rel_diff"] = max(abs(a - c) / max(abs(a), 1e-30)
                                                 for a, c in zip(pair[0]["losses"], pair[1]["losses"]))
        rows += pair
    return rows


def _shapes(text: str):
    """"1x1024,8x2048" -> ((1, 1024), (8, 2048)) (batch, sequence length)."""
    try:
        shapes = tuple(tuple(int(x) for x in sh.split("x")) for sh in text.split(","))
    except ValueError:
        shapes = ()
    if not shapes or any(len(sh) != 2 or min(sh) < 1 for sh in shapes):
        raise argparse.ArgumentTypeError(f"BATCHxSEQ_LEN pairs of positive integers separated by commas "
                                         f"(e.g. 1x1024,8x2048), got {text!r}")
    return shapes


if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1].startswith("-"):
        raise SystemExit(__doc__)
    parser = build_parser((*PARTS, "maml", "lm_module"), prog="scripts/graph_bench.py OUT_DIR")
    parser.add_argument("--recipe", default="recipes/maml_transformer.yaml", help="MAML recipe (maml part)")
    parser.add_argument("--maml-steps", type=int, default=60, help="training steps per MAML run")
    parser.add_argument("--lm-shapes", default="1x1024,8x2048", type=_shapes,
                        help="lm_module part: comma-separated BATCHxSEQ_LEN shapes")
    raise SystemExit(main(["--out", sys.argv[1], *sys.argv[2:]],
                          extra={"maml": lambda a: maml_rows(a.recipe, a.maml_steps), "lm_module": lambda a: lm_module_rows(a.lm_shapes)},
                          parser=parser))
