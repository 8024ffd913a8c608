"""fp32 accuracy at large logits: worst relative error of each chain output of the kernels
(o, dq, dk, dv, Q̄, K̄, V̄, dŌ) against float64 autograd on the same inputs, beside PyTorch's
own fp32 math chain. q and k are scaled so that max |logit| sweeps ~50 .. ~2,000.

The rule (tests/test_kernels.py::test_fp32_large_logits): every output's relative error
max|ours − f64| / max|f64| is within max(4 × the worst error of the math chain, 1e-5). For
float32 the last table gives each (mask, seed, scale) row's worst output, the tolerance and
PASS / FAIL; the exit status is 1 when a row fails.

    python scripts/kernels/large_logit_sweep.py                     # CPU: Triton interpreter, N=24, d=8
    python scripts/kernels/large_logit_sweep.py --seeds 0-7 --scales 8,16,20,24 --masks full,causal
    python scripts/kernels/large_logit_sweep.py --n 512 --d 64 --heads 2 --dtype float32,bfloat16 --causal
    python scripts/kernels/large_logit_sweep.py --seeds 0-7 --masks full,causal --out OUT   # JSON in OUT

Under the interpreter the float32 products round as on the GPU (tests/_gpu_dot.py, as in the
test); ``--blas-dot`` keeps the interpreter's own BLAS products, whose rounding depends on the
tile shape (docs/bob-math.md, "Row sums of the recomputed P").
"""

from __future__ import annotations

import argparse
import json
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
    from ttt_flash.attention.reference import naive_attention

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


def parse_seeds(text: str) -> list:
    """``"0-7"`` -> [0, ..., 7]; ``"0,3,5"`` -> [0, 3, 5]."""
    seeds = []
    for part in text.split(","):
        lo, _, hi = part.strip().partition("-")
        try:
            seeds.extend(range(int(lo), int(hi) + 1) if hi else [int(lo)])
        except ValueError:
            raise SystemExit(f"--seeds: {text!r} is not a list of seeds such as 0-7 or 0,3,5")
    return seeds


def verdict(ours, base):
    """(worst output, its error, tolerance, passed) of one row under the rule above."""
    tol = max(4 * max(base), 1e-5)
    i = max(range(len(ours)), key=lambda j: ours[j])
    return NAMES[i], ours[i], tol, ours[i] <= tol


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=24)
    p.add_argument("--d", type=int, default=8)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--causal", action="store_true", help="the same as --masks causal")
    p.add_argument("--masks", default=None, help="comma list of full, causal (default: full)")
    p.add_argument("--scales", default="2,4,8,16,24")
    p.add_argument("--seeds", default="0", help="seeds of the inputs: 0-7 or 0,3,5")
    p.add_argument("--out", default=None, help="folder for large_logit_sweep.json")
    p.add_argument("--blas-dot", action="store_true",
                   help="interpreter: keep its BLAS float32 tl.dot (default: the GPU's rounding)")
    a = p.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1" and not a.blas_dot:
        import sys
        from pathlib import Path

        sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
        from _gpu_dot import install

        install()
    masks = (a.masks or ("causal" if a.causal else "full")).split(",")
    if any(m not in ("full", "causal") for m in masks):
        raise SystemExit(f"--masks: {a.masks!r}: give a comma list of full, causal")
    seeds = parse_seeds(a.seeds)
    scales = tuple(float(s) for s in a.scales.split(","))
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    records = []
    try:
        for dt in a.dtype.split(","):
            for mask in masks:
                for seed in seeds:
                    rows = sweep(a.n, a.d, a.heads, mask == "causal", getattr(torch, dt), scales,
                                 seed=seed, device=dev)
                    print(f"{dt} N={a.n} d={a.d} H={a.heads} {mask} seed={seed}: max rel. error "
                          f"(ours / torch {dt} math)")
                    print(f"{'max|logit|':>10} " + " ".join(f"{n:>17}" for n in NAMES)
                          + f" {'worst':>17}")
                    for scale, (logit, ours, base) in zip(scales, rows):
                        cells = " ".join(f"{o:8.1e}/{b:8.1e}" for o, b in zip(ours, base))
                        print(f"{logit:10.0f} {cells} {max(ours):8.1e}/{max(base):8.1e}",
                              flush=True)
                        records.append(dict(dtype=dt, mask=mask, seed=seed, scale=scale,
                                            max_logit=logit, ours=dict(zip(NAMES, ours)),
                                            math=dict(zip(NAMES, base))))
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev
    failed = 0
    checked = [r for r in records if r["dtype"] == "float32"]
    if checked:
        print(f"\nfloat32 N={a.n} d={a.d} H={a.heads} on {dev}: worst output against "
              "max(4 x worst math error, 1e-5)")
        print(f"{'mask':>6} {'seed':>4} {'scale':>5} {'max|logit|':>10} {'worst':>5} "
              f"{'ours':>8} {'math':>8} {'tol':>8}")
        for r in checked:
            ours, base = list(r["ours"].values()), list(r["math"].values())
            name, err, tol, ok = verdict(ours, base)
            r.update(worst=name, tol=tol, passed=ok)
            failed += not ok
            print(f"{r['mask']:>6} {r['seed']:>4} {r['scale']:>5g} {r['max_logit']:10.0f} "
                  f"{name:>5} {err:8.1e} {max(base):8.1e} {tol:8.1e} {'PASS' if ok else 'FAIL'}")
        print(f"{len(checked) - failed} of {len(checked)} rows pass")
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        path = os.path.join(a.out, "large_logit_sweep.json")
        meta = dict(n=a.n, d=a.d, heads=a.heads, device=dev, torch=torch.__version__,
                    gpu=torch.cuda.get_device_name() if dev == "cuda" else None)
        with open(path, "w") as f:
            json.dump(dict(meta=meta, rows=records), f, indent=1)
        print(f"wrote {path}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
