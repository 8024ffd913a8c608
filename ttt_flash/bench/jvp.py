"""Benchmark of forward-mode AD through attention (``ttt-flash bench --jvp``).

Per sequence length N, in one process and one run (medians of ``triton.testing.do_bench``
on CUDA, of a wall-clock loop on the CPU):

* ``tangent_fwd``: the tangent-forward composer alone, O, L, Ȯ, L̇ in one pass
  (``attn_jvp``; Triton on CUDA), against ``sdpa_fwd`` (first-order fused SDPA forward,
  the flash backend on CUDA): the ``/sdpa_fwd`` column.
* ``jvp``: ``torch.func.jvp`` of :func:`ttt_flash.flash_attention` (the forward, then the
  tangent through the autograd Function).
* ``jvp_bwd``: the consistency-model step: O and Ȯ under ``torch.autograd.forward_ad``,
  then the gradients of ⟨Ō, O⟩ + ⟨Ō̇, Ȯ⟩ w.r.t. (q, k, v, q̇, k̇, v̇), against
  ``sdpa_fwd_bwd`` (first-order SDPA forward + backward) and ``chain`` (our
  reverse-over-reverse chain: forward, first backward with ``create_graph``, BoB):
  the ``/sdpa_fb`` and ``/chain`` columns.
* ``jvp_flash_attention``: where the ``jvp-flash-attention`` package is installed (a Triton
  jvp with a first-order backward; ``pip install jvp-flash-attention``, or its wheel carried
  to the GPU machine), its primal + tangent forward (``JVPAttn.fwd_dual`` under forward_ad),
  against ``sdpa_fwd``. It has no backward through the tangent, so no ``jvp_bwd`` row.

Flop counts per attending (query, key) pair, per unit of head dim (causal halves them):
forward 4, tangent forward 12 (S, Q̇Kᵀ, QK̇ᵀ, PV, (P∘Ṡ)V, PV̇), first backward 10,
BoB 38, chain 52, jvp-then-backward 4 + 10 + 10 + 10 + 30 = 64 (the autograd forward, the
tangent of that forward from its saved L (no PV), the first backward for Ō and for Ō̇, the
BoB with U = ẋ given its row statistics α = L̇ and E + αD = rowsum(Ō̇∘Ȯ): no statistics
pass and no dŌ; docs/forward-mode.md).

With ``--hvp``: one Hessian-vector product of a GPT-2-small-shaped model (12 layers,
d_model 768, 12 heads; ``--hvp-seq-len`` 2048, ``--hvp-batch`` 8 on CUDA), forward over
reverse (``ttt_flash.second_order``, ``mode="fwd_rev"``) against reverse over reverse: time and
peak memory above the weights and the direction (CUDA), and the relative difference of the
two products.

Before timing, a correctness check at N <= 256 compares the tangent forward and the
jvp-then-backward gradients with float64 materialised attention; a provider of ours whose
error exceeds 2 × that of PyTorch's same-dtype math path (plus a rounding floor) gets no speed.

Usage::

    ttt-flash bench --jvp --seq-lens 16384,65536 --hvp                       # H200, bf16
    ttt-flash bench --jvp --device cpu --seq-lens 32 --dtype float32 --hvp   # CPU smoke test
    ttt-flash bench --jvp --seq-lens 16384,65536 --profile    # + device time per kernel

Writes ``bench_jvp.json`` into ``--out`` and prints a table.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import math
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence

import torch
import torch.autograd.forward_ad as fwAD

from ..attention import backend_module, resolve_backend, flash_attention
from .common import HelpFormatter, LiveBytes, attended_pairs, error_text, flop_unit, measure, median_ms, new_result, write_json
from ..attention.reference import naive_attention

__all__ = ["JvpBenchConfig", "run_jvp_bench", "format_jvp_table", "main", "FLOPS_PER_PAIR_PER_D"]

#: Flops per attending (query, key) pair per unit of head dim, by row kind.
FLOPS_PER_PAIR_PER_D = {"tangent_fwd": 12, "jvp": 16, "jvp_bwd": 64, "chain": 52,
                        "sdpa_fwd": 4, "sdpa_fwd_bwd": 14, "jvp_flash_attention": 12}
PROVIDERS = tuple(FLOPS_PER_PAIR_PER_D)
#: Providers of other packages, run only where the package is installed.
OPTIONAL = {"jvp_flash_attention": "jvp_flash_attention"}


def default_providers() -> List[str]:
    """Every provider, the optional ones only where their package is installed."""
    return [p for p in PROVIDERS if p not in OPTIONAL or importlib.util.find_spec(OPTIONAL[p]) is not None]
_FLOOR = {"float64": 1e-12, "float32": 1e-5, "float16": 2e-3, "bfloat16": 1e-2}


@dataclass
class JvpBenchConfig:
    """One run: attention shapes, dtype, mask, providers, and the GPT HVP memory test."""

    seq_lens: List[int] = field(default_factory=lambda: [16384, 65536])
    batch: int = 1
    heads: int = 12
    head_dim: int = 64
    dtype: str = "bfloat16"
    causal: bool = False
    providers: List[str] = field(default_factory=default_providers)
    device: str = "cuda"
    warmup_ms: float = 25.0
    rep_ms: float = 100.0
    check: bool = True
    hvp: bool = False  #: also the GPT-2-small HVP, fwd_rev vs rev_rev
    hvp_seq_len: int = 2048
    hvp_batch: int = 8
    hvp_layers: int = 12
    hvp_d_model: int = 768
    hvp_vocab: int = 50304
    hvp_chunk: int = 2048  #: tokens per chunk of the recomputed vocabulary head
    profile: bool = False  #: also the device time per kernel of jvp_bwd and chain (torch.profiler)

    def __post_init__(self):
        if self.dtype not in _FLOOR:
            raise ValueError(f"dtype must be one of {sorted(_FLOOR)}, got {self.dtype!r}")
        bad = [p for p in self.providers if p not in PROVIDERS]
        if bad:
            raise ValueError(f"unknown providers {bad}; choose from {list(PROVIDERS)}")


# --------------------------------------------------------------------------- providers


def _inputs(cfg: JvpBenchConfig, n: int, dtype, seed: int = 0):
    """q, k, v, their tangents q̇, k̇, v̇, and cotangents Ō, Ō̇: (B, H, N, D) each."""
    g = torch.Generator(device=cfg.device).manual_seed(seed)
    return [torch.randn(cfg.batch, cfg.heads, n, cfg.head_dim, device=cfg.device, dtype=dtype, generator=g)
            for _ in range(8)]


def _jvp_bwd_fn(attn: Callable, x: Sequence[torch.Tensor], cot: Sequence[torch.Tensor]) -> Callable:
    """O, Ȯ under forward_ad, then the gradients w.r.t. (q, k, v, q̇, k̇, v̇)."""
    leaves = [t.detach().requires_grad_(True) for t in x]

    def run():
        with fwAD.dual_level():
            o = attn(*(fwAD.make_dual(a, t) for a, t in zip(leaves[:3], leaves[3:])))
            o, od = fwAD.unpack_dual(o)
        return (o, od, *torch.autograd.grad((o, od), leaves, cot))

    return run


def _make(cfg: JvpBenchConfig, provider: str, n: int) -> Callable:
    dtype = getattr(torch, cfg.dtype)
    q, k, v, qd, kd, vd, ob, odb = _inputs(cfg, n, dtype)
    kw = dict(causal=cfg.causal)
    if provider == "tangent_fwd":
        backend = resolve_backend("auto", q)
        scale = cfg.head_dim ** -0.5
        return lambda: backend_module(backend).attn_jvp(q, k, v, qd, kd, vd, scale=scale, causal=cfg.causal, window=None)
    if provider == "jvp":
        return lambda: torch.func.jvp(lambda a, b, c: flash_attention(a, b, c, **kw), (q, k, v), (qd, kd, vd))
    if provider == "jvp_bwd":
        return _jvp_bwd_fn(lambda a, b, c: flash_attention(a, b, c, **kw), (q, k, v, qd, kd, vd), (ob, odb))
    if provider == "jvp_flash_attention":
        return _jvp_flash_attention_fn(q, k, v, qd, kd, vd, cfg.causal)
    if provider == "chain":
        leaves = [t.requires_grad_(True) for t in (q, k, v, ob)]

        def chain():
            o = flash_attention(*leaves[:3], **kw)
            grads = torch.autograd.grad(o, leaves[:3], leaves[3], create_graph=True)
            inner = sum((g * w).sum() for g, w in zip(grads, (qd, kd, vd)))
            return torch.autograd.grad(inner, leaves)

        return chain
    import torch.nn.functional as F

    ctx = _sdpa_context(cfg)
    if provider == "sdpa_fwd":
        def fwd():
            with ctx():
                return F.scaled_dot_product_attention(q, k, v, is_causal=cfg.causal)

        return fwd
    leaves = [t.requires_grad_(True) for t in (q, k, v)]

    def fwd_bwd():
        with ctx():
            o = F.scaled_dot_product_attention(*leaves, is_causal=cfg.causal)
        return torch.autograd.grad(o, leaves, ob)

    return fwd_bwd


def _jvp_flash_attention_fn(q, k, v, qd, kd, vd, causal: bool) -> Callable:
    """The ``jvp-flash-attention`` package's primal + tangent forward (``JVPAttn.fwd_dual``
    under forward_ad): returns (o, ȯ)."""
    from jvp_flash_attention.jvp_attention import JVPAttn

    def dual():
        with fwAD.dual_level():
            o = JVPAttn.fwd_dual(fwAD.make_dual(q, qd), fwAD.make_dual(k, kd), fwAD.make_dual(v, vd),
                                 causal=causal)
            return fwAD.unpack_dual(o)

    return dual


def _sdpa_context(cfg: JvpBenchConfig):
    """The flash SDPA backend on CUDA (an error, not a fallback, if it cannot run);
    PyTorch's default choice on the CPU."""
    import contextlib

    if not cfg.device.startswith("cuda"):
        return contextlib.nullcontext
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return lambda: sdpa_kernel([SDPBackend.FLASH_ATTENTION])


def _measure(cfg: JvpBenchConfig, provider: str, n: int) -> dict:
    def build():
        flops = FLOPS_PER_PAIR_PER_D[provider] * cfg.head_dim * cfg.batch * cfg.heads
        return _make(cfg, provider, n), flops * attended_pairs(n, cfg.causal, None), {}

    return measure(cfg, provider, n, build)


# --------------------------------------------------------------------------- correctness


def _rel(a: torch.Tensor, e: torch.Tensor) -> float:
    return ((a.double() - e).norm() / e.norm().clamp_min(1e-300)).item()


def check_correctness(cfg: JvpBenchConfig, n: int = 256) -> dict:
    """Relative L2 errors vs float64 materialised attention of the tangent forward (o, ȯ) and
    of the jvp-then-backward gradients, ours and PyTorch's math path in the same dtype."""
    dtype = getattr(torch, cfg.dtype)
    x64 = _inputs(cfg, n, torch.float64, seed=1)
    low = [t.to(dtype) for t in x64]
    kw = dict(causal=cfg.causal)
    naive = lambda a, b, c: naive_attention(a, b, c, **kw)  # noqa: E731
    ours = lambda a, b, c: flash_attention(a, b, c, **kw)  # noqa: E731

    def run(attn, x):
        o, od = torch.func.jvp(attn, tuple(x[:3]), tuple(x[3:6]))

        def loss(q, k, v, a, b, c):
            o, od = torch.func.jvp(attn, (q, k, v), (a, b, c))
            return (o * x[6]).sum() + (od * x[7]).sum()

        return (o, od, *torch.func.grad(loss, argnums=tuple(range(6)))(*x[:6]))

    exact, mine, lowmath = run(naive, x64), run(ours, low), run(naive, low)
    backend = resolve_backend("auto", low[0])
    o, _, od, _ = backend_module(backend).attn_jvp(*low[:6], scale=cfg.head_dim ** -0.5, causal=cfg.causal, window=None)
    names = ["o", "od", "q_bar", "k_bar", "v_bar", "qd_bar", "kd_bar", "vd_bar"]
    res, ok = {}, True
    for name, a, m, e in zip(names, mine, lowmath, exact):
        err, err_math = _rel(a, e), _rel(m, e)
        res[name] = {"ttt_flash": err, "math_same_dtype": err_math}
        ok &= math.isfinite(err) and err <= 2 * err_math + _FLOOR[cfg.dtype]
    for name, a, i in (("tangent_fwd_o", o, 0), ("tangent_fwd_od", od, 1)):
        err, err_math = _rel(a, exact[i]), res[names[i]]["math_same_dtype"]
        res[name] = {"ttt_flash": err, "math_same_dtype": err_math}
        ok &= math.isfinite(err) and err <= 2 * err_math + _FLOOR[cfg.dtype]
    res["ok"] = bool(ok)
    if "jvp_flash_attention" in cfg.providers and cfg.device.startswith("cuda"):
        # the other package's (o, ȯ), judged by the same rule; it gates that row only
        try:
            o, od = _jvp_flash_attention_fn(*low[:6], cfg.causal)()
            good = True
            for name, a, i in (("jvp_flash_attention_o", o, 0), ("jvp_flash_attention_od", od, 1)):
                err, err_math = _rel(a, exact[i]), res[names[i]]["math_same_dtype"]
                res[name] = {"jvp_flash_attention": err, "math_same_dtype": err_math}
                good &= math.isfinite(err) and err <= 2 * err_math + _FLOOR[cfg.dtype]
            res["jvp_flash_attention_ok"] = bool(good)
        except Exception as e:  # noqa: BLE001 - a failure of the other package is a result
            res["jvp_flash_attention_ok"] = False
            res["jvp_flash_attention_error"] = error_text(e)
    return res


# --------------------------------------------------------------------------- GPT HVP memory


#: The GPT HVP rows: (provider, mode, recompute units + chunked head).
HVP_ROWS = (
    ("gpt_hvp_rev_rev", "rev_rev", False),
    ("gpt_hvp_rev_rev_recompute", "rev_rev", True),
    ("gpt_hvp_fwd_rev_no_recompute", "fwd_rev", False),
    ("gpt_hvp_fwd_rev", "fwd_rev", True),
)


def chunked_lm_loss(model, x, y, chunk: int):
    """``model.loss(x, y)`` with the vocabulary head (final logits, fp32 cross-entropy) computed
    and recomputed in chunks of ``chunk`` tokens (:func:`ttt_flash.second_order.recomputation`): the same
    mean cross-entropy, without a (tokens × vocabulary) fp32 tensor of the whole batch."""
    from ..second_order import recompute
    from ..models.gpt import lm_loss

    def head_sum(h, w, t):
        return lm_loss(torch.nn.functional.linear(h, w), t) * t.numel()

    h = model(x, return_hidden=True).flatten(0, 1)
    t = y.flatten()
    total = sum(recompute(head_sum, h[i:i + chunk], model.output_weight, t[i:i + chunk])
                for i in range(0, t.numel(), chunk))
    return total / t.numel()


def hvp_memory(cfg: JvpBenchConfig) -> List[dict]:
    """One HVP of a GPT (bf16/fp16 weights as ``cfg.dtype``; float32 loss) in four ways
    (:data:`HVP_ROWS`): reverse over reverse (one product: ``create_graph`` gradient, then a
    reverse pass that frees its graph) and forward over reverse (``ttt_flash.second_order.hvp``),
    each without and with recomputation (the transformer blocks as units, the vocabulary head in ``cfg.hvp_chunk``-
    token chunks). Time, peak memory above weights + direction (the CUDA allocator's peak; on
    the CPU the peak of live tensor storages, :class:`LiveBytes`), and each product's relative
    difference to the plain reverse-over-reverse one. ``peak_ratio_vs_rev_rev`` and
    ``peak_ratio_vs_best_rev_rev`` (the lower of the two reverse-over-reverse peaks) on the
    forward-over-reverse rows."""
    from .. import second_order as hessian
    from ..models import GPT, GPTConfig

    dtype = getattr(torch, cfg.dtype)
    heads = max(1, cfg.hvp_d_model // 64)
    gcfg = GPTConfig(vocab_size=cfg.hvp_vocab, n_layer=cfg.hvp_layers, n_head=heads,
                     d_model=cfg.hvp_d_model, attention="ttt_flash")
    torch.manual_seed(0)
    model = GPT(gcfg).to(device=cfg.device, dtype=dtype)
    g = torch.Generator(device=cfg.device).manual_seed(0)
    idx = torch.randint(0, cfg.hvp_vocab, (cfg.hvp_batch, cfg.hvp_seq_len + 1), device=cfg.device, generator=g)
    x, y = idx[:, :-1], idx[:, 1:]
    params = [p for p in model.parameters() if p.requires_grad]
    vecs = [torch.randn(p.shape, device=cfg.device, generator=g, dtype=torch.float32).to(dtype) for p in params]
    losses = {False: lambda: model.loss(x, y), True: lambda: chunked_lm_loss(model, x, y, cfg.hvp_chunk)}

    def product(mode: str, rc: bool):
        if mode == "fwd_rev":
            return lambda: hessian.hvp(losses[rc], model, vecs, mode=mode, recompute="blocks" if rc else None)

        def rev_rev():  # one product: the create_graph graph is freed by the second pass
            with hessian.recomputed(model, "blocks") if rc else contextlib.nullcontext():
                grads = torch.autograd.grad(losses[rc](), params, create_graph=True)
            return torch.autograd.grad(grads, params, vecs)

        return rev_rev

    cuda = cfg.device.startswith("cuda")
    rows, products = [], {}
    for provider, mode, rc in HVP_ROWS:
        fn = product(mode, rc)
        row = {"provider": provider, "mode": mode, "recompute": rc, "N": cfg.hvp_seq_len,
               "batch": cfg.hvp_batch, "layers": cfg.hvp_layers, "d_model": cfg.hvp_d_model}
        try:
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                products[provider] = [h.detach() for h in fn()]
                torch.cuda.synchronize()
                row["peak_gib"] = (torch.cuda.max_memory_allocated() - base) / 2**30
            else:
                with LiveBytes() as live:
                    products[provider] = [h.detach() for h in fn()]
                row["peak_gib"] = live.peak / 2**30
                row["peak_source"] = "live tensor storages (LiveBytes)"
            row["ms"] = median_ms(cfg, fn)
        except Exception as e:  # noqa: BLE001
            row["error"] = error_text(e)
        rows.append(row)
    ref = products.get("gpt_hvp_rev_rev")
    if ref is not None:
        b = torch.cat([h.double().flatten() for h in ref])
        for row in rows[1:]:
            if row["provider"] in products:
                a = torch.cat([h.double().flatten() for h in products[row["provider"]]])
                row["rel_diff_vs_rev_rev"] = ((a - b).norm() / b.norm()).item()
    peaks = {r["provider"]: r["peak_gib"] for r in rows if "peak_gib" in r}
    rev = [peaks[p] for p in ("gpt_hvp_rev_rev", "gpt_hvp_rev_rev_recompute") if p in peaks]
    for row in rows:
        if row["mode"] == "fwd_rev" and "peak_gib" in row and rev:
            if "gpt_hvp_rev_rev" in peaks:
                row["peak_ratio_vs_rev_rev"] = row["peak_gib"] / peaks["gpt_hvp_rev_rev"]
            row["peak_ratio_vs_best_rev_rev"] = row["peak_gib"] / min(rev)
    return rows


# --------------------------------------------------------------------------- kernel profile


def kernel_profile(cfg: JvpBenchConfig, n: int, providers: Sequence[str] = ("jvp_bwd", "chain")) -> dict:
    """Device milliseconds per kernel name (summed over its launches) of one warm call of each
    provider at N, from ``torch.profiler`` (CUDA kernels; on the CPU the self time of each
    operator): ``{provider: {name: ms}}``, names cut to 80 characters, largest first."""
    from torch.profiler import ProfilerActivity, profile

    cuda = cfg.device.startswith("cuda")
    out = {}
    for provider in providers:
        fn = _make(cfg, provider, n)
        fn()
        if cuda:
            torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
            fn()
            if cuda:
                torch.cuda.synchronize()
        times = {}
        for e in prof.key_averages():
            if cuda:
                if getattr(e, "device_type", None) != torch.autograd.DeviceType.CUDA:
                    continue
                us = getattr(e, "self_device_time_total", None)
                us = getattr(e, "self_cuda_time_total", 0.0) if us is None else us
            else:
                us = e.self_cpu_time_total
            if us > 0:
                name = e.key[:80]
                times[name] = times.get(name, 0.0) + us / 1000.0
        out[provider] = dict(sorted(times.items(), key=lambda kv: -kv[1]))
    return out


# --------------------------------------------------------------------------- driver


def run_jvp_bench(cfg: JvpBenchConfig) -> dict:
    """Every (provider, N), ratios, the correctness check and (with ``hvp``) the GPT HVP."""
    result = new_result(cfg, cfg.device.startswith("cuda"))
    if cfg.check:
        result["check"] = check_correctness(cfg, n=min(256, max(cfg.seq_lens)))
    ok = result.get("check", {"ok": True})["ok"]
    for n in cfg.seq_lens:
        for provider in cfg.providers:
            if not ok and provider in ("tangent_fwd", "jvp", "jvp_bwd"):
                result["rows"].append({"provider": provider, "N": n, "error": "correctness check failed"})
                continue
            if provider == "jvp_flash_attention" and not result.get("check", {}).get("jvp_flash_attention_ok", True):
                result["rows"].append({"provider": provider, "N": n, "error": "correctness check failed"})
                continue
            result["rows"].append(_measure(cfg, provider, n))
    by = {(r["provider"], r["N"]): r.get("ms") for r in result["rows"]}
    for r in result["rows"]:
        for col, unit in (("ratio_sdpa_fwd", "sdpa_fwd"), ("ratio_sdpa_fwd_bwd", "sdpa_fwd_bwd"),
                          ("ratio_chain", "chain")):
            if r["provider"] in ("tangent_fwd", "jvp", "jvp_bwd", "jvp_flash_attention") and "ms" in r \
                    and by.get((unit, r["N"])):
                r[col] = r["ms"] / by[(unit, r["N"])]
    if cfg.profile:
        result["profile"] = {}
        for n in cfg.seq_lens:
            try:
                result["profile"][str(n)] = kernel_profile(cfg, n)
            except Exception as e:  # noqa: BLE001 - a profiler failure is reported, not fatal
                result["profile"][str(n)] = {"error": error_text(e)}
    if cfg.hvp:
        result["hvp"] = hvp_memory(cfg)
    return result


def format_jvp_table(result: dict) -> str:
    cfg = result["config"]
    lines = [f"forward-mode benchmark on {result['device_name']} ({result['date']}, torch {result['torch']}): "
             f"B={cfg['batch']} H={cfg['heads']} d={cfg['head_dim']} {cfg['dtype']} causal={cfg['causal']}"]
    if "check" in result:
        chk = result["check"]
        worst = max(v["ttt_flash"] for v in chk.values() if isinstance(v, dict) and "ttt_flash" in v)
        verdict = "ok" if chk["ok"] else "FAILED"
        lines.append(f"correctness vs float64 at N<=256: worst rel. L2 {worst:.2e} -> {verdict}")
        if "jvp_flash_attention_ok" in chk:
            other = [v["jvp_flash_attention"] for v in chk.values() if isinstance(v, dict) and "jvp_flash_attention" in v]
            detail = f"worst rel. L2 {max(other):.2e}" if other else chk.get("jvp_flash_attention_error", "")
            lines.append(f"jvp_flash_attention vs float64: {detail} -> "
                         f"{'ok' if chk['jvp_flash_attention_ok'] else 'FAILED'}")
    rate_name, rate_div = flop_unit(result["rows"])  # GFLOP/s on the CPU: no column of 0.0
    lines.append(f"{'provider':<20}{'N':>8}{'ms':>11}{rate_name:>9}{'peak GiB':>10}"
                 f"{'/sdpa_fwd':>10}{'/sdpa_fb':>9}{'/chain':>8}")
    for r in result["rows"]:
        if "ms" not in r:
            lines.append(f"{r['provider']:<20}{r['N']:>8}  {r['error']}")
            continue
        cols = [f"{r[c]:.2f}" if c in r else "-" for c in ("ratio_sdpa_fwd", "ratio_sdpa_fwd_bwd", "ratio_chain")]
        peak = f"{r['peak_gib']:.3f}" if "peak_gib" in r else "-"
        rate = f"{r['tflops'] / rate_div:.{3 if rate_div < 1 else 1}f}"
        lines.append(f"{r['provider']:<20}{r['N']:>8}{r['ms']:>11.3f}{rate:>9}{peak:>10}"
                     f"{cols[0]:>10}{cols[1]:>9}{cols[2]:>8}")
    for n, per in result.get("profile", {}).items():
        for provider, times in per.items():
            if provider == "error":
                lines.append(f"profile N={n}: {times}")
                continue
            total = sum(times.values())
            top = ", ".join(f"{k} {v:.2f}" for k, v in list(times.items())[:8])
            lines.append(f"profile N={n} {provider} ({total:.2f} ms in kernels): {top}")
    for r in result.get("hvp", []):
        if "error" in r:
            lines.append(f"{r['provider']:<29} N={r['N']} batch={r['batch']}: {r['error']}")
            continue
        peak = "peak -"
        if "peak_gib" in r:
            peak = f"{r['peak_gib']:.2f} GiB" if r["peak_gib"] >= 1 else f"{r['peak_gib'] * 1024:.2f} MiB"
        extra = ""
        if "rel_diff_vs_rev_rev" in r:
            extra = f", rel. diff vs rev_rev {r['rel_diff_vs_rev_rev']:.1e}"
        if "peak_ratio_vs_rev_rev" in r:
            extra += f", peak / rev_rev {r['peak_ratio_vs_rev_rev']:.2f}"
        if "peak_ratio_vs_best_rev_rev" in r:
            extra += f", peak / best rev_rev {r['peak_ratio_vs_best_rev_rev']:.2f}"
        lines.append(f"{r['provider']:<29} N={r['N']} batch={r['batch']} layers={r['layers']}: "
                     f"{r['ms']:.1f} ms, {peak}{extra}")
    return "\n".join(lines)


def _ints(s: str) -> List[int]:
    return [int(x) for x in s.replace(" ", "").split(",") if x]


def main(argv: Optional[Sequence[str]] = None) -> int:
    cuda = torch.cuda.is_available()
    where = "CUDA" if cuda else "no CUDA"
    p = argparse.ArgumentParser(prog="ttt-flash bench --jvp", description=__doc__.split("\n\n")[0],
                                epilog=f"Defaults shown are for this machine ({where}); with CUDA they are the "
                                       "GPU shapes (B=1, H=12, d=64, bf16; HVP: GPT-2 small, N=2048, batch 8), "
                                       "without it a seconds-long CPU smoke test.",
                                formatter_class=HelpFormatter)
    p.add_argument("--seq-lens", type=_ints, default="16384,65536" if cuda else "32", metavar="N[,N...]",
                   help="comma-separated sequence lengths N (queries = keys)")
    p.add_argument("--batch", type=int, default=1, help="batch size B")
    p.add_argument("--heads", type=int, default=12 if cuda else 2, help="heads H")
    p.add_argument("--head-dim", type=int, default=64 if cuda else 16, help="head dimension d")
    p.add_argument("--dtype", choices=["float16", "bfloat16", "float32", "float64"],
                   default="bfloat16" if cuda else "float32", help="dtype of q, k, v and their tangents")
    p.add_argument("--causal", action=argparse.BooleanOptionalAction, default=False, help="causal mask")
    p.add_argument("--providers", default=",".join(default_providers()),
                   help=f"comma-separated, of {list(PROVIDERS)}; default: all installed")
    p.add_argument("--device", default="cuda" if cuda else "cpu", help="torch device")
    p.add_argument("--warmup-ms", type=float, default=25.0, help="warm-up time per measurement (ms; CUDA)")
    p.add_argument("--rep-ms", type=float, default=100.0, help="timed repetitions per measurement (ms)")
    p.add_argument("--no-check", action="store_true",
                   help="skip the correctness check against float64 before timing")
    p.add_argument("--hvp", action="store_true",
                   help="also one GPT Hessian-vector product by fwd_rev and by rev_rev (time, peak memory)")
    p.add_argument("--hvp-seq-len", type=int, default=2048 if cuda else 16, help="--hvp: tokens per sequence")
    p.add_argument("--hvp-batch", type=int, default=8 if cuda else 2, help="--hvp: sequences per batch")
    p.add_argument("--hvp-layers", type=int, default=12 if cuda else 1, help="--hvp: GPT blocks")
    p.add_argument("--hvp-d-model", type=int, default=768 if cuda else 64, help="--hvp: model width")
    p.add_argument("--hvp-vocab", type=int, default=50304 if cuda else 256, help="--hvp: vocabulary size")
    p.add_argument("--hvp-chunk", type=int, default=2048 if cuda else 8,
                   help="--hvp: tokens per chunk of the recomputed vocabulary head (the recompute rows)")
    p.add_argument("--profile", action="store_true",
                   help="also the device time per kernel of one jvp_bwd and one chain call per N "
                        "(torch.profiler)")
    p.add_argument("--out", default="bench_out", help="folder for bench_jvp.json ('' to skip)")
    a = p.parse_args(argv)
    cfg = JvpBenchConfig(seq_lens=a.seq_lens, batch=a.batch, heads=a.heads, head_dim=a.head_dim,
                         dtype=a.dtype, causal=a.causal, providers=[x for x in a.providers.split(",") if x],
                         device=a.device, warmup_ms=a.warmup_ms, rep_ms=a.rep_ms, check=not a.no_check,
                         hvp=a.hvp, hvp_seq_len=a.hvp_seq_len, hvp_batch=a.hvp_batch,
                         hvp_layers=a.hvp_layers, hvp_d_model=a.hvp_d_model, hvp_vocab=a.hvp_vocab,
                         hvp_chunk=a.hvp_chunk, profile=a.profile)
    result = run_jvp_bench(cfg)
    print(format_jvp_table(result))
    if a.out:
        print(f"wrote {write_json(result, a.out, 'bench_jvp.json')}")
    return 0 if result.get("check", {"ok": True})["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
