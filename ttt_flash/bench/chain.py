"""Benchmark of the attention "chain": forward, first backward with ``create_graph=True``
and backward-over-backward for (q, k, v, dO): one exact attention Hessian-vector product.

Providers (compared in one process, one run):

* ``ttt_flash``: :func:`ttt_flash.flash_attention` (Triton kernels on CUDA, the chunked
  reference on the CPU). ``ttt_flash_fast``: the same with ``precise_bob=False``.
* ``math``: materialised attention in plain PyTorch ops (O(N²) memory; reported as OOM
  when it runs out of memory).
* ``sdpa_flash`` / ``sdpa_cudnn``: first-order fused SDPA forward + backward (CUDA only):
  the unit for ratios. ``sdpa``: first-order SDPA with PyTorch's default choice (CPU).

Flop counts per (query, key) pair (docs/bob-math.md): chain 52·d, first-order 14·d;
causal halves both. Memory is the peak allocated above the inputs (CUDA only).

Usage::

    ttt-flash bench --seq-lens 1024,4096,16384 --dtype bfloat16          # GPU
    ttt-flash bench --device cpu --seq-lens 64,128 --dtype float64      # CPU smoke test

With ``--gpt-step``: a first-order training step of the ``models/`` GPT, eager vs
``torch.compile`` (:mod:`ttt_flash.bench.step`). With ``--graph``: eager against CUDA-graph
replay of the chain, a MAML meta-step, a MAML recipe and a GPT step (:mod:`ttt_flash.bench.graph`).

Writes ``bench.json`` (all numbers) and ``bench.png`` (time and memory vs N, log-log)
into ``--out``; prints a table. A configuration whose correctness check fails gets no
speed reported.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence

import torch

from ..attention import flash_attention
from .common import (
    AttentionShape, HelpFormatter, attended_pairs, attention_chain, flop_unit, measure, new_result, progress_bar,
    shape_text, write_json,
)
from ..attention.reference import naive_attention
from ..second_order.grad import calling_thread_backward, use_calling_thread

__all__ = ["BenchConfig", "run_bench", "chain_flops", "make_provider", "main"]

CHAIN_FLOPS_PER_PAIR_PER_D = 52
FIRST_ORDER_FLOPS_PER_PAIR_PER_D = 14


@dataclass
class BenchConfig(AttentionShape):
    """One benchmark run: shapes, dtype, mask (:class:`~ttt_flash.bench.common.AttentionShape`)
    and providers."""

    providers: List[str] = field(default_factory=lambda: ["ttt_flash", "math", "sdpa_flash", "sdpa_cudnn"])
    warmup_ms: float = 25.0
    rep_ms: float = 100.0
    check: bool = True  #: compare ttt_flash with a float64 reference before timing
    out: Optional[str] = "bench_out"
    #: False (default): every provider's backward runs on the calling thread
    #: (``torch.autograd.set_multithreading_enabled(False)``), as the library's second-order
    #: steps run; True: on PyTorch's per-device autograd threads, PyTorch's default (see
    #: docs/benchmarks.md: at short lengths the chain is host-bound)
    autograd_threads: bool = False

    def __post_init__(self):
        super().__post_init__()
        known = {"ttt_flash", "ttt_flash_fast", "math", "sdpa", "sdpa_flash", "sdpa_cudnn", "sdpa_efficient"}
        bad = [p for p in self.providers if p not in known]
        if bad:
            raise ValueError(f"unknown providers {bad}; choose from {sorted(known)}")


def chain_flops(cfg: BenchConfig, n: int, first_order: bool = False) -> float:
    """Flops of one chain (or one first-order fwd+bwd) at sequence length n."""
    per = FIRST_ORDER_FLOPS_PER_PAIR_PER_D if first_order else CHAIN_FLOPS_PER_PAIR_PER_D
    return per * cfg.head_dim * cfg.batch * cfg.heads * attended_pairs(n, cfg.causal, cfg.window)


# --------------------------------------------------------------------------- providers


def _inputs(cfg: BenchConfig, n: int, dtype, requires_grad=True, seed=0):
    g = torch.Generator(device=cfg.device).manual_seed(seed)

    def r(h):
        return torch.randn(cfg.batch, h, n, cfg.head_dim, device=cfg.device, dtype=dtype, generator=g)

    q, k, v, do = r(cfg.heads), r(cfg.kv_heads), r(cfg.kv_heads), r(cfg.heads)
    uq, uk, uv = r(cfg.heads), r(cfg.kv_heads), r(cfg.kv_heads)
    for t in (q, k, v, do):
        t.requires_grad_(requires_grad)
    return q, k, v, do, (uq, uk, uv)


def _chain_fn(attn: Callable, q, k, v, do, u) -> Callable[[], tuple]:
    return lambda: attention_chain(attn, q, k, v, do, u)


def _sdpa_first_order_fn(cfg: BenchConfig, backend: Optional[str], q, k, v, do) -> Callable[[], tuple]:
    import torch.nn.functional as F

    kw = {}
    if cfg.kv_heads != cfg.heads:
        kw["enable_gqa"] = True

    def attend():
        if cfg.window is not None:
            raise RuntimeError("SDPA has no sliding-window mask without a materialised bias")
        return F.scaled_dot_product_attention(q, k, v, is_causal=cfg.causal, **kw)

    def run():
        if backend is None:
            o = attend()
        else:
            from torch.nn.attention import SDPBackend, sdpa_kernel

            with sdpa_kernel(getattr(SDPBackend, backend)):
                o = attend()
        with calling_thread_backward():  # the chain's backward runs on the calling thread too
            return (o, *torch.autograd.grad(o, (q, k, v), do))

    return run


def make_provider(cfg: BenchConfig, provider: str, n: int):
    """``(fn, first_order)``: a no-argument callable that runs ``provider``'s chain once at
    length ``n`` on fresh inputs (B, H, n, d of ``cfg``), and whether it is first-order only
    (the SDPA providers)."""
    dtype = getattr(torch, cfg.dtype)
    q, k, v, do, u = _inputs(cfg, n, dtype)
    kw = dict(causal=cfg.causal, window=cfg.window)
    if provider in ("ttt_flash", "ttt_flash_fast"):
        kw["precise_bob"] = provider == "ttt_flash"
        return _chain_fn(lambda a, b, c: flash_attention(a, b, c, layout="bhnd", **kw), q, k, v, do, u), False
    if provider == "math":
        return _chain_fn(lambda a, b, c: naive_attention(a, b, c, **kw), q, k, v, do, u), False
    backend = {"sdpa": None, "sdpa_flash": "FLASH_ATTENTION", "sdpa_cudnn": "CUDNN_ATTENTION",
               "sdpa_efficient": "EFFICIENT_ATTENTION"}[provider]
    return _sdpa_first_order_fn(cfg, backend, q, k, v, do), True


def _single_threaded(fn: Callable) -> Callable:
    def run():
        with torch.autograd.set_multithreading_enabled(False):
            return fn()

    return run


def _on_autograd_threads(fn: Callable) -> Callable:
    def run():
        with use_calling_thread(False), torch.autograd.set_multithreading_enabled(True):
            return fn()

    return run


def _measure(cfg: BenchConfig, provider: str, n: int) -> dict:
    def build():
        fn, first_order = make_provider(cfg, provider, n)
        fn = _on_autograd_threads(fn) if cfg.autograd_threads else _single_threaded(fn)
        return fn, chain_flops(cfg, n, first_order), {"first_order": first_order}

    return measure(cfg, provider, n, build)


def check_correctness(cfg: BenchConfig, n: int = 256) -> dict:
    """Relative L2 error of each chain output of ttt_flash vs float64 materialised attention."""
    dtype = getattr(torch, cfg.dtype)
    q, k, v, do, u = _inputs(cfg, n, torch.float64, seed=1)
    kw = dict(causal=cfg.causal, window=cfg.window)
    exact = _chain_fn(lambda a, b, c: naive_attention(a, b, c, **kw), q, k, v, do, u)()
    low = [t.detach().to(dtype).requires_grad_(True) for t in (q, k, v, do)]
    ours = _chain_fn(lambda a, b, c: flash_attention(a, b, c, layout="bhnd", **kw), *low, [t.to(dtype) for t in u])()
    lowmath = _chain_fn(lambda a, b, c: naive_attention(a, b, c, **kw), *low, [t.to(dtype) for t in u])()
    names = ["o", "dq", "dk", "dv", "q_bar", "k_bar", "v_bar", "do_bar"]
    res = {}
    ok = True
    floor = {"float64": 1e-12, "float32": 1e-5, "float16": 2e-3, "bfloat16": 1e-2}[cfg.dtype]
    for name, a, m, e in zip(names, ours, lowmath, exact):
        err = ((a.double() - e).norm() / e.norm()).item()
        err_math = ((m.double() - e).norm() / e.norm()).item()
        res[name] = {"ttt_flash": err, "math_same_dtype": err_math}
        ok &= math.isfinite(err) and err <= 2 * err_math + floor
    res["ok"] = ok
    return res


def run_bench(cfg: BenchConfig, progress: bool = True) -> dict:
    """Run every (provider, N) and return a dict with the config, rows and checks."""
    cuda = cfg.device.startswith("cuda")
    providers = [p for p in cfg.providers if cuda or not p.startswith("sdpa_")]
    if not cuda and "sdpa" not in providers and any(p.startswith("sdpa_") for p in cfg.providers):
        providers.append("sdpa")
    result = new_result(cfg, cuda)
    if cfg.check and "ttt_flash" in providers:
        result["check"] = check_correctness(cfg, n=min(256, max(cfg.seq_lens)))
    checked_ok = result.get("check", {"ok": True})["ok"]
    jobs = [(p, n) for n in cfg.seq_lens for p in providers]
    bar = progress_bar(jobs, "bench", progress)
    oom = set()
    for provider, n in bar:
        if hasattr(bar, "set_postfix_str"):
            bar.set_postfix_str(f"{provider} N={n}")
        if provider in oom:
            result["rows"].append({"provider": provider, "N": n, "error": "OOM"})
            continue
        if provider.startswith("ttt_flash") and not checked_ok:
            result["rows"].append({"provider": provider, "N": n, "error": "correctness check failed"})
            continue
        row = _measure(cfg, provider, n)
        if row.get("error") == "OOM":
            oom.add(provider)
        result["rows"].append(row)
    _add_ratios(result)
    return result


def _add_ratios(result: dict) -> None:
    by = {(r["provider"], r["N"]): r for r in result["rows"]}
    for r in result["rows"]:
        if r["provider"] in ("ttt_flash", "ttt_flash_fast", "math") and "ms" in r:
            for unit in ("sdpa_flash", "sdpa_cudnn", "sdpa"):
                u = by.get((unit, r["N"]))
                if u and "ms" in u:
                    r[f"ratio_{unit}"] = r["ms"] / u["ms"]


def format_table(result: dict) -> str:
    """The printed table: one row per (provider, N). Columns without a value in any row
    (peak memory on the CPU, the cuDNN ratio without cuDNN) are left out."""
    cfg = result["config"]
    rows = result["rows"]
    lines = [
        f"chain benchmark on {result['device_name']} ({result['date']}, torch {result['torch']}): "
        + shape_text(cfg)
    ]
    if "check" in result:
        chk = result["check"]
        worst = max(v["ttt_flash"] for k, v in chk.items() if k != "ok")
        lines.append(f"correctness vs float64 at N<=256: worst rel. L2 {worst:.2e} -> {'ok' if chk['ok'] else 'FAILED'}")
    unit = "sdpa_flash" if any(r["provider"] == "sdpa_flash" for r in rows) else "sdpa"
    cudnn = any("ratio_sdpa_cudnn" in r for r in rows)
    peak = any("peak_gib" in r for r in rows)
    rate_name, rate_div = flop_unit(rows)
    lines.append(f"ratios: time / first-order {unit} fwd+bwd ('/unit')" + (" and / sdpa_cudnn ('/cudnn')" if cudnn else ""))
    if not peak:
        lines.append("peak memory: measured on CUDA only (see the GPU numbers in docs/benchmarks.md)")
    header = f"{'provider':<14}{'N':>9}{'ms':>11}{rate_name:>9}" + (f"{'peak GiB':>10}" if peak else "") + f"{'/unit':>8}"
    lines.append(header + (f"{'/cudnn':>8}" if cudnn else ""))
    for r in rows:
        if "ms" not in r:
            lines.append(f"{r['provider']:<14}{r['N']:>9}  {r['error']}")
            continue
        f1 = f"{r['ratio_sdpa_flash']:.2f}" if "ratio_sdpa_flash" in r else (f"{r['ratio_sdpa']:.2f}" if "ratio_sdpa" in r else "-")
        line = f"{r['provider']:<14}{r['N']:>9}{r['ms']:>11.3f}{r['tflops'] / rate_div:>9.{3 if rate_div < 1 else 1}f}"
        if peak:
            line += f"{r['peak_gib']:>10.3f}" if "peak_gib" in r else f"{'-':>10}"
        line += f"{f1:>8}"
        if cudnn:
            line += f"{r['ratio_sdpa_cudnn']:>8.2f}" if "ratio_sdpa_cudnn" in r else f"{'-':>8}"
        lines.append(line)
    return "\n".join(lines)


def plot_panels(result: dict) -> List[str]:
    """The panels of bench.png: "time", and "memory" when some row has a peak-memory value
    (CUDA runs; the CPU has no per-call peak to report, so its plot has the time panel only)."""
    return ["time"] + (["memory"] if any("peak_gib" in r for r in result["rows"]) else [])


def plain_log_ticks(axes, ns: List[int]) -> None:
    """Plain tick labels on log-log axes: the measured lengths on x (``16,384``), numbers such as
    ``0.5`` / ``40`` on y (matplotlib's default labels read ``4×10⁰`` on a short log range)."""
    from matplotlib import ticker

    plain = ticker.FuncFormatter(lambda v, _: f"{v:g}")
    for ax in axes:
        ax.set_xticks(ns, [f"{n:,}" for n in ns])
        ax.xaxis.set_minor_formatter(ticker.NullFormatter())
        ax.xaxis.set_minor_locator(ticker.NullLocator())
        ax.yaxis.set_major_formatter(plain)
        ax.yaxis.set_minor_formatter(plain if ax.get_ylim()[1] / max(ax.get_ylim()[0], 1e-30) < 100
                                     else ticker.NullFormatter())


def plain_text(rst: str) -> str:
    """``rst`` without reStructuredText markup, for argparse help (````x```` and ``:func:`x``` -> x)."""
    import re

    text = re.sub(r":\w+:`~?([^`]+)`", r"\1", rst)
    return re.sub(r"``([^`]+)``", r"\1", text)


def save(result: dict, out: str) -> List[str]:
    """Write bench.json and (if matplotlib is installed) bench.png into ``out``."""
    paths = [write_json(result, out, "bench.json")]
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print('matplotlib not installed (pip install -e ".[plot]" in the ttt-flash folder): no plot written')
        return paths
    panels = plot_panels(result)
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    axes = axes[0]
    providers = sorted({r["provider"] for r in result["rows"]})
    for p in providers:
        rows = [r for r in result["rows"] if r["provider"] == p and "ms" in r]
        if rows:
            axes[0].loglog([r["N"] for r in rows], [r["ms"] for r in rows], "o-", label=p)
        rows = [r for r in rows if "peak_gib" in r]
        if rows and "memory" in panels:
            axes[1].loglog([r["N"] for r in rows], [max(r["peak_gib"], 1e-4) for r in rows], "o-", label=p)
    axes[0].set(xlabel="sequence length N", ylabel="time (ms)", title="chain (sdpa: first order)")
    if "memory" in panels:
        axes[1].set(xlabel="sequence length N", ylabel="peak memory above inputs (GiB)", title="memory")
    plain_log_ticks(axes, sorted({r["N"] for r in result["rows"]}))
    for ax in axes:
        ax.grid(True, which="both", alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    fig.tight_layout()
    paths.append(os.path.join(out, "bench.png"))
    fig.savefig(paths[1], dpi=120)
    plt.close(fig)
    return paths


def _ints(s: str) -> List[int]:
    return [int(x) for x in s.replace(" ", "").split(",") if x]


def build_parser(cuda: Optional[bool] = None) -> argparse.ArgumentParser:
    """The ``ttt-flash bench`` parser. Defaults depend on whether CUDA is available (``cuda``;
    None: ask torch): GPU-sized shapes on CUDA, a seconds-long smoke test on the CPU."""
    if cuda is None:
        cuda = torch.cuda.is_available()
    where = "CUDA" if cuda else "no CUDA"
    p = argparse.ArgumentParser(prog="ttt-flash bench", description=plain_text(__doc__.split("\n\n")[0]),
                                epilog="Defaults shown are for this machine (" + where + "); on "
                                + ("the CPU: --seq-lens 64,128 --heads 2 --head-dim 16 --dtype float64."
                                   if cuda else "CUDA: --seq-lens 1024,4096 --heads 12 --head-dim 64 "
                                   "--dtype bfloat16."),
                                formatter_class=HelpFormatter)
    p.add_argument("--seq-lens", type=_ints, default="1024,4096" if cuda else "64,128", metavar="N[,N...]",
                   help="comma-separated sequence lengths N (queries = keys)")
    p.add_argument("--batch", type=int, default=1, help="batch size B")
    p.add_argument("--heads", type=int, default=12 if cuda else 2, help="query heads H")
    p.add_argument("--kv-heads", type=int, default=None,
                   help="key/value heads (a divisor of --heads: grouped-query attention); None: --heads")
    p.add_argument("--head-dim", type=int, default=64 if cuda else 16, help="head dimension d")
    p.add_argument("--dtype", choices=["float16", "bfloat16", "float32", "float64"],
                   default="bfloat16" if cuda else "float64", help="dtype of q, k, v and dO")
    p.add_argument("--causal", action=argparse.BooleanOptionalAction, default=False,
                   help="causal mask (flop counts halve)")
    p.add_argument("--window", type=int, default=None,
                   help="sliding window of keys per query (needs --causal); None: no window")
    p.add_argument("--providers", default=None,
                   help="comma-separated; None: ttt_flash,math,sdpa_flash,sdpa_cudnn "
                        "(with --gpt-step: eager,compiled); sdpa_* fall back to sdpa without CUDA")
    p.add_argument("--device", default="cuda" if cuda else "cpu", help="torch device")
    p.add_argument("--warmup-ms", type=float, default=25.0, help="warm-up time per measurement (ms; CUDA)")
    p.add_argument("--rep-ms", type=float, default=100.0, help="timed repetitions per measurement (ms)")
    p.add_argument("--no-check", action="store_true",
                   help="skip the correctness check against float64 before timing")
    p.add_argument("--autograd-threads", action=argparse.BooleanOptionalAction, default=False,
                   help="run every provider's backward on PyTorch's per-device autograd threads "
                        "(PyTorch's default); without it, on the calling thread, as the library's "
                        "second-order steps run (torch.autograd.set_multithreading_enabled(False))")
    p.add_argument("--out", default="bench_out", help="folder for bench.json and bench.png")
    p.add_argument("--jvp", action="store_true", help="forward-mode benchmark instead (ttt_flash.bench.jvp; "
                   "its options: ttt-flash bench --jvp --help)")
    p.add_argument("--graph", action="store_true", help="eager vs CUDA-graph replay of the chain, the MAML "
                   "meta-step, a MAML recipe and a GPT step instead (ttt_flash.bench.graph; its options: "
                   "ttt-flash bench --graph --help)")
    step = p.add_argument_group("first-order GPT step, eager vs torch.compile (--gpt-step)")
    step.add_argument("--gpt-step", action="store_true",
                      help="time a first-order training step of the models/ GPT, eager and compiled "
                           "(providers eager,compiled), instead of the attention chain")
    step.add_argument("--layers", type=int, default=2, help="GPT blocks (--gpt-step)")
    step.add_argument("--vocab-size", type=int, default=4096, help="GPT vocabulary (--gpt-step)")
    step.add_argument("--compile-backend", default="inductor",
                      help="torch.compile backend (--gpt-step; aot_eager needs no compiler)")
    cp = p.add_argument_group("one sequence across P processes (--context-parallel, ttt_flash.bench.cp)")
    cp.add_argument("--context-parallel", type=int, default=None, metavar="P",
                    help="time the chain on P processes (one GPU each; gloo on the CPU) against one process")
    cp.add_argument("--cp-baseline", action=argparse.BooleanOptionalAction, default=True,
                    help="--no-cp-baseline: skip the one-process timing (--context-parallel)")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if "--jvp" in args:  # forward-mode benchmark, with its own options (ttt_flash.bench.jvp)
        from .jvp import main as jvp_main

        return jvp_main([x for x in args if x != "--jvp"])
    if "--graph" in args:  # eager vs CUDA-graph replay, with its own options (ttt_flash.bench.graph)
        from .graph import main as graph_main

        return graph_main([x for x in args if x != "--graph"])
    p = build_parser()
    a = p.parse_args(argv)
    check_args(p, a)
    if a.context_parallel:
        from .cp import main_from_args

        return main_from_args(a)
    if a.gpt_step:
        return _gpt_step_main(a)
    cfg = BenchConfig(seq_lens=a.seq_lens, batch=a.batch, heads=a.heads, kv_heads=a.kv_heads,
                      head_dim=a.head_dim, dtype=a.dtype, causal=a.causal, window=a.window,
                      providers=_providers(a.providers, BenchConfig), device=a.device,
                      warmup_ms=a.warmup_ms, rep_ms=a.rep_ms, check=not a.no_check, out=a.out,
                      autograd_threads=a.autograd_threads)
    result = run_bench(cfg)
    paths = save(result, cfg.out) if cfg.out else []
    print(format_table(result))
    for path in paths:
        print(f"wrote {path}")
    return 0 if result.get("check", {"ok": True})["ok"] else 1


def check_args(p: argparse.ArgumentParser, a) -> None:
    """Argument errors (``p.error``: usage and one line, exit status 2) for values no
    benchmark can run: sizes below 1, a window below 1, query heads that are not a multiple of
    the key/value heads, negative times."""
    if not a.seq_lens or min(a.seq_lens) < 1:
        p.error(f"--seq-lens must be one or more lengths >= 1, got {a.seq_lens}")
    for flag in ("batch", "heads", "head_dim", "layers", "vocab_size"):
        if getattr(a, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(a, flag)}")
    if a.kv_heads is not None and (a.kv_heads < 1 or a.heads % a.kv_heads):
        p.error(f"--kv-heads must be >= 1 and divide --heads ({a.heads}), got {a.kv_heads}")
    if a.window is not None and a.window < 1:
        p.error(f"--window must be >= 1 (the number of most recent keys a query sees), got {a.window}")
    if a.context_parallel is not None and a.context_parallel < 1:
        p.error(f"--context-parallel must be >= 1 (processes), got {a.context_parallel}")
    for flag in ("warmup_ms", "rep_ms"):
        if not getattr(a, flag) >= 0:
            p.error(f"--{flag.replace('_', '-')} must be >= 0, got {getattr(a, flag)}")


def _providers(arg: Optional[str], config_cls) -> List[str]:
    """The --providers list, or the config class's default when not given."""
    if arg is None:
        return config_cls().providers
    return [x for x in arg.split(",") if x]


def _gpt_step_main(a) -> int:
    from .step import StepBenchConfig, format_step_table, run_step_bench

    providers = _providers(a.providers, StepBenchConfig)
    cfg = StepBenchConfig(seq_lens=a.seq_lens, batch=a.batch, heads=a.heads, kv_heads=a.kv_heads,
                          head_dim=a.head_dim, layers=a.layers, vocab_size=a.vocab_size,
                          window=a.window, dtype=a.dtype, device=a.device, providers=providers,
                          compile_backend=a.compile_backend, warmup_ms=a.warmup_ms, rep_ms=a.rep_ms)
    result = run_step_bench(cfg)
    if a.out:
        path = write_json(result, a.out, "bench_step.json")
    print(format_step_table(result))
    if a.out:
        print(f"wrote {path}")
    bad = [r for r in result["rows"] if "error" in r or r.get("ok") is False]
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
