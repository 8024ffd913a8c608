"""Compile every Triton kernel a chain launches for sm_90 on a machine without a GPU, and
print registers / spills / shared memory per kernel (ptxas via ``cuobjdump -res-usage``).

The composers run on CPU tensors with each kernel replaced by a recorder (no launch); each
recorded launch is then compiled for sm_90 by ``JITFunction.warmup`` under a stub driver
(scripts/kernels/gluon_compile_sm90.py), with the tiles of the sm_90 table (``plan.capability`` told
(9, 0); no Gluon pass) and the launcher's own argument specialisation, so the numbers are
close to the GPU's (the triton installed here, not the GPU machine's). Catches compile errors
before device time is spent::

    python scripts/kernels/compile_sm90.py [--dtype bfloat16] [--head-dim 64] [--causal] [--dump DIR]

``--given qk`` passes only U_Q, U_K (and Q̇, K̇) as cotangents and tangents, the others None,
so that the kernels compile with those tensors absent (default ``qkv``: all given).

``--dump DIR`` writes each compiled kernel's PTX (kernel name and constexprs in the file
name, the ``.version`` / ``.target`` header and comments dropped), so that two source trees'
kernels can be compared with ``diff -r``.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys

os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
import triton  # noqa: E402
from triton.runtime import driver  # noqa: E402

from ttt_flash.kernels import attn_bob, attn_bwd, attn_fwd, attn_jvp, attn_tangent  # noqa: E402
from ttt_flash.kernels import configs, plan  # noqa: E402

MODS = [sys.modules[f"ttt_flash.kernels.{m}"] for m in ("fwd", "bwd", "bob", "jvp")]


class Recorder:
    def __init__(self, name, fn, out):
        self.name, self.fn, self.out = name, fn, out

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.out.append((self.name, self.fn, args, kwargs))
        return launch


def _stub_driver():
    """The sm_90 stub driver of scripts/kernels/gluon_compile_sm90.py: ``JITFunction.warmup``
    compiles for sm_90 without a GPU, with the launcher's own specialisation."""
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    spec = importlib.util.spec_from_file_location("_gluon_compile_sm90",
                                                  os.path.join(here, "gluon_compile_sm90.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod._Sm90Stub()


def compile_launch(fn, args, kwargs):
    """Compile one recorded launch for sm_90 as the GPU's launcher would (its argument
    specialisation: 16-byte aligned pointers, integers divisible by 16, tuples element by
    element) and return the compiled kernel."""
    return fn.warmup(*args, grid=(1,), **kwargs)


def res_usage(ck):
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(ck.asm["cubin"])
        f.flush()
        tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
        out = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
    regs = re.search(r"REG:(\d+)", out)
    stack = re.search(r"STACK:(\d+)", out)
    return (int(regs.group(1)) if regs else -1), (int(stack.group(1)) if stack else -1)


def dump_ptx(folder, name, kwargs, ck):
    """Write the PTX body of ``name`` at these constexprs to ``folder`` (file name: the kernel
    and a hash of its constexprs, listed in ``index.txt``), without the header, comments and
    debug information (source lines differ between trees, the code need not)."""
    import hashlib

    os.makedirs(folder, exist_ok=True)
    tag = ",".join(f"{k}={v}" for k, v in sorted(kwargs.items()))
    fname = f"{name}.{hashlib.md5(tag.encode()).hexdigest()[:10]}.ptx"
    keep = []
    for ln in ck.asm["ptx"].splitlines():
        if ln.startswith(".section") or ln.startswith("\t.section"):
            break  # DWARF sections follow the code
        if ln.strip() and not ln.lstrip().startswith(("//", ".loc", ".file", ".version",
                                                        ".target", ".address_size")):
            keep.append(ln)
    with open(os.path.join(folder, fname), "w") as f:
        f.write("\n".join(keep) + "\n")
    with open(os.path.join(folder, "index.txt"), "a") as f:
        f.write(f"{fname} {tag}\n")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--causal", action="store_true")
    p.add_argument("--n", type=int, default=256)
    p.add_argument("--override", action="append", default=[],
                   help="kind=block_m,block_n,num_warps,num_stages,qmajor(0/1)")
    p.add_argument("--no-rowsum", action="store_true", help="ROWSUM_CORRECTION off for the dtype")
    p.add_argument("--only", default="", help="comma list of kernel names to compile")
    p.add_argument("--dump", default="", help="folder for each kernel's PTX")
    p.add_argument("--given", default="qkv", help="which of U_Q, U_K, U_V (Q̇, K̇, V̇) are given")
    a = p.parse_args()
    over = {}
    for o in a.override:
        kind, vals = o.split("=")
        bm, bn, w, s, qm = (int(x) for x in vals.split(","))
        over[kind] = configs.TileConfig(bm, bn, w, s, bool(qm))
    dtype = getattr(torch, a.dtype)
    if a.no_rowsum:
        configs.ROWSUM_CORRECTION[dtype] = False
    driver.set_active(_stub_driver())
    plan.capability = lambda device: (9, 0)  # the sm_90 table's tiles
    plan._gluon_capability = lambda device: None  # the Triton passes only
    plan.clear_cache()

    rec = []
    for m in MODS:
        for name in dir(m):
            obj = getattr(m, name)
            if isinstance(obj, triton.runtime.jit.JITFunction) and name.endswith("_kernel"):
                setattr(m, name, Recorder(name, obj, rec))
    x = [torch.randn(1, 2, a.n, a.head_dim).to(dtype) for _ in range(7)]
    q, k, v, do, uq, uk, uv = x
    uq, uk, uv = (u if c in a.given else None for u, c in zip((uq, uk, uv), "qkv"))
    kw = dict(scale=a.head_dim ** -0.5, causal=a.causal, window=None)
    with configs.tile_overrides(over):
        o, lse = attn_fwd(q, k, v, **kw)
        lse = torch.zeros(1, 2, a.n)
        attn_bwd(q, k, v, o, lse, do, **kw)
        attn_bob(q, k, v, o, lse, do, lse, uq, uk, uv, **kw)
        attn_bob(q, k, v, o, lse, do, lse, uq, uk, uv, precise=False, **kw)
        attn_jvp(q, k, v, uq, uk, uv, **kw)
        attn_tangent(q, k, v, o, lse, uq, uk, uv, **kw)
    seen = set()
    print(f"{'kernel':<24}{'regs':>6}{'stack':>7}{'shared KiB':>12}  constexprs")
    bad = 0
    for name, fn, args, kwargs in rec:
        key = (name, tuple(sorted((k2, str(v2)) for k2, v2 in kwargs.items())))
        if key in seen or (a.only and name not in a.only.split(",")):
            continue
        seen.add(key)
        flags = ",".join(k2 for k2, v2 in kwargs.items() if v2 is True)
        try:
            ck = compile_launch(fn, args, kwargs)
            if a.dump:
                dump_ptx(a.dump, name, kwargs, ck)
            regs, stack = res_usage(ck)
            print(f"{name:<24}{regs:>6}{stack:>7}{ck.metadata.shared / 1024:>12.1f}  "
                  f"{kwargs.get('BLOCK_M')}x{kwargs.get('BLOCK_N')}/{kwargs.get('num_warps')} {flags}", flush=True)
        except Exception as e:  # noqa: BLE001 - report every failing kernel
            bad += 1
            print(f"{name:<24} FAILED: {type(e).__name__}: {str(e)[:3000]}", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
