"""One-call GPU check of the experimental Gluon dK/dV pass (kernels/gluon/dkdv.py).

Stages, each guarded so that a failure prints its error and the run goes on:
  1. correctness at B=1, H=2, N=1024, d=64 bf16 (full and causal): max error of dK, dV of the
     Gluon pass and of the Triton pass against float64 autograd through naive attention;
  2. at N=16K, H=12, d=64 bf16: max |Gluon - Triton| relative to max |Triton|;
  3. timings (triton.testing.do_bench medians, ms) of the Triton atomic-free dK/dV launch
     (``_attn_bwd_dkdv_kernel`` with the table's ``bwd_dkdv`` tiles) and of Gluon variants.
A table is printed last.

    python scripts/gluon_dkdv_check.py
"""

from __future__ import annotations

import traceback

import torch

RESULTS = []


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
    return [torch.randn(b, h, n, d, device="cuda", dtype=dtype, generator=g) for _ in range(4)]


def triton_dkdv_launcher(q, k, v, do, lse, delta, causal):
    """The composer's atomic-free dK/dV launch alone (attn_bwd.py), for timing."""
    import importlib

    import triton

    # the module itself: ttt_flash.kernels re-exports the composer under the same name
    ab = importlib.import_module("ttt_flash.kernels.attn_bwd")
    from ttt_flash.kernels.common import LOG2E, block_d, cu_or_dummy, layout, long_rows, view
    from ttt_flash.kernels.common import dot_precision, rowvec_strides
    from ttt_flash.kernels.plan import tiles as get_config

    lay = layout(q, k, None, None, None, None)
    scale = lay.head_dim ** -0.5
    bd = block_d(lay.head_dim)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    cu = cu_or_dummy(None, q)
    cfg = get_config("bwd_dkdv", bd, q.dtype, q.device)
    grid = (triton.cdiv(lay.n_k, cfg.block_n), lay.h_kv, lay.batch)
    common = dict(HEAD_DIM=lay.head_dim, BLOCK_D=bd, EVEN_D=bd == lay.head_dim,
                  CAUSAL=bool(causal), WINDOW=False, IS_VARLEN=False,
                  PREC=dot_precision(q.dtype), LONG=long_rows(lay, q, k, v, do, dk, dv))

    def run():
        ab._attn_bwd_dkdv_kernel[grid](
            *(view(x, False) for x in (q, k, v, do, dk, dv)), lse, delta, delta,
            rowvec_strides(lay), (cu, cu), lay.n_q, lay.n_k, lay.groups, scale, scale * LOG2E, 0,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, num_warps=cfg.num_warps,
            num_stages=cfg.num_stages, QMAJOR=cfg.qmajor, ROWSUM=False,
            **common)
        return dk, dv

    return run, cfg


def fwd_and_delta(q, k, v, do, causal):
    from ttt_flash.kernels import attn_bwd, attn_fwd

    kw = dict(scale=None, causal=causal, window=None)
    o, lse = attn_fwd(q, k, v, **kw)
    _, dk, dv, delta = attn_bwd(q, k, v, o, lse, do, deterministic=True, **kw)
    return lse, delta, dk, dv


VARIANTS = [  # (block_n, block_m, num_warps, maxnreg)
    (128, 64, 8, None),
    (64, 64, 4, None),
    (128, 32, 8, None),
    (128, 32, 8, 128),
    (64, 32, 4, None),
]


def correctness_small():
    from ttt_flash.kernels.gluon.dkdv import gluon_dkdv
    from ttt_flash.reference import naive_attention

    for causal in (False, True):
        q, k, v, do = inputs(1, 2, 1024, 64, torch.bfloat16, seed=1)
        lse, delta, dk_t, dv_t = fwd_and_delta(q, k, v, do, causal)
        q64, k64, v64 = (x.double().requires_grad_() for x in (q, k, v))
        o64 = naive_attention(q64, k64, v64, causal=causal)
        _, dk64, dv64 = torch.autograd.grad(o64, (q64, k64, v64), do.double())
        for var in VARIANTS:
            def one(var=var):
                bn, bm, w, mr = var
                dk_g, dv_g = gluon_dkdv(q, k, v, do, lse, delta, causal=causal, block_n=bn,
                                        block_m=bm, num_warps=w, maxnreg=mr)
                torch.cuda.synchronize()
                e = lambda a, r: (a.double() - r).abs().max().item()  # noqa: E731
                return (f"gluon dK err {e(dk_g, dk64):.3e} dV err {e(dv_g, dv64):.3e} | "
                        f"triton dK err {e(dk_t, dk64):.3e} dV err {e(dv_t, dv64):.3e} | "
                        f"|dK| {dk64.abs().max().item():.2e}")
            record(f"small causal={causal} {var}", guarded(f"small causal={causal} {var}", one))


def big(causal):
    import triton
    from ttt_flash.kernels.gluon.dkdv import gluon_dkdv

    q, k, v, do = inputs(1, 12, 16384, 64, torch.bfloat16, seed=2)
    lse, delta, dk_t, dv_t = fwd_and_delta(q, k, v, do, causal)
    run_t, cfg = triton_dkdv_launcher(q, k, v, do, lse, delta, causal)
    dk_r, dv_r = run_t()
    torch.cuda.synchronize()
    record(f"16K causal={causal} triton launcher == attn_bwd",
           bool(torch.equal(dk_r, dk_t) and torch.equal(dv_r, dv_t)))
    t_ms = triton.testing.do_bench(run_t, return_mode="median")
    record(f"16K causal={causal} triton dkdv {cfg}", f"{t_ms:.3f} ms")
    for var in VARIANTS:
        def one(var=var):
            bn, bm, w, mr = var
            f = lambda: gluon_dkdv(q, k, v, do, lse, delta, causal=causal, block_n=bn,  # noqa
                                   block_m=bm, num_warps=w, maxnreg=mr)
            dk_g, dv_g = f()
            torch.cuda.synchronize()
            rel = max(((dk_g.float() - dk_t.float()).abs().max() / dk_t.float().abs().max()).item(),
                      ((dv_g.float() - dv_t.float()).abs().max() / dv_t.float().abs().max()).item())
            g_ms = triton.testing.do_bench(f, return_mode="median")
            return f"{g_ms:.3f} ms (triton {t_ms:.3f}, speedup {t_ms / g_ms:.2f}x), max rel diff {rel:.2e}"
        record(f"16K causal={causal} gluon {var}", guarded(f"16K causal={causal} gluon {var}", one))


def main():
    import triton

    record("env", f"torch {torch.__version__} triton {triton.__version__} "
                  f"{torch.cuda.get_device_name()} cc {torch.cuda.get_device_capability()}")
    guarded("import", lambda: record("gluon available",
                                     __import__("ttt_flash.kernels.gluon.dkdv",
                                                fromlist=["available"]).available()))
    guarded("small", correctness_small)
    guarded("16K full", lambda: big(False))
    guarded("16K causal", lambda: big(True))
    print("\n==== summary ====")
    for stage, value in RESULTS:
        print(f"{stage:55s} | {value}")


if __name__ == "__main__":
    from ttt_flash.kernels import configs

    # the library's passes as the Triton baseline: its Gluon passes off
    with configs.use_gluon_passes(False):
        main()
