"""Host (CPU) cost of one chain at small N on the GPU machine, split into its parts
(issue 4 notes): the whole chain; the chain with every Triton launch replaced by a no-op
(Python, autograd and PyTorch ops only); each composer alone; a cProfile of the chain.

    python3 scripts/host_probe.py --n 1024
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time

import torch


def per_call_ms(fn, reps: int) -> float:
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    host = (time.perf_counter() - t) / reps * 1e3
    torch.cuda.synchronize()
    return host


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=1024)
    p.add_argument("--reps", type=int, default=200)
    a = p.parse_args()
    import ttt_flash.kernels  # noqa: F401
    from ttt_flash import flash_attention

    mods = [sys.modules[f"ttt_flash.kernels.{m}"] for m in ("attn_fwd", "attn_bwd", "bob")]
    x = [torch.randn(1, 12, a.n, 64, device="cuda", dtype=torch.bfloat16) for _ in range(7)]
    q, k, v, do = (t.requires_grad_(True) for t in x[:4])
    u = x[4:]

    def chain():
        o = flash_attention(q, k, v)
        g = torch.autograd.grad(o, (q, k, v), do, create_graph=True)
        inner = sum((s * w).sum() for s, w in zip(g, u))
        return torch.autograd.grad(inner, (q, k, v, do))

    rows = [("chain (host time per call, not synchronised)", per_call_ms(chain, a.reps))]
    from ttt_flash.kernels import attn_bob, attn_bwd, attn_fwd

    qd, kd, vd, dod = (t.detach() for t in (q, k, v, do))
    kw = dict(scale=0.125, causal=False, window=None)
    o, lse = attn_fwd(qd, kd, vd, **kw)
    _, _, _, delta = attn_bwd(qd, kd, vd, o, lse, dod, **kw)
    rows.append(("attn_fwd composer", per_call_ms(lambda: attn_fwd(qd, kd, vd, **kw), a.reps)))
    rows.append(("attn_bwd composer", per_call_ms(lambda: attn_bwd(qd, kd, vd, o, lse, dod, **kw), a.reps)))
    rows.append(("attn_bob composer, precise", per_call_ms(
        lambda: attn_bob(qd, kd, vd, o, lse, dod, delta, *u, precise=True, **kw), a.reps)))
    rows.append(("torch.empty_like + one elementwise op (reference)", per_call_ms(lambda: qd * 2.0, a.reps)))

    class NoLaunch:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: None

    saved = {}
    for m in mods:
        for name in dir(m):
            if name.endswith("_kernel"):
                saved[(m, name)] = getattr(m, name)
                setattr(m, name, NoLaunch())
    rows.append(("chain with Triton launches stubbed", per_call_ms(chain, a.reps)))
    for (m, name), fn in saved.items():
        setattr(m, name, fn)

    pr = cProfile.Profile()
    pr.enable()
    for _ in range(50):
        chain()
    pr.disable()
    torch.cuda.synchronize()
    buf = io.StringIO()
    pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(22)
    print(buf.getvalue()[:5000])
    for name, ms in rows:
        print(f"{name:<56} {ms:8.3f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
