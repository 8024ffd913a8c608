"""GPU time of recipes/sophia_gpt.yaml's LanguageModel step, eager and with ``cuda_graph``:
how long the replayed graph runs on the GPU, how many kernels it holds and where they go.

The module of ``scripts/graph_bench.py --parts lm_module`` (GPT-2 small shape, byte vocabulary,
Sophia-H refreshed every 5 steps, bf16-mixed, clipping at 1.0) at batch 1 x 1,024, trained for
31 steps per mode. Per step, with a synchronisation at its start: the wall time to a
synchronisation at its end (``total``), the host time to the end of the step before that
synchronisation (``host``), the step's span on the stream from CUDA events (``span``), and with
``cuda_graph`` the replays' GPU time (``replay_gpu``, events around ``CapturedStep.replay``)
and host time (``replay_host``); medians over steps 6-21 (plain and Hessian-refresh steps
apart). A torch.profiler trace of steps 24-29 per mode (``OUT/<mode>.json.gz``), and of the
graph mode's trace a kernel census of one plain and one refresh step: kernels by kind and by
phase (forward up to the loss, backward, and from the first multi-tensor kernel on: clipping
and the optimizer).

    python3 scripts/lm_step_kernels.py OUT                 # needs a CUDA GPU
    python3 scripts/lm_step_kernels.py --census TRACE.json.gz   # the census of a saved trace

Writes OUT/lm_step_kernels.json and prints a table last.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STEPS, EVERY, WINDOW = 31, 5, (6, 22)


def _kind(name: str) -> str:
    if "nvjet" in name or "gemm" in name or "cutlass" in name:
        return "matmul"
    if name.startswith("_sophia"):
        return "ttt_flash optimizer update"
    if name.startswith("_"):
        return "ttt_flash attention"
    if "multi_tensor" in name:
        return "multi-tensor (foreach)"
    if "reduce" in name:
        return "reduction"
    if "Memcpy" in name or "Memset" in name:
        return "memcpy / memset"
    return "element-wise and other"


def census(trace_path: str) -> dict:
    """Kernel census of a plain and a Hessian-refresh step in a graph-mode trace: steps are the
    runs of kernels separated by more than 300 us of idle stream; the refresh step is the
    longest."""
    with gzip.open(trace_path, "rt") if trace_path.endswith(".gz") else open(trace_path) as f:
        events = json.load(f)["traceEvents"]
    kernels = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")), key=lambda e: e["ts"])
    runs, cur = [], [kernels[0]]
    for a, b in zip(kernels, kernels[1:]):
        if b["ts"] - (a["ts"] + a["dur"]) > 300:
            runs.append(cur)
            cur = []
        cur.append(b)
    runs.append(cur)
    steps = [r for r in runs if len(r) > 500]
    out = {}
    for label, step in (("plain", min(steps, key=len)), ("refresh", max(steps, key=len))):
        t0 = step[0]["ts"]
        loss = next(i for i, e in enumerate(step) if "nll" in e["name"].lower() or "softmax" in e["name"].lower())
        tail = next(i for i, e in enumerate(step) if "multi_tensor" in e["name"])
        kinds = collections.defaultdict(lambda: [0, 0.0])
        for e in step:
            k = kinds[_kind(e["name"])]
            k[0] += 1
            k[1] += e["dur"] / 1e3
        out[label] = {
            "kernels": len(step),
            "span_ms": (step[-1]["ts"] + step[-1]["dur"] - t0) / 1e3,
            "busy_ms": sum(e["dur"] for e in step) / 1e3,
            "phases": {
                "forward": {"kernels": loss, "ms": (step[loss]["ts"] - t0) / 1e3},
                "backward" + (" and Hessian products" if label == "refresh" else ""):
                    {"kernels": tail - loss, "ms": (step[tail]["ts"] - step[loss]["ts"]) / 1e3},
                "clipping and optimizer": {"kernels": len(step) - tail,
                                           "ms": (step[-1]["ts"] + step[-1]["dur"] - step[tail]["ts"]) / 1e3},
            },
            "by_kind": {k: {"kernels": n, "ms": ms} for k, (n, ms) in sorted(kinds.items(), key=lambda x: -x[1][1])},
        }
    return out


def measure(out: Path) -> dict:
    import lightning.pytorch as pl
    import torch

    import ttt_flash.cuda_graph as cg
    from ttt_flash.bench.common import StreamSpan
    from ttt_flash.lightning import ByteTextDataModule, LanguageModel
    from ttt_flash.models import GPTConfig

    replays = []
    original = cg.CapturedStep.replay

    def timed_replay(self):
        t = time.perf_counter()
        span = StreamSpan().start()
        result = original(self)
        replays.append((span.stop(), time.perf_counter() - t))
        return result

    cg.CapturedStep.replay = timed_replay

    class Record(pl.Callback):
        def __init__(self):
            self.rows = []

        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            torch.cuda.synchronize()
            self.t, self.step, self.first = time.perf_counter(), trainer.global_step, len(replays)
            self.span = StreamSpan().start()

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            self.span.stop()
            host = time.perf_counter() - self.t
            torch.cuda.synchronize()
            total = time.perf_counter() - self.t
            mine = replays[self.first:]
            self.rows.append(dict(step=self.step, total=1e3 * total, host=1e3 * host, span=self.span.ms(),
                                  replay_gpu=sum(span.ms() for span, _ in mine),
                                  replay_host=1e3 * sum(h for _, h in mine)))

    result = {"command": "python3 scripts/lm_step_kernels.py OUT", "device": torch.cuda.get_device_name(),
              "torch": torch.__version__, "batch": 1, "n": 1024, "hessian_every": EVERY, "modes": {}}
    for mode, flag in (("eager", False), ("graph", True)):
        pl.seed_everything(0, verbose=False)
        model = LanguageModel(GPTConfig.gpt2_small(vocab_size=256, attention="ttt_flash"), optimizer="sophiah", lr=3e-4,
                              betas=(0.965, 0.99), weight_decay=0.2, rho=0.04, hessian_every=EVERY, warmup_steps=10,
                              cuda_graph=flag)
        data = ByteTextDataModule(seq_len=1024, batch_size=1, max_bytes=2**23, train_batches=STEPS, val_batches=1)
        rec = Record()
        prof = torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA],
            schedule=torch.profiler.schedule(wait=0, warmup=2, active=6, repeat=1, skip_first=22))

        class Step(pl.Callback):
            def on_train_batch_end(self, *args):
                prof.step()

        trainer = pl.Trainer(max_steps=STEPS, accelerator="gpu", devices=1, precision="bf16-mixed", logger=False,
                             callbacks=[rec, Step()], enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False, limit_val_batches=0, gradient_clip_val=1.0)
        with prof:
            trainer.fit(model, data)
        trace = out / f"{mode}.json"
        prof.export_chrome_trace(str(trace))
        with open(trace, "rb") as f, gzip.open(f"{trace}.gz", "wb") as g:
            g.write(f.read())
        trace.unlink()
        row = {}
        for kind in ("plain", "refresh"):
            rows = [r for r in rec.rows if WINDOW[0] <= r["step"] < WINDOW[1] and (r["step"] % EVERY == 0) == (kind == "refresh")]
            row[kind] = {k: statistics.median(r[k] for r in rows) for k in ("total", "host", "span", "replay_gpu", "replay_host")}
        if flag:
            row["census"] = census(f"{trace}.gz")
        result["modes"][mode] = row
    return result


def table(result: dict) -> str:
    lines = ["mode   step     total ms  host ms  span ms  replay GPU ms"]
    for mode, row in result["modes"].items():
        for kind in ("plain", "refresh"):
            r = row[kind]
            lines.append(f"{mode:6s} {kind:8s} {r['total']:8.2f} {r['host']:8.2f} {r['span']:8.2f} {r['replay_gpu']:10.2f}")
    cen = result["modes"].get("graph", {}).get("census") or result.get("census")
    for kind, c in (cen or {}).items():
        phases = ", ".join(f"{p} {v['kernels']} kernels {v['ms']:.2f} ms" for p, v in c["phases"].items())
        lines.append(f"graph {kind}: {c['kernels']} kernels, {c['span_ms']:.2f} ms on the stream: {phases}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="scripts/lm_step_kernels.py", description=__doc__.split("\n\n")[0])
    p.add_argument("out", nargs="?", help="folder for lm_step_kernels.json and the traces")
    p.add_argument("--census", metavar="TRACE", help="only the kernel census of a saved graph-mode trace")
    args = p.parse_args(argv)
    if args.census:
        print(json.dumps(census(args.census), indent=1))
        return 0
    if not args.out:
        p.error("give OUT (a folder for the results), or --census TRACE")
    import torch

    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU (torch.cuda.is_available() is False); --census reads a saved trace anywhere")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(ROOT))
    result = measure(out)
    (out / "lm_step_kernels.json").write_text(json.dumps(result, indent=1))
    print(table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
