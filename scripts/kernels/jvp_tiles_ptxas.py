"""Register and stack (spill) use of the tangent-forward kernels (kernels/jvp.py) for tile
candidates, compiled offline for sm_90 (no GPU needed): how the ``jvp`` rows of configs.py
were chosen.

    python scripts/kernels/jvp_tiles_ptxas.py --dtype bf16 --head-dim 128 --tiles 64x64x8x2,64x32x8x2

Each candidate is BLOCK_MxBLOCK_NxWARPSxSTAGES; both kernels (``attn_jvp``, ``attn_tangent``)
are compiled with causal masking and every tangent present (the most registers) by
scripts/kernels/compile_sm90.py with the candidate as the ``jvp`` tile override.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--tiles", default="128x64x8x3,64x64x8x2,64x32x8x2")
    a = p.parse_args()
    bad = 0
    for t in a.tiles.split(","):
        bm, bn, warps, stages = (int(x) for x in t.split("x"))
        r = subprocess.run([sys.executable, os.path.join(HERE, "compile_sm90.py"),
                            "--dtype", DTYPES[a.dtype], "--head-dim", str(a.head_dim),
                            "--causal", "--override", f"jvp={bm},{bn},{warps},{stages},0",
                            "--only", "_attn_jvp_kernel,_attn_tangent_kernel"],
                           capture_output=True, text=True)
        rows = [ln for ln in r.stdout.splitlines() if ln.startswith("_attn_")]
        bad += r.returncode != 0
        print(f"{a.dtype} d={a.head_dim} {t}:")
        for ln in rows or [r.stderr[-400:]]:
            print("   ", ln)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
