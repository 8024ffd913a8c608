"""``ttt-flash bench --context-parallel P``: the attention chain (forward, first backward with
``create_graph=True``, backward-over-backward: one exact Hessian-vector product) over one
sequence split across P processes (:func:`ttt_flash.distributed.context_parallel_attention`),
against the same chain in one process.

Launches P processes (``torch.multiprocessing``; NCCL with one GPU per process on CUDA,
gloo on the CPU). Per length N it reports the time of one chain on P processes (wall clock
from a barrier to the barrier after the chain, median over repetitions), the peak memory
above the inputs on every GPU, the one-process time (rank 0 alone, the others waiting) and
the speed-up. Before timing, a correctness check at a short length compares the P-process
chain with the one-process chain and a float64 materialised reference; a configuration
that fails it gets no time.

Usage::

    ttt-flash bench --context-parallel 2 --seq-lens 262144,1048576 --dtype bfloat16   # 2 GPUs
    ttt-flash bench --context-parallel 2 --device cpu --seq-lens 33 --heads 2 --head-dim 8 \\
        --dtype float64                                                              # CPU

Writes ``bench_cp.json`` into ``--out`` and prints a table.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import socket
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import List, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..attention import flash_attention
from .common import AttentionShape, shape_text, write_json
from ..distributed.context_parallel import context_parallel_attention, shard_sequence
from ..attention.reference import naive_attention

__all__ = ["CPBenchConfig", "run_cp_bench", "format_cp_table", "main_from_args"]


@dataclass
class CPBenchConfig(AttentionShape):
    """One context-parallel benchmark run: ``processes``, and the attention
    (:class:`~ttt_flash.bench.common.AttentionShape`) over the whole sequence."""

    seq_lens: List[int] = field(default_factory=lambda: [262144])
    processes: int = 2
    rep_ms: float = 100.0  #: repetitions: as many as fit in rep_ms after the first (at least 1)
    #: one chain at min(N, warmup_len) first compiles the kernels (tiles depend on the length:
    #: a warm-up at 4,096 left a first chain at 16,384 paying for compilation)
    warmup_len: int = 65536
    baseline: bool = True  #: also time one process over the whole sequence
    check: bool = True
    check_len: int = 257  #: length of the correctness check (not divisible by P)
    out: Optional[str] = "bench_out"

    def __post_init__(self):
        if isinstance(self.processes, bool) or not isinstance(self.processes, int) or self.processes < 1:
            raise ValueError(f"--context-parallel must be an int >= 1 (processes), got {self.processes!r}")
        super().__post_init__()
        if self.heads < self.processes:
            raise ValueError(f"--context-parallel {self.processes} needs at least as many heads, got {self.heads}")
        if self.device.startswith("cuda") and torch.cuda.device_count() < self.processes:
            raise ValueError(
                f"--context-parallel {self.processes} needs {self.processes} GPUs, found "
                f"{torch.cuda.device_count()}"
            )


# --------------------------------------------------------------------------- one process's work


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _chain(attn, q, k, v, do, u):
    o = attn(q, k, v)
    grads = torch.autograd.grad(o, (q, k, v), do, create_graph=True)
    inner = sum((g * w).sum() for g, w in zip(grads, u))
    return (o, *grads, *torch.autograd.grad(inner, (q, k, v, do)))


def _inputs(cfg: CPBenchConfig, n: int, dtype, device, seed: int, shard: bool):
    """q, k, v, dO (requiring grad) and the three HVP directions; this rank's block only
    when ``shard`` (generated block by block, never the whole sequence)."""
    rank, size = (dist.get_rank(), dist.get_world_size()) if shard else (0, 1)
    start, end = n * rank // size, n * (rank + 1) // size
    g = torch.Generator(device=device).manual_seed(seed + 1000 * rank)

    def r(h):
        return torch.randn(cfg.batch, h, end - start, cfg.head_dim, device=device, dtype=dtype, generator=g)

    q, k, v, do = r(cfg.heads), r(cfg.kv_heads), r(cfg.kv_heads), r(cfg.heads)
    u = (r(cfg.heads), r(cfg.kv_heads), r(cfg.kv_heads))
    for t in (q, k, v, do):
        t.requires_grad_(True)
    return q, k, v, do, u


def _sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def _timed(fn, cuda: bool, collective: bool) -> float:
    """Seconds of a single call, from a barrier to the barrier after it (all ranks done)."""
    _sync(cuda)
    if collective:
        dist.barrier()
    t0 = time.perf_counter()
    fn()
    _sync(cuda)
    if collective:
        dist.barrier()
        _sync(cuda)
    return time.perf_counter() - t0


def _repeat(cfg: CPBenchConfig, fn, cuda: bool, collective: bool, device) -> List[float]:
    """The first timed call decides (on rank 0, broadcast) how many more fit in rep_ms."""
    times = [_timed(fn, cuda, collective)]
    more = max(0, min(49, int(cfg.rep_ms / 1e3 / max(times[0], 1e-9)) - 1))
    if collective:
        t = torch.tensor([more], device=device)
        dist.broadcast(t, src=0)
        more = int(t.item())
    times += [_timed(fn, cuda, collective) for _ in range(more)]
    return times


def _check(cfg: CPBenchConfig, dtype, device) -> dict:
    """Relative L2 errors (vs float64 materialised attention) of the P-process chain and of
    the one-process chain in the benchmark dtype, at a short length, on every rank's block."""
    n = cfg.check_len
    g = torch.Generator(device=device).manual_seed(1)
    shape = lambda h: (cfg.batch, h, n, cfg.head_dim)  # noqa: E731
    full = [torch.randn(shape(h), device=device, dtype=torch.float64, generator=g)
            for h in (cfg.heads, cfg.kv_heads, cfg.kv_heads, cfg.heads, cfg.heads, cfg.kv_heads, cfg.kv_heads)]
    kw = dict(causal=cfg.causal, window=cfg.window)

    def run(attn, tensors, cast):
        q, k, v, do, *u = (t.to(cast) for t in tensors)
        for t in (q, k, v, do):
            t.requires_grad_(True)
        return _chain(attn, q, k, v, do, u)

    exact = run(lambda a, b, c: naive_attention(a, b, c, **kw), full, torch.float64)
    one = run(lambda a, b, c: flash_attention(a, b, c, **kw), full, dtype)
    cp = run(lambda a, b, c: context_parallel_attention(a, b, c, seq_len=n, **kw),
             [shard_sequence(t, 2) for t in full], dtype)
    floor = {"float64": 1e-12, "float32": 1e-5, "float16": 2e-3, "bfloat16": 1e-2}[cfg.dtype]
    names = ["o", "dq", "dk", "dv", "q_bar", "k_bar", "v_bar", "do_bar"]
    out, ok = {}, True
    for name, e, a, b in zip(names, exact, one, cp):
        e = shard_sequence(e, 2)
        a = shard_sequence(a, 2)
        # squared errors and norms summed over ranks: the relative L2 error of the whole tensor
        sums = torch.tensor([((a.double() - e).norm() ** 2).item(), ((b.double() - e).norm() ** 2).item(),
                             (e.norm() ** 2).item()], dtype=torch.float64, device=device)
        dist.all_reduce(sums)
        err_one, err_cp = (math.sqrt(sums[0].item() / sums[2].item()), math.sqrt(sums[1].item() / sums[2].item()))
        out[name] = {"one_process": err_one, "context_parallel": err_cp}
        ok &= math.isfinite(err_cp) and err_cp <= 2 * err_one + floor
    out["ok"] = ok
    return out


def _worker(rank: int, cfg: CPBenchConfig, port: int, path: str) -> None:
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off (docs/distributed.md)
    cuda = cfg.device.startswith("cuda")
    if cuda:
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // cfg.processes))
        device = torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=cfg.processes, timeout=datetime.timedelta(hours=2),
                            **({"device_id": device} if cuda else {}))
    try:
        _bench(rank, cfg, cuda, device, path)
    finally:
        dist.destroy_process_group()


def _bench(rank: int, cfg: CPBenchConfig, cuda: bool, device, path: str) -> None:
    dtype = getattr(torch, cfg.dtype)
    kw = dict(causal=cfg.causal, window=cfg.window)
    result = {"config": asdict(cfg), "rows": [], "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
              "device_name": torch.cuda.get_device_name(device) if cuda else "cpu"}
    if cfg.check:
        result["check"] = _check(cfg, dtype, device)
    ok = result.get("check", {"ok": True})["ok"]
    for n in cfg.seq_lens:
        row = {"N": n, "processes": cfg.processes}
        result["rows"].append(row)
        if not ok:
            row["error"] = "correctness check failed"
            continue
        def cp(length):
            return lambda a, b, c: context_parallel_attention(a, b, c, seq_len=length, **kw)

        m = min(n, cfg.warmup_len)  # warm-up: compiles the kernels at a short length
        _chain(cp(m), *_inputs(cfg, m, dtype, device, 0, shard=True))
        inputs = _inputs(cfg, n, dtype, device, 0, shard=True)
        _sync(cuda)
        if cuda:
            torch.cuda.empty_cache()
            base = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
        times = _repeat(cfg, lambda: _chain(cp(n), *inputs), cuda, True, device)
        row["ms_cp"] = statistics.median(times) * 1e3
        row["reps_cp"] = len(times)
        if cuda:
            peak = torch.tensor([(torch.cuda.max_memory_allocated(device) - base) / 2**30], device=device)
            peaks = [torch.zeros_like(peak) for _ in range(cfg.processes)]
            dist.all_gather(peaks, peak)
            row["peak_gib_per_rank"] = [p.item() for p in peaks]
        del inputs
        if cuda:
            torch.cuda.empty_cache()
        if cfg.baseline:
            if rank == 0:  # one process over the whole sequence, the others wait
                one = lambda a, b, c: flash_attention(a, b, c, **kw)  # noqa: E731
                _chain(one, *_inputs(cfg, min(n, cfg.warmup_len), dtype, device, 0, shard=False))
                inputs = _inputs(cfg, n, dtype, device, 0, shard=False)
                _sync(cuda)
                if cuda:
                    base = torch.cuda.memory_allocated(device)
                    torch.cuda.reset_peak_memory_stats(device)
                times = _repeat(cfg, lambda: _chain(one, *inputs), cuda, False, device)
                row["ms_one"] = statistics.median(times) * 1e3
                row["reps_one"] = len(times)
                if cuda:
                    row["peak_gib_one"] = (torch.cuda.max_memory_allocated(device) - base) / 2**30
                row["speedup"] = row["ms_one"] / row["ms_cp"]
                del inputs
                if cuda:
                    torch.cuda.empty_cache()
            dist.barrier()
    if rank == 0:
        with open(os.path.join(path, "bench_cp.json"), "w") as f:
            json.dump(result, f, indent=1)


# --------------------------------------------------------------------------- launcher


def run_cp_bench(cfg: CPBenchConfig) -> dict:
    """Launch ``cfg.processes`` processes, run the benchmark, return rank 0's result dict."""
    cuda = cfg.device.startswith("cuda")
    # spawn on CUDA (a forked child cannot use CUDA); fork on the CPU where available (the
    # children inherit the imports instead of paying for them each)
    method = "fork" if not cuda and "fork" in mp.get_all_start_methods() else "spawn"
    with tempfile.TemporaryDirectory() as path:
        mp.start_processes(_worker, args=(cfg, _free_port(), path), nprocs=cfg.processes, start_method=method)
        with open(os.path.join(path, "bench_cp.json")) as f:
            return json.load(f)


def format_cp_table(result: dict) -> str:
    cfg = result["config"]
    lines = [
        f"context-parallel chain on {cfg['processes']} x {result['device_name']} ({result['date']}, torch "
        f"{result['torch']}): " + shape_text(cfg)
    ]
    if "check" in result:
        chk = result["check"]
        worst = max(v["context_parallel"] for k, v in chk.items() if k != "ok")
        lines.append(f"correctness at N={cfg['check_len']}: worst rel. L2 vs float64 {worst:.2e} "
                     f"-> {'ok' if chk['ok'] else 'FAILED'}")
    lines.append(f"{'N':>9}{'P procs ms':>13}{'1 proc ms':>12}{'speed-up':>10}  peak GiB per rank (1 proc)")
    for r in result["rows"]:
        if "error" in r:
            lines.append(f"{r['N']:>9}  {r['error']}")
            continue
        one = f"{r['ms_one']:.1f}" if "ms_one" in r else "-"
        sp = f"{r['speedup']:.2f}" if "speedup" in r else "-"
        peaks = ", ".join(f"{p:.2f}" for p in r.get("peak_gib_per_rank", [])) or "-"
        if "peak_gib_one" in r:
            peaks += f" ({r['peak_gib_one']:.2f})"
        lines.append(f"{r['N']:>9}{r['ms_cp']:>13.1f}{one:>12}{sp:>10}  {peaks}")
    return "\n".join(lines)


def main_from_args(a) -> int:
    """``ttt-flash bench --context-parallel P`` with the parsed bench arguments ``a``."""
    cfg = CPBenchConfig(processes=a.context_parallel, seq_lens=a.seq_lens, batch=a.batch, heads=a.heads,
                        kv_heads=a.kv_heads, head_dim=a.head_dim, dtype=a.dtype, causal=a.causal,
                        window=a.window, device=a.device, rep_ms=a.rep_ms, baseline=a.cp_baseline,
                        check=not a.no_check, out=a.out)
    result = run_cp_bench(cfg)
    print(format_cp_table(result))
    if cfg.out:
        print(f"wrote {write_json(result, cfg.out, 'bench_cp.json')}")
    return 0 if result.get("check", {"ok": True})["ok"] else 1
