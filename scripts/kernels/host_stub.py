"""Host time of the eager attention chain on the CPU, phase by phase, with the library's Triton
path taken and every Triton kernel launch replaced by a no-op: what the library's Python,
PyTorch's dispatch and autograd cost per chain, with no GPU and no kernel work.

The chain is the one of ``scripts/kernels/host_phases.py``: ``o = flash_attention(q, k, v,
backend="triton")``, ``dq, dk, dv = autograd.grad(o, (q, k, v), do, create_graph=True)``, the
inner product ``(dq*uq).sum() + (dk*uk).sum() + (dv*uv).sum()``, then ``autograd.grad`` of it
with respect to (q, k, v, do) (backward over backward). The script sets ``TRITON_INTERPRET=1``
before importing triton (so that ``backend="triton"`` accepts CPU tensors) and replaces the
``launch`` that the composer modules (``fwd``, ``bwd``, ``bob``, ``jvp``) imported from
``kernels/launch.py`` by a function that returns at once: outputs are uninitialised, the
host work around the launches is the library's. Small float32 tensors (default B1 H12 N16
d64) keep allocation negligible; float32 takes the row-sum passes of the CPU path (16-bit
inputs are run in float32 there, by a cast the GPU does not make).

Medians over ``--iters`` chains after ``--warmup`` chains, then a cProfile of ``--profile``
chains (top ``--top`` functions by own time). ``--rounds`` repeats the timed block (the
median of the per-round medians is reported; each round's medians are in the JSON).

    python scripts/kernels/host_stub.py                       # B1 H12 N16 d64 float32, full
    python scripts/kernels/host_stub.py --causal --iters 500
    python scripts/kernels/host_stub.py --out OUT             # also OUT/host_stub.json, OUT/host_stub_profile.txt

Prints the profile, then a table last (host ms per phase).
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: backend="triton" on the CPU

import argparse  # noqa: E402
import cProfile  # noqa: E402
import datetime  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import pstats  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # scripts/kernels/, also when loaded by path
import host_phases as _phases  # noqa: E402  (the chain; imports nothing but torch at load)

PHASES = ("fwd", "bwd", "inner", "bob")
COMPOSER_MODULES = ("fwd", "bwd", "bob", "jvp")


def _noop_launch(kernel, grid, *args, **meta):
    """``launch(kernel, grid, *args, **meta)`` that launches nothing."""
    return None


def stub_launches():
    """Replace ``launch`` in the composer modules by :func:`_noop_launch`; returns a function
    that restores them."""
    import importlib

    mods = [importlib.import_module(f"ttt_flash.kernels.{m}") for m in COMPOSER_MODULES]
    saved = [m.launch for m in mods]
    for m in mods:
        m.launch = _noop_launch

    def restore():
        for m, f in zip(mods, saved):
            m.launch = f

    return restore


def make_inputs(b, h, n, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = [torch.randn(b, h, n, d, generator=g).to(dtype) for _ in range(7)]
    for t in x[:4]:
        t.requires_grad_(True)
    return x


def chain(x, causal, rec=None):
    """One chain of ``host_phases.chain`` on the Triton path (its launches stubbed)."""
    return _phases.chain(x, causal, rec, backend="triton")


def measure(x, causal, iters, warmup, rounds):
    for _ in range(warmup):
        chain(x, causal)
    per_round = []
    for _ in range(rounds):
        rec: list = []
        for _ in range(iters):
            chain(x, causal, rec)
        med = [statistics.median(r[i] for r in rec) * 1e3 for i in range(4)]
        totals = statistics.median(sum(r) for r in rec) * 1e3
        per_round.append(dict(zip(PHASES, med), total=totals))
    keys = (*PHASES, "total")
    return {k: statistics.median(r[k] for r in per_round) for k in keys}, per_round


def profile(x, causal, count, top):
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(count):
        chain(x, causal)
    pr.disable()
    buf = io.StringIO()
    pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(top)
    return buf.getvalue()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    p.add_argument("--causal", action="store_true")
    p.add_argument("--iters", type=int, default=300, help="chains timed per round")
    p.add_argument("--warmup", type=int, default=30, help="chains run before timing")
    p.add_argument("--rounds", type=int, default=1, help="timed rounds (median of medians)")
    p.add_argument("--profile", type=int, default=200, help="chains under cProfile (0: none)")
    p.add_argument("--top", type=int, default=30, help="functions listed by own time")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--out", help="folder for host_stub.json and host_stub_profile.txt")
    a = p.parse_args(argv)
    for name, low in (("batch", 1), ("heads", 1), ("seq", 1), ("head_dim", 1), ("iters", 1), ("warmup", 0),
                      ("rounds", 1), ("profile", 0), ("top", 1), ("threads", 1)):
        if getattr(a, name) < low:
            p.error(f"--{name.replace('_', '-')} must be >= {low}, got {getattr(a, name)}")
    torch.set_num_threads(a.threads)
    import triton

    restore = stub_launches()
    try:
        x = make_inputs(a.batch, a.heads, a.seq, a.head_dim, getattr(torch, a.dtype))
        med, per_round = measure(x, a.causal, a.iters, a.warmup, a.rounds)
        prof = profile(x, a.causal, a.profile, a.top) if a.profile else ""
    finally:
        restore()
    shape = f"B{a.batch} H{a.heads} N{a.seq} d{a.head_dim} {a.dtype}{' causal' if a.causal else ''}"
    if prof:
        print(f"cProfile of {a.profile} chains, by own time:")
        print(prof)
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "host_stub.json"), "w") as f:
            json.dump({"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                       "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
                       "shape": shape, "torch": torch.__version__, "triton": triton.__version__,
                       "python": platform.python_version(), "iters": a.iters, "rounds": a.rounds,
                       "median_ms": med, "rounds_ms": per_round}, f, indent=1)
        with open(os.path.join(a.out, "host_stub_profile.txt"), "w") as f:
            f.write(prof)
    print(f"host ms per chain, launches stubbed ({shape}; median of {a.iters} chains"
          f"{f' x {a.rounds} rounds' if a.rounds > 1 else ''})")
    print(f"{'fwd':>8}{'bwd':>8}{'inner':>8}{'BoB':>8}{'total':>8}")
    print("".join(f"{med[k]:8.3f}" for k in (*PHASES, "total")))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
