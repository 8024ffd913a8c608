"""fp32 accuracy at large logits: worst relative error of each chain output of the kernels
(o, dq, dk, dv, Q̄, K̄, V̄, dŌ) against float64 autograd on the same inputs, beside PyTorch's
own fp32 math chain. q and k are scaled so that max |logit| sweeps ~50 .. ~2,000.

    python scripts/large_logit_sweep.py                     # CPU: Triton interpreter, N=24, d=8
    python scripts/large_logit_sweep.py --n 512 --d 64 --heads 2 --dtype float32,bfloat16 --causal
"""

from __future__ import annotations

import argparse
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

NAMES = ("o", "dq", "dk", "dv", "qb", "kb", "vb", "dob")


def chain(attn, q, k, v, do, uq, uk, uv):
    """The eight chain outputs by autograd through ``attn``."""
    q, k, v, do = (t.detach().clone().requires_grad_() for t in (q, k, v, do))
    o = attn(q, k, v)
    g = torch.autograd.grad(o, (q, k, v), do, create_graph=True)
    total = sum((a * b).sum() for a, b in zip(g, (uq, uk, uv)))
    bob = torch.autograd.grad(total, (q, k, v, do))
    return [t.detach() for t in (o, *g, *bob)]


def inputs(n, d, heads, scale_qk, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    t = [torch.randn(1, heads, n, d, generator=g, dtype=torch.float64) for _ in range(7)]
    t[0] = t[0] * scale_qk
    t[1] = t[1] * scale_qk
    return [x.to(device) for x in t]


def rel_errors(got, ref):
    return [((a.double() - r).abs().max() / r.abs().max().clamp_min(1e-300)).item() for a, r in zip(got, ref)]


def sweep(n=24, d=8, heads=2, causal=False, dtype=torch.float32, scales=(2.0, 4.0, 8.0, 16.0, 24.0), seed=0,
          device="cpu"):
    """Rows (max |logit|, kernel errors, math-path errors) for each q/k scale."""
    from ttt_flash import flash_attention
    from ttt_flash.reference import naive_attention

    rows = []
    for a in scales:
        x = inputs(n, d, heads, a, seed, device)
        x = [t.to(dtype).double() for t in x]  # the oracle sees the rounded inputs
        logit = (x[0] @ x[1].transpose(-1, -2) * d**-0.5).abs().max().item()
        ref = chain(lambda q, k, v: naive_attention(q, k, v, causal=causal), *x)
        low = [t.to(dtype) for t in x]
        torch_low = chain(lambda q, k, v: naive_attention(q, k, v, causal=causal), *low)
        ours = chain(lambda q, k, v: flash_attention(q, k, v, causal=causal, backend="triton"), *low)
        rows.append((logit, rel_errors(ours, ref), rel_errors(torch_low, ref)))
    return rows


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=24)
    p.add_argument("--d", type=int, default=8)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--causal", action="store_true")
    p.add_argument("--scales", default="2,4,8,16,24")
    a = p.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    for dt in a.dtype.split(","):
        rows = sweep(a.n, a.d, a.heads, a.causal, getattr(torch, dt),
                     tuple(float(s) for s in a.scales.split(",")), device=dev)
        print(f"{dt} N={a.n} d={a.d} H={a.heads} causal={a.causal}: max rel. error (ours / torch {dt} math)")
        print(f"{'max|logit|':>10} " + " ".join(f"{n:>17}" for n in NAMES) + f" {'worst':>17}")
        for logit, ours, base in rows:
            cells = " ".join(f"{o:8.1e}/{b:8.1e}" for o, b in zip(ours, base))
            print(f"{logit:10.0f} {cells} {max(ours):8.1e}/{max(base):8.1e}")
    torch.backends.cuda.matmul.allow_tf32 = prev
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
