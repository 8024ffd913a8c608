"""Register and spill counts of the tangent-forward kernel (kernels/attn_jvp.py) for tile
candidates, compiled offline for sm_90 (no GPU needed): how its tile table was chosen.

    python scripts/jvp_tiles_ptxas.py --dtype bf16 --head-dim 128 --tiles 64x64x8x2,64x32x8x2

Each candidate is BLOCK_MxBLOCK_NxWARPSxSTAGES; the kernel is compiled with causal masking
and every tangent present (the most registers), and ptxas -v (Triton's bundled one) reports
registers and spill bytes.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ttt_flash.kernels.attn_jvp import _attn_jvp_kernel  # noqa: E402

POINTERS = ("Q", "K", "V", "QD", "KD", "VD", "O", "OD")


def ptxas_report(dtype: str, d: int, bm: int, bn: int, warps: int, stages: int, causal=True, window=False) -> str:
    ptr = {"bf16": "*bf16", "fp16": "*fp16", "fp32": "*fp32"}[dtype]
    bd = max(16, triton.next_power_of_2(d))
    cons = dict(HEAD_DIM=d, BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=bd, EVEN_D=bd == d, CAUSAL=causal, WINDOW=window,
                IS_VARLEN=False, LONG=False, PREC="ieee" if dtype == "fp32" else None,
                HAS_QD=True, HAS_KD=True, HAS_VD=True)
    sig = {}
    for n in _attn_jvp_kernel.arg_names:
        if n in cons:
            sig[n] = "constexpr"
        elif n in ("LSE", "LSED"):
            sig[n] = "*fp32"
        elif n in ("CU_Q", "CU_K"):
            sig[n] = "*i32"
        elif n in POINTERS:
            sig[n] = ptr
        else:
            sig[n] = "fp32" if n == "scale" else "i32"
    kernel = triton.compile(ASTSource(fn=_attn_jvp_kernel, signature=sig, constexprs=cons),
                            target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=stages))
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas-blackwell"
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(kernel.asm["ptx"])
    r = subprocess.run([str(ptxas), "-arch=sm_90a", "-v", f.name, "-o", os.devnull], capture_output=True, text=True)
    os.unlink(f.name)
    lines = [ln.split("info    : ")[-1].strip() for ln in (r.stdout + r.stderr).splitlines()
             if "Used" in ln or "spill" in ln]
    return " | ".join(lines) or (r.stdout + r.stderr)[-300:]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--tiles", default="128x64x8x3,64x64x8x2,64x32x8x2")
    a = p.parse_args()
    for t in a.tiles.split(","):
        bm, bn, warps, stages = (int(x) for x in t.split("x"))
        print(f"{a.dtype} d={a.head_dim} {t}: {ptxas_report(a.dtype, a.head_dim, bm, bn, warps, stages)}")


if __name__ == "__main__":
    main()
