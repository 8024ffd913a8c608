"""Every number of the CUDA-graph benchmark (docs/cuda-graphs.md) in one run: the parts of
``ttt-flash bench --graph`` (the chain eager / host / kernel / replayed / first-order SDPA flash
at 1K and 4K, causal and not, and B=8 2K causal; the MAML meta-step at N = 512 and 2,048:
ttt-flash eager and replayed, the same loop with SDPA math, higher + SDPA math; a GPT-2-small
step and Hessian-vector-product step at batch 1 / 1,024 and batch 8 / 2,048, eager and
replayed) and a fourth, ``maml``: recipes/maml_transformer.yaml trained through Lightning on the
GPU with cuda_graph false and true (steps/s, the first 20 logged training losses).

    python3 scripts/graph_bench.py OUT_DIR [--parts chain,meta,lm,maml] [--seq-lens 1024,4096] ...

Writes OUT_DIR/bench_graph.json and prints a table last.
"""
from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import List

import torch

from ttt_flash.bench_graph import PARTS, _row_line, build_parser, error_text, main


def maml_rows(recipe: str = "recipes/maml_transformer.yaml", steps: int = 60, logged: int = 20,
              progress: bool = True) -> List[dict]:
    """The recipe's MAML module and data on the GPU, ``cuda_graph`` false then true: steps/s
    (median over the steps after the first 10) and the first ``logged`` training losses."""
    import yaml
    import lightning.pytorch as pl

    from ttt_flash.lightning import MAML, NetConfig
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
        try:
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
            if flag and model._graphed.graphs is not None:
                row["graphs"] = len(model._graphed.graphs.graphs)
                row["eager_calls"] = model._graphed.graphs.eager_calls
        except Exception as e:  # noqa: BLE001
            row["error"] = error_text(e)
        torch.cuda.empty_cache()
        rows.append(row)
        if progress:
            print(_row_line(row), flush=True)
    if len(rows) == 2 and "losses" in rows[0] and "losses" in rows[1]:
        rows[1]["speedup"] = rows[1]["steps_per_s"] / rows[0]["steps_per_s"]
        rows[1]["losses_identical"] = rows[0]["losses"] == rows[1]["losses"]
        rows[1]["losses_max_rel_diff"] = max(abs(a - b) / max(abs(a), 1e-30) for a, b in zip(rows[0]["losses"], rows[1]["losses"]))
    return rows


if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1].startswith("-"):
        raise SystemExit(__doc__)
    parser = build_parser((*PARTS, "maml"), prog="scripts/graph_bench.py OUT_DIR")
    parser.add_argument("--recipe", default="recipes/maml_transformer.yaml", help="MAML recipe (maml part)")
    parser.add_argument("--maml-steps", type=int, default=60, help="training steps per MAML run")
    raise SystemExit(main(["--out", sys.argv[1], *sys.argv[2:]],
                          extra={"maml": lambda a: maml_rows(a.recipe, a.maml_steps)}, parser=parser))
