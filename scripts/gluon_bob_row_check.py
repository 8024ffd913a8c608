"""One-call GPU check of the experimental Gluon BoB row passes (kernels/gluon/bob_row.py).

Stages, each guarded so that a failure prints its error and the run goes on; single-partition
variants run before warp-specialised ones (a hang in the latter then costs only the stages
after it):
  1. correctness at B=1, H=2, N=1024, d=64 bf16 (full and causal): max error of Q̄, dŌ of the
     Gluon direct pass (fed the Triton statistics pass's α, E + αD) and of the Triton direct
     pass against float64 double backward; max |α, E + αD| difference of the Gluon statistics
     pass from the Triton one, relative to the largest value;
  2. at N=16K, H=12, d=64 bf16: max |Gluon - Triton| relative to max |Triton| and
     ``triton.testing.do_bench`` medians (ms) of the Triton statistics and direct launches
     (the table's ``bob_stats`` / ``bob_direct`` tiles) and of each Gluon variant.
A short table is printed last.

    python scripts/gluon_bob_row_check.py [--quick]
"""

from __future__ import annotations

import argparse
import importlib
import traceback

import torch

RESULTS = []
TABLE = []

# (block_m, block_n, num_warps, stages, warp_specialize (0/1), maxnreg)
VARIANTS = [
    (64, 64, 4, 2, 0, None),
    (64, 64, 4, 2, 1, 168),
    (128, 64, 8, 2, 1, 168),
]


def record(stage, value):
    RESULTS.append((stage, value))
    print(f"[{stage}] {value}", flush=True)


def guarded(stage, fn):
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - every failure is reported, then the run goes on
        traceback.print_exc()
        record(stage, f"FAILED {type(exc).__name__}: {str(exc)[-1500:]}")
        return None


def inputs(b, h, n, d, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(b, h, n, d, device="cuda", dtype=dtype, generator=g) for _ in range(7)]


def triton_launchers(q, k, v, do, uq, uk, uv, causal):
    """The composer's statistics and direct launches (bob.py's statistics and direct launches
    with all cotangents, Q̄ and dŌ wanted, no ρ), each alone for timing, and L, D."""
    import triton

    bob = importlib.import_module("ttt_flash.kernels.bob_rows")
    from ttt_flash.kernels import attn_bwd, attn_fwd
    from ttt_flash.kernels.common import (LOG2E, block_d, cu_or_dummy, dot_precision, layout,
                                          long_rows, rowvec_strides, view)
    from ttt_flash.kernels.plan import tiles as get_config

    kw = dict(scale=None, causal=causal, window=None)
    o, lse = attn_fwd(q, k, v, **kw)
    _, _, _, delta = attn_bwd(q, k, v, o, lse, do, deterministic=True, **kw)
    lay = layout(q, k, None, None, None, None)
    scale = lay.head_dim ** -0.5
    bd = block_d(lay.head_dim)
    alpha, ee = (torch.empty_like(lse) for _ in range(2))
    qb, dob = torch.empty_like(q), torch.empty_like(do)
    cu = cu_or_dummy(None, q)
    flags = dict(HEAD_DIM=lay.head_dim, BLOCK_D=bd, EVEN_D=bd == lay.head_dim,
                 CAUSAL=bool(causal), WINDOW=False, IS_VARLEN=False,
                 PREC=dot_precision(q.dtype), HAS_UQ=True, HAS_UK=True, HAS_UV=True,
                 HAS_G=True, ROWSUM=False,
                 LONG=long_rows(lay, q, k, v, do, uq, uk, uv, qb, dob))
    args = (rowvec_strides(lay), (cu, cu), lay.n_q, lay.n_k, lay.groups, scale, scale * LOG2E, 0)
    ins = [view(x, False) for x in (q, k, v, do, uq, uk, uv)]
    cs = get_config("bob_stats", bd, q.dtype, q.device)
    cd = get_config("bob_direct", bd, q.dtype, q.device)

    def stats():
        bob._bob_stats_kernel[(triton.cdiv(lay.n_q, cs.block_m), lay.h_q, lay.batch)](
            *ins, lse, delta, alpha, ee, lse, *args,
            BLOCK_M=cs.block_m, BLOCK_N=cs.block_n, NEED_E=True, num_warps=cs.num_warps,
            num_stages=cs.num_stages, **flags)
        return alpha, ee

    def direct():
        bob._bob_direct_kernel[(triton.cdiv(lay.n_q, cd.block_m), lay.h_q, lay.batch)](
            *ins, view(qb, False), view(dob, False), lse, delta, alpha, ee, lse, *args,
            BLOCK_M=cd.block_m, BLOCK_N=cd.block_n, NEED_QB=True, NEED_DOB=True, SPLIT=False,
            STATS_FIRST=False, WRITE_STATS=False, NEED_E=True, num_warps=cd.num_warps,
            num_stages=cd.num_stages, **flags)
        return qb, dob

    return o, lse, delta, stats, direct, cs, cd


def float64_row(q, k, v, do, uq, uk, uv, causal):
    """Q̄, dŌ of float64 autograd through naive attention (double backward)."""
    from ttt_flash.reference import naive_attention

    q64, k64, v64, do64 = (x.double().requires_grad_() for x in (q, k, v, do))
    o64 = naive_attention(q64, k64, v64, causal=causal)
    dq, dk, dv = torch.autograd.grad(o64, (q64, k64, v64), do64, create_graph=True)
    inner = (dq * uq.double()).sum() + (dk * uk.double()).sum() + (dv * uv.double()).sum()
    return torch.autograd.grad(inner, (q64, do64))


def kw_of(var, causal):
    bm, bn, w, st, ws, mr = var
    return dict(causal=causal, block_m=bm, block_n=bn, num_warps=w, stages=st,
                warp_specialize=bool(ws), maxnreg=mr)


def rel(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def correctness_small(variants):
    from ttt_flash.kernels.gluon.bob_row import gluon_bob_direct, gluon_bob_stats

    for causal in (False, True):
        x = inputs(1, 2, 1024, 64, torch.bfloat16, seed=1)
        _, lse, delta, stats, direct, _, _ = triton_launchers(*x, causal)
        al_t, ee_t = (t.clone() for t in stats())
        qb_t, dob_t = (t.clone() for t in direct())
        qb64, dob64 = float64_row(*x, causal)
        for var in variants:
            def one(var=var):
                qb_g, dob_g = gluon_bob_direct(*x, lse, delta, al_t, ee_t, **kw_of(var, causal))
                al_g, ee_g = gluon_bob_stats(*x, lse, delta, **kw_of(var, causal))
                torch.cuda.synchronize()
                e = lambda a, r: (a.double() - r).abs().max().item()  # noqa: E731
                return (f"gluon Q̄ err {e(qb_g, qb64):.3e} dŌ err {e(dob_g, dob64):.3e} | "
                        f"triton Q̄ err {e(qb_t, qb64):.3e} dŌ err {e(dob_t, dob64):.3e} | "
                        f"|Q̄| {qb64.abs().max().item():.2e} |dŌ| {dob64.abs().max().item():.2e}"
                        f" | stats rel diff α {rel(al_g, al_t):.2e} E+αD {rel(ee_g, ee_t):.2e}")
            tag = f"small causal={causal} {var}"
            record(tag, guarded(tag, one))


BIG = {}


def big_setup(causal):
    import triton

    x = inputs(1, 12, 16384, 64, torch.bfloat16, seed=2)
    _, lse, delta, stats, direct, cs, cd = triton_launchers(*x, causal)
    al_t, ee_t = (t.clone() for t in stats())
    qb_t, dob_t = (t.clone() for t in direct())
    s_ms = triton.testing.do_bench(stats, return_mode="median")
    d_ms = triton.testing.do_bench(direct, return_mode="median")
    record(f"16K causal={causal} triton bob_stats {cs}", f"{s_ms:.3f} ms")
    record(f"16K causal={causal} triton bob_direct {cd}", f"{d_ms:.3f} ms")
    BIG[causal] = (x, lse, delta, al_t, ee_t, qb_t, dob_t, s_ms, d_ms)


def big(causal, variants):
    import triton

    from ttt_flash.kernels.gluon.bob_row import gluon_bob_direct, gluon_bob_stats

    x, lse, delta, al_t, ee_t, qb_t, dob_t, s_ms, d_ms = BIG[causal]
    for var in variants:
        def one_direct(var=var):
            def f():
                return gluon_bob_direct(*x, lse, delta, al_t, ee_t, **kw_of(var, causal))
            qb_g, dob_g = f()
            torch.cuda.synchronize()
            r = max(rel(qb_g, qb_t), rel(dob_g, dob_t))
            g_ms = triton.testing.do_bench(f, return_mode="median")
            TABLE.append(("direct", causal, var, g_ms, d_ms, r))
            return (f"{g_ms:.3f} ms (triton {d_ms:.3f}, speed-up {d_ms / g_ms:.2f}x), "
                    f"max rel diff {r:.2e}")

        def one_stats(var=var):
            def f():
                return gluon_bob_stats(*x, lse, delta, **kw_of(var, causal))
            al_g, ee_g = f()
            torch.cuda.synchronize()
            r = max(rel(al_g, al_t), rel(ee_g, ee_t))
            g_ms = triton.testing.do_bench(f, return_mode="median")
            TABLE.append(("stats", causal, var, g_ms, s_ms, r))
            return (f"{g_ms:.3f} ms (triton {s_ms:.3f}, speed-up {s_ms / g_ms:.2f}x), "
                    f"max rel diff {r:.2e}")

        tag = f"16K causal={causal} gluon direct {var}"
        record(tag, guarded(tag, one_direct))
        tag = f"16K causal={causal} gluon stats {var}"
        record(tag, guarded(tag, one_stats))


def main():
    import triton

    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true", help="first variant of each kind only")
    a = p.parse_args()
    single = [v for v in VARIANTS if not v[4]]
    ws = [v for v in VARIANTS if v[4]]
    if a.quick:
        single, ws = single[:1], ws[:1]
    record("env", f"torch {torch.__version__} triton {triton.__version__} "
                  f"{torch.cuda.get_device_name()} cc {torch.cuda.get_device_capability()}")
    guarded("import", lambda: record("gluon available", importlib.import_module(
        "ttt_flash.kernels.gluon.bob_row").available()))
    guarded("small single", lambda: correctness_small(single))
    for causal in (False, True):
        guarded(f"16K setup causal={causal}", lambda c=causal: big_setup(c))
        if causal in BIG:
            guarded(f"16K single causal={causal}", lambda c=causal: big(c, single))
    guarded("small ws", lambda: correctness_small(ws))
    for causal in (False, True):
        if causal in BIG:
            guarded(f"16K ws causal={causal}", lambda c=causal: big(c, ws))
    print("\n==== summary ====")
    for stage, value in RESULTS:
        print(f"{stage:60s} | {value}")
    print("\n==== 16K (B=1, H=12, d=64 bf16), medians ====")
    print("| pass | causal | variant (qt, kt, warps, slots, ws, maxnreg) | Gluon ms | Triton ms "
          "| speed-up | max rel diff |")
    for kind, causal, var, g, t, r in TABLE:
        print(f"| {kind} | {causal} | {var} | {g:.3f} | {t:.3f} | {t / g:.2f}x | {r:.1e} |")


if __name__ == "__main__":
    from ttt_flash.kernels import configs

    # the library's passes as the Triton baseline: its Gluon passes off
    with configs.use_gluon_passes(False):
        main()
