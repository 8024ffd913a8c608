"""``ttt-flash bench --graph``: eager against CUDA-graph replay (docs/cuda-graphs.md).

Three parts (``--parts``), each a list of rows in one JSON file (``bench_graph.json``):

* ``chain``: the attention chain (forward, backward with ``create_graph``,
  backward-over-backward; B=1, H=12, d=64, bf16 by default) at each ``--seq-lens``, causal and
  not (and B=8, 2,048 causal): eager wall time, host enqueue time (the calls without a
  synchronisation), GPU kernel time (the profiler's sum over the chain's kernels), the chain
  captured and replayed, and first-order SDPA flash (forward + backward); ratios eager / SDPA
  and replay / kernel time. The chain's and SDPA's backward passes run on the calling thread
  (the library's default, :class:`ttt_flash.second_order.calling_thread_backward`); the
  ``*_threads`` columns repeat eager, host and SDPA with both on PyTorch's per-device autograd
  threads. Eager, host and SDPA are measured in 5 interleaved rounds (both placements in each):
  medians over the rounds, eager / SDPA the median of the rounds' ratios.
* ``meta``: one second-order MAML meta-step: a 4-block pre-LN transformer (d_model 256, 4 heads
  of 64, GELU MLP ×4, Linear(8→256) in, Linear(256→1) out, bf16 weights, MSE), ``--tasks``
  tasks, each one inner SGD step (lr 0.01) on a support sequence and the loss on a query
  sequence (:func:`ttt_flash.meta.inner_loop` + :func:`ttt_flash.meta.functional_loss`),
  summed, one backward. Providers: ttt-flash eager, ttt-flash replayed, the same loop with
  SDPA math attention, and ``higher`` + SDPA math (when installed); peak memory; whether the
  replayed meta-gradients (after new data) are bitwise equal to eager.
* ``lm``: a GPT-2-small-sized :class:`ttt_flash.models.GPT` (bf16) at batch 1 / 1,024 tokens
  and batch 8 / 2,048: the plain training step (forward, backward) and the exact
  Hessian-vector-product step of Sophia-H's refresh (a Rademacher probe drawn inside the step
  from a graph-safe generator), eager and replayed.

Times are medians of ``triton.testing.do_bench`` (ms). Needs CUDA. ``scripts/graph_bench.py``
adds a fourth part, a MAML recipe trained through Lightning with ``cuda_graph`` false and true
(the Lightning floor sits above the benchmarks').
"""

from __future__ import annotations

import argparse
import contextlib
import math
import statistics
import time
from typing import Callable, Dict, List, Optional, Sequence

import torch
import torch.nn.functional as F

from .common import attention_chain, is_oom, write_json
from ..second_order.grad import calling_thread_backward, use_calling_thread
from ..cuda_graph import CapturedStep, graph_safe_generator

__all__ = ["main", "chain_rows", "meta_rows", "lm_rows", "format_table", "build_parser"]

PARTS = ("chain", "meta", "lm")


def error_text(e: BaseException) -> str:
    """A row's ``error``: ``"OOM"``, or the exception's type and message (capture errors name
    the operation, so the message is kept whole up to 400 characters)."""
    return "OOM" if is_oom(e) else f"{type(e).__name__}: {str(e)[:400]}"


@contextlib.contextmanager
def bench_row(row: dict, rows: List[dict], progress: bool):
    """Measure one ``row`` in the ``with`` body: an exception there becomes the row's ``error``
    (a failed case is a row, not the end of the run); then the CUDA cache is emptied, the row
    appended to ``rows`` and, with ``progress``, printed."""
    try:
        yield row
    except Exception as e:  # noqa: BLE001 - see the docstring
        row["error"] = error_text(e)
    torch.cuda.empty_cache()
    rows.append(row)
    if progress:
        print(row_line(row), flush=True)


def _bench(fn: Callable, warmup_ms: float = 25, rep_ms: float = 200) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def _host_ms(fn: Callable, reps: int = 100, block: int = 20) -> float:
    """Host time per call of ``fn``: the median over ``reps`` calls enqueued back to back, a
    synchronisation after every ``block`` calls (the queue never fills)."""
    fn()
    torch.cuda.synchronize()
    times = []
    for i in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        if i % block == block - 1:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    return statistics.median(times) * 1e3


def _kernel_ms(fn: Callable, reps: int = 5) -> Optional[float]:
    """GPU time per call: the profiler's sum of the device durations of the kernels (and
    copies) ``fn`` launches."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    total = 0.0
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            total += e.time_range.elapsed_us()
    return total / reps / 1e3 if total > 0 else None


def _peak_gib(fn: Callable) -> float:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() / 2**30


# --------------------------------------------------------------------------- chain


def chain_rows(seq_lens: Sequence[int], heads: int = 12, head_dim: int = 64, dtype=torch.bfloat16,
               extra=((8, 2048, True),), progress: bool = True, rounds: int = 5) -> List[dict]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from ..attention import flash_attention

    cases = [(1, n, c) for n in seq_lens for c in (False, True)] + list(extra)
    rows = []
    for b, n, causal in cases:
        row = {"part": "chain", "batch": b, "n": n, "causal": causal, "heads": heads, "head_dim": head_dim}
        with bench_row(row, rows, progress):
            g = torch.Generator(device="cuda").manual_seed(0)
            r = lambda: torch.randn(b, heads, n, head_dim, device="cuda", dtype=dtype, generator=g)  # noqa: E731
            q, k, v, do, uq, uk, uv = (r() for _ in range(7))
            leaves = [t.clone().requires_grad_() for t in (q, k, v, do)]
            attn = lambda a, b_, c: flash_attention(a, b_, c, causal=causal, layout="bhnd")  # noqa: E731
            eager = lambda: attention_chain(attn, *leaves, (uq, uk, uv))  # noqa: E731

            def step(q, k, v, do, uq, uk, uv):
                return attention_chain(attn, *[t.detach().requires_grad_() for t in (q, k, v, do)], (uq, uk, uv))

            row["kernel_ms"] = _kernel_ms(eager)
            graphed = CapturedStep(step, (q, k, v, do, uq, uk, uv), name="chain")
            row["graph_ms"] = _bench(graphed.replay)
            want = eager()
            got = graphed.replay()
            row["graph_equal"] = all(torch.equal(a, b_) for a, b_ in zip(got, want))
            lq, lk, lv = (t.detach().clone().requires_grad_() for t in (q, k, v))

            def sdpa():  # the first-order step, its backward on the same thread as the chain's
                with calling_thread_backward():
                    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                        o = F.scaled_dot_product_attention(lq, lk, lv, is_causal=causal)
                    return torch.autograd.grad(o, (lq, lk, lv), do)

            # eager, host and SDPA in interleaved rounds, the calling thread (the library's
            # default) then PyTorch's per-device autograd threads in each: at short lengths
            # both sides are host-bound and the host's speed drifts, so each ratio compares
            # measurements seconds apart; medians over the rounds
            got_rounds = {k: [] for k in ("eager_ms", "host_ms", "sdpa_flash_ms", "eager_over_sdpa",
                                          "eager_threads_ms", "host_threads_ms", "sdpa_flash_threads_ms",
                                          "eager_over_sdpa_threads")}
            for _ in range(rounds):
                for suffix, calling in (("", True), ("_threads", False)):
                    with use_calling_thread(calling):
                        e, h, sd = _bench(eager), _host_ms(eager), _bench(sdpa)
                    got_rounds[f"eager{suffix}_ms"].append(e)
                    got_rounds[f"host{suffix}_ms"].append(h)
                    got_rounds[f"sdpa_flash{suffix}_ms"].append(sd)
                    got_rounds[f"eager_over_sdpa{suffix}"].append(e / sd)
            row.update({k: statistics.median(v) for k, v in got_rounds.items()})
            row["rounds"] = rounds
            if row["kernel_ms"]:
                row["graph_over_kernel"] = row["graph_ms"] / row["kernel_ms"]
            del graphed
    return rows


# --------------------------------------------------------------------------- meta-step


def _meta_net(attention: str, seed: int = 0):
    from ..models.regressors import TinyTransformer

    torch.manual_seed(seed)
    return TinyTransformer(8, 1, d_model=256, n_heads=4, n_layers=4, attention=attention).cuda().to(torch.bfloat16)


def _meta_data(n: int, tasks: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(tasks, 1, n, d, device="cuda", dtype=torch.bfloat16, generator=g) for d in (8, 1, 8, 1)]


def meta_step_fn(net, kind: str = "inner_loop") -> Callable:
    """The meta-step of the module docstring over ``(xs, ys, xq, yq)`` of shape
    (tasks, 1, N, 8 | 1): gradients zeroed in place, accumulated into ``p.grad``; returns
    the summed query loss. ``kind``: ``"inner_loop"`` (:mod:`ttt_flash.meta`) or ``"higher"``."""
    from ..meta import functional_loss, higher_inner_loop, inner_loop

    params = list(net.parameters())
    sgd = torch.optim.SGD(params, lr=0.01)

    def step(xs, ys, xq, yq):
        for p in params:
            if p.grad is not None:
                p.grad.zero_()
        total = 0.0
        for t in range(xs.shape[0]):
            if kind == "higher":
                fast = higher_inner_loop(net, F.mse_loss, (xs[t], ys[t]), 1, sgd)
            else:
                fast = inner_loop(net, dict(net.named_parameters()), F.mse_loss, (xs[t], ys[t]), 1, 0.01)
            total = total + functional_loss(net, fast, F.mse_loss, (xq[t], yq[t]))
        total.backward()
        return total.detach()

    return step


def meta_rows(seq_lens: Sequence[int] = (512, 2048), tasks: int = 4, progress: bool = True) -> List[dict]:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    try:
        import higher  # noqa: F401

        have_higher = True
    except ImportError:
        have_higher = False
    rows = []
    for n in seq_lens:
        data = _meta_data(n, tasks, 0)
        providers = ["ttt_flash_eager", "ttt_flash_graph", "sdpa_math_loop"] + (["higher_sdpa_math"] if have_higher else [])
        for provider in providers:
            row = {"part": "meta", "n": n, "tasks": tasks, "provider": provider}
            with bench_row(row, rows, progress):
                net = _meta_net("ttt_flash" if provider.startswith("ttt_flash") else "sdpa")
                for p in net.parameters():
                    p.grad = torch.zeros_like(p)
                step = meta_step_fn(net, "higher" if provider.startswith("higher") else "inner_loop")
                if provider.startswith("ttt_flash"):
                    run = lambda: step(*data)  # noqa: E731
                else:
                    def run():
                        with sdpa_kernel(SDPBackend.MATH):
                            return step(*data)
                if provider == "ttt_flash_graph":
                    graphed = CapturedStep(step, data, params=list(net.parameters()), name="meta-step")
                    row["ms"] = _bench(graphed.replay, rep_ms=300)
                    new = _meta_data(n, tasks, 1)
                    graphed(*new)
                    got = [p.grad.clone() for p in net.parameters()]
                    step(*new)
                    row["bitwise_equal_to_eager"] = all(torch.equal(a, p.grad) for a, p in zip(got, net.parameters()))
                    row["peak_gib"] = _peak_gib(graphed.replay)
                    del graphed
                else:
                    row["ms"] = _bench(run, rep_ms=300)
                    row["peak_gib"] = _peak_gib(run)
                    if provider == "ttt_flash_eager":
                        row["host_ms"] = _host_ms(run, reps=5)
    return rows


# --------------------------------------------------------------------------- language model


def lm_rows(shapes=((1, 1024), (8, 2048)), vocab_size: int = 256, progress: bool = True) -> List[dict]:
    from ..models import GPT, GPTConfig

    rows = []
    for b, n in shapes:
        torch.manual_seed(0)
        model = GPT(GPTConfig.gpt2_small(vocab_size=vocab_size, attention="ttt_flash")).cuda().to(torch.bfloat16)
        params = [p for p in model.parameters() if p.requires_grad]
        for p in params:
            p.grad = torch.zeros_like(p)
        g = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randint(0, vocab_size, (b, n), device="cuda", generator=g)
        y = torch.randint(0, vocab_size, (b, n), device="cuda", generator=g)
        gen = graph_safe_generator(seed=0)

        def plain(x, y):
            for p in params:
                p.grad.zero_()
            loss = model.loss(x, y)
            loss.backward()
            return loss.detach()

        def hvp_step(x, y):
            loss = model.loss(x, y)
            grads = torch.autograd.grad(loss, params, create_graph=True)
            vecs = [torch.randint(0, 2, p.shape, device="cuda", generator=gen).to(p.dtype).mul_(2).sub_(1) for p in params]
            hv = torch.autograd.grad(grads, params, vecs)
            return [v * h for v, h in zip(vecs, hv)]  # the Hutchinson diagonal sample

        for name, fn, kw in (("plain_step", plain, {"params": params}), ("hvp_step", hvp_step, {"generators": [gen]})):
            row = {"part": "lm", "batch": b, "n": n, "step": name}
            with bench_row(row, rows, progress):
                row["eager_ms"] = _bench(lambda: fn(x, y), rep_ms=300)
                graphed = CapturedStep(fn, (x, y), name=f"lm-{name}", **kw)
                row["graph_ms"] = _bench(graphed.replay, rep_ms=300)
                row["speedup"] = row["eager_ms"] / row["graph_ms"]
                del graphed
        del model, params
    return rows


# --------------------------------------------------------------------------- output


def _fmt(x) -> str:
    if isinstance(x, float):
        return f"{x:.3f}" if abs(x) < 100 else f"{x:.1f}"
    return str(x)


def row_line(row: dict) -> str:
    skip = {"part", "losses"}
    return f"[{row['part']}] " + "  ".join(f"{k}={_fmt(v)}" for k, v in row.items() if k not in skip)


def format_table(result: dict) -> str:
    lines = []
    chain = [r for r in result["rows"] if r["part"] == "chain"]
    if chain:
        lines.append("chain (ms)        eager   host  kernel  graph  sdpa_fa  eager/sdpa  graph/kernel  equal"
                     "  | autograd threads: eager   host  sdpa_fa  eager/sdpa")
        for r in chain:
            label = f"B{r['batch']} N{r['n']} {'causal' if r['causal'] else 'full'}"
            if "error" in r:
                lines.append(f"{label:16s}  ERROR {r['error'][:80]}")
                continue
            lines.append(f"{label:16s} {r['eager_ms']:6.2f} {r['host_ms']:6.2f} {(r['kernel_ms'] or math.nan):6.2f} "
                         f"{r['graph_ms']:6.2f} {r['sdpa_flash_ms']:7.2f} {r['eager_over_sdpa']:10.2f} "
                         f"{r.get('graph_over_kernel', math.nan):12.2f}  {str(r['graph_equal']):5s}"
                         f"  | {'':16s}{r.get('eager_threads_ms', math.nan):6.2f} "
                         f"{r.get('host_threads_ms', math.nan):6.2f} {r.get('sdpa_flash_threads_ms', math.nan):7.2f} "
                         f"{r.get('eager_over_sdpa_threads', math.nan):10.2f}")
    meta = [r for r in result["rows"] if r["part"] == "meta"]
    if meta:
        lines.append("meta-step (ms, GiB)       N  provider            ms     GiB  bitwise")
        for r in meta:
            if "error" in r:
                lines.append(f"{'':24s}{r['n']:5d}  {r['provider']:18s} ERROR {r['error'][:60]}")
                continue
            lines.append(f"{'':24s}{r['n']:5d}  {r['provider']:18s} {r['ms']:7.2f} {r['peak_gib']:6.2f}  "
                         f"{r.get('bitwise_equal_to_eager', '')}")
    for part, (label, body) in _ONE_LINE.items():  # "maml", "lm_module": scripts/graph_bench.py's parts
        lines += [label(r) + (f" ERROR {r['error'][:80]}" if "error" in r else body(r))
                  for r in result["rows"] if r["part"] == part]
    return "\n".join(lines)


def _maml_line(r: dict) -> str:
    extra = (f"  speedup {r['speedup']:.2f}x  losses identical {r['losses_identical']}"
             f" (max rel diff {r['losses_max_rel_diff']:.2e})") if "speedup" in r else ""
    return f" {r['steps_per_s']:8.1f} steps/s{extra}"


def _lm_module_line(r: dict) -> str:
    extra = (f"  plain {r['plain_speedup']:.2f}x  refresh {r['refresh_speedup']:.2f}x  loss max rel diff "
             f"{r['losses_max_rel_diff']:.1e}") if "plain_speedup" in r else ""
    if "losses_identical" in r:
        extra += f"  losses identical: {r['losses_identical']}"
    return f" plain {r['plain_ms']:8.2f} ms  refresh {r['refresh_ms']:8.2f} ms{extra}"


#: Part -> (the row's label, the rest of its line) for the parts printed one line a row.
_ONE_LINE = {
    "maml": (lambda r: f"maml cuda_graph={r['cuda_graph']!s:5s}", _maml_line),
    "lm": (lambda r: f"lm B{r['batch']} N{r['n']} {r['step']}".ljust(28),
           lambda r: f" eager {r['eager_ms']:8.2f} ms  graph {r['graph_ms']:8.2f} ms  {r['speedup']:.2f}x"),
    "lm_module": (lambda r: f"lm module B{r['batch']} N{r['n']} cuda_graph={r['cuda_graph']!s:5s}", _lm_module_line),
}


def build_parser(parts: Sequence[str] = PARTS, prog: str = "ttt-flash bench --graph") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument("--parts", default=",".join(parts), help=f"comma-separated subset of {','.join(parts)}")
    p.add_argument("--seq-lens", default="1024,4096", help="chain sequence lengths")
    p.add_argument("--meta-seq-lens", default="512,2048", help="meta-step sequence lengths")
    p.add_argument("--tasks", type=int, default=4, help="meta-step tasks")
    p.add_argument("--out", default="bench_out", help="folder for bench_graph.json")
    return p


def main(argv: Optional[Sequence[str]] = None, extra: Optional[Dict[str, Callable]] = None,
         parser: Optional[argparse.ArgumentParser] = None) -> int:
    """Run the parts named by ``--parts``; ``extra`` maps further part names to
    ``fn(args) -> rows`` (run after the built-in ones), parsed by ``parser``."""
    extra = extra or {}
    known = (*PARTS, *extra)
    a = (parser or build_parser(known)).parse_args(argv)
    parts = [x for x in a.parts.split(",") if x]
    bad = sorted(set(parts) - set(known))
    if bad:
        raise SystemExit(f"ttt-flash bench --graph: unknown part(s) {bad}; choose from {list(known)}")
    if not torch.cuda.is_available():
        raise SystemExit("ttt-flash bench --graph needs a CUDA GPU: CUDA graphs do not exist on the CPU")
    result: Dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": []}
    try:
        import triton

        result["triton"] = triton.__version__
    except ImportError:  # pragma: no cover
        pass
    runs = {"chain": lambda _: chain_rows([int(x) for x in a.seq_lens.split(",")]),
            "meta": lambda _: meta_rows([int(x) for x in a.meta_seq_lens.split(",")], a.tasks),
            "lm": lambda _: lm_rows(), **extra}
    path = write_json(result, a.out, "bench_graph.json")
    for name in known:
        if name in parts:
            result["rows"] += runs[name](a)
            # written after every part: a run cut short keeps the parts it finished
            path = write_json(result, a.out, "bench_graph.json")
    print(format_table(result))
    print(f"wrote {path}")
    return 1 if any("error" in r for r in result["rows"]) else 0


if __name__ == "__main__":
    raise SystemExit(main())
