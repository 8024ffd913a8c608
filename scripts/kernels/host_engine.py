"""Where the eager chain's host time goes between Triton's launch path, the cached launcher
and PyTorch's autograd threads (docs/benchmarks.md, "Short sequences").

Parts, on one CUDA GPU (bf16, B = 1, H = 12, d = 64):

* by default: micro costs (median microseconds: a PyTorch element-wise op, ``empty_like``, a
  sum, a trivial ``autograd.grad`` on CUDA and on the CPU with the backward on PyTorch's
  autograd threads and on the calling thread, a Triton launch through Triton and through
  ``ttt_flash.kernels.launch`` (cached)); then the chain's host time per phase (forward, first
  backward with ``create_graph``, inner product, backward over backward; median ms) at
  N = 1,024, full and causal, in six interleaved rounds of five variants: the cached launcher
  off (``off``) and on (``on``), both with the backward on PyTorch's autograd threads; on with
  the backward on the calling thread (``on_nothread``); on with Python's garbage collector off
  (``on_nogc``); on with a synchronisation after each chain (``on_sync_each``); then a CPU-op
  profile of 20 chains (OUT/profile.txt);
* ``--sdpa``: the chain (``ttt_flash.bench.common.attention_chain``) against first-order SDPA
  flash at 1,024 and 4,096 tokens, full and causal, both with their backward on PyTorch's
  autograd threads (``default``) and both on the calling thread (``calling``): eager time
  (``triton.testing.do_bench`` median) and host time (median of 200 calls), two rounds;
* ``--floor``: at 1,024 tokens, full and causal, in five interleaved rounds, all on the calling
  thread: the chain; the same chain with attention replaced by ``q * k * v`` (the chain's own
  PyTorch work, its inner product and two ``autograd.grad`` calls, with the least an attention
  could add); the inner product and its gradient alone; first-order SDPA flash. Eager and host
  medians;
* ``--jitter``: the same chain at 1,024 tokens measured five times in one process (after start,
  again, after a profiler session, after a CUDA-graph capture, after ``empty_cache``): how far
  host time drifts between measurements.

    python3 scripts/kernels/host_engine.py OUT            # micro costs, chain variants, profile
    python3 scripts/kernels/host_engine.py OUT --sdpa     # the SDPA comparison instead
    python3 scripts/kernels/host_engine.py OUT --floor    # the chain's floor instead
    python3 scripts/kernels/host_engine.py OUT --jitter   # repeated measurements of one chain

Writes OUT/probe.json (OUT/probe2.json with ``--sdpa``, OUT/floor.json with ``--floor``,
OUT/jitter.json with ``--jitter``) and prints a table last.
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import sys

import torch

import ttt_flash.kernels.launch as L
from ttt_flash import flash_attention
from ttt_flash.bench.graph import _host_ms
from ttt_flash.second_order import use_calling_thread

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # scripts/kernels/
from host_phases import chain as phased_chain  # noqa: E402  (the chain, timed phase by phase)

DEV = "cuda"


def med_us(fn, n=3000, warm=100):
    """Median host microseconds of ``fn()`` after ``warm`` calls (a synchronisation every 200)."""
    for _ in range(warm):
        fn()
    return _host_ms(fn, reps=n, block=200) * 1e3


def micro() -> dict:
    import triton
    import triton.language as tl

    res = {}
    x = torch.randn(1, 12, 1024, 64, device=DEV, dtype=torch.bfloat16)
    y = torch.randn_like(x)
    res["cuda_mul"] = med_us(lambda: x * y)
    res["cuda_empty_like"] = med_us(lambda: torch.empty_like(x))
    res["cuda_sum"] = med_us(lambda: x.sum())
    res["cuda_mulsum3"] = med_us(lambda: (x * y).sum() + (x * y).sum() + (x * y).sum())
    xc = torch.randn(1, 12, 16, 64)
    res["cpu_mul"] = med_us(lambda: xc * xc)
    for d, t in (("cuda", x), ("cpu", xc)):
        a = t.clone().requires_grad_()
        res[f"grad_trivial_{d}"] = med_us(lambda: torch.autograd.grad((a * 2).sum(), a), n=1000)
        with torch.autograd.set_multithreading_enabled(False):
            res[f"grad_trivial_{d}_nothread"] = med_us(lambda: torch.autograd.grad((a * 2).sum(), a), n=1000)

    @triton.jit
    def _k(x_ptr, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(x_ptr + i, tl.load(x_ptr + i, mask=i < n) + 1, mask=i < n)

    z = torch.zeros(4096, device=DEV)
    with L.use_cached_launch(False):
        res["triton_launch"] = med_us(lambda: _k[(4,)](z, 4096, BLOCK=1024))
    with L.use_cached_launch(True):
        res["cached_launch"] = med_us(lambda: L.launch(_k, (4,), z, 4096, BLOCK=1024))
    return res


def make(n):
    g = torch.Generator(device=DEV).manual_seed(0)
    xs = [torch.randn(1, 12, n, 64, device=DEV, dtype=torch.bfloat16, generator=g) for _ in range(7)]
    for t in xs[:4]:
        t.requires_grad_()
    return xs


def chain(xs, causal, rec=None):
    """``host_phases.chain`` with the library's switch off, so that where its backward runs is
    the caller's ``torch.autograd.set_multithreading_enabled`` setting; appends (forward,
    first backward, inner product, BoB) host seconds to ``rec``."""
    with use_calling_thread(False):
        return phased_chain(xs, causal, rec)


VARIANTS = {
    "off": dict(launch=False), "on": dict(launch=True),
    "on_nothread": dict(launch=True, nothread=True), "on_nogc": dict(launch=True, nogc=True),
    "on_sync_each": dict(launch=True, sync=True),
}


def chain_variants() -> dict:
    chains = {}
    for n, causal in ((1024, False), (1024, True)):
        xs = make(n)
        recs = {k: [] for k in VARIANTS}
        for rnd in range(6):
            order = list(VARIANTS.items()) if rnd % 2 == 0 else list(reversed(list(VARIANTS.items())))
            for name, v in order:
                with L.use_cached_launch(v["launch"]), \
                        torch.autograd.set_multithreading_enabled(not v.get("nothread")):
                    if v.get("nogc"):
                        gc.disable()
                    for i in range(60):
                        chain(xs, causal, recs[name] if i >= 10 else None)
                        if v.get("sync") or i % 20 == 19:
                            torch.cuda.synchronize()
                    gc.enable()
                    torch.cuda.synchronize()
        key = f"n{n}{'c' if causal else ''}"
        chains[key] = {name: [statistics.median(r[i] for r in rec) * 1e3 for i in range(4)]
                       + [statistics.median(sum(r) for r in rec) * 1e3]
                       for name, rec in recs.items()}
    return chains


def profile_table(out: str) -> str:
    from torch.profiler import ProfilerActivity, profile

    xs = make(1024)
    with L.use_cached_launch(True):
        for _ in range(20):
            chain(xs, False)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(20):
                chain(xs, False)
            torch.cuda.synchronize()
    tab = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=45)
    with open(os.path.join(out, "profile.txt"), "w") as f:
        f.write(tab)
    return tab


def sdpa_part(out: str) -> None:
    import torch.nn.functional as F
    import triton.testing
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from ttt_flash.bench.common import attention_chain

    def bench(fn):
        return float(triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median"))

    rows = []
    for n, causal in ((1024, False), (1024, True), (4096, False), (4096, True)):
        g = torch.Generator(device=DEV).manual_seed(0)
        q, k, v, do, uq, uk, uv = (torch.randn(1, 12, n, 64, device=DEV, dtype=torch.bfloat16, generator=g)
                                   for _ in range(7))
        leaves = [t.clone().requires_grad_() for t in (q, k, v, do)]

        def attn(a, b, c):
            return flash_attention(a, b, c, causal=causal, layout="bhnd")

        def eager():
            return attention_chain(attn, *leaves, (uq, uk, uv))

        lq, lk, lv = (t.detach().clone().requires_grad_() for t in (q, k, v))

        def sdpa():
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                o = F.scaled_dot_product_attention(lq, lk, lv, is_causal=causal)
            return torch.autograd.grad(o, (lq, lk, lv), do)

        row = {"n": n, "causal": causal}
        for _ in range(2):
            for mode in ("default", "calling"):
                with use_calling_thread(mode == "calling"), \
                        torch.autograd.set_multithreading_enabled(mode == "default"):
                    for name, fn in (("chain", eager), ("sdpa", sdpa)):
                        row.setdefault(f"{name}_{mode}_ms", []).append(bench(fn))
                        row.setdefault(f"{name}_{mode}_host", []).append(_host_ms(fn, reps=200))
        row = {k: (statistics.median(v) if isinstance(v, list) else v) for k, v in row.items()}
        for mode in ("default", "calling"):
            row[f"ratio_{mode}"] = row[f"chain_{mode}_ms"] / row[f"sdpa_{mode}_ms"]
        row["ratio_chain_calling_sdpa_default"] = row["chain_calling_ms"] / row["sdpa_default_ms"]
        rows.append(row)
        print(row, flush=True)
    with open(os.path.join(out, "probe2.json"), "w") as f:
        json.dump(rows, f, indent=1)
    print(f"{'case':10s} {'chain d':>8s} {'host d':>7s} {'chain c':>8s} {'host c':>7s} {'sdpa d':>7s} {'host':>6s} "
          f"{'sdpa c':>7s} {'host':>6s} {'r d':>5s} {'r c':>5s} {'r c/d':>5s}")
    for r in rows:
        print(f"{r['n']}{'c' if r['causal'] else ' ':9s} {r['chain_default_ms']:8.3f} {r['chain_default_host']:7.3f} "
              f"{r['chain_calling_ms']:8.3f} {r['chain_calling_host']:7.3f} {r['sdpa_default_ms']:7.3f} "
              f"{r['sdpa_default_host']:6.3f} {r['sdpa_calling_ms']:7.3f} {r['sdpa_calling_host']:6.3f} "
              f"{r['ratio_default']:5.2f} {r['ratio_calling']:5.2f} {r['ratio_chain_calling_sdpa_default']:5.2f}")


def floor_part(out: str) -> None:
    import torch.nn.functional as F
    import triton.testing
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from ttt_flash.bench.common import attention_chain

    def bench(fn):
        return float(triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median"))

    result = {}
    for causal in (False, True):
        g = torch.Generator(device=DEV).manual_seed(0)
        q, k, v, do, uq, uk, uv = (torch.randn(1, 12, 1024, 64, device=DEV, dtype=torch.bfloat16, generator=g)
                                   for _ in range(7))
        leaves = [t.clone().requires_grad_() for t in (q, k, v, do)]

        def chain():
            return attention_chain(lambda a, b, c: flash_attention(a, b, c, causal=causal, layout="bhnd"),
                                   *leaves, (uq, uk, uv))

        def skeleton():  # the chain with attention replaced by q * k * v
            return attention_chain(lambda a, b, c: a * b * c, *leaves, (uq, uk, uv))

        def inner_only():  # the inner product and its gradient alone
            with torch.autograd.set_multithreading_enabled(False):
                s = (leaves[0] * uq).sum() + (leaves[1] * uk).sum() + (leaves[2] * uv).sum()
                return torch.autograd.grad(s, leaves[:3])

        lq, lk, lv = (t.detach().clone().requires_grad_() for t in (q, k, v))

        def sdpa():
            with torch.autograd.set_multithreading_enabled(False):
                with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                    o = F.scaled_dot_product_attention(lq, lk, lv, is_causal=causal)
                return torch.autograd.grad(o, (lq, lk, lv), do)

        fns = {"chain": chain, "skeleton": skeleton, "inner_only": inner_only, "sdpa": sdpa}
        rounds = {f"{n}_{m}": [] for n in fns for m in ("eager", "host")}
        for _ in range(5):
            for name, fn in fns.items():
                rounds[f"{name}_eager"].append(bench(fn))
                rounds[f"{name}_host"].append(_host_ms(fn, reps=200))
        row = {k: statistics.median(v) for k, v in rounds.items()}
        row["rounds"] = rounds
        key = "causal" if causal else "full"
        result[key] = row
        print(key, " ".join(f"{k}={v:.3f}" for k, v in row.items() if k != "rounds"), flush=True)
    with open(os.path.join(out, "floor.json"), "w") as f:
        json.dump(result, f, indent=1)


def jitter_part(out: str) -> None:
    """The same chain measured five times in one process (host: median of 200 calls; eager:
    ``do_bench`` median), full and causal: after start, again, after a profiler session, after
    a CUDA-graph capture and replay, after ``torch.cuda.empty_cache()``."""
    import triton.testing

    from ttt_flash.bench.common import attention_chain
    from ttt_flash.bench.graph import _kernel_ms
    from ttt_flash.cuda_graph import CapturedStep

    def make_chain(causal):
        g = torch.Generator(device=DEV).manual_seed(0)
        xs = [torch.randn(1, 12, 1024, 64, device=DEV, dtype=torch.bfloat16, generator=g) for _ in range(7)]
        leaves = [t.clone().requires_grad_() for t in xs[:4]]

        def attn(a, b, c):
            return flash_attention(a, b, c, causal=causal, layout="bhnd")

        def step(q, k, v, do, uq, uk, uv):
            return attention_chain(attn, *[t.detach().requires_grad_() for t in (q, k, v, do)], (uq, uk, uv))

        return (lambda: attention_chain(attn, *leaves, xs[4:])), step, tuple(xs)

    full, step, args = make_chain(False)
    causal = make_chain(True)[0]
    rows = []

    def measure(after):
        row = {"after": after, "full_host": _host_ms(full, 200), "causal_host": _host_ms(causal, 200),
               "full_eager": float(triton.testing.do_bench(full, return_mode="median")),
               "causal_eager": float(triton.testing.do_bench(causal, return_mode="median"))}
        rows.append(row)
        print(" ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{v:24s}" for k, v in row.items()), flush=True)

    measure("start")
    measure("start, again")
    _kernel_ms(full)
    measure("a profiler session")
    graphed = CapturedStep(step, args, name="chain")
    graphed.replay()
    torch.cuda.synchronize()
    measure("a CUDA-graph capture")
    del graphed
    torch.cuda.empty_cache()
    measure("empty_cache")
    with open(os.path.join(out, "jitter.json"), "w") as f:
        json.dump(rows, f, indent=1)


def main(argv) -> int:
    usage = "usage: python3 scripts/kernels/host_engine.py OUT [--sdpa | --floor | --jitter]"
    parts = {"--sdpa": sdpa_part, "--floor": floor_part, "--jitter": jitter_part}
    if len(argv) < 1 or argv[0].startswith("-"):
        raise SystemExit(f"{usage}: OUT, the output folder, comes first")
    if len(argv) > 2 or (len(argv) == 2 and argv[1] not in parts):
        raise SystemExit(f"{usage}: at most one part, one of {', '.join(parts)}; got {' '.join(argv[1:])!r}")
    if not torch.cuda.is_available():
        raise SystemExit(f"{usage}: needs a CUDA GPU")
    out = argv[0]
    os.makedirs(out, exist_ok=True)
    if len(argv) == 2:
        parts[argv[1]](out)
        return 0
    res = micro()
    res["chains_ms_fwd_bwd_inner_bob_total"] = chains = chain_variants()
    print(profile_table(out)[:6000])
    with open(os.path.join(out, "probe.json"), "w") as f:
        json.dump(res, f, indent=1)
    for k, v in res.items():
        if k != "chains_ms_fwd_bwd_inner_bob_total":
            print(f"{k:28s} {v:8.2f} us")
    print("chain host ms: fwd bwd inner bob total")
    for key, d in chains.items():
        for name, v in d.items():
            print(f"{key:7s} {name:14s}", " ".join(f"{t:6.3f}" for t in v))
    return 0

if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
