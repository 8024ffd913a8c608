"""Compile the experimental Gluon kernels (kernels/gluon/) for sm_90 on a machine without
a GPU and print registers, spills and shared memory per variant.

The active Triton driver is replaced by a stub that reports an sm_90 target; each kernel is
compiled with ``warmup`` on CPU tensors (descriptors are built the way the wrappers build
them), then ptxas (-v, sm_90a) reads the PTX. Works with triton 3.6 (the H200 machine's) and
3.9; run it with each interpreter to catch API drift before device time is spent::

    python scripts/kernels/gluon_compile_sm90.py [--kernel bob_col|dkdv|bob_direct|bob_stats|fwd|dq]
        [--head-dim 64] [--causal] [--groups 1]

(``--groups G``: GQA inputs, G query heads per kv head.)

(``bob_direct`` / ``bob_stats``: kernels/gluon/bob_row.py; ``fwd``: kernels/gluon/fwd.py; ``dq``:
kernels/gluon/dq.py; the variants of these row passes read block_m (query tile) first:
``qt x kt / warps``.)
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import subprocess
import sys
import tempfile
import types

os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime import driver  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


class _Sm90Stub:
    """Just enough of a CUDA driver for ``JITFunction.warmup`` to compile for sm_90."""

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")

    def get_device_interface(self):
        return torch.cuda

    def get_benchmarker(self):
        return None

    def map_python_to_cpp_type(self, ty):
        from triton.backends.nvidia.driver import ty_to_cpp

        return ty_to_cpp(ty)


def load_module(name):
    """kernels/gluon/<name>.py by path (this script may run under an interpreter where the
    package is not installed), as a module of a bare package over kernels/ (so that its
    relative imports of gluon/common.py, configs.py, common.py and host.py resolve; kernels/__init__.py
    is not run)."""
    pkg = "_gluon_kernels"
    if pkg not in sys.modules:
        package = types.ModuleType(pkg)
        package.__path__ = [os.path.join(HERE, "..", "..", "kernels")]
        sys.modules[pkg] = package
    return importlib.import_module(f"{pkg}.gluon.{name}")


def _tool(name):
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def resources(kernel):
    """(registers, stack bytes, spill store bytes, spill load bytes, warnings) of a compiled
    kernel: registers and stack from its cubin (cuobjdump), spills from ptxas -v on its PTX
    for sm_90a (-1 where the bundled ptxas is older than the PTX, as in triton 3.9)."""
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "k.cubin")
        with open(cubin, "wb") as f:
            f.write(kernel.asm["cubin"])
        res = subprocess.run([_tool("cuobjdump"), "-res-usage", cubin], capture_output=True,
                             text=True).stdout
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(kernel.asm["ptx"])
        out = subprocess.run([_tool("ptxas"), "-v", "--gpu-name", "sm_90a", src, "-o",
                              os.path.join(tmp, "p.cubin")], capture_output=True, text=True)
    regs = re.search(r"REG:(\d+)", res)
    stack = re.search(r"STACK:(\d+)", res)
    text = out.stdout + out.stderr
    st = re.findall(r"(\d+) bytes spill stores", text)
    ld = re.findall(r"(\d+) bytes spill loads", text)
    warn = [line for line in text.splitlines() if "warning" in line.lower()]
    return (int(regs.group(1)) if regs else -1, int(stack.group(1)) if stack else -1,
            sum(map(int, st)) if st else -1, sum(map(int, ld)) if ld else -1, warn)


def _heads(groups, kv):
    """Head counts of the seven (q, k, v, do, uq, uk, uv) inputs: 2 kv heads, G query heads
    each."""
    return [2 if i in kv else 2 * groups for i in range(7)]


def compile_bob_col(mod, gl, d, causal, block_n, block_m, warps, stages, ws, maxnreg,
                    groups=1):
    """ws: 0 single partition, 1 warp-specialised, 2 warp-specialised with deferred K̄ waits,
    3 warp-specialised with two consumer partitions (warps / 2 each, block_n / 2 keys each)
    sharing the query-tile ring, 4 the same with deferred K̄ waits."""
    b, n = 1, 4 * block_n
    x = [torch.zeros(b, hh, n, d, dtype=torch.bfloat16)
         for hh in _heads(groups, (1, 2, 5, 6))]
    r = [torch.zeros(b, 2 * groups, n) for _ in range(4)]
    consumers = 2 if ws >= 3 else 1
    args, meta, _ = mod._prepare(*x, *r, None, 0.125, causal, block_n, block_m, warps, stages,
                                 consumers=consumers)
    if maxnreg:
        meta["maxnreg"] = maxnreg
    if ws:
        return mod._gluon_bob_col_ws_kernel.warmup(*args, CONSUMER_REGS=mod.CONSUMER_REGS,
                                                   PRODUCER_REGS=mod.PRODUCER_REGS,
                                                   DEFER=ws in (2, 4), grid=(1,), **meta)
    return mod._gluon_bob_col_kernel.warmup(*args, grid=(1,), **meta)


def compile_dkdv(mod, gl, d, causal, block_n, block_m, warps, stages, ws, maxnreg, groups=1):
    """ws: 0 single partition (``stages`` unused: a two-slot ring), 3 the TMA producer and
    two consumer partitions (warps / 2 each, block_n / 2 keys each) sharing a ring of
    ``stages`` Q / dO slots (``consumers=2``)."""
    b, n = 1, 4 * block_n
    q, do = (torch.zeros(b, 2 * groups, n, d, dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.zeros(b, 2, n, d, dtype=torch.bfloat16) for _ in range(2))
    lse, delta = (torch.zeros(b, 2 * groups, n) for _ in range(2))
    consumers = 2 if ws >= 3 else 1
    out = (torch.empty_like(k), torch.empty_like(v))
    args, meta = mod._prepare(q, k, v, do, lse, delta, 0.125, causal, block_n, block_m, warps,
                              out, consumers)
    if maxnreg:
        meta["maxnreg"] = maxnreg
    if consumers > 1:
        return mod._gluon_dkdv_ws_kernel.warmup(*args, STAGES=stages, CONSUMERS=consumers,
                                                CONSUMER_REGS=mod.CONSUMER_REGS,
                                                PRODUCER_REGS=mod.PRODUCER_REGS, grid=(1,),
                                                **meta)
    return mod._gluon_dkdv_kernel.warmup(*args, grid=(1,), **meta)


def compile_bob_row(mod, gl, d, causal, block_m, block_n, warps, stages, ws, maxnreg, stats,
                    groups=1):
    """The row passes of gluon/bob_row.py (ws: 0 single partition, 1 warp-specialised, 2
    the producer and two consumer partitions of warps / 2 each sharing the key-tile ring)."""
    b, n = 1, 4 * max(block_n, block_m)
    x = [torch.zeros(b, hh, n, d, dtype=torch.bfloat16)
         for hh in _heads(groups, (1, 2, 5, 6))]
    r = [torch.zeros(b, 2 * groups, n) for _ in range(4)]
    args, meta, _ = mod._prepare(*x, *r, 0.125, causal, stats, block_n, block_m, warps, stages,
                                 consumers=2 if ws == 2 else 1)
    if maxnreg:
        meta["maxnreg"] = maxnreg
    return mod._gluon_bob_row_kernel.warmup(*args, WS=bool(ws), CONSUMER_REGS=mod.CONSUMER_REGS,
                                            PRODUCER_REGS=mod.PRODUCER_REGS, grid=(1,), **meta)


def compile_bob_direct(mod, gl, d, causal, block_m, block_n, warps, stages, ws, maxnreg,
                       groups=1):
    return compile_bob_row(mod, gl, d, causal, block_m, block_n, warps, stages, ws, maxnreg,
                           False, groups)


def compile_bob_stats(mod, gl, d, causal, block_m, block_n, warps, stages, ws, maxnreg,
                      groups=1):
    return compile_bob_row(mod, gl, d, causal, block_m, block_n, warps, stages, ws, maxnreg,
                           True, groups)


def compile_fwd(mod, gl, d, causal, block_m, block_n, warps, stages, ws, maxnreg, groups=1):
    """The forward of gluon/fwd.py (ws: 0 single partition, 1 warp-specialised, 2 two
    consumer partitions of warps / 2 each, 3 the same taking turns)."""
    b, n = 1, 4 * max(block_n, block_m)
    q = torch.zeros(b, 2 * groups, n, d, dtype=torch.bfloat16)
    k, v = (torch.zeros(b, 2, n, d, dtype=torch.bfloat16) for _ in range(2))
    consumers = 2 if ws >= 2 else 1
    args, meta, _ = mod._prepare(q, k, v, 0.125, causal, block_n, block_m, warps, stages,
                                 consumers)
    if maxnreg:
        meta["maxnreg"] = maxnreg
    return mod._gluon_fwd_kernel.warmup(*args, WS=bool(ws), PINGPONG=ws == 3,
                                        CONSUMER_REGS=mod.CONSUMER_REGS,
                                        PRODUCER_REGS=mod.PRODUCER_REGS, grid=(1,), **meta)


def compile_dq(mod, gl, d, causal, block_m, block_n, warps, stages, ws, maxnreg, groups=1):
    """The dQ pass of gluon/dq.py (ws: 0 single partition, 1 warp-specialised, 2 two
    consumer partitions of warps / 2 each, 3 the same with deferred dS K waits, 4
    warp-specialised with deferred dS K waits)."""
    b, n = 1, 4 * max(block_n, block_m)
    q, o, do = (torch.zeros(b, 2 * groups, n, d, dtype=torch.bfloat16) for _ in range(3))
    k, v = (torch.zeros(b, 2, n, d, dtype=torch.bfloat16) for _ in range(2))
    lse = torch.zeros(b, 2 * groups, n)
    consumers = 2 if ws in (2, 3) else 1
    args, meta, _ = mod._prepare(q, k, v, o, do, lse, 0.125, causal, block_n, block_m, warps,
                                 stages, consumers)
    if maxnreg:
        meta["maxnreg"] = maxnreg
    return mod._gluon_dq_kernel.warmup(*args, WS=bool(ws), DEFER=ws >= 3,
                                       CONSUMER_REGS=mod.CONSUMER_REGS,
                                       PRODUCER_REGS=mod.PRODUCER_REGS, grid=(1,), **meta)


# (block_m, block_n, num_warps, stages, warp_specialize, maxnreg) of the dQ pass
# (warp_specialize 2: the TMA producer and two consumer partitions; 3: the same with deferred
# dS K waits; 4: the producer and one consumer partition with deferred dS K waits)
DQ_VARIANTS = [
    (128, 128, 8, 2, 2, 0),
    (128, 128, 8, 2, 3, 0),
    (128, 64, 8, 3, 3, 0),
    (128, 64, 8, 3, 4, 0),
    (128, 64, 8, 2, 2, 0),
    (128, 64, 8, 3, 2, 0),
    (128, 128, 8, 2, 0, 0),
    (128, 64, 8, 2, 0, 0),
    (128, 64, 8, 3, 1, 0),
    (64, 128, 4, 2, 0, 0),
    (64, 64, 4, 3, 1, 0),
]

# (block_m, block_n, num_warps, stages, warp_specialize, maxnreg) of the forward
# (warp_specialize 2: the TMA producer and two consumer partitions; 3: the same taking turns)
FWD_VARIANTS = [
    (128, 128, 8, 2, 0, 0),
    (128, 128, 8, 2, 1, 0),
    (128, 128, 8, 3, 1, 0),
    (128, 128, 8, 2, 2, 0),
    (128, 128, 8, 3, 2, 0),
    (128, 128, 8, 2, 3, 0),
    (128, 64, 8, 2, 0, 0),
    (128, 64, 8, 3, 0, 0),
    (128, 64, 8, 3, 1, 0),
    (128, 64, 8, 3, 2, 0),
    (128, 64, 8, 3, 3, 0),
    (64, 128, 4, 2, 0, 0),
    (64, 128, 4, 3, 1, 0),
    (64, 64, 4, 3, 1, 0),
]

# (block_m, block_n, num_warps, stages, warp_specialize, maxnreg) of the row passes
# (warp_specialize 2: the TMA producer and two 4-warp consumer partitions, ``consumers=2``)
BOB_ROW_VARIANTS = [
    (64, 64, 4, 2, 0, 0),
    (64, 64, 4, 2, 1, 128),
    (64, 64, 4, 3, 1, 128),
    (64, 64, 4, 2, 1, 168),
    (128, 64, 8, 2, 1, 168),
    (64, 128, 4, 2, 1, 168),
    (64, 32, 4, 2, 0, 0),
    (128, 64, 8, 2, 0, 0),
    (128, 64, 8, 2, 2, 0),
    (128, 64, 8, 3, 2, 0),
    (128, 32, 8, 2, 2, 0),
    (128, 32, 8, 3, 2, 0),
    (128, 32, 8, 4, 2, 0),
]

# (block_n, block_m, num_warps, stages, warp_specialize, maxnreg)
BOB_COL_VARIANTS = [
    (64, 64, 4, 2, False, None),
    (64, 32, 4, 2, False, None),
    (128, 64, 8, 2, False, None),
    (64, 64, 4, 2, True, 128),
    (64, 32, 4, 3, True, 128),
    (128, 64, 8, 2, True, 168),
    (64, 64, 4, 3, True, 128),
    (64, 64, 4, 3, 2, 128),
    # ws 3: the TMA producer and two 4-warp consumer partitions (64 keys each) sharing the
    # query-tile ring (consumers=2); 4: the same with deferred K̄ waits
    (128, 64, 8, 2, 3, 0),
    (128, 32, 8, 2, 3, 0),
    (128, 32, 8, 3, 3, 0),
    (128, 64, 8, 3, 4, 0),
    (128, 32, 8, 3, 4, 0),
]

# (block_n, block_m, num_warps, stages, warp_specialize, maxnreg) of the dK / dV pass
# (stages unused without warp specialisation; ws 3: the TMA producer and two 4-warp consumer
# partitions sharing the Q / dO ring, consumers=2)
DKDV_VARIANTS = [
    (128, 64, 8, 1, 0, 0),
    (64, 64, 4, 1, 0, 0),
    (128, 64, 8, 2, 3, 0),
    (128, 64, 8, 3, 3, 0),
    (128, 32, 8, 2, 3, 0),
    (128, 32, 8, 3, 3, 0),
]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--kernel", default="bob_col",
                   choices=["bob_col", "dkdv", "bob_direct", "bob_stats", "fwd", "dq"])
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--causal", action="store_true")
    p.add_argument("--groups", type=int, default=1, help="query heads per kv head (GQA)")
    p.add_argument("--variant", action="append", default=[],
                   help="block_n,block_m,num_warps,stages,ws,maxnreg(0: none) (row passes: "
                   "block_m first); ws: 0 single partition, 1 TMA producer; bob_col 2 +defer, "
                   "3 two consumer partitions, 4 two consumers +defer; dkdv 3 two consumers; "
                   "row passes 2 two consumers; fwd 2 two consumers, 3 +pingpong")
    p.add_argument("--dump", default="", help="folder for the PTX / TTGIR of each variant")
    a = p.parse_args()
    driver.set_active(_Sm90Stub())
    row = a.kernel in ("bob_direct", "bob_stats", "fwd", "dq")
    mod = load_module("bob_row" if a.kernel in ("bob_direct", "bob_stats") else a.kernel)
    if not mod.HAVE_GLUON:
        print(f"triton {triton.__version__}: Gluon's Hopper ops are missing")
        return 1
    defaults = {"bob_col": BOB_COL_VARIANTS, "bob_direct": BOB_ROW_VARIANTS,
                "bob_stats": BOB_ROW_VARIANTS, "fwd": FWD_VARIANTS, "dq": DQ_VARIANTS,
                "dkdv": DKDV_VARIANTS}
    variants = [tuple(int(v) for v in s.split(",")) for s in a.variant] or defaults[a.kernel]
    fn = globals()[f"compile_{a.kernel}"]
    print(f"triton {triton.__version__}, gluon_{a.kernel}, d={a.head_dim}, causal={a.causal}, "
          f"groups={a.groups}")
    tiles = "qt x kt" if row else "kt x qt"
    print(f"{tiles + ' / warps, stages, ws, maxnreg':<40}{'regs':>6}{'stack':>7}"
          f"{'spill st/ld':>13}{'smem KiB':>10}{'wgmma':>7}")
    bad = 0
    for bn, bm, w, st, ws, mr in variants:
        if a.kernel == "fwd":
            ws_names = ['-', 'ws', 'ws+2c', 'ws+2c+pp']
        elif a.kernel == "dq":
            ws_names = ['-', 'ws', 'ws+2c', 'ws+2c+defer', 'ws+defer']
        elif a.kernel in ("bob_stats", "bob_direct"):
            ws_names = ['-', 'ws', 'ws+2c']
        else:
            ws_names = ['-', 'ws', 'ws+defer', 'ws+2c', 'ws+2c+defer']
        ws_name = ws_names[int(ws)]
        name = f"{bn}x{bm}/{w}, {st}, {ws_name}, {mr or '-'}"
        try:
            k = fn(mod, mod.gl, a.head_dim, a.causal, bn, bm, w, st, int(ws), mr or None,
                   a.groups)
            ptx = k.asm["ptx"]
            regs, stack, sst, sld, warn = resources(k)
            print(f"{name:<40}{regs:>6}{stack:>7}{f'{sst}/{sld}':>13}"
                  f"{k.metadata.shared / 1024:>10.1f}{ptx.count('wgmma.mma_async'):>7}",
                  flush=True)
            for line in warn[:3]:
                print(f"    {line.strip()[:200]}")
            if a.dump:
                os.makedirs(a.dump, exist_ok=True)
                tag = name.replace(" ", "").replace("/", "w").replace(",", "_")
                for ext in ("ptx", "ttgir"):
                    with open(os.path.join(a.dump, f"{tag}.{ext}"), "w") as f:
                        f.write(k.asm[ext])
        except Exception as e:  # noqa: BLE001 - report every failing variant
            bad += 1
            msg = str(e).strip().splitlines()
            print(f"{name:<40} FAILED: {type(e).__name__}: {' | '.join(msg[-6:])[:1500]}",
                  flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
