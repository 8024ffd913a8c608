"""Compile every Triton kernel a chain launches for sm_90 on a machine without a GPU, and
print registers / spills / shared memory per kernel (ptxas via ``cuobjdump -res-usage``).

The composers run on CPU tensors with each kernel replaced by a recorder (no launch); each
recorded launch is then compiled with ``triton.compile`` for ``GPUTarget("cuda", 90, 64)``
with the tiles of the sm_90 table. Integer arguments are compiled unspecialised (no
divisibility hints), so the numbers are close to, not equal to, the GPU's. Catches compile
errors before device time is spent::

    python scripts/compile_sm90.py [--dtype bfloat16] [--head-dim 64] [--causal]
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
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from ttt_flash.kernels import attn_bob, attn_bwd, attn_fwd, configs  # noqa: E402

MODS = [sys.modules[f"ttt_flash.kernels.{m}"] for m in ("attn_fwd", "attn_bwd", "bob")]
_DT = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32", torch.int32: "*i32"}


class Recorder:
    def __init__(self, name, fn, out):
        self.name, self.fn, self.out = name, fn, out

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.out.append((self.name, self.fn, args, kwargs))
        return launch


def compile_launch(fn, args, kwargs):
    names = fn.arg_names
    sig, consts = {}, {}
    for name, a in zip(names, args):
        if isinstance(a, torch.Tensor):
            sig[name] = _DT[a.dtype]
        elif isinstance(a, bool):
            sig[name] = "i1"
        elif isinstance(a, int):
            sig[name] = "i64" if abs(a) >= 2**31 else "i32"
        else:
            sig[name] = "fp32"
    opts = {k: kwargs[k] for k in ("num_warps", "num_stages") if k in kwargs}
    for name, val in kwargs.items():
        if name in opts:
            continue
        sig[name] = "constexpr"
        consts[name] = val
    for name, p in zip(names, fn.params):  # constexpr defaults not passed
        if name not in sig and p.is_constexpr:
            sig[name] = "constexpr"
            consts[name] = p.default
    src = ASTSource(fn, sig, consts)
    return triton.compile(src, target=GPUTarget("cuda", 90, 64), options=opts)


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
    a = p.parse_args()
    for o in a.override:
        kind, vals = o.split("=")
        bm, bn, w, s, qm = (int(x) for x in vals.split(","))
        configs._OVERRIDES[kind] = configs.TileConfig(bm, bn, w, s, bool(qm))
    dtype = getattr(torch, a.dtype)
    if a.no_rowsum:
        configs.ROWSUM_CORRECTION[dtype] = False

    def sm90_config(kind, block_d, dt, device):
        if kind in configs._OVERRIDES:
            return configs._OVERRIDES[kind]
        table = configs._FP32 if dt == torch.float32 else configs._SM90_HALF
        return table[block_d][kind]

    rec = []
    for m in MODS:
        for name in dir(m):
            obj = getattr(m, name)
            if isinstance(obj, triton.runtime.jit.JITFunction) and name.endswith("_kernel"):
                setattr(m, name, Recorder(name, obj, rec))
        if hasattr(m, "get_config"):
            m.get_config = sm90_config
    configs.get_config = sm90_config
    import ttt_flash.kernels.bob as bob

    bob.fuse_row_sweeps = lambda n_k, bd, dt, dev: n_k <= configs.FUSED_ROW_MAX_KEYS and (
        sm90_config("bob_stats", bd, dt, dev) == sm90_config("bob_direct", bd, dt, dev))
    x = [torch.randn(1, 2, a.n, a.head_dim).to(dtype) for _ in range(7)]
    q, k, v, do, uq, uk, uv = x
    kw = dict(scale=a.head_dim ** -0.5, causal=a.causal, window=None)
    o, lse = attn_fwd(q, k, v, **kw)
    lse = torch.zeros(1, 2, a.n)
    for det in (True, False):
        for atomic in (False, True):
            sys.modules["ttt_flash.kernels.attn_bwd"].use_atomics = lambda *_, at=atomic: at
            bob.use_atomics = lambda *_, at=atomic: at
            attn_bwd(q, k, v, o, lse, do, deterministic=det, **kw)
            attn_bob(q, k, v, o, lse, do, lse, uq, uk, uv, deterministic=det, **kw)
    attn_bob(q, k, v, o, lse, do, lse, uq, uk, uv, precise=False, **kw)
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
            regs, stack = res_usage(ck)
            print(f"{name:<24}{regs:>6}{stack:>7}{ck.metadata.shared / 1024:>12.1f}  "
                  f"{kwargs.get('BLOCK_M')}x{kwargs.get('BLOCK_N')}/{kwargs.get('num_warps')} {flags}", flush=True)
        except Exception as e:  # noqa: BLE001 - report every failing kernel
            bad += 1
            print(f"{name:<24} FAILED: {type(e).__name__}: {str(e)[:400]}", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
