"""Host time of the eager attention chain, phase by phase: where a short-sequence chain spends
its time when the GPU work is a fraction of a millisecond.

For each shape: the median host time (no synchronisation) of the forward, the first backward
with ``create_graph``, the chain's inner product <U, grad> and the backward-over-backward, over
``--iters`` chains after 10 warm-up chains; the CUDA kernels one chain launches and their GPU
time (profiler); and a cProfile of 50 chains (by own time and by cumulative time) in
OUT/<shape>_<mode>.txt. Each shape twice (``--modes``): the backward passes on the calling
thread, as the library runs them, and on PyTorch's per-device autograd threads.

    python3 scripts/kernels/host_phases.py --out OUT                     # the four shapes of docs/benchmarks.md
    python3 scripts/kernels/host_phases.py --out OUT --shapes 1x1024,1x1024c

Writes OUT/host_phases.json and prints a table last (one H200, bf16, H = 12, d = 64).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import time

import torch


def _shape(text: str):
    """"BxN" or "BxNc" (causal) -> (B, N, causal)."""
    causal = text.endswith("c")
    try:
        b, n = (int(x) for x in text[:-1 if causal else None].split("x"))
    except ValueError:
        b = n = 0
    if b < 1 or n < 1:
        raise SystemExit(f"--shapes takes BxN items (a trailing c for causal) separated by commas, "
                         f"e.g. 1x1024,1x1024c; got {text!r}")
    return b, n, causal


def chain(x, causal: bool, rec=None, backend: str = "auto"):
    """One eager chain over ``x = [q, k, v, do, uq, uk, uv]`` (q, k, v, do requiring grad):
    forward, the first backward with ``create_graph``, the inner product <U, grad>, the
    backward over backward; appends its phases' host seconds (fwd, bwd, inner, BoB) to ``rec``.
    Returns (o, dq, dk, dv, q̄, k̄, v̄, dō). ``scripts/kernels/host_stub.py`` times the same.
    The backward passes run where the library runs its own (the calling thread unless
    ``use_calling_thread(False)`` is in force: PyTorch's per-device autograd threads)."""
    from ttt_flash import flash_attention
    from ttt_flash.second_order import calling_thread_backward

    q, k, v, do, uq, uk, uv = x
    with calling_thread_backward():
        t0 = time.perf_counter()
        o = flash_attention(q, k, v, causal=causal, backend=backend)
        t1 = time.perf_counter()
        dq, dk, dv = torch.autograd.grad(o, (q, k, v), do, create_graph=True)
        t2 = time.perf_counter()
        s = (dq * uq).sum() + (dk * uk).sum() + (dv * uv).sum()
        t3 = time.perf_counter()
        bars = torch.autograd.grad(s, (q, k, v, do))
        t4 = time.perf_counter()
    if rec is not None:
        rec.append((t1 - t0, t2 - t1, t3 - t2, t4 - t3))
    return (o, dq, dk, dv, *bars)


def phases(n: int, causal: bool, b: int, iters: int, out: str, mode: str = "calling") -> dict:
    """One shape's row; ``mode`` "calling": the backward passes on the calling thread (the
    library's default), "threads": on PyTorch's per-device autograd threads."""
    from ttt_flash.second_order import use_calling_thread

    with use_calling_thread(mode == "calling"):
        row = _phases(n, causal, b, iters, out, mode)
    return row


def _phases(n: int, causal: bool, b: int, iters: int, out: str, mode: str) -> dict:
    from torch.profiler import ProfilerActivity, profile

    x = [torch.randn(b, 12, n, 64, device="cuda", dtype=torch.bfloat16) for _ in range(7)]
    for t in x[:4]:
        t.requires_grad_(True)

    def run(rec=None):
        chain(x, causal, rec)

    for _ in range(10):
        run()
    torch.cuda.synchronize()
    rec: list = []
    for _ in range(iters):
        run(rec)
    torch.cuda.synchronize()
    med = [statistics.median(r[i] for r in rec) * 1e3 for i in range(4)]
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    kernels = [e.name for e in events]
    gpu_ms = sum(getattr(e, "device_time", float("nan")) for e in events) / 1e3
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(50):
        run()
    torch.cuda.synchronize()
    pr.disable()
    key = f"b{b}_n{n}_{'causal' if causal else 'full'}_{mode}"
    with open(os.path.join(out, key + ".txt"), "w") as f:
        for order in ("tottime", "cumulative"):
            buf = io.StringIO()
            pstats.Stats(pr, stream=buf).sort_stats(order).print_stats(45)
            f.write(buf.getvalue())
    return dict(key=key, mode=mode, forward_ms=med[0], backward_ms=med[1], inner_ms=med[2], bob_ms=med[3],
                total_ms=sum(med), gpu_ms=gpu_ms, kernels=kernels)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="folder for host_phases.json and the profiles")
    p.add_argument("--shapes", default="1x1024,1x1024c,1x4096c,8x2048c",
                   help="comma-separated BxN, a trailing c for causal")
    p.add_argument("--iters", type=int, default=100, help="chains timed per shape")
    p.add_argument("--modes", default="calling,threads",
                   help="where the backward passes run, comma-separated: calling (the calling "
                        "thread, the library's default), threads (PyTorch's per-device autograd threads)")
    a = p.parse_args(argv)
    shapes = [_shape(x) for x in a.shapes.split(",")]
    modes = a.modes.split(",")
    if not modes or any(m not in ("calling", "threads") for m in modes):
        raise SystemExit(f"--modes takes calling and/or threads separated by commas; got {a.modes!r}")
    if not torch.cuda.is_available():
        raise SystemExit("host_phases.py needs a CUDA GPU (it times kernel launches)")
    os.makedirs(a.out, exist_ok=True)
    rows = [phases(n, c, b, a.iters, a.out, m) for b, n, c in shapes for m in modes]
    with open(os.path.join(a.out, "host_phases.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)
    print(f"{'shape':<26}{'forward':>9}{'backward':>10}{'inner':>8}{'BoB':>8}{'total':>8}{'kernels':>9}  (host ms)")
    for r in rows:
        print(f"{r['key']:<26}{r['forward_ms']:9.3f}{r['backward_ms']:10.3f}{r['inner_ms']:8.3f}"
              f"{r['bob_ms']:8.3f}{r['total_ms']:8.3f}{len(r['kernels']):9d}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
