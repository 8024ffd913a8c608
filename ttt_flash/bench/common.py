"""What the benchmarks share (``chain.py``, ``step.py``, ``jvp.py``,
``cp.py``, ``graph.py``) and the chain ``ttt-flash check`` runs: timing, the result dict, one measured
row, the JSON file, and the attention chain forward → backward → backward-over-backward.

Imports torch (triton.testing on CUDA, tqdm if present);
the benchmark modules import it, never each other (``chain.py`` dispatches to the others
from its ``main`` only).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
import traceback
import warnings
import weakref
from dataclasses import asdict, dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

try:  # absolute: scripts/house_ab.py loads this file by path and runs it against other trees
    from ttt_flash.second_order.grad import calling_thread_backward
except ImportError:  # a tree without the switch: the calling thread, as the library's default
    def calling_thread_backward():
        return torch.autograd.set_multithreading_enabled(False)

__all__ = [
    "AttentionShape",
    "shape_text",
    "attention_chain",
    "attended_pairs",
    "median_ms",
    "event_times",
    "burst_ms",
    "is_oom",
    "error_text",
    "new_result",
    "progress_bar",
    "measure",
    "write_json",
    "LiveBytes",
    "SyncCensus",
]


@dataclass
class AttentionShape:
    """The attention a benchmark times: shapes, dtype and mask, checked on construction."""

    seq_lens: List[int] = field(default_factory=lambda: [1024, 4096])
    batch: int = 1
    heads: int = 12
    kv_heads: Optional[int] = None  #: default: ``heads``
    head_dim: int = 64
    dtype: str = "bfloat16"
    causal: bool = False
    window: Optional[int] = None
    device: str = "cuda"

    def __post_init__(self):
        if self.kv_heads is None:
            self.kv_heads = self.heads
        if self.heads % self.kv_heads:
            raise ValueError(f"heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})")
        if self.dtype not in ("float16", "bfloat16", "float32", "float64"):
            raise ValueError(f"dtype must be float16, bfloat16, float32 or float64, got {self.dtype!r}")
        if self.window is not None and not self.causal:
            raise ValueError("window requires causal=True")


def shape_text(cfg: Dict) -> str:
    """An :class:`AttentionShape` as a result file holds it (a dict), in a table's title."""
    return (f"B={cfg['batch']} H={cfg['heads']}/{cfg['kv_heads']} d={cfg['head_dim']} {cfg['dtype']} "
            f"causal={cfg['causal']} window={cfg['window']}")


def attention_chain(attn: Callable[[Tensor, Tensor, Tensor], Tensor], q: Tensor, k: Tensor, v: Tensor,
                    do: Tensor, u: Sequence[Tensor]) -> Tuple[Tensor, ...]:
    """The chain every second-order use of attention runs: ``o = attn(q, k, v)``, the first
    backward ``(dq, dk, dv)`` for cotangent ``do`` (with its graph), then the gradients of
    ``⟨u_q, dq⟩ + ⟨u_k, dk⟩ + ⟨u_v, dv⟩`` w.r.t. ``(q, k, v, do)``.

    ``q``, ``k``, ``v``, ``do`` must require grad; ``u`` holds three tensors of the shapes of
    ``(q, k, v)``. Returns ``(o, dq, dk, dv, q̄, k̄, v̄, dō)``. Both backward passes run on
    the calling thread, as the library's second-order steps do
    (:class:`ttt_flash.second_order.calling_thread_backward`).
    """
    with calling_thread_backward():
        o = attn(q, k, v)
        grads = torch.autograd.grad(o, (q, k, v), do, create_graph=True)
        inner = sum((g * w).sum() for g, w in zip(grads, u))
        return (o, *grads, *torch.autograd.grad(inner, (q, k, v, do)))


def attended_pairs(n: int, causal: bool, window: Optional[int]) -> float:
    """(query, key) pairs that attend; causal is counted as N²/2 (the usual convention)."""
    if window is not None and window < n:
        return window * (window + 1) / 2 + (n - window) * window
    return n * n / 2 if causal else float(n * n)


def median_ms(cfg, fn: Callable) -> float:
    """Median milliseconds of fn(): ``triton.testing.do_bench`` on CUDA, a wall-clock loop on
    the CPU. ``cfg`` has ``device``, ``warmup_ms`` and ``rep_ms``."""
    if cfg.device.startswith("cuda"):
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=cfg.warmup_ms, rep=cfg.rep_ms, return_mode="median"))
    fn()
    times = []
    deadline = time.perf_counter() + max(cfg.rep_ms, 1.0) / 1e3
    while len(times) < 3 or (time.perf_counter() < deadline and len(times) < 50):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def event_times(fn: Callable, reps: int, warmup: int = 1, cuda: Optional[bool] = None) -> List[float]:
    """Milliseconds of each of ``reps`` calls of ``fn``, after ``warmup`` untimed ones: CUDA
    events around each call, synchronised after it, on a GPU (``cuda`` None: when CUDA is
    available); a wall clock on the CPU. The A/B scripts take medians and minima of these."""
    cuda = torch.cuda.is_available() if cuda is None else cuda
    for _ in range(warmup):
        fn()
    if cuda:
        torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return times


class StreamSpan:
    """The span of some work on the current CUDA stream between two CUDA events, recorded
    without synchronising: :meth:`start` before the work, :meth:`stop` after it, :meth:`ms`
    once both have completed (after a later synchronisation)."""

    def __init__(self):
        self.begin = torch.cuda.Event(enable_timing=True)
        self.end = torch.cuda.Event(enable_timing=True)

    def start(self) -> "StreamSpan":
        self.begin.record()
        return self

    def stop(self) -> "StreamSpan":
        self.end.record()
        return self

    def ms(self) -> float:
        return self.begin.elapsed_time(self.end)


def burst_ms(fn: Callable, calls: int) -> float:
    """Mean milliseconds per call of ``calls`` back-to-back calls of ``fn`` on the GPU, timed by
    one pair of CUDA events around all of them (the sustained rate, launch gaps hidden)."""
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / calls


def is_oom(e: BaseException) -> bool:
    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()


def error_text(e: BaseException) -> str:
    """A row's ``error``: ``"OOM"``, or the exception's type and first line (80 characters)."""
    return "OOM" if is_oom(e) else f"{type(e).__name__}: {str(e).splitlines()[0][:80]}"


def new_result(cfg, cuda: bool) -> dict:
    """The result dict every benchmark fills: its config, where and when it ran, no rows yet."""
    return {
        "config": asdict(cfg),
        "device_name": torch.cuda.get_device_name() if cuda else platform.processor() or "cpu",
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "rows": [],
    }


def progress_bar(items, desc: str, progress: bool):
    """tqdm over ``items`` when tqdm is installed (it comes with Lightning), else the items."""
    try:
        from tqdm.auto import tqdm
    except ImportError:  # pragma: no cover
        return items
    return tqdm(items, desc=desc, disable=not progress, leave=False)


def measure(cfg, provider: str, n: int, build: Callable[[], Tuple[Callable, float, Dict]]) -> dict:
    """One row: ``build()`` gives ``(fn, flops, extra)``; the row has ``provider``, ``N``, on
    CUDA ``peak_gib`` (of a single call of ``fn`` beyond what was allocated before), ``ms``
    (:func:`median_ms`), ``extra``'s entries and ``tflops``, or ``error`` (:func:`error_text`:
    an OOM or a refusal is a result, not a crash)."""
    cuda = cfg.device.startswith("cuda")
    row = {"provider": provider, "N": n}
    try:
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        fn, flops, extra = build()
        if cuda:
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            fn()  # its outputs are freed on return; the peak stays recorded
            torch.cuda.synchronize()
            row["peak_gib"] = (torch.cuda.max_memory_allocated() - base) / 2**30
        ms = median_ms(cfg, fn)
        row["ms"] = ms
        row.update(extra)
        row["tflops"] = flops / (ms * 1e-3) / 1e12
    except Exception as e:  # noqa: BLE001 - OOM and refusals are results, not crashes
        row["error"] = error_text(e)
    finally:
        if cuda:
            torch.cuda.empty_cache()
    return row


def write_json(result: dict, out: str, name: str) -> str:
    """Write ``result`` to ``out/name`` (creating ``out``); return the path."""
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, name)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    return path


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The module docstring as written; every option's help ends with its default."""


def flop_unit(rows: Sequence[dict]) -> tuple:
    """(name, divisor of TFLOP/s) for a table's rate column: TFLOP/s when any rate reaches
    1 TFLOP/s (GPUs), else GFLOP/s (the CPU), so that no column reads 0.0."""
    rates = [r["tflops"] for r in rows if "tflops" in r]
    return ("TFLOP/s", 1.0) if rates and max(rates) >= 1.0 else ("GFLOP/s", 1e-3)


class LiveBytes(TorchDispatchMode):
    """Peak bytes of live tensor storages created while the mode is active (the CPU stand-in
    for ``torch.cuda.max_memory_allocated``): each op's outputs are counted once per storage and
    uncounted when the storage is freed. Tensors created before entering (weights) are not
    counted; views share their base's storage.

    Example::

        >>> import torch
        >>> with LiveBytes() as m:
        ...     a = torch.zeros(1000)          # 4000 bytes
        ...     b = a * 2                      # 4000 more
        ...     del b
        ...     c = a + 1                      # 4000: peak still 8000
        >>> m.peak, m.current
        (8000, 8000)
    """

    def __init__(self):
        super().__init__()
        self.current = 0
        self.peak = 0
        self._live = {}

    def _track(self, t) -> None:
        try:
            storage = t.untyped_storage()
            key = storage.data_ptr()
        except (RuntimeError, NotImplementedError):  # storage-less tensors (meta, functorch wrappers)
            return
        n = storage.nbytes()
        if n == 0 or key in self._live:
            return
        self._live[key] = n
        self.current += n
        self.peak = max(self.peak, self.current)
        weakref.finalize(storage, self._free, key)

    def _free(self, key) -> None:
        n = self._live.pop(key, None)
        if n is not None:
            self.current -= n

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._track(t)
        return out


class SyncCensus:
    """The synchronising CUDA calls PyTorch flags (``torch.cuda.set_sync_debug_mode("warn")``:
    ``.item()``, blocking copies between host and device, ...) made between :meth:`start` and
    :meth:`stop`, each as its innermost Python frames outside torch (``file:line <- ...``) in
    :attr:`calls`. ``torch.cuda.synchronize()`` and ``Event.synchronize()`` are not flagged.
    Other warnings pass through. Start and stop may sit in different hooks (a Lightning callback)."""

    def __init__(self, frames: int = 4):
        self.frames = frames
        self.calls: List[str] = []
        self._catch = None
        self._mode = 0

    def start(self) -> None:
        if self._catch is not None:
            return
        self._catch = warnings.catch_warnings()
        self._catch.__enter__()
        shown = warnings.showwarning
        warnings.simplefilter("always")
        warnings.showwarning = lambda message, *args, **kw: self._record(message, shown, args, kw)
        self._mode = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("warn")

    def _record(self, message, shown, args, kw) -> None:
        if "synchronizing CUDA operation" not in str(message):
            shown(message, *args, **kw)
            return
        skip = ("/torch/", "/warnings.py", __file__)
        frames = [f for f in traceback.extract_stack()[:-2] if not any(s in f.filename for s in skip)]
        self.calls.append(" <- ".join(f"{os.path.basename(f.filename)}:{f.lineno}"
                                      for f in reversed(frames[-self.frames:])))

    def stop(self) -> None:
        if self._catch is None:
            return
        torch.cuda.set_sync_debug_mode(self._mode)
        self._catch.__exit__(None, None, None)
        self._catch = None
