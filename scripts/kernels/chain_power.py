"""Chain against first-order SDPA flash under sustained load, with the GPU's SM clock and
board power sampled during each, and the per-pass CUDA time of one chain.

    python3 scripts/kernels/chain_power.py --shapes 16384:12:12:64,65536:12:12:64 --causal both \
        --out DIR

A shape is ``N:H_q:H_kv:d`` (batch 1, bf16). Per (shape, causal): the chain of
``ttt_flash.bench`` (forward, ``autograd.grad(..., create_graph=True)``, backward-over-backward)
and SDPA flash forward + backward on the same inputs are timed in interleaved rounds; each
round runs one provider back-to-back for at least ``--burst-s`` seconds (so that short shapes
reach the sustained clock as well) and reports the mean per call (CUDA events). Meanwhile
``nvidia-smi`` samples the SM clock, the board power and the active clock-event reasons
(0x4: the software power cap) every ``--sample-ms``; each provider's samples are those inside
its own bursts. One more chain under ``torch.profiler`` gives the CUDA time of every kernel
(launch order; the BoB's two row passes share a kernel name and are told apart by order).

Per (query, key) pair (causal: half the pairs) the table gives the chain's and SDPA's time in
picoseconds, so lengths and head layouts compare directly (e.g. GQA 32 / 8 at N against
8 heads at 2N: the same number of pairs). Writes ``chain_power.json`` into ``--out`` and
prints the table last. Needs a CUDA GPU and ``nvidia-smi``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import subprocess
import sys
import time

import torch

SMI_FIELDS = "timestamp,clocks.sm,power.draw,clocks_event_reasons.active"


def parse_shapes(text: str):
    """``N:H:HKV:d,...`` -> [(N, H, H_kv, d)]; ValueError naming the bad entry."""
    out = []
    for part in text.split(","):
        try:
            n, h, hk, d = (int(x) for x in part.split(":"))
        except ValueError:
            raise ValueError(f"--shapes: {part!r} is not N:H_q:H_kv:d (four integers)") from None
        if min(n, h, hk, d) < 1 or h % hk:
            raise ValueError(f"--shapes: {part!r}: sizes must be positive and H_q a multiple "
                             "of H_kv")
        out.append((n, h, hk, d))
    return out


def read_samples(path: str):
    """(unix time, SM MHz, watts, reasons) rows of the sampler's CSV (bad lines skipped)."""
    rows = []
    with open(path) as f:
        for line in f:
            p = [s.strip() for s in line.split(",")]
            try:
                t = datetime.datetime.strptime(p[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
                rows.append((t, float(p[1].split()[0]), float(p[2].split()[0]), p[3]))
            except (ValueError, IndexError):
                continue
    return rows


def window_stats(rows, windows):
    """Median SM clock and power, and the set of clock-event reasons, of the samples inside
    ``windows`` [(t0, t1)]."""
    sel = [r for r in rows if any(a <= r[0] <= b for a, b in windows)]
    if not sel:
        return dict(samples=0)
    return dict(samples=len(sel), sm_mhz=statistics.median(r[1] for r in sel),
                sm_mhz_min=min(r[1] for r in sel), watts=statistics.median(r[2] for r in sel),
                reasons=sorted({r[3] for r in sel}))


def power_capped(reasons) -> bool:
    """Whether any of the sampled clock-event masks has the software power cap bit (0x4)."""
    out = False
    for x in reasons:
        try:
            out = out or bool(int(x, 16) & 0x4)
        except ValueError:
            continue
    return out


def burst(fn, calls: int) -> tuple:
    """Mean ms per call of ``calls`` back-to-back calls (``ttt_flash.bench.common.burst_ms``),
    and the wall window."""
    from ttt_flash.bench.common import burst_ms

    torch.cuda.synchronize()
    t0 = time.time()
    return burst_ms(fn, calls), (t0, time.time())


def profile_chain(fn) -> list:
    """[(kernel name#k, ms)] of one call, in launch order (#k numbers repeated names)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    seen: dict = {}
    out = []
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        seen[e.name] = seen.get(e.name, 0) + 1
        out.append((f"{e.name}#{seen[e.name]}", e.device_time_total / 1e3))
    return out


def measure(shape, causal, a, rows_windows):
    from ttt_flash import bench

    n, h, hk, d = shape
    cfg = bench.BenchConfig(seq_lens=[n], batch=1, heads=h, kv_heads=hk, head_dim=d,
                            dtype="bfloat16", causal=causal,
                            providers=["ttt_flash", "sdpa_flash"], device="cuda", check=False,
                            out=None)
    fns = {"chain": bench.make_provider(cfg, "ttt_flash", n)[0],
           "sdpa": bench.make_provider(cfg, "sdpa_flash", n)[0]}
    calls = {}
    for name, fn in fns.items():  # warm-up (compiles), then the calls per burst
        fn()
        ms, _ = burst(fn, 1)
        calls[name] = max(1, math.ceil(a.burst_s * 1e3 / max(ms, 1e-3)))
    times = {name: [] for name in fns}
    for _ in range(a.rounds):
        for name, fn in fns.items():
            ms, win = burst(fn, calls[name])
            times[name].append(ms)
            rows_windows[name].append(win)
    kernels = profile_chain(fns["chain"])
    del fns
    torch.cuda.empty_cache()
    pairs = n * n * h * (0.5 if causal else 1.0)
    med = {k: statistics.median(v) for k, v in times.items()}
    return dict(shape=list(shape), causal=causal, calls_per_burst=calls, times_ms=times,
                chain_ms=med["chain"], sdpa_ms=med["sdpa"], ratio=med["chain"] / med["sdpa"],
                chain_ps_per_pair=med["chain"] * 1e9 / pairs,
                sdpa_ps_per_pair=med["sdpa"] * 1e9 / pairs, kernels=kernels,
                kernel_ps_per_pair={k: ms * 1e9 / pairs for k, ms in kernels if ms > 0})


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default="16384:12:12:64,65536:12:12:64")
    p.add_argument("--causal", choices=["no", "yes", "both"], default="both")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--burst-s", type=float, default=1.0,
                   help="each provider runs back-to-back for at least this long per round")
    p.add_argument("--sample-ms", type=int, default=100)
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    shapes = parse_shapes(a.shapes)
    if a.rounds < 1 or a.burst_s <= 0 or a.sample_ms < 10:
        p.error("--rounds >= 1, --burst-s > 0 and --sample-ms >= 10 are required")
    if not torch.cuda.is_available():
        print("chain_power.py needs a CUDA GPU", file=sys.stderr)
        return 2
    os.makedirs(a.out, exist_ok=True)
    csv = os.path.join(a.out, "smi_samples.csv")
    sampler = subprocess.Popen(["nvidia-smi", f"--query-gpu={SMI_FIELDS}", "--format=csv,noheader",
                                "-lms", str(a.sample_ms)], stdout=open(csv, "w"))
    modes = {"no": [False], "yes": [True], "both": [False, True]}[a.causal]
    results = []
    try:
        for shape in shapes:
            for causal in modes:
                windows = {"chain": [], "sdpa": []}
                r = measure(shape, causal, a, windows)
                r["windows"] = windows
                results.append(r)
                print(f"N={shape[0]} H={shape[1]}/{shape[2]} d={shape[3]} causal={causal}: "
                      f"chain {r['chain_ms']:.2f} ms, sdpa {r['sdpa_ms']:.2f} ms, "
                      f"ratio {r['ratio']:.3f}", flush=True)
    finally:
        time.sleep(2 * a.sample_ms / 1e3)
        sampler.terminate()
        sampler.wait()
    rows = read_samples(csv)
    for r in results:
        r["gpu"] = {k: window_stats(rows, w) for k, w in r["windows"].items()}
    with open(os.path.join(a.out, "chain_power.json"), "w") as f:
        json.dump(results, f, indent=1)
    print("\nper pass, ps per (query, key) pair:")
    for r in results:
        n, h, hk, d = r["shape"]
        cells = " | ".join(f"{k.split('(')[0][:28]} {v:.3f}" for k, v in
                           r["kernel_ps_per_pair"].items() if v > 0.02 * r["chain_ps_per_pair"])
        print(f"N={n} H={h}/{hk} d={d} {'causal' if r['causal'] else 'full'}: {cells}")
    print(f"\n{'N':>8} {'H/Hkv':>6} {'d':>4} {'causal':>6} {'chain ms':>10} {'sdpa ms':>9} "
          f"{'/flash':>7} {'ps/pair':>8} {'sdpa':>6} {'MHz chain/sdpa':>15} {'W chain/sdpa':>13} "
          f"{'cap':>4}")
    for r in results:
        n, h, hk, d = r["shape"]
        g = r["gpu"]
        mhz = (f"{g['chain'].get('sm_mhz', 0):.0f}/{g['sdpa'].get('sm_mhz', 0):.0f}")
        watts = (f"{g['chain'].get('watts', 0):.0f}/{g['sdpa'].get('watts', 0):.0f}")
        cap = "yes" if power_capped(g["chain"].get("reasons", [])) else "no"
        print(f"{n:>8} {f'{h}/{hk}':>6} {d:>4} {str(r['causal']):>6} {r['chain_ms']:>10.2f} "
              f"{r['sdpa_ms']:>9.2f} {r['ratio']:>7.3f} {r['chain_ps_per_pair']:>8.3f} "
              f"{r['sdpa_ps_per_pair']:>6.3f} {mhz:>15} {watts:>13} {cap:>4}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
