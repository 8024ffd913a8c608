"""Time and memory of Sophia-H training steps on a byte-level GPT, ttt_flash vs materialised attention.

For each sequence length N and attention implementation, on random byte tokens:

  plain    one first-order step: forward, backward, SophiaH.step (the 9 steps in 10 that
           reuse the Hessian estimate)
  hessian  one Hessian-refresh step: forward, backward(create_graph=True), Hutchinson
           Hessian-vector product (SophiaH.update_hessian), SophiaH.step
  k-avg    wall clock of k consecutive Sophia-H steps (one refresh) divided by k
  hvp only the update_hessian part of a refresh step

Times are medians over --reps (after one warm-up), peak memory is torch.cuda.max_memory_allocated
of the step. Each configuration runs in its own process (an out-of-memory error leaves memory
behind in the process that hit it); one that runs out of memory is reported as OOM. Before timing, the
Hutchinson estimate through ttt_flash is compared with the one through materialised attention
(same probe, same weights, small model, N = 256); no time is reported for ttt_flash if that
check fails.

GPU (the lead's figures):
    python scripts/bench_sophia.py --preset gpt2_small --seq-lens 2048 --batch 8 --json sophia_2048.json
    python scripts/bench_sophia.py --preset gpt2_small --seq-lens 8192,32768 --batch 1 --json sophia_long.json
CPU smoke run (tiny model):
    python scripts/bench_sophia.py --preset tiny --seq-lens 64,128 --batch 2 --reps 2
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import statistics
import subprocess
import sys
import time
import warnings
from typing import Dict, List, Optional, Sequence

import torch

from ttt_flash.models import GPT, GPTConfig
from ttt_flash.second_order.optim import SophiaH

warnings.filterwarnings("ignore", message=r"Using backward\(\) with create_graph=True")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _is_oom(e: BaseException) -> bool:
    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()


class Runner:
    """A GPT + SophiaH on one device, with the pieces of a training step as methods."""

    def __init__(self, args, attention: str, n: int, layers: Optional[int] = None):
        self.device = torch.device(args.device)
        kw = dict(vocab_size=256, attention=attention, checkpoint=args.checkpoint)
        if layers is not None:
            kw["n_layer"] = layers
        cfg = getattr(GPTConfig, args.preset)(**kw)
        torch.manual_seed(0)
        self.model = GPT(cfg).to(self.device)
        self.opt = SophiaH(self.model.parameters(), lr=1e-4, k=args.k)
        g = torch.Generator().manual_seed(1)
        self.idx = torch.randint(0, 256, (args.batch, n + 1), generator=g).to(self.device)
        self.autocast = (
            torch.autocast(self.device.type, dtype=torch.bfloat16)
            if args.dtype == "bfloat16"
            else contextlib.nullcontext()
        )

    def loss(self):
        with self.autocast:
            return self.model.loss(self.idx[:, :-1], self.idx[:, 1:])

    def plain_step(self) -> None:
        self.opt.zero_grad(set_to_none=True)
        self.loss().backward()
        self.opt.step()

    def hessian_step(self, timings: Optional[dict] = None) -> None:
        self.opt.zero_grad(set_to_none=True)
        self.loss().backward(create_graph=True)
        _sync(self.device)
        t0 = time.perf_counter()
        self.opt.update_hessian()
        _sync(self.device)
        if timings is not None:
            timings.setdefault("hvp", []).append(time.perf_counter() - t0)
        self.opt.step()


def _timed(fn, device, reps: int) -> Dict[str, float]:
    fn()  # warm-up (Triton compilation, allocator)
    times, peaks = [], []
    for _ in range(reps):
        _sync(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
        if device.type == "cuda":
            peaks.append(torch.cuda.max_memory_allocated(device) / 2**30)
    return {"ms": 1e3 * statistics.median(times), "peak_gib": max(peaks) if peaks else float("nan")}


def measure(args, attention: str, n: int) -> dict:
    row = {"N": n, "attention": attention, "batch": args.batch}
    try:
        r = Runner(args, attention, n)
        r.hessian_step()  # the first step must refresh the estimate
        row["plain"] = _timed(r.plain_step, r.device, args.reps)
        hvp: dict = {}
        row["hessian"] = _timed(lambda: r.hessian_step(hvp), r.device, args.reps)
        row["hvp_ms"] = 1e3 * statistics.median(hvp["hvp"][1:] or hvp["hvp"])

        def k_steps():
            r.hessian_step()
            for _ in range(args.k - 1):
                r.plain_step()

        k = _timed(k_steps, r.device, max(1, args.reps // args.k))
        row["k_avg_ms"] = k["ms"] / args.k
        row["tokens_per_s"] = args.batch * n / (row["k_avg_ms"] / 1e3)
    except Exception as e:  # noqa: BLE001 - OOM is a result, anything else is re-raised
        if not _is_oom(e):
            raise
        row["oom"] = True
    finally:
        # An OOM inside backward(create_graph=True) leaves p.grad <-> graph reference cycles:
        # collect them, or the next configuration starts with that memory still held.
        r = None
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return row


def _in_child(args, attention: str, n: int) -> dict:
    """measure() in a fresh process."""
    cmd = [sys.executable, __file__, "--preset", args.preset, "--batch", str(args.batch), "--dtype", args.dtype,
           "--device", args.device, "--k", str(args.k), "--reps", str(args.reps), "--child", f"{n}:{attention}"]
    if args.checkpoint:
        cmd.append("--checkpoint")
    r = subprocess.run(cmd, capture_output=True, text=True)
    rows = [line[4:] for line in r.stdout.splitlines() if line.startswith("ROW ")]
    if r.returncode != 0 or not rows:
        raise RuntimeError(f"benchmark of N={n} {attention} failed:\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}")
    return json.loads(rows[-1])


def check(args) -> Dict[str, float]:
    """Relative L2 difference of one Hutchinson estimate, ttt_flash vs math attention."""
    est = {}
    for attention in ("ttt_flash", "math"):
        r = Runner(args, attention, 256, layers=2)
        r.opt.zero_grad()
        r.loss().backward(create_graph=True)
        r.opt.update_hessian(generator=torch.Generator().manual_seed(2))
        est[attention] = torch.cat([r.opt.state[p]["hessian"].float().reshape(-1) for p in r.model.parameters()])
    err = ((est["ttt_flash"] - est["math"]).norm() / est["math"].norm()).item()
    tol = 5e-2 if args.dtype == "bfloat16" else 1e-3
    return {"rel_err": err, "tol": tol, "ok": err <= tol}


def table(rows: List[dict], k: int) -> str:
    head = (f"{'N':>6} {'attention':>10} | {'plain ms':>9} {'GiB':>6} | {'refresh ms':>10} {'GiB':>6} "
            f"{'hvp ms':>8} | {f'k={k} avg ms':>11} {'tok/s':>9}")
    lines = [head, "-" * len(head)]
    for r in rows:
        if r.get("oom"):
            lines.append(f"{r['N']:>6} {r['attention']:>10} | {'OOM':>9}")
            continue
        if r.get("skipped"):
            lines.append(f"{r['N']:>6} {r['attention']:>10} | {'(correctness check failed: not timed)'}")
            continue
        lines.append(
            f"{r['N']:>6} {r['attention']:>10} | {r['plain']['ms']:9.1f} {r['plain']['peak_gib']:6.2f} | "
            f"{r['hessian']['ms']:10.1f} {r['hessian']['peak_gib']:6.2f} {r['hvp_ms']:8.1f} | "
            f"{r['k_avg_ms']:11.1f} {r['tokens_per_s']:9.0f}"
        )
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=["tiny", "gpt2_small"], default="gpt2_small" if cuda else "tiny")
    p.add_argument("--seq-lens", default="2048" if cuda else "64,128", help="comma-separated N")
    p.add_argument("--batch", type=int, default=8 if cuda else 2)
    p.add_argument("--attention", default="ttt_flash,math", help="comma-separated GPTConfig.attention values")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16" if cuda else "float32",
                   help="bfloat16: autocast (float32 weights); float32: no autocast")
    p.add_argument("--device", default="cuda" if cuda else "cpu")
    p.add_argument("--k", type=int, default=10, help="Sophia-H refreshes the Hessian every k steps")
    p.add_argument("--reps", type=int, default=10 if cuda else 2)
    p.add_argument("--checkpoint", action="store_true", help="activation checkpointing in every block")
    p.add_argument("--no-check", action="store_true", help="skip the ttt_flash vs math correctness check")
    p.add_argument("--json", default=None, help="write the raw numbers here")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)  # N:attention, run in this process
    args = p.parse_args(argv)
    if args.child is not None:
        n, attention = args.child.split(":")
        print("ROW " + json.dumps(measure(args, attention, int(n))), flush=True)
        return 0
    seq_lens = [int(s) for s in args.seq_lens.split(",") if s]
    attentions = [a for a in args.attention.split(",") if a]

    dev = torch.cuda.get_device_name() if args.device.startswith("cuda") else "CPU"
    print(f"Sophia-H steps: GPT {args.preset} (byte vocab), batch {args.batch}, {args.dtype}, k={args.k}, "
          f"{args.reps} reps, on {dev}, torch {torch.__version__}", flush=True)
    gate = None if args.no_check else check(args)
    if gate is not None:
        print(f"check: Hutchinson estimate ttt_flash vs math, N=256, 2 layers: rel. L2 diff "
              f"{gate['rel_err']:.2e} (tol {gate['tol']:g}) {'OK' if gate['ok'] else 'FAILED'}", flush=True)
    rows = []
    for n in seq_lens:
        for attention in attentions:
            if attention == "ttt_flash" and gate is not None and not gate["ok"]:
                rows.append({"N": n, "attention": attention, "skipped": True})
                continue
            rows.append(_in_child(args, attention, n))
            print(table(rows[-1:], args.k).splitlines()[-1], flush=True)
    print()
    print(table(rows, args.k))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "device": dev, "torch": torch.__version__, "check": gate, "rows": rows},
                      f, indent=1)
    return 0 if gate is None or gate["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
