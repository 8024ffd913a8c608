"""Offline tile sweep: the source of the numbers in ``configs.py``. Never runs at call time.

For each kernel kind it times the composer that launches it (``attn_fwd``, ``attn_bwd``,
``attn_bob`` or ``attn_jvp``) with ``configs.tile_overrides({kind: candidate})`` for each candidate, all other kernels on
their table entries, and prints the fastest candidate per kind next to the current entry::

    python -m ttt_flash.kernels.tune --head-dim 64 --dtype bfloat16 --seq-len 16384 --heads 12

Candidates are compiled first in parallel worker processes (filling Triton's on-disk
cache: compilation dominates a sweep), then timed one after another in this process with
``triton.testing.do_bench`` medians. A candidate that fails to compile or launch, or whose
results differ from the table entry's, is dropped. Results go to ``--out`` as JSON.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from . import configs, plan
from .bwd import attn_bwd
from .fwd import attn_fwd
from .jvp import attn_jvp
from .bob import attn_bob
from .host import block_d

#: kernel kind -> (composer name, extra composer kwargs)
KIND_COMPOSER = {
    "fwd": ("fwd", {}),
    "bwd_dq": ("bwd", {}),
    "bwd_dkdv": ("bwd", {}),
    "bob_affine": ("bob", {"precise": False}),
    "bob_stats": ("bob", {"precise": True}),
    "bob_direct": ("bob", {"precise": True}),
    "bob_col": ("bob", {"precise": True}),
    "jvp": ("jvp", {}),
}

#: kinds whose kernels come in both tile orientations (``TileConfig.qmajor``)
QMAJOR_KINDS = ("bwd_dkdv", "bob_col")


def candidates(kind: str, grid: str = "default"):
    blocks = (16, 32, 64, 128) if grid == "wide" else (32, 64, 128)
    out = []
    for bm, bn, w, s in itertools.product(blocks, blocks, (4, 8), (1, 2, 3) if grid == "wide" else (2, 3)):
        if bm * bn > 128 * 64 and kind.startswith("bob") and kind != "bob_stats":
            continue  # six (row) or two (column) tile-by-d accumulators: no room
        for qm in ((False, True) if kind in QMAJOR_KINDS else (False,)):
            out.append(configs.TileConfig(bm, bn, w, s, qm))
    return out


def make_inputs(n: int, heads: int, head_dim: int, dtype: torch.dtype, causal: bool, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    t = [torch.randn(1, heads, n, head_dim, device="cuda", dtype=dtype, generator=g) for _ in range(7)]
    q, k, v, do, uq, uk, uv = t
    kw = dict(scale=head_dim**-0.5, causal=causal, window=None)
    o, lse = attn_fwd(q, k, v, **kw)
    _, _, _, delta = attn_bwd(q, k, v, o, lse, do, **kw)
    return dict(q=q, k=k, v=v, do=do, uq=uq, uk=uk, uv=uv, o=o, lse=lse, delta=delta, kw=kw)


def run_composer(kind: str, x: dict):
    which, extra = KIND_COMPOSER[kind]
    if which == "bob":
        extra = dict(extra, **x.get("bob_kw", {}))
    if which == "fwd":
        return attn_fwd(x["q"], x["k"], x["v"], **x["kw"])
    if which == "jvp":  # the tangent of every input: the kernel's most work
        return attn_jvp(x["q"], x["k"], x["v"], x["uq"], x["uk"], x["uv"], **x["kw"])
    if which == "bwd":
        return attn_bwd(x["q"], x["k"], x["v"], x["o"], x["lse"], x["do"], **x["kw"], **extra)
    return attn_bob(x["q"], x["k"], x["v"], x["o"], x["lse"], x["do"], x["delta"], x["uq"], x["uk"], x["uv"],
                    **x["kw"], **extra)


def _worker(spec: dict) -> None:
    """Compile (run once at a short length) each (kind, config) of ``spec``; print failures."""
    dtype = getattr(torch, spec["dtype"])
    x = make_inputs(256, 2, spec["head_dim"], dtype, spec["causal"])
    bad = []
    for kind, cfg in spec["jobs"]:
        try:
            with configs.tile_overrides({kind: configs.TileConfig(*cfg)}):
                run_composer(kind, x)
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 - a failing candidate is a result
            bad.append([kind, cfg, f"{type(e).__name__}: {str(e)[:120]}"])
    print(json.dumps(bad))


def _rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m ttt_flash.kernels.tune", description=__doc__.split("\n\n")[0])
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--seq-len", type=int, default=16384)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--causal", action="store_true")
    p.add_argument("--kinds", default="fwd,bwd_dq,bwd_dkdv,bob_stats,bob_direct,bob_col")
    p.add_argument("--grid", choices=["default", "wide"], default="default")
    p.add_argument("--bob-split", default="0,0", help="split_row,split_col of attn_bob (0/1 each)")
    p.add_argument("--jobs", type=int, default=min(16, os.cpu_count() or 1), help="parallel compile workers")
    p.add_argument("--out", default="tune.json")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker is not None:
        _worker(json.loads(a.worker))
        return 0
    import triton.testing

    kinds = [k for k in a.kinds.split(",") if k]
    jobs = [(k, [c.block_m, c.block_n, c.num_warps, c.num_stages, c.qmajor])
            for k in kinds for c in candidates(k, a.grid)]
    t0 = time.time()
    chunks = [jobs[i :: a.jobs] for i in range(a.jobs)]

    def compile_chunk(chunk):
        spec = json.dumps(dict(jobs=chunk, head_dim=a.head_dim, dtype=a.dtype, causal=a.causal))
        r = subprocess.run([sys.executable, "-m", "ttt_flash.kernels.tune", "--worker", spec],
                           capture_output=True, text=True)
        lines = [l for l in r.stdout.splitlines() if l.startswith("[")]
        return json.loads(lines[-1]) if lines else [[k, c, "worker crashed: " + r.stderr[-200:]] for k, c in chunk]

    with ThreadPoolExecutor(a.jobs) as ex:
        failed = [f for part in ex.map(compile_chunk, chunks) for f in part]
    bad = {(k, tuple(c)) for k, c, _ in failed}
    print(f"compiled {len(jobs)} candidates in {time.time() - t0:.0f} s; {len(bad)} failed", flush=True)

    dtype = getattr(torch, a.dtype)
    x = make_inputs(a.seq_len, a.heads, a.head_dim, dtype, a.causal, seed=1)
    split_row, split_col = (bool(int(f)) for f in a.bob_split.split(","))
    x["bob_kw"] = dict(split_row=split_row, split_col=split_col)
    results = {"args": vars(a), "device": torch.cuda.get_device_name(), "kinds": {}}
    for kind in kinds:
        base_cfg = plan.tiles(kind, block_d(a.head_dim), dtype, x["q"].device)
        ref = run_composer(kind, x)
        base_ms = triton.testing.do_bench(lambda: run_composer(kind, x), warmup=10, rep=50, return_mode="median")
        rows = []
        for k2, c in jobs:
            if k2 != kind or (kind, tuple(c)) in bad:
                continue
            try:
                with configs.tile_overrides({kind: configs.TileConfig(*c)}):
                    out = run_composer(kind, x)
                    err = max(_rel(o, r) for o, r in zip(out, ref) if o is not None and r is not None and o.numel())
                    if not err < 2e-2:
                        rows.append({"cfg": c, "error": f"results differ (rel {err:.1e})"})
                        continue
                    ms = triton.testing.do_bench(lambda: run_composer(kind, x), warmup=10, rep=50,
                                                 return_mode="median")
                rows.append({"cfg": c, "ms": ms})
            except Exception as e:  # noqa: BLE001
                rows.append({"cfg": c, "error": f"{type(e).__name__}: {str(e)[:100]}"})
        timed = sorted((r for r in rows if "ms" in r), key=lambda r: r["ms"])
        results["kinds"][kind] = {"table": [base_cfg.block_m, base_cfg.block_n, base_cfg.num_warps, base_cfg.num_stages,
                                            base_cfg.qmajor],
                                  "table_ms": base_ms, "rows": rows}
        best = timed[0] if timed else None
        print(f"{kind:<11} table {tuple(results['kinds'][kind]['table'])} {base_ms:8.3f} ms   "
              + (f"best {tuple(best['cfg'])} {best['ms']:8.3f} ms" if best else "no candidate ran"), flush=True)
    with open(a.out, "w") as f:
        json.dump(results, f, indent=1)
    best = {}
    for kind, v in results["kinds"].items():
        timed = sorted((r for r in v["rows"] if "ms" in r), key=lambda r: r["ms"])
        if timed and timed[0]["ms"] < 0.97 * v["table_ms"]:  # keep the table unless clearly faster
            best[kind] = timed[0]["cfg"]
    best_path = os.path.splitext(a.out)[0] + ".best.json"
    with open(best_path, "w") as f:
        json.dump(best, f)
    print(f"wrote {a.out} and {best_path} (try it: python scripts/kernels/tile_check.py --variant best=@{best_path})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
