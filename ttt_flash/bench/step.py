"""Benchmark of a first-order training step of the ``models/`` GPT, eager vs ``torch.compile``.

One step is ``loss = model.loss(x, y); loss.backward()`` (gradients of every parameter) with
``flash_attention`` in every block. Providers:

* ``eager``: the module as is.
* ``compiled``: ``torch.compile(step, fullgraph=True, backend=...)`` of the loss computation;
  the backward is the one AOTAutograd compiles with it. ``flash_attention`` enters the graph
  as the custom operators of :mod:`ttt_flash.attention.ops`.

Before timing, the compiled step's loss and gradients are compared with the eager step's
(relative max error per parameter, the worst one reported) and the first call's time
(compilation included) is recorded. Only first-order steps can be compiled: PyTorch does not
differentiate compiled backward graphs a second time (:mod:`ttt_flash.attention.ops`).

Usage::

    ttt-flash bench --gpt-step --seq-lens 4096,16384 --layers 4 --dtype bfloat16        # GPU
    ttt-flash bench --gpt-step --device cpu --seq-lens 32 --dtype float64 \\
        --compile-backend aot_eager                                                     # CPU smoke test
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import List, Optional

import torch

from .common import median_ms, new_result, progress_bar
from ..models import GPT, GPTConfig

__all__ = ["StepBenchConfig", "run_step_bench", "format_step_table"]

#: Tolerance on the compiled-vs-eager relative gradient error, per dtype (inductor reorders
#: and fuses float arithmetic, so low precisions differ by rounding).
STEP_TOLERANCE = {"float64": 1e-9, "float32": 1e-3, "bfloat16": 5e-2, "float16": 5e-2}


@dataclass
class StepBenchConfig:
    """Shapes of the GPT and of the batch; dtype is the autocast dtype for 16-bit runs
    (float32 weights), or the weights' dtype for float32/float64."""

    seq_lens: List[int] = field(default_factory=lambda: [1024, 4096])
    batch: int = 1
    heads: int = 12
    kv_heads: Optional[int] = None
    head_dim: int = 64
    layers: int = 2
    vocab_size: int = 4096
    window: Optional[int] = None
    dtype: str = "bfloat16"
    device: str = "cuda"
    providers: List[str] = field(default_factory=lambda: ["eager", "compiled"])
    compile_backend: str = "inductor"
    warmup_ms: float = 25.0
    rep_ms: float = 100.0

    def __post_init__(self):
        if self.dtype not in STEP_TOLERANCE:
            raise ValueError(f"dtype must be one of {sorted(STEP_TOLERANCE)}, got {self.dtype!r}")
        bad = [p for p in self.providers if p not in ("eager", "compiled")]
        if bad:
            raise ValueError(f"unknown step providers {bad}; choose from ['eager', 'compiled']")


def _model(cfg: StepBenchConfig) -> GPT:
    gcfg = GPTConfig(vocab_size=cfg.vocab_size, n_layer=cfg.layers, n_head=cfg.heads,
                     n_kv_head=cfg.kv_heads, d_model=cfg.heads * cfg.head_dim, window=cfg.window,
                     attention="ttt_flash")
    weights = torch.float64 if cfg.dtype == "float64" else torch.float32
    torch.manual_seed(0)
    return GPT(gcfg).to(device=cfg.device, dtype=weights)


def _loss_fn(cfg: StepBenchConfig):
    low = cfg.dtype in ("bfloat16", "float16")
    dev_type = torch.device(cfg.device).type

    def loss(model, x, y):
        if low:
            with torch.autocast(dev_type, dtype=getattr(torch, cfg.dtype)):
                return model.loss(x, y)
        return model.loss(x, y)

    return loss


def _step(model, loss_fn, x, y):
    for p in model.parameters():
        p.grad = None
    loss = loss_fn(model, x, y)
    loss.backward()
    return loss.detach()


def _grads(model):
    return [p.grad.detach().clone() for p in model.parameters()]


def _rel(a, b) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


def _sync(cfg):
    if cfg.device.startswith("cuda"):
        torch.cuda.synchronize()


def run_step_bench(cfg: StepBenchConfig, progress: bool = True) -> dict:
    """Time eager and compiled first-order GPT steps at each sequence length."""
    cuda = cfg.device.startswith("cuda")
    result = new_result(cfg, cuda)
    bar = progress_bar(cfg.seq_lens, "gpt step", progress)
    loss_fn = _loss_fn(cfg)
    for n in bar:
        torch._dynamo.reset()  # noqa: SLF001 - one fresh compilation per shape
        model = _model(cfg)
        g = torch.Generator(device=cfg.device).manual_seed(n)
        x = torch.randint(0, cfg.vocab_size, (cfg.batch, n), device=cfg.device, generator=g)
        y = torch.randint(0, cfg.vocab_size, (cfg.batch, n), device=cfg.device, generator=g)
        fns = {"eager": loss_fn}
        if "compiled" in cfg.providers:
            fns["compiled"] = torch.compile(loss_fn, fullgraph=True, backend=cfg.compile_backend)
        ref_loss = ref_grads = None
        for name in cfg.providers:
            row = {"provider": name, "N": n, "tokens": cfg.batch * n}
            try:
                _sync(cfg)
                t0 = time.perf_counter()
                loss = _step(model, fns[name], x, y)
                _sync(cfg)
                row["first_call_s"] = time.perf_counter() - t0
                if name == "eager":
                    ref_loss, ref_grads = loss, _grads(model)
                elif ref_grads is not None:
                    row["loss_rel_err"] = _rel(loss, ref_loss)
                    row["grad_rel_err"] = max(_rel(a, b) for a, b in zip(_grads(model), ref_grads))
                    row["ok"] = bool(math.isfinite(row["grad_rel_err"])
                                     and row["grad_rel_err"] <= STEP_TOLERANCE[cfg.dtype])
                if cuda:
                    torch.cuda.reset_peak_memory_stats()
                    base = torch.cuda.memory_allocated()
                ms = median_ms(cfg, lambda: _step(model, fns[name], x, y))
                row["ms"] = ms
                row["tokens_per_s"] = cfg.batch * n / (ms * 1e-3)
                if cuda:
                    row["peak_gib"] = (torch.cuda.max_memory_allocated() - base) / 2**30
            except Exception as e:  # noqa: BLE001 - reported per row
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:100]}"
            result["rows"].append(row)
        model = fns = None  # free before the next length
        if cuda:
            torch.cuda.empty_cache()
    by = {(r["provider"], r["N"]): r for r in result["rows"]}
    for r in result["rows"]:
        e = by.get(("eager", r["N"]))
        if r["provider"] == "compiled" and "ms" in r and e and "ms" in e:
            r["speedup"] = e["ms"] / r["ms"]
    return result


def format_step_table(result: dict) -> str:
    cfg = result["config"]
    lines = [
        f"first-order GPT step on {result['device_name']} ({result['date']}, torch {result['torch']}): "
        f"B={cfg['batch']} layers={cfg['layers']} H={cfg['heads']}/{cfg['kv_heads'] or cfg['heads']} "
        f"d={cfg['head_dim']} {cfg['dtype']} window={cfg['window']} compile backend={cfg['compile_backend']}",
    ]
    has_peak = any("peak_gib" in r for r in result["rows"])  # CUDA only: no column on the CPU
    lines.append(f"{'provider':<10}{'N':>8}{'ms':>10}{'tok/s':>12}" + (f"{'peak GiB':>10}" if has_peak else "")
                 + f"{'1st call s':>11}{'speedup':>9}{'grad err':>10}")
    for r in result["rows"]:
        if "ms" not in r:
            lines.append(f"{r['provider']:<10}{r['N']:>8}  {r['error']}")
            continue
        peak = (f"{r['peak_gib']:.3f}" if "peak_gib" in r else "-") if has_peak else ""
        sp = f"{r['speedup']:.2f}" if "speedup" in r else "-"
        err = f"{r['grad_rel_err']:.1e}" if "grad_rel_err" in r else "-"
        if r.get("ok") is False:
            err += " FAILED"
        lines.append(f"{r['provider']:<10}{r['N']:>8}{r['ms']:>10.2f}{r['tokens_per_s']:>12.0f}{peak:>{10 if has_peak else 0}}"
                     f"{r['first_call_s']:>11.1f}{sp:>9}{err:>10}")
    return "\n".join(lines)
