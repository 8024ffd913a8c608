"""Per-pass timings of the jvp-then-backward step on a GPU: the tangent forward
as one pass (``attn_jvp``, O, L, Ȯ, L̇) against the tangent of the computed forward
(``attn_tangent``, from O and L), and the BoB with dO = Ō̇, U = ẋ with its statistics pass
(the step before) against the BoB given the tangent's statistics (α = L̇, E + αD =
rowsum(Ō̇∘Ȯ), the step now), without dŌ (the step's choice: Triton direct pass) and with dŌ
(which the Gluon direct pass serves). Medians of ``triton.testing.do_bench``.

    python scripts/kernels/jvp_bwd_ab.py --seq-lens 16384,65536 --out ab.json
"""

from __future__ import annotations

import argparse
import json

import torch
import triton

from ttt_flash.kernels import attn_bob, attn_bwd, attn_fwd, attn_jvp, attn_tangent


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq-lens", default="16384,65536")
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--out", default="")
    a = p.parse_args()
    res = {"device": torch.cuda.get_device_name(), "heads": a.heads, "head_dim": a.head_dim, "rows": []}
    for n in [int(x) for x in a.seq_lens.split(",")]:
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v, qd, kd, vd, dod = (torch.randn(1, a.heads, n, a.head_dim, device="cuda", dtype=torch.bfloat16,
                                                generator=g) for _ in range(7))
        kw = dict(scale=a.head_dim ** -0.5, causal=False, window=None)
        o, lse = attn_fwd(q, k, v, **kw)
        od, lsed, rho = attn_tangent(q, k, v, o, lse, qd, kd, vd, **kw)
        _, _, _, delta = attn_bwd(q, k, v, o, lse, dod, **kw)
        ee = (dod.float() * od.float()).sum(-1)
        no_dob = (True, True, True, False)
        cases = {
            "attn_fwd": lambda: attn_fwd(q, k, v, **kw),
            "attn_jvp (one pass, 12d)": lambda: attn_jvp(q, k, v, qd, kd, vd, **kw),
            "attn_tangent (from O, L; 10d)": lambda: attn_tangent(q, k, v, o, lse, qd, kd, vd, **kw),
            "attn_bwd": lambda: attn_bwd(q, k, v, o, lse, dod, **kw),
            "rowsum(dO*od)": lambda: (dod.float() * od.float()).sum(-1),
            "bob stats pass, no dob (before)": lambda: attn_bob(q, k, v, o, lse, dod, delta, qd, kd, vd,
                                                                 needs=no_dob, **kw),
            "bob given stats, no dob (now)": lambda: attn_bob(q, k, v, o, lse, dod, delta, qd, kd, vd,
                                                               needs=no_dob, stats=(lsed, ee, rho), **kw),
            "bob given stats, with dob": lambda: attn_bob(q, k, v, o, lse, dod, delta, qd, kd, vd,
                                                          stats=(lsed, ee, rho), **kw),
            "bob given stats, no dob, no K/V bar (row pass)": lambda: attn_bob(
                q, k, v, o, lse, dod, delta, qd, kd, vd, needs=(True, False, False, False),
                stats=(lsed, ee, rho), **kw),
            "bob given stats, with dob, no K/V bar (row pass)": lambda: attn_bob(
                q, k, v, o, lse, dod, delta, qd, kd, vd, needs=(True, False, False, True),
                stats=(lsed, ee, rho), **kw),
        }
        for name, fn in cases.items():
            ms = float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))
            res["rows"].append({"N": n, "case": name, "ms": ms})
            print(f"N={n:>6} {name:<50} {ms:9.3f} ms", flush=True)
        # the two tangents agree (bf16): relative L2 of Ȯ, L̇
        _, _, od1, lsed1 = attn_jvp(q, k, v, qd, kd, vd, **kw)
        rel = lambda x, y: ((x.double() - y.double()).norm() / y.double().norm()).item()  # noqa: E731
        res.setdefault("agreement", {})[str(n)] = {"od": rel(od, od1), "lsed": rel(lsed, lsed1)}
        print(f"N={n:>6} attn_tangent vs attn_jvp rel. L2: od {rel(od, od1):.2e}, lsed {rel(lsed, lsed1):.2e}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
