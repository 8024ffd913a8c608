"""Everything the GPU must show, in one process per stage: run on the device machine.

    python scripts/gpu_suite.py --stages tests,errors,bench,startup,length --out $OUT

Stages:
  tests    pytest -m gpu (kernel accuracy against float64, every variant and dtype)
  errors   bf16 relative L2 error table at N=1024, B=1, H=12, d=64 (ours vs PyTorch bf16 math)
  bench    the chain benchmark (ttt-flash bench) at the anchor shapes, causal and not
  shapes   d=128 (H=8) and GQA (H=32, H_kv=8, d=128) rows
  startup  first chain call at N=4096 in a fresh process with an empty Triton cache
  host     host (Python) cost of a chain at N=1024: wall time, kernel count, cProfile
  regs     registers / spills / shared memory of every compiled kernel (Triton metadata)
  length   one chain at N=1,048,576 (--length: a comma list), causal and non-causal
           (--length-causal yes/no: one of them), row spot-check
Prints a short summary table last; details go to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

SUMMARY: list = []


def log(msg: str) -> None:
    print(msg, flush=True)


def stage_tests(out: str) -> None:
    t0 = time.time()
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", "tests"],
                       capture_output=True, text=True)
    with open(os.path.join(out, "gpu_tests.log"), "w") as f:
        f.write(r.stdout + r.stderr)
    last = [l for l in r.stdout.strip().splitlines() if l.strip()][-1:] or ["(no output)"]
    log(r.stdout[-6000:])
    SUMMARY.append(("gpu tests", f"{last[0]} ({time.time() - t0:.0f} s)"))


def _chain(attn, q, k, v, do, u):
    o = attn(q, k, v)
    g = torch.autograd.grad(o, (q, k, v), do, create_graph=True)
    inner = sum((a * b).sum() for a, b in zip(g, u))
    return [o, *g, *torch.autograd.grad(inner, (q, k, v, do))]


def stage_errors(out: str) -> None:
    from ttt_flash import flash_attention
    from ttt_flash.attention.reference import naive_attention

    names = ["o", "dq", "dk", "dv", "q_bar", "k_bar", "v_bar", "do_bar"]
    rows = {}
    for causal in (False, True):
        torch.manual_seed(0)
        x = [torch.randn(1, 12, 1024, 64, device="cuda", dtype=torch.float64) for _ in range(7)]
        # the float64 reference sees the same bf16-rounded inputs (errors are the kernels' own)
        x = [t.bfloat16().double() for t in x]
        q, k, v, do = (t.clone().requires_grad_(True) for t in x[:4])
        exact = _chain(lambda a, b, c: naive_attention(a, b, c, causal=causal), q, k, v, do, x[4:])
        low = [t.detach().bfloat16().requires_grad_(True) for t in x[:4]]
        ul = [t.bfloat16() for t in x[4:]]
        ours = _chain(lambda a, b, c: flash_attention(a, b, c, causal=causal), *low, ul)
        fast = _chain(lambda a, b, c: flash_attention(a, b, c, causal=causal, precise_bob=False), *low, ul)
        mathp = _chain(lambda a, b, c: naive_attention(a, b, c, causal=causal), *low, ul)
        rel = lambda a, e: ((a.double() - e).norm() / e.norm()).item()
        for n, a, f, m, e in zip(names, ours, fast, mathp, exact):
            rows[(causal, n)] = (rel(a, e), rel(f, e), rel(m, e))
    lines = ["bf16 rel. L2 error vs float64, N=1024 B=1 H=12 d=64",
             f"{'output':>8} {'causal':>7} {'ttt_flash':>10} {'precise_bob=False':>18} {'torch bf16 math':>16}"]
    for (causal, n), (a, f, m) in rows.items():
        lines.append(f"{n:>8} {str(causal):>7} {a:10.2e} {f:18.2e} {m:16.2e}")
    text = "\n".join(lines)
    log(text)
    with open(os.path.join(out, "errors.txt"), "w") as f:
        f.write(text + "\n")
    for i, label in ((0, "precise_bob=True"), (1, "precise_bob=False")):
        worst = max(rows[(c, n)][i] for c in (False, True) for n in ("q_bar", "k_bar", "v_bar", "do_bar"))
        SUMMARY.append((f"bf16 worst BoB rel. L2 (N=1024), {label}", f"{worst:.2e} (target <= 2.5e-3)"))


def _bench(out: str, tag: str, args: list) -> dict:
    from ttt_flash.bench import main as bench_main

    path = os.path.join(out, tag)
    bench_main(args + ["--out", path])
    with open(os.path.join(path, "bench.json")) as f:
        return json.load(f)


def stage_bench(out: str, seq_lens: str) -> None:
    for causal in (False, True):
        tag = "bench_causal" if causal else "bench_noncausal"
        res = _bench(out, tag, ["--seq-lens", seq_lens, "--heads", "12", "--head-dim", "64", "--dtype", "bfloat16",
                                "--providers", "ttt_flash,ttt_flash_fast,math,sdpa_flash,sdpa_cudnn"] + (["--causal"] if causal else []))
        for r in res["rows"]:
            if r["provider"].startswith("ttt_flash") and "ms" in r:
                SUMMARY.append((f"{r['provider']} {'causal' if causal else 'non-causal'} N={r['N']}",
                                f"{r['ms']:.2f} ms, {r['tflops']:.0f} TFLOP/s, {r.get('peak_gib', 0):.3f} GiB, "
                                f"/flash {r.get('ratio_sdpa_flash', float('nan')):.2f}, /cudnn {r.get('ratio_sdpa_cudnn', float('nan')):.2f}"))


def stage_shapes(out: str) -> None:
    for tag, extra in (("bench_d128", ["--heads", "8", "--head-dim", "128"]),
                       ("bench_gqa", ["--heads", "32", "--kv-heads", "8", "--head-dim", "128"])):
        for causal in (False, True):
            res = _bench(out, tag + ("_causal" if causal else ""),
                         ["--seq-lens", "4096,16384", "--dtype", "bfloat16", "--providers", "ttt_flash,sdpa_flash,sdpa_cudnn"]
                         + extra + (["--causal"] if causal else []))
            for r in res["rows"]:
                if r["provider"] == "ttt_flash" and "ms" in r:
                    SUMMARY.append((f"{tag} {'causal' if causal else 'non-causal'} N={r['N']}",
                                    f"{r['ms']:.2f} ms, /flash {r.get('ratio_sdpa_flash', float('nan')):.2f}"))


def stage_profile(out: str) -> None:
    """Per-kernel CUDA time of one chain at N=16,384 (B=1, H=12, d=64, bf16, non-causal)."""
    from torch.profiler import ProfilerActivity, profile

    from ttt_flash import flash_attention

    x = [torch.randn(1, 12, 16384, 64, device="cuda", dtype=torch.bfloat16) for _ in range(7)]
    q, k, v, do = (t.requires_grad_(True) for t in x[:4])
    run = lambda: _chain(lambda a, b, c: flash_attention(a, b, c), q, k, v, do, x[4:])
    run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            run()
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=15)
    log(table)
    with open(os.path.join(out, "profile.txt"), "w") as f:
        f.write(table)


def stage_host(out: str) -> None:
    """Host (Python) cost of a chain at N=1024, where the GPU work is ~0.2 ms: host time per
    phase, kernels launched per chain, their GPU time and the cProfile of 50 chains
    (``host_phases.py``, its B=1, N=1024 row; the profile in OUT/b1_n1024_full.txt)."""
    import host_phases  # scripts/kernels/host_phases.py, beside this script

    r = host_phases.phases(1024, False, 1, 50, out)
    text = (f"N=1024 chain: {r['total_ms']:.2f} ms host per chain (forward {r['forward_ms']:.2f}, backward "
            f"{r['backward_ms']:.2f}, inner product {r['inner_ms']:.2f}, BoB {r['bob_ms']:.2f}); "
            f"{len(r['kernels'])} GPU kernels per chain, {r['gpu_ms']:.3f} ms GPU time")
    log(text)
    SUMMARY.append(("host cost N=1024 chain", f"{r['total_ms']:.2f} ms host, {len(r['kernels'])} kernels, "
                                              f"{r['gpu_ms']:.3f} ms GPU"))


def stage_regs(out: str) -> None:
    """Registers, spills, shared memory and warps of every compiled kernel after one chain at
    N=16,384 (non-causal and causal), from Triton's compiled-kernel metadata."""
    from ttt_flash import flash_attention
    from ttt_flash.kernels import bob_affine, bob_col, bob_row, dkdv, dq, fwd

    for causal in (False, True):
        x = [torch.randn(1, 12, 16384, 64, device="cuda", dtype=torch.bfloat16) for _ in range(7)]
        q, k, v, do = (t.requires_grad_(True) for t in x[:4])
        _chain(lambda a, b, c: flash_attention(a, b, c, causal=causal), q, k, v, do, x[4:])
    torch.cuda.synchronize()
    lines = [f"{'kernel':<24}{'regs':>6}{'spills':>8}{'shared KiB':>12}{'warps':>7}{'stages':>8}"]
    for mod in (fwd, dq, dkdv, bob_row, bob_affine, bob_col):
        for name in dir(mod):
            fn = getattr(mod, name)
            caches = getattr(fn, "device_caches", None)
            if not name.startswith("_") or caches is None:
                continue
            for entry in caches.values():
                cache = entry[0] if isinstance(entry, tuple) else entry
                for ck in cache.values():
                    try:
                        ck._init_handles()
                    except Exception:  # noqa: BLE001
                        pass
                    md = ck.metadata
                    lines.append(f"{name.strip('_')[:24]:<24}{getattr(ck, 'n_regs', -1):>6}{getattr(ck, 'n_spills', -1):>8}"
                                 f"{getattr(md, 'shared', 0) / 1024:>12.1f}{getattr(md, 'num_warps', 0):>7}"
                                 f"{getattr(md, 'num_stages', 0):>8}")
    text = "\n".join(lines)
    log(text)
    with open(os.path.join(out, "regs.txt"), "w") as f:
        f.write(text + "\n")


def stage_startup(out: str) -> None:
    code = (
        "import time,torch;t=time.perf_counter();from ttt_flash import flash_attention;"
        "x=[torch.randn(1,12,4096,64,device='cuda',dtype=torch.bfloat16,requires_grad=True) for _ in range(4)];"
        "o=flash_attention(*x[:3]);g=torch.autograd.grad(o,x[:3],x[3],create_graph=True);"
        "s=sum((a*a).sum() for a in g);r=torch.autograd.grad(s,x);torch.cuda.synchronize();"
        "print(f'{time.perf_counter()-t:.2f}')"
    )
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, TRITON_CACHE_DIR=cache)
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    log(r.stdout + r.stderr[-2000:])
    SUMMARY.append(("first chain call N=4096, empty cache", f"{r.stdout.strip()} s (target <= 15 s)"))


def stage_length(out: str, n: int, causal_modes=(True, False)) -> None:
    from ttt_flash import flash_attention
    from ttt_flash.attention.reference import naive_attention

    for causal in causal_modes:
        # warm-up (compilation) on a shorter sequence with the same specialisation: above
        # FUSED_ROW_MAX_KEYS the BoB row sweeps are separate launches, and the Hopper (Gluon)
        # passes run only from their min_keys on (configs.GLUON)
        from ttt_flash.kernels.configs import FUSED_ROW_MAX_KEYS, GLUON

        nw = 4096 if n <= FUSED_ROW_MAX_KEYS else 2 * FUSED_ROW_MAX_KEYS
        gluon_min = max((c.min_keys for c in GLUON.values()), default=0)
        if n >= gluon_min:
            nw = max(nw, min(n, 2 * gluon_min))
        w = [torch.randn(1, 12, nw, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(4)]
        _chain(lambda a, b, c: flash_attention(a, b, c, causal=causal), *w, [t.detach() for t in w[:3]])
        del w
        torch.manual_seed(0)
        x = [torch.randn(1, 12, n, 64, device="cuda", dtype=torch.bfloat16) for _ in range(7)]
        q, k, v, do = (t.requires_grad_(True) for t in x[:4])
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        res = _chain(lambda a, b, c: flash_attention(a, b, c, causal=causal), q, k, v, do, x[4:])
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        peak = (torch.cuda.max_memory_allocated() - base) / 2**30
        # Row outputs (o, dq, q_bar, do_bar) of query i depend only on row i of (q, dO, U_Q)
        # and on all the keys it sees (k, v, U_K, U_V): a one-row float64 problem over those
        # keys reproduces them exactly (a 1-row non-causal problem over keys [0, i] is row i
        # of the causal one).
        errs = []
        for i in (1, 17, n // 2, n - 1):
            kend = i + 1 if causal else n
            row = lambda t: t.detach()[:, :, i:i + 1].double().requires_grad_(True)
            keys = lambda t: t.detach()[:, :, :kend].double().requires_grad_(True)
            ref = _chain(lambda a, b, c: naive_attention(a, b, c), row(q), keys(k), keys(v), row(do),
                         [x[4][:, :, i:i + 1].double(), x[5][:, :, :kend].double(), x[6][:, :, :kend].double()])
            for j in (0, 1, 4, 7):  # o, dq, q_bar, do_bar
                e = ref[j]
                errs.append(((res[j][:, :, i:i + 1].double() - e).norm() / e.norm()).item())
        del res
        SUMMARY.append((f"N={n} chain {'causal' if causal else 'non-causal'}",
                        f"{dt:.2f} s, peak {peak:.2f} GiB, row spot-check worst rel. L2 {max(errs):.2e}"))
        log(SUMMARY[-1])
        del q, k, v, do, x
        torch.cuda.empty_cache()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--stages", default="tests,errors,bench,shapes,startup")
    p.add_argument("--seq-lens", default="1024,4096,16384,65536")
    p.add_argument("--length", default=str(1 << 20), help="comma-separated sequence lengths")
    p.add_argument("--length-causal", choices=["both", "yes", "no"], default="both",
                   help="which masks the length stage runs")
    p.add_argument("--out", default=os.environ.get("OUT", "gpu_out"))
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    log(f"torch {torch.__version__}, GPU {torch.cuda.get_device_name()}, capability {torch.cuda.get_device_capability()}")
    import triton

    log(f"triton {triton.__version__}")
    masks = {"both": (True, False), "yes": (True,), "no": (False,)}[a.length_causal]
    for stage in a.stages.split(","):
        t0 = time.time()
        try:
            {"tests": lambda: stage_tests(a.out), "errors": lambda: stage_errors(a.out),
             "bench": lambda: stage_bench(a.out, a.seq_lens), "shapes": lambda: stage_shapes(a.out),
             "startup": lambda: stage_startup(a.out), "profile": lambda: stage_profile(a.out),
             "host": lambda: stage_host(a.out), "regs": lambda: stage_regs(a.out), "length": lambda: [stage_length(a.out, int(n), masks) for n in a.length.split(",")]}[stage]()
        except Exception as e:  # noqa: BLE001 - report and go on to the next stage
            import traceback

            traceback.print_exc()
            SUMMARY.append((f"stage {stage}", f"FAILED: {type(e).__name__}: {str(e)[:200]}"))
        log(f"[stage {stage}: {time.time() - t0:.0f} s]")
    with open(os.path.join(a.out, "summary.json"), "w") as f:
        json.dump(SUMMARY, f, indent=1)
    print("\n==== summary ====")
    for k, v in SUMMARY:
        print(f"{k:<44} {v}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
