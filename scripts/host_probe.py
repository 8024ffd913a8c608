"""Host (CPU) cost of one chain at small N on the GPU machine, split into its parts
(docs/benchmarks.md, host overhead): the whole chain; the chain with every Triton launch replaced by a no-op
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
           f"def k84(A, B, C, D, {names60}, {flags}):\n    pass\n"
           f"def k64(A, B, C, D, {names60}):\n    pass\n"
           f"def k24(A, B, C, D, {flags}):\n    pass\n"
           f"def k5(A, B, C, D, FLAGS: tl.constexpr):\n    pass\n")
    import tempfile, importlib.util
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write("import triton.language as tl\n" + src)
    spec = importlib.util.spec_from_file_location("launch_probe_kernels", f.name)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    k34, k84 = triton.jit(mod.k34), triton.jit(mod.k84)
    k64, k24, k5 = triton.jit(mod.k64), triton.jit(mod.k24), triton.jit(mod.k5)
    t = [torch.empty(16, device="cuda") for _ in range(4)]
    ints30 = [64 * (i + 1) for i in range(30)]
    ints60 = [64 * (i + 1) for i in range(60)]
    fl = {f"F{i}": bool(i % 2) for i in range(20)}
    return [
        ("launch, 4 pointers", per_call_ms(lambda: k4[(1,)](*t), reps) * 1e3),
        ("launch, 4 pointers + 30 ints", per_call_ms(lambda: k34[(1,)](*t, *ints30), reps) * 1e3),
        ("launch, 4 pointers + 60 ints + 20 constexpr", per_call_ms(lambda: k84[(1,)](*t, *ints60, **fl), reps) * 1e3),
        ("launch, 4 pointers + 60 ints", per_call_ms(lambda: k64[(1,)](*t, *ints60), reps) * 1e3),
        ("launch, 4 pointers + 20 constexpr (keywords)", per_call_ms(lambda: k24[(1,)](*t, **fl), reps) * 1e3),
        ("launch, 4 pointers + 20 constexpr (positional)", per_call_ms(lambda: k24[(1,)](*t, *fl.values()), reps) * 1e3),
        ("launch, 4 pointers + 1 constexpr bit mask", per_call_ms(lambda: k5[(1,)](*t, FLAGS=0b1010101010), reps) * 1e3),
        ("launch, 4 pointers + 60 ints + 20 constexpr + num_warps/num_stages",
         per_call_ms(lambda: k84[(1,)](*t, *ints60, **fl, num_warps=8, num_stages=3), reps) * 1e3),
    ]


def engine_costs(chain, q, k, v, o, lse, do, delta, u, kw, reps: int) -> list:
    """Where the chain's host time goes besides the composers: the chain with autograd's
    device threads off, the composer run from inside a backward (the engine's device thread)
    against an empty backward, a launch from a Python thread, and the same chain with
    attention replaced by an elementwise product (the harness and engine alone)."""
    import threading

    from ttt_flash.kernels import attn_bob

    rows = []
    with torch.autograd.set_multithreading_enabled(False):
        rows.append(("chain, autograd multithreading off", per_call_ms(chain, reps)))

    def make(body):
        class Wrap(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                return x.clone()

            @staticmethod
            def backward(ctx, g):
                body()
                return g

        return Wrap

    xx = torch.zeros(4, device="cuda", requires_grad=True)
    one = torch.ones(4, device="cuda")
    bob = lambda: attn_bob(q, k, v, o, lse, do, delta, *u, precise=True, **kw)
    empty_bwd, bob_bwd = make(lambda: None), make(bob)
    rows.append(("grad through an empty Function", per_call_ms(lambda: torch.autograd.grad(empty_bwd.apply(xx), xx, one), reps)))
    rows.append(("grad through a Function running attn_bob", per_call_ms(lambda: torch.autograd.grad(bob_bwd.apply(xx), xx, one), reps)))
    # cProfile from inside the engine's device thread: 100 composer calls in one backward
    prof_text = []

    def profiled():
        import cProfile
        import io
        import pstats

        pr = cProfile.Profile()
        pr.enable()
        for _ in range(100):
            bob()
        pr.disable()
        buf = io.StringIO()
        pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(25)
        prof_text.append(buf.getvalue()[:5000])

    torch.autograd.grad(make(profiled).apply(xx), xx, one)
    print("==== cProfile of 100 attn_bob calls inside a backward (device thread)")
    print(prof_text[0])
    t0 = [0.0]

    def timed100():
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(100):
            bob()
        t0[0] = (time.perf_counter() - t) * 10  # ms per call
    torch.autograd.grad(make(timed100).apply(xx), xx, one)
    rows.append(("attn_bob composer, 100 calls in one backward (per call)", t0[0]))
    res = []
    th = threading.Thread(target=lambda: res.append(per_call_ms(bob, reps)))
    th.start()
    th.join()
    rows.append(("attn_bob composer from a Python thread", res[0]))
    qq, kk, vv = (t.detach().requires_grad_(True) for t in (q, k, v))
    dd = do.detach().requires_grad_(True)

    def elementwise_chain():
        y = qq * kk * vv
        g = torch.autograd.grad(y, (qq, kk, vv), dd, create_graph=True)
        inner = sum((s * w).sum() for s, w in zip(g, u))
        return torch.autograd.grad(inner, (qq, kk, vv, dd))

    rows.append(("chain of q*k*v instead of attention (harness + engine)", per_call_ms(elementwise_chain, reps)))
    return rows


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
    rows += engine_costs(chain, qd, kd, vd, o, lse, dod, delta, u, kw, a.reps)

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
