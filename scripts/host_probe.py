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


def launch_costs(reps: int) -> list:
    """Host time of launching an empty Triton kernel with 4 pointers and 0 / 30 / 60 int
    arguments (+ 20 constexpr flags on the last): what a launch's argument count costs."""
    import triton
    import triton.language as tl

    @triton.jit
    def k4(A, B, C, D):
        pass

    names30 = ", ".join(f"s{i}" for i in range(30))
    names60 = ", ".join(f"s{i}" for i in range(60))
    flags = ", ".join(f"F{i}: tl.constexpr" for i in range(20))
    src = (f"def k34(A, B, C, D, {names30}):\n    pass\n"
           f"def k84(A, B, C, D, {names60}, {flags}):\n    pass\n")
    import tempfile, importlib.util
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write("import triton.language as tl\n" + src)
    spec = importlib.util.spec_from_file_location("launch_probe_kernels", f.name)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    k34, k84 = triton.jit(mod.k34), triton.jit(mod.k84)
    t = [torch.empty(16, device="cuda") for _ in range(4)]
    ints30 = [64 * (i + 1) for i in range(30)]
    ints60 = [64 * (i + 1) for i in range(60)]
    fl = {f"F{i}": bool(i % 2) for i in range(20)}
    return [
        ("launch, 4 pointers", per_call_ms(lambda: k4[(1,)](*t), reps) * 1e3),
        ("launch, 4 pointers + 30 ints", per_call_ms(lambda: k34[(1,)](*t, *ints30), reps) * 1e3),
        ("launch, 4 pointers + 60 ints + 20 constexpr", per_call_ms(lambda: k84[(1,)](*t, *ints60, **fl), reps) * 1e3),
    ]


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

    rows += launch_costs(a.reps)

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
        unit = "us" if name.startswith("launch") else "ms"
        print(f"{name:<56} {ms:8.3f} {unit}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
