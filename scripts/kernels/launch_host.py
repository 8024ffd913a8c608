"""Host time of the Triton kernels' launches with cached launches off and on
(``ttt_flash.kernels.launch``): per launch of each kernel the eager chain runs, and per eager
chain.

For each shape (H = 12, d = 64, bf16; Gluon passes allowed and not): one eager chain (forward,
backward with ``create_graph``, inner product, backward over backward) is run with the switch
off and on and its outputs compared bitwise (a configuration whose outputs differ gets no
timings). Then, switch off and on interleaved (the order alternating), ``--iters`` rounds of:
each Triton launch the chain made, re-issued ``--reps`` times in a row (the median host time
of one launch), and one whole chain (its host time, no synchronisation inside). Medians over
the rounds, in microseconds.

    python3 scripts/kernels/launch_host.py --out OUT                      # B1 N1024, full and causal
    python3 scripts/kernels/launch_host.py --out OUT --shapes 1x1024c --iters 200

Writes OUT/launch_host.json and prints a table last.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
from host_phases import _shape  # the BxN[c] shape syntax (scripts/kernels/)


def _chain(x, causal):
    """The eager chain of scripts/kernels/host_phases.py; returns its outputs."""
    from ttt_flash import flash_attention

    q, k, v, do = x[:4]
    o = flash_attention(q, k, v, causal=causal)
    g = torch.autograd.grad(o, (q, k, v), do, create_graph=True)
    inner = sum((a * w).sum() for a, w in zip(g, x[4:]))
    return (o, *g, *torch.autograd.grad(inner, (q, k, v, do)))


def _recorded_launches(x, causal):
    """Every ``launch(kernel, grid, *args, **meta)`` one chain makes, as called."""
    from ttt_flash.kernels import bob, bwd, fwd, jvp

    calls = []
    modules = (fwd, bwd, bob, jvp)
    saved = [m.launch for m in modules]

    def record(kernel, grid, *args, **meta):
        calls.append((kernel, grid, args, meta))
        return saved[0](kernel, grid, *args, **meta)

    for m in modules:
        m.launch = record
    try:
        _chain(x, causal)
    finally:
        for m, f in zip(modules, saved):
            m.launch = f
    return calls


def _launch_us(call, reps: int) -> float:
    """Median host time of one re-issued launch, over ``reps`` in a row."""
    from ttt_flash.kernels.launch import launch

    kernel, grid, args, meta = call
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        launch(kernel, grid, *args, **meta)
        times.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return statistics.median(times) * 1e6


def _chain_us(x, causal) -> float:
    t0 = time.perf_counter()
    _chain(x, causal)
    t = time.perf_counter() - t0
    torch.cuda.synchronize()
    return t * 1e6


def measure(b: int, n: int, causal: bool, gluon: bool, iters: int, reps: int) -> dict:
    from ttt_flash.kernels import configs
    from ttt_flash.kernels import launch as cached

    key = f"b{b}_n{n}_{'causal' if causal else 'full'}_{'gluon' if gluon else 'triton'}"
    x = [torch.randn(b, 12, n, 64, device="cuda", dtype=torch.bfloat16) for _ in range(7)]
    for t in x[:4]:
        t.requires_grad_(True)
    with configs.use_gluon_passes(gluon):
        with cached.use_cached_launch(False):
            off = _chain(x, causal)
        with cached.use_cached_launch(True):
            on = [_chain(x, causal) for _ in range(2)][-1]  # binds, then hits
            calls = _recorded_launches(x, causal)
        same = all(torch.equal(a, c) for a, c in zip(off, on))
        row = dict(key=key, bitwise_equal=same, launches=[c[0].fn.__name__ for c in calls])
        if not same:
            return row
        for _ in range(10):
            _chain(x, causal)
        torch.cuda.synchronize()
        per = {False: [[] for _ in calls], True: [[] for _ in calls]}
        chain = {False: [], True: []}
        for i in range(iters):
            for enabled in ((False, True) if i % 2 == 0 else (True, False)):
                with cached.use_cached_launch(enabled):
                    for j, call in enumerate(calls):
                        per[enabled][j].append(_launch_us(call, reps))
                    chain[enabled].append(_chain_us(x, causal))
    for enabled, name in ((False, "off"), (True, "on")):
        row[f"launch_us_{name}"] = [statistics.median(v) for v in per[enabled]]
        row[f"chain_us_{name}"] = statistics.median(chain[enabled])
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="folder for launch_host.json")
    p.add_argument("--shapes", default="1x1024,1x1024c",
                   help="comma-separated BxN, a trailing c for causal")
    p.add_argument("--gluon", choices=("both", "on", "off"), default="both",
                   help="Gluon passes allowed (on), not (off: Triton kernels only), or both rows")
    p.add_argument("--iters", type=int, default=100, help="interleaved rounds per shape")
    p.add_argument("--reps", type=int, default=20, help="launches re-issued in a row per round")
    a = p.parse_args(argv)
    shapes = [_shape(x) for x in a.shapes.split(",")]
    if not torch.cuda.is_available():
        raise SystemExit("launch_host.py needs a CUDA GPU (it times kernel launches)")
    import triton

    os.makedirs(a.out, exist_ok=True)
    gluons = {"both": (False, True), "on": (True,), "off": (False,)}[a.gluon]
    rows = [measure(b, n, c, g, a.iters, a.reps) for b, n, c in shapes for g in gluons]
    with open(os.path.join(a.out, "launch_host.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                   "triton": triton.__version__, "iters": a.iters, "reps": a.reps, "rows": rows},
                  f, indent=1)
    print(f"{'shape':<26}{'kernel':<26}{'off us':>9}{'on us':>9}")
    for r in rows:
        if not r["bitwise_equal"]:
            print(f"{r['key']:<26}outputs differ with the switch on: no timings")
            continue
        for name, off, on in zip(r["launches"], r["launch_us_off"], r["launch_us_on"]):
            print(f"{r['key']:<26}{name:<26}{off:9.1f}{on:9.1f}")
        print(f"{r['key']:<26}{'whole chain':<26}{r['chain_us_off']:9.1f}{r['chain_us_on']:9.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
