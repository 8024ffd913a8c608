"""flash_attention(return_lse=True) on the GPU: accuracy of (o, lse) and of their first and
second derivatives against float64, then time and peak memory against the call without lse.

Gate (one row per case): the chain of a loss of both outputs,

  o, lse = flash_attention(q, k, v, return_lse=True)
  first   (dq, dk, dv) of ⟨W_o, o⟩ + ⟨W_l, lse⟩ + ⟨sin o, lse⟩ (create_graph)
  second  the gradients of ⟨U, (dq, dk, dv)⟩ w.r.t. (q, k, v)

on the Triton kernels in --dtypes against the same chain on the float64 reference (on the
GPU); the relative L2 error of every tensor (o, lse, dq, dk, dv, q̄, k̄, v̄) must stay under
1e-4 (float32) or 3e-2 (bfloat16, float16), the tolerances of ``ttt-flash check``.

Timing (one row per variant and length, B = 1, causal, --heads query heads over --kv-heads key
heads of dimension --head-dim): forward + create_graph first backward + one second backward,
for
  plain      flash_attention(q, k, v), loss ⟨W_o, o⟩ (what runs without return_lse)
  lse_unused return_lse=True, loss of o alone (must cost what plain costs)
  lse_used   return_lse=True, loss ⟨W_o, o⟩ + ⟨W_l, lse⟩ (one more forward and first backward
             with the keys as values in the first backward, their derivatives in the second)
and the first-order step (forward + backward) of the same three. Times are medians
(triton.testing.do_bench); peak memory is torch.cuda.max_memory_allocated beyond the inputs.

    python3 scripts/lse_bench.py --out runs/lse_bench
    python3 scripts/lse_bench.py --device cpu --dtypes float32 --gate-n 24 --seq-lens 64 --head-dim 16 --out /tmp/lse   # smoke run (interpreter)
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass

import torch

TOL = {"float32": 1e-4, "bfloat16": 3e-2, "float16": 3e-2}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
NAMES = ("o", "lse", "dq", "dk", "dv", "q_bar", "k_bar", "v_bar")


@dataclass
class Config:
    device: str
    dtypes: str
    gate_n: int
    seq_lens: str
    heads: int
    kv_heads: int
    head_dim: int
    warmup_ms: int
    rep_ms: int
    out: str


def _loss(o, lse, wo, wl, mixed=True):
    lf = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse)).to(o.dtype)
    loss = (o * wo).sum() + (lf * wl).sum()
    return loss + (torch.sin(o) * lf.unsqueeze(-1)).sum() if mixed else loss


def _chain(attn, xs, wo, wl, us):
    """(o, lse, dq, dk, dv, q̄, k̄, v̄) of the gate's loss."""
    o, lse = attn(*xs)
    g = torch.autograd.grad(_loss(o, lse, wo, wl), xs, create_graph=True)
    inner = sum((a * u).sum() for a, u in zip(g, us))
    return (o, lse, *g, *torch.autograd.grad(inner, xs))


def gate(cfg: Config, dtype_name: str, case: dict) -> dict:
    from ttt_flash import flash_attention

    dev, dtype, n = cfg.device, DTYPES[dtype_name], cfg.gate_n
    nq, nk = n, n + n // 4  # N_q != N_k: bottom-right aligned masks
    g = torch.Generator(device="cpu").manual_seed(0)
    rnd = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).to(dev)  # noqa: E731
    xs = [rnd(1, cfg.heads, nq, cfg.head_dim), rnd(1, cfg.kv_heads, nk, cfg.head_dim),
          rnd(1, cfg.kv_heads, nk, cfg.head_dim)]
    wo, wl, us = rnd(*xs[0].shape), rnd(*xs[0].shape[:-1]), [rnd(*x.shape) for x in xs]

    def leaves(dt):
        return [x.to(dt).requires_grad_(True) for x in xs]

    kw = dict(causal=case["causal"], window=case["window"])
    exact = _chain(lambda *a: flash_attention(*a, backend="reference", return_lse=True, **kw),
                   leaves(torch.float64), wo, wl, us)
    ours = _chain(lambda *a: flash_attention(*a, backend="triton", return_lse=True, **kw),
                  leaves(dtype), wo.to(dtype), wl.float(), [u.to(dtype) for u in us])
    row = {"dtype": dtype_name, "case": case["name"], "N_q": nq, "N_k": nk}
    worst = 0.0
    for name, a, e in zip(NAMES, ours, exact):
        fin = torch.isfinite(e)
        a, e = a.double()[fin], e[fin]
        err = ((a - e).norm() / e.norm().clamp_min(1e-300)).item()
        row[name] = err
        worst = max(worst, err if err == err else float("inf"))
    row["ok"] = worst <= TOL[dtype_name]
    return row


def timing(cfg: Config, n: int, variant: str, order: int) -> dict:
    from ttt_flash import flash_attention
    from ttt_flash.bench.common import measure

    dev, dtype = cfg.device, DTYPES[cfg.dtypes.split(",")[0]]

    def build():
        g = torch.Generator(device="cpu").manual_seed(1)
        rnd = lambda *s: torch.randn(*s, generator=g).to(device=dev, dtype=dtype)  # noqa: E731
        xs = [rnd(1, cfg.heads, n, cfg.head_dim).requires_grad_(True),
              rnd(1, cfg.kv_heads, n, cfg.head_dim).requires_grad_(True),
              rnd(1, cfg.kv_heads, n, cfg.head_dim).requires_grad_(True)]
        wo, wl = rnd(1, cfg.heads, n, cfg.head_dim), rnd(1, cfg.heads, n).float()
        us = [torch.randn_like(x) for x in xs]

        def loss():
            if variant == "plain":
                return (flash_attention(*xs, causal=True) * wo).sum()
            o, lse = flash_attention(*xs, causal=True, return_lse=True)
            return (o * wo).sum() + ((lse * wl).sum() if variant == "lse_used" else 0.0)

        def fn():
            if order == 1:
                torch.autograd.grad(loss(), xs)
                return
            grads = torch.autograd.grad(loss(), xs, create_graph=True)
            torch.autograd.grad(grads, xs, us)

        return fn, 0.0, {"variant": variant, "order": order}

    row = measure(cfg, "ttt_flash", n, build)
    row.pop("tflops", None)
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtypes", default="float32,bfloat16", help="kernel dtypes of the gate; the first also times")
    p.add_argument("--gate-n", type=int, default=512, help="queries of the gate (keys: 1.25x)")
    p.add_argument("--seq-lens", default="4096,16384", help="lengths timed (comma-separated; '' skips timing)")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--warmup-ms", type=int, default=100)
    p.add_argument("--rep-ms", type=int, default=500)
    p.add_argument("--out", required=True, help="folder of the JSON result")
    args = p.parse_args(argv)
    cfg = Config(**{k: v for k, v in vars(args).items()})
    if not cfg.device.startswith("cuda"):
        os.environ.setdefault("TRITON_INTERPRET", "1")  # the Triton interpreter on the CPU
    from ttt_flash.bench.common import new_result, progress_bar, write_json

    result = new_result(cfg, cfg.device.startswith("cuda"))
    cases = [dict(name="causal", causal=True, window=None), dict(name="window", causal=True, window=cfg.gate_n // 4),
             dict(name="full", causal=False, window=None)]
    jobs = [("gate", d, c) for d in cfg.dtypes.split(",") for c in cases]
    lens = [int(x) for x in cfg.seq_lens.split(",") if x]
    jobs += [("time", n, (v, o)) for n in lens for o in (1, 2) for v in ("plain", "lse_unused", "lse_used")]
    gates, times = [], []
    for kind, a, b in progress_bar(jobs, "lse_bench", True):
        if kind == "gate":
            gates.append(gate(cfg, a, b))
        else:
            times.append(timing(cfg, a, *b))
    result["gate"], result["rows"] = gates, times
    path = write_json(result, cfg.out, "lse_bench.json")

    print(f"gate: relative L2 error vs float64 (tolerance {TOL})")
    print(f"{'dtype':9} {'case':7} " + " ".join(f"{n:>8}" for n in NAMES) + "  ok")
    for r in gates:
        print(f"{r['dtype']:9} {r['case']:7} " + " ".join(f"{r[n]:8.1e}" for n in NAMES) + f"  {r['ok']}")
    if times:
        print(f"\n{'N':>6} {'order':>5} {'variant':11} {'ms':>9} {'peak GiB':>9} {'vs plain':>8}")
        base = {(r["N"], r.get("order")): r.get("ms") for r in times if r.get("variant") == "plain"}
        for r in times:
            if "error" in r:
                print(f"{r['N']:>6} {'':>5} {'':11} {r['error']}")
                continue
            ref = base.get((r["N"], r["order"]))
            ratio = f"{r['ms'] / ref:8.2f}" if ref else ""
            print(f"{r['N']:>6} {r['order']:>5} {r['variant']:11} {r['ms']:9.3f} {r.get('peak_gib', float('nan')):9.3f} {ratio}")
    print(f"\nJSON: {path}")
    return 0 if all(r["ok"] for r in gates) else 1


if __name__ == "__main__":
    sys.exit(main())
