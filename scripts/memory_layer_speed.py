"""Step time and peak memory of the memory-layer MQAR recipes, before and after the
layer's parallel write, at the recipes' full lengths.

    python scripts/memory_layer_speed.py                                  # 32,768 and 131,072 tokens, CUDA
    python scripts/memory_layer_speed.py --lengths 131072 --graph         # also replayed as a CUDA graph
    OMP_NUM_THREADS=1 python scripts/memory_layer_speed.py --device cpu --lengths 1024 --batch 2 --steps 2   # smoke test

Each configuration builds :class:`ttt_flash.lightning.memory.MemoryLayerMQAR` from the recipe's
``model.init_args`` and times the module's training computation (the unwritten read, the written
forward and the backward through every write; no optimizer step) on one batch of the recipe's
task at each length. Configurations:

* ``recipe``: the recipe as written;
* ``stepwise``: the same with ``parallel_write=false`` (one autograd step through ``attend``
  per chunk write, the layer's previous computation);
* ``old``: ``qk_norm=false``, ``kv_shift=false``, ``slot_query=query``, ``conv=2``,
  ``parallel_write=false`` (the previous recipe's layer);
* with ``--graph``: ``recipe`` captured once as a CUDA graph and replayed.

Prints one line per (configuration, length): median step time over ``--steps`` timed steps
after one warm-up step, peak memory (CUDA), and the number of autograd nodes of the step's
graph; writes the table as JSON with ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import yaml

from ttt_flash.lightning.memory import MemoryLayerMQAR
from ttt_flash.memory import MemoryLM
from ttt_flash.tasks import AssociativeRecallTasks, RecallBatch

ROOT = Path(__file__).resolve().parent.parent


def _count_nodes(t: torch.Tensor) -> int:
    seen, stack = set(), [t.grad_fn]
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        stack.extend(f for f, _ in fn.next_functions)
    return len(seen)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", default=str(ROOT / "recipes/memory_layer_mqar_131k.yaml"))
    ap.add_argument("--lengths", default="32768,131072", help="comma-separated context lengths")
    ap.add_argument("--configs", default="recipe,stepwise,old", help="comma-separated: recipe, stepwise, old")
    ap.add_argument("--batch", type=int, default=None, help="sequences per step (default: the recipe's)")
    ap.add_argument("--steps", type=int, default=3, help="timed steps (after one warm-up step)")
    ap.add_argument("--graph", action="store_true", help="also time the recipe replayed as a CUDA graph")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()

    cfg = yaml.safe_load(open(args.recipe))
    model_args = dict(cfg["model"]["init_args"]["net"]["init_args"])
    data_args = cfg["data"]["init_args"]
    batch_size = args.batch or data_args["batch_size"]
    variants = {"recipe": {}, "stepwise": {"parallel_write": False},
                "old": {"qk_norm": False, "kv_shift": False, "slot_query": "query", "conv": 2, "parallel_write": False}}
    device = torch.device(args.device)
    if device.type == "cpu":
        model_args["attention"] = "math"
    rows = []
    names = [c for c in args.configs.split(",") if c]
    if args.graph and device.type == "cuda":
        names.append("recipe+graph")
    for length in (int(x) for x in args.lengths.split(",")):
        tasks = AssociativeRecallTasks(num_keys=data_args["num_keys"], num_values=data_args["num_values"],
                                       num_pairs=data_args["num_pairs"], num_queries=data_args["num_queries"],
                                       context_len=length)
        batch = RecallBatch(*(t.to(device) for t in tasks.sample(batch_size, generator=torch.Generator().manual_seed(0))))
        for name in names:
            kw = {**model_args, **variants[name.split("+")[0]]}
            torch.manual_seed(0)
            module = MemoryLayerMQAR(MemoryLM(**kw)).to(device)
            params = [p for p in module.parameters() if p.requires_grad]

            def step(*fields):
                for p in params:
                    p.grad = None if name != "recipe+graph" else p.grad
                    if p.grad is not None:
                        p.grad.zero_()
                loss = module._metrics(RecallBatch(*fields), train=True)["loss_post"]
                loss.backward()
                return loss.detach()

            run = step
            if name == "recipe+graph":
                from ttt_flash.cuda_graph import CapturedStep
                run = CapturedStep(step, tuple(batch), params=params, name="memory_layer_speed")
            if device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            nodes = None
            if name != "recipe+graph":
                loss = module._metrics(batch, train=True)["loss_post"]
                nodes = _count_nodes(loss)
                del loss
            times = []
            for i in range(args.steps + 1):
                t0 = time.perf_counter()
                run(*batch)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                if i:
                    times.append(time.perf_counter() - t0)
            peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None
            row = {"config": name, "context": length, "batch": batch_size, "step_s": statistics.median(times),
                   "peak_gib": peak, "autograd_nodes": nodes}
            rows.append(row)
            print(f"{name:14s} context {length:7d} batch {batch_size:3d}  step {row['step_s']:8.3f} s  "
                  f"peak {'-' if peak is None else f'{peak:6.1f} GiB'}  autograd nodes {nodes}", flush=True)
            del module, run
            if device.type == "cuda":
                torch.cuda.empty_cache()
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
