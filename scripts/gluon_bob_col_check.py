"""One-call GPU check of the experimental Gluon BoB column pass (kernels/gluon/bob_col.py).

Stages, each guarded so that a failure prints its error and the run goes on; single-partition
variants run before warp-specialised ones (a hang in the latter then costs only the stages
after it):
  1. correctness at B=1, H=2, N=1024, d=64 bf16 (full and causal): max error of K̄, V̄ of the
     Gluon pass and of the Triton column pass against float64 autograd (double backward
     through naive attention), the Gluon pass fed the Triton statistics pass's α, E + αD;
  2. at N=16K, H=12, d=64 bf16: max |Gluon - Triton| relative to max |Triton|, and
     ``triton.testing.do_bench`` medians (ms) of the Triton column-pass launch (the table's
     ``bob_col`` tiles) and of each Gluon variant.
A table is printed last.

    python scripts/gluon_bob_col_check.py [--quick]
"""

from __future__ import annotations

import argparse
import importlib
import traceback

import torch

RESULTS = []

# (block_n, block_m, num_warps, stages, warp_specialize (0 no, 1 yes, 2 with deferred K̄
# waits), maxnreg)
VARIANTS = [
    (64, 64, 4, 2, 0, None),
    (64, 32, 4, 2, 0, None),
    (128, 64, 8, 2, 0, None),
    (64, 64, 4, 2, 1, 128),
    (64, 64, 4, 3, 1, 128),
    (64, 64, 4, 3, 2, 128),
    (64, 32, 4, 3, 1, 128),
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


def triton_reference(q, k, v, do, uq, uk, uv, causal):
    """The library's statistics + column passes (``attn_bob`` asked for K̄, V̄ only, atomic-
    free) and the row vectors they pass between them: (lse, delta, alpha, ee, kb, vb)."""
    bob = importlib.import_module("ttt_flash.kernels.bob")
    from ttt_flash.kernels import attn_bwd, attn_fwd

    kw = dict(scale=None, causal=causal, window=None)
    o, lse = attn_fwd(q, k, v, **kw)
    _, _, _, delta = attn_bwd(q, k, v, o, lse, do, deterministic=True, **kw)
    made = []
    new_rowvec = bob.new_rowvec

    def capture(lay, device):  # α, E + αD (and ρ) are the composer's first row vectors
        made.append(new_rowvec(lay, device))
        return made[-1]

    bob.new_rowvec = capture
    try:
        _, kb, vb, _ = bob.attn_bob(q, k, v, o, lse, do, delta, uq, uk, uv,
                                    needs=(False, True, True, False), deterministic=True, **kw)
    finally:
        bob.new_rowvec = new_rowvec
    return lse, delta, made[0], made[1], kb, vb


def triton_col_launcher(q, k, v, do, uq, uk, uv, lse, delta, alpha, ee, causal):
    """The composer's column-pass launch alone (bob.py's column-pass launch), for timing."""
    import triton

    bob = importlib.import_module("ttt_flash.kernels.bob_cols")
    from ttt_flash.kernels.common import (LOG2E, block_d, cu_or_dummy, dot_precision, layout,
                                          long_rows, rowvec_strides, view)
    from ttt_flash.kernels.plan import tiles as get_config

    lay = layout(q, k, None, None, None, None)
    scale = lay.head_dim ** -0.5
    bd = block_d(lay.head_dim)
    kb, vb = torch.empty_like(k), torch.empty_like(v)
    cu = cu_or_dummy(None, q)
    cfg = get_config("bob_col", bd, q.dtype, q.device)
    grid = (triton.cdiv(lay.n_k, cfg.block_n), lay.h_kv, lay.batch)
    flags = dict(HEAD_DIM=lay.head_dim, BLOCK_D=bd, EVEN_D=bd == lay.head_dim,
                 CAUSAL=bool(causal), WINDOW=False, IS_VARLEN=False,
                 PREC=dot_precision(q.dtype), HAS_UQ=True, HAS_UK=True, HAS_UV=True,
                 HAS_G=True, ROWSUM=False,
                 LONG=long_rows(lay, q, k, v, do, uq, uk, uv, kb, vb))

    def run():
        bob._bob_col_kernel[grid](
            *(view(x, False) for x in (q, k, v, do, uq, uk, uv, kb, vb)),
            lse, delta, alpha, ee, lse, rowvec_strides(lay), (cu, cu), lay.n_q, lay.n_k,
            lay.groups, scale, scale * LOG2E, 0,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, NEED_KB=True, NEED_VB=True,
            SPLIT=False, QMAJOR=cfg.qmajor, num_warps=cfg.num_warps,
            num_stages=cfg.num_stages, **flags)
        return kb, vb

    return run, cfg


def float64_bob(q, k, v, do, uq, uk, uv, causal):
    """K̄, V̄ of float64 autograd through naive attention (double backward)."""
    from ttt_flash.reference import naive_attention

    q64, k64, v64, do64 = (x.double().requires_grad_() for x in (q, k, v, do))
    o64 = naive_attention(q64, k64, v64, causal=causal)
    dq, dk, dv = torch.autograd.grad(o64, (q64, k64, v64), do64, create_graph=True)
    inner = (dq * uq.double()).sum() + (dk * uk.double()).sum() + (dv * uv.double()).sum()
    _, kb64, vb64 = torch.autograd.grad(inner, (q64, k64, v64))
    return kb64, vb64


def call(var, x, rows, causal):
    from ttt_flash.kernels.gluon.bob_col import gluon_bob_col

    bn, bm, w, st, ws, mr = var
    return gluon_bob_col(*x, *rows, causal=causal, block_n=bn, block_m=bm, num_warps=w,
                         stages=st, warp_specialize=ws > 0, defer=ws == 2, maxnreg=mr)


def correctness_small(variants):
    for causal in (False, True):
        x = inputs(1, 2, 1024, 64, torch.bfloat16, seed=1)
        lse, delta, alpha, ee, kb_t, vb_t = triton_reference(*x, causal)
        kb64, vb64 = float64_bob(*x, causal)
        for var in variants:
            def one(var=var):
                kb_g, vb_g = call(var, x, (lse, delta, alpha, ee), causal)
                torch.cuda.synchronize()
                e = lambda a, r: (a.double() - r).abs().max().item()  # noqa: E731
                return (f"gluon K̄ err {e(kb_g, kb64):.3e} V̄ err {e(vb_g, vb64):.3e} | "
                        f"triton K̄ err {e(kb_t, kb64):.3e} V̄ err {e(vb_t, vb64):.3e} | "
                        f"|K̄| {kb64.abs().max().item():.2e} |V̄| {vb64.abs().max().item():.2e}")
            tag = f"small causal={causal} {var}"
            record(tag, guarded(tag, one))


BIG = {}


def big_setup(causal):
    import triton

    x = inputs(1, 12, 16384, 64, torch.bfloat16, seed=2)
    lse, delta, alpha, ee, kb_t, vb_t = triton_reference(*x, causal)
    run_t, cfg = triton_col_launcher(*x, lse, delta, alpha, ee, causal)
    kb_r, vb_r = run_t()
    torch.cuda.synchronize()
    record(f"16K causal={causal} triton launcher == attn_bob",
           bool(torch.equal(kb_r, kb_t) and torch.equal(vb_r, vb_t)))
    t_ms = triton.testing.do_bench(run_t, return_mode="median")
    record(f"16K causal={causal} triton bob_col {cfg}", f"{t_ms:.3f} ms")
    BIG[causal] = (x, (lse, delta, alpha, ee), kb_t, vb_t, t_ms)


def big(causal, variants):
    import triton

    x, rows, kb_t, vb_t, t_ms = BIG[causal]
    for var in variants:
        def one(var=var):
            f = lambda: call(var, x, rows, causal)  # noqa: E731
            kb_g, vb_g = f()
            torch.cuda.synchronize()
            rel = max(((kb_g.float() - kb_t.float()).abs().max() / kb_t.float().abs().max()).item(),
                      ((vb_g.float() - vb_t.float()).abs().max() / vb_t.float().abs().max()).item())
            g_ms = triton.testing.do_bench(f, return_mode="median")
            return (f"{g_ms:.3f} ms (triton {t_ms:.3f}, speed-up {t_ms / g_ms:.2f}x), "
                    f"max rel diff {rel:.2e}")
        tag = f"16K causal={causal} gluon {var}"
        record(tag, guarded(tag, one))


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
        "ttt_flash.kernels.gluon.bob_col").available()))
    guarded("small single", lambda: correctness_small(single))
    for causal in (False, True):
        guarded(f"16K setup causal={causal}", lambda c=causal: big_setup(c))
        guarded(f"16K single causal={causal}", lambda c=causal: big(c, single))
    guarded("small ws", lambda: correctness_small(ws))
    for causal in (False, True):
        if causal in BIG:
            guarded(f"16K ws causal={causal}", lambda c=causal: big(c, ws))
    print("\n==== summary ====")
    for stage, value in RESULTS:
        print(f"{stage:60s} | {value}")


if __name__ == "__main__":
    from ttt_flash.kernels import configs

    # the library's passes as the Triton baseline: its Gluon passes off
    with configs.use_gluon_passes(False):
        main()
