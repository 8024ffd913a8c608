"""Time each Gluon pass (kernels/gluon/) alone over a list of tile variants, at one shape.

    python scripts/kernels/gluon_pass_sweep.py --heads 8 --kv-heads 8 --head-dim 128 --n 16384 \
        [--causal] [--kinds fwd,bwd_dq,bwd_dkdv,bob_stats,bob_direct,bob_col] [--out DIR]

Per pass kind and variant: ``triton.testing.do_bench`` median (ms) of the Gluon function on
random bf16 inputs of shape (1, H_q, N, d) / (1, H_kv, N, d), and the rate it implies
(flops per (query, key) pair: forward 4·d, dQ 6·d, dK/dV 8·d, statistics 10·d, direct 18·d,
column 16·d; causal counts half the pairs). The forward's rows start with the Triton forward
(``attn_fwd`` with ``configs.use_gluon_passes(False)``, variant ``triton``) timed in the same
run, and each Gluon variant's O and L are compared with it (``o_maxdiff`` in bf16 units of
max |O|, ``lse_maxdiff``; a variant beyond 4 units or 1e-3 is reported as failed, without a
time). The dQ pass's rows (``bwd_dq``) likewise start with the Triton dQ kernel
(``_attn_bwd_dq_kernel``'s CUDA time in ``attn_bwd`` with the Gluon passes off, from
``torch.profiler``), on O and L of the Triton forward, and each Gluon variant's dQ and D are
compared with that call's (``dq_maxdiff`` in bf16 units of max |dQ|, ``delta_maxdiff``
relative to max |D|; beyond 4 units or 1e-4: failed). The other Triton passes' times at the
same shape come from
``scripts/kernels/gluon_chain_ab.py --profile`` (the chain with the Gluon passes off). A short table
of every row is printed last. A variant that
fails to compile or run prints its error and the sweep goes on. Writes
``gluon_pass_sweep.json`` into ``--out``.

The BoB row passes' variants (per head dim, :data:`ROW_DEFAULTS`) are each compared with
the table's tiles (configs.GLUON) on the same inputs (statistics within 2^-10, Q̄ / dŌ within
4 bf16 units of the largest output; beyond: failed, without a time); the last table gives
each one's speed-up over the table's tiles of the same run.

Variants (``--variant kind=a,b,c,d,e,f``, repeatable, replaces that kind's defaults): the
keyword arguments of the Gluon function in the order of :data:`FIELDS`; 0 for ``maxnreg``
means none. The key-tile kinds (``bwd_dkdv``, ``bob_col``) take their defaults per head dim
from :data:`KEY_TILE_DEFAULTS`, and each of their variants after the first is compared with
the first (the table's tiles), failed beyond :data:`KEY_TILE_TOL_UNITS` bf16 units.
``warp_specialize`` 2 of a row pass (``bob_stats``, ``bob_direct``) is the producer with two
consumer partitions (``consumers=2``), of the forward as there; bob_col's 3 and 4 are two
consumers (4: with deferred K̄ waits), bwd_dkdv names ``consumers`` and ``stages`` itself.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

#: per kind: the order of a variant's numbers (keywords of the Gluon function)
FIELDS = {
    "fwd": ("block_m", "block_n", "num_warps", "stages", "warp_specialize", "maxnreg"),
    "bwd_dq": ("block_m", "block_n", "num_warps", "stages", "warp_specialize", "maxnreg"),
    "bwd_dkdv": ("block_n", "block_m", "num_warps", "maxnreg", "consumers", "stages"),
    "bob_col": ("block_n", "block_m", "num_warps", "stages", "warp_specialize", "maxnreg"),
    "bob_stats": ("block_m", "block_n", "num_warps", "stages", "warp_specialize", "maxnreg"),
    "bob_direct": ("block_m", "block_n", "num_warps", "stages", "warp_specialize", "maxnreg"),
}

#: d = 128 candidates without ptxas spills (or with the fewest; scripts/kernels/gluon_compile_sm90.py)
#: (the row passes' candidates are per head dim: ROW_DEFAULTS)
DEFAULTS = {
    "bwd_dkdv": [(64, 64, 4, 0), (64, 32, 4, 0), (128, 32, 8, 0)],
    "bob_col": [(128, 32, 8, 2, 1, 168), (64, 32, 4, 2, 1, 168), (64, 32, 4, 2, 0, 0),
                (128, 32, 8, 2, 0, 0)],
}

#: forward candidates per head dim (no ptxas spills; scripts/kernels/gluon_compile_sm90.py --kernel fwd)
#: (warp_specialize 2: the TMA producer and two consumer partitions, ``consumers=2``; 3: the
#: same taking turns, ``pingpong=True``; those last, so that the rows before them are kept
#: whatever happens to them)
FWD_DEFAULTS = {
    64: [(128, 128, 8, 2, 0, 0), (128, 128, 8, 2, 1, 0), (128, 128, 8, 3, 1, 0),
         (128, 64, 8, 3, 0, 0), (128, 64, 8, 3, 1, 0), (64, 128, 4, 2, 0, 0),
         (64, 128, 4, 3, 1, 0), (128, 128, 8, 2, 2, 0), (128, 128, 8, 3, 2, 0),
         (128, 128, 8, 2, 3, 0), (128, 128, 8, 3, 3, 0)],
    128: [(128, 128, 8, 2, 0, 0), (128, 128, 8, 2, 1, 0), (128, 64, 8, 2, 0, 0),
          (128, 64, 8, 3, 1, 0), (64, 128, 4, 2, 0, 0), (64, 64, 4, 3, 1, 0),
          (128, 128, 8, 2, 2, 0), (128, 64, 8, 3, 2, 0), (128, 128, 8, 2, 3, 0),
          (128, 64, 8, 3, 3, 0)],
}

#: key-tile pass candidates per head dim (scripts/kernels/gluon_compile_sm90.py --kernel bob_col /
#: dkdv); they replace DEFAULTS' lists of these kinds. The table's tiles come first: the
#: other variants' outputs are compared with the first one's. bob_col's warp_specialize: 0
#: single partition, 1 TMA producer, 2 producer + deferred K̄ waits, 3 producer and two
#: 4-warp consumer partitions (64 keys each) sharing the query-tile ring (``consumers=2``),
#: 4 the same with deferred K̄ waits; bwd_dkdv's consumers 2: the same producer / two
#: consumers shape, with ``stages`` ring slots.
KEY_TILE_DEFAULTS = {
    64: {
        "bwd_dkdv": [(64, 64, 4, 0), (128, 64, 8, 0), (128, 64, 8, 0, 2, 2),
                     (128, 64, 8, 0, 2, 3), (128, 32, 8, 0, 2, 2), (128, 32, 8, 0, 2, 3)],
        "bob_col": [(64, 64, 4, 2, 1, 128), (64, 64, 4, 2, 0, 0), (128, 64, 8, 2, 3, 0),
                    (128, 64, 8, 3, 3, 0), (128, 32, 8, 2, 3, 0), (128, 32, 8, 3, 3, 0),
                    (128, 64, 8, 3, 4, 0), (128, 32, 8, 3, 4, 0)],
    },
    128: {
        "bwd_dkdv": [(64, 64, 4, 0), (64, 32, 4, 0), (128, 32, 8, 0), (128, 64, 8, 0, 2, 2),
                     (128, 32, 8, 0, 2, 2), (128, 32, 8, 0, 2, 3)],
        "bob_col": [(128, 32, 8, 2, 1, 168), (64, 32, 4, 2, 1, 168), (64, 32, 4, 2, 0, 0),
                    (128, 32, 8, 2, 3, 0), (128, 32, 8, 3, 3, 0), (128, 32, 8, 3, 4, 0)],
    },
}

#: largest difference from the first variant of a key-tile kind, in bf16 units (2^-8) of
#: the first variant's max |output|, beyond which a variant is reported as failed
KEY_TILE_TOL_UNITS = 4.0

#: BoB row-pass candidates per head dim, the table's tiles (configs.GLUON) first
#: (warp_specialize 2: the TMA producer and two 4-warp consumer partitions sharing the ring of
#: key tiles, ``consumers=2``; scripts/kernels/gluon_compile_sm90.py --kernel bob_stats / bob_direct)
ROW_DEFAULTS = {
    64: {
        "bob_stats": [(64, 64, 4, 2, 0, 0), (128, 64, 8, 2, 1, 168), (128, 64, 8, 2, 2, 0),
                      (128, 64, 8, 3, 2, 0), (128, 32, 8, 2, 2, 0), (128, 32, 8, 3, 2, 0)],
        "bob_direct": [(64, 64, 4, 2, 0, 0), (64, 32, 4, 2, 0, 0), (128, 64, 8, 2, 2, 0),
                       (128, 64, 8, 3, 2, 0), (128, 32, 8, 2, 2, 0), (128, 32, 8, 3, 2, 0)],
    },
    128: {
        "bob_stats": [(128, 64, 8, 2, 0, 0), (64, 32, 4, 2, 0, 0), (128, 32, 8, 2, 0, 0),
                      (64, 64, 4, 2, 0, 0), (64, 32, 4, 3, 0, 0), (128, 64, 8, 2, 2, 0),
                      (128, 32, 8, 2, 2, 0), (128, 32, 8, 3, 2, 0)],
        "bob_direct": [(64, 32, 4, 2, 0, 0), (128, 32, 8, 2, 0, 0), (64, 32, 4, 2, 1, 168),
                       (64, 32, 4, 3, 0, 0), (128, 32, 8, 2, 2, 0), (128, 32, 8, 3, 2, 0),
                       (128, 32, 8, 4, 2, 0)],
    },
}

#: dQ candidates per head dim (no ptxas spills; scripts/kernels/gluon_compile_sm90.py --kernel dq)
#: (warp_specialize 2: the TMA producer and two consumer partitions, ``consumers=2``; 3: the
#: same with deferred dS K waits, ``defer=True``; 4: the producer and one consumer partition
#: with deferred waits; the deferred ones last)
DQ_DEFAULTS = {
    64: [(128, 128, 8, 2, 2, 0), (128, 64, 8, 2, 2, 0), (128, 64, 8, 3, 2, 0),
         (128, 128, 8, 2, 0, 0), (128, 64, 8, 2, 0, 0), (128, 64, 8, 3, 1, 0),
         (64, 128, 4, 2, 0, 0), (64, 64, 4, 3, 1, 0), (128, 128, 8, 2, 3, 0),
         (128, 128, 8, 3, 3, 0), (128, 64, 8, 3, 3, 0), (128, 64, 8, 3, 4, 0)],
    128: [(128, 128, 8, 2, 2, 0), (128, 64, 8, 2, 2, 0), (128, 64, 8, 3, 2, 0),
          (128, 64, 8, 2, 0, 0), (128, 64, 8, 3, 1, 0), (64, 64, 4, 2, 0, 0),
          (64, 64, 4, 3, 1, 0), (128, 128, 8, 2, 3, 0), (128, 64, 8, 3, 3, 0),
          (128, 64, 8, 3, 4, 0)],
}

FLOPS_PER_PAIR_D = {"fwd": 4, "bwd_dq": 6, "bwd_dkdv": 8, "bob_stats": 10, "bob_direct": 18,
                    "bob_col": 16}


def run_fwd(variants, x, causal, on_row=lambda rows: None):
    """The Triton forward, then each Gluon forward variant checked against it and timed;
    ``on_row(rows)`` after each row (the script saves the JSON there)."""
    import triton

    from ttt_flash.kernels import attn_fwd, configs
    from ttt_flash.kernels.gluon import fwd as gluon_fwd

    q, k, v = x[:3]
    b, h, n, d = q.shape
    pairs = b * h * n * n * (0.5 if causal else 1.0)

    def rate(ms):
        return FLOPS_PER_PAIR_D["fwd"] * d * pairs / ms / 1e9

    def triton_fwd():
        with configs.use_gluon_passes(False):
            return attn_fwd(q, k, v, scale=None, causal=causal, window=None)

    o_t, lse_t = triton_fwd()
    ms = triton.testing.do_bench(triton_fwd, warmup=25, rep=100)
    rows = [dict(kind="fwd", variant="triton", ms=ms, tflops=rate(ms))]
    print(f"PASS fwd        {'triton':<26} {ms:8.3f} ms {rate(ms):6.0f} TFLOP/s", flush=True)
    on_row(rows)
    unit = o_t.float().abs().max().item() * 2.0 ** -8
    for var in variants:
        kw = dict(zip(FIELDS["fwd"], var))
        kw["consumers"] = 2 if kw["warp_specialize"] >= 2 else 1
        kw["pingpong"] = kw["warp_specialize"] == 3
        kw["warp_specialize"] = bool(kw["warp_specialize"])
        kw["maxnreg"] = kw.get("maxnreg") or None
        try:
            o_g, lse_g = gluon_fwd.gluon_attn_fwd(q, k, v, causal=causal, **kw)
            torch.cuda.synchronize()
            o_diff = (o_g.float() - o_t.float()).abs().max().item() / unit
            lse_diff = (lse_g - lse_t).abs().max().item()
            if not (o_diff <= 4 and lse_diff <= 1e-3):
                raise RuntimeError(f"disagrees with the Triton forward: O by {o_diff:.2f} bf16 "
                                   f"units, L by {lse_diff:.2e}")
            ms = triton.testing.do_bench(
                lambda: gluon_fwd.gluon_attn_fwd(q, k, v, causal=causal, **kw),
                warmup=25, rep=100)
            rows.append(dict(kind="fwd", variant=list(var), ms=ms, tflops=rate(ms),
                             o_maxdiff=o_diff, lse_maxdiff=lse_diff))
            print(f"PASS fwd        {str(var):<26} {ms:8.3f} ms {rate(ms):6.0f} TFLOP/s "
                  f"(O {o_diff:.2f} units, L {lse_diff:.1e} from Triton)", flush=True)
        except Exception as ex:  # noqa: BLE001 - a failing variant is a result
            rows.append(dict(kind="fwd", variant=list(var), error=f"{type(ex).__name__}: {ex}"))
            print(f"PASS fwd        {str(var):<26} FAILED {type(ex).__name__}: "
                  f"{str(ex)[:300]}", flush=True)
        on_row(rows)
    return rows


def triton_dq_ms(q, k, v, o, lse, do, causal, reps=20):
    """CUDA time (ms, mean of ``reps`` calls) of the Triton dQ kernel alone, launched by
    ``attn_bwd`` with the Gluon passes off (``torch.profiler``)."""
    from torch.profiler import ProfilerActivity, profile

    from ttt_flash.kernels import attn_bwd, configs

    def call():
        with configs.use_gluon_passes(False):
            attn_bwd(q, k, v, o, lse, do, scale=None, causal=causal, window=None)

    call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            call()
        torch.cuda.synchronize()
    total = sum(e.device_time_total for e in prof.key_averages()
                if "_attn_bwd_dq_kernel" in e.key)
    if not total:
        raise RuntimeError("the profiler saw no _attn_bwd_dq_kernel launch")
    return total / reps / 1e3


def run_dq(variants, x, causal, on_row=lambda rows: None):
    """The Triton dQ pass, then each Gluon dQ variant checked against it (dQ and D) and
    timed; O and L come from the Triton forward. ``on_row(rows)`` after each row."""
    import triton

    from ttt_flash.kernels import attn_bwd, attn_fwd, configs
    from ttt_flash.kernels.gluon import dq as gluon_dq

    q, k, v, do = x[:4]
    b, h, n, d = q.shape
    pairs = b * h * n * n * (0.5 if causal else 1.0)

    def rate(ms):
        return FLOPS_PER_PAIR_D["bwd_dq"] * d * pairs / ms / 1e9

    with configs.use_gluon_passes(False):
        o, lse = attn_fwd(q, k, v, scale=None, causal=causal, window=None)
        dq_t, _, _, delta_t = attn_bwd(q, k, v, o, lse, do, scale=None, causal=causal,
                                       window=None)
    rows = []
    try:
        ms = triton_dq_ms(q, k, v, o, lse, do, causal)
        rows.append(dict(kind="bwd_dq", variant="triton", ms=ms, tflops=rate(ms)))
        print(f"PASS bwd_dq     {'triton':<26} {ms:8.3f} ms {rate(ms):6.0f} TFLOP/s", flush=True)
    except Exception as ex:  # noqa: BLE001 - the variants are still checked against it
        rows.append(dict(kind="bwd_dq", variant="triton", error=f"{type(ex).__name__}: {ex}"))
        print(f"PASS bwd_dq     {'triton':<26} FAILED {type(ex).__name__}: {ex}", flush=True)
    on_row(rows)
    unit = dq_t.float().abs().max().item() * 2.0 ** -8
    d_mag = max(delta_t.abs().max().item(), 1e-30)
    for var in variants:
        kw = dict(zip(FIELDS["bwd_dq"], var))
        kw["consumers"] = 2 if kw["warp_specialize"] in (2, 3) else 1
        kw["defer"] = kw["warp_specialize"] >= 3
        kw["warp_specialize"] = bool(kw["warp_specialize"])
        kw["maxnreg"] = kw.get("maxnreg") or None
        try:
            dq_g, delta_g = gluon_dq.gluon_attn_dq(q, k, v, o, do, lse, causal=causal, **kw)
            torch.cuda.synchronize()
            dq_diff = (dq_g.float() - dq_t.float()).abs().max().item() / unit
            delta_diff = (delta_g - delta_t).abs().max().item() / d_mag
            if not (dq_diff <= 4 and delta_diff <= 1e-4):
                raise RuntimeError(f"disagrees with the Triton dQ pass: dQ by {dq_diff:.2f} "
                                   f"bf16 units, D by {delta_diff:.2e} of max |D|")
            ms = triton.testing.do_bench(
                lambda: gluon_dq.gluon_attn_dq(q, k, v, o, do, lse, causal=causal, **kw),
                warmup=25, rep=100)
            rows.append(dict(kind="bwd_dq", variant=list(var), ms=ms, tflops=rate(ms),
                             dq_maxdiff=dq_diff, delta_maxdiff=delta_diff))
            print(f"PASS bwd_dq     {str(var):<26} {ms:8.3f} ms {rate(ms):6.0f} TFLOP/s "
                  f"(dQ {dq_diff:.2f} units, D {delta_diff:.1e} from Triton)", flush=True)
        except Exception as ex:  # noqa: BLE001 - a failing variant is a result
            rows.append(dict(kind="bwd_dq", variant=list(var),
                             error=f"{type(ex).__name__}: {ex}"))
            print(f"PASS bwd_dq     {str(var):<26} FAILED {type(ex).__name__}: "
                  f"{str(ex)[:300]}", flush=True)
        on_row(rows)
    return rows


def format_table(rows):
    """Markdown table of the sweep's rows (the forward's and the dQ pass's with their
    speed-up over the Triton pass of the same run, the row passes' over the table's tiles)."""
    base = {r["kind"]: r["ms"] for r in rows if r.get("variant") == "triton" and "ms" in r}
    base.update({r["kind"]: r["ms"] for r in rows if r.get("table") and "ms" in r})
    out = ["| kind | variant | ms | TFLOP/s | vs Triton / table |",
           "| --- | --- | --- | --- | --- |"]
    for r in rows:
        var = r["variant"] if isinstance(r["variant"], str) else \
            ",".join(str(t) for t in r["variant"])
        if "ms" not in r:
            out.append(f"| {r['kind']} | {var} | failed | | |")
            continue
        speed = f"{base[r['kind']] / r['ms']:.3f}x" if r["kind"] in base else ""
        out.append(f"| {r['kind']} | {var} | {r['ms']:.3f} | {r['tflops']:.0f} | {speed} |")
    return "\n".join(out)


def _row_kw(kind, var):
    """Keywords of the Gluon function for a variant (warp_specialize 2 of the row passes:
    ``consumers=2``)."""
    kw = dict(zip(FIELDS[kind], var))
    if "warp_specialize" in kw:
        ws = kw["warp_specialize"]
        if kind in ("bob_stats", "bob_direct"):
            kw["consumers"] = 2 if ws == 2 else 1
        elif kind == "bob_col":  # 2: deferred K̄ waits, 3: two consumers, 4: both
            kw["consumers"] = 2 if ws >= 3 else 1
            kw["defer"] = ws in (2, 4)
        kw["warp_specialize"] = bool(ws)
    kw["maxnreg"] = kw.get("maxnreg") or None
    return kw


def _table_kw(kind, d):
    """Keywords of the table's tiles (configs.GLUON) for ``kind`` at head dim ``d``."""
    from ttt_flash.kernels import configs

    c = configs.GLUON[(kind, d)]
    return dict(block_m=c.block_m, block_n=c.block_n, num_warps=c.num_warps, stages=c.stages,
                warp_specialize=c.warp_specialize, consumers=c.consumers, maxnreg=c.maxnreg)


def _row_check(kind, got, ref):
    """Largest difference of a row pass's outputs from the reference's, and whether it is
    within the bound: statistics (float32 row sums) 2^-10 of the reference's largest
    magnitude, direct (16-bit Q̄, dŌ) 4 bf16 units of it."""
    worst, ok = 0.0, True
    for g, t in zip(got, ref):
        scale = t.float().abs().max().item()
        unit = scale * (2.0 ** -10 if kind == "bob_stats" else 4 * 2.0 ** -8)
        diff = (g.float() - t.float()).abs().max().item()
        worst = max(worst, diff / max(scale, 1e-30))
        ok = ok and diff <= unit
    return worst, ok


def run_kind(kind, variants, x, r, causal):
    from ttt_flash.kernels.gluon import bob_col as gluon_bob_col
    from ttt_flash.kernels.gluon import bob_row as gluon_bob_row
    from ttt_flash.kernels.gluon import dkdv as gluon_dkdv

    q, k, v, do, uq, uk, uv = x
    lse, delta, alpha, ee = r
    if kind == "bwd_dkdv":
        def call(**kw):
            return gluon_dkdv.gluon_dkdv(q, k, v, do, lse, delta, causal=causal, **kw)
    elif kind == "bob_col":
        def call(**kw):
            return gluon_bob_col.gluon_bob_col(q, k, v, do, uq, uk, uv, lse, delta, alpha, ee,
                                               causal=causal, **kw)
    elif kind == "bob_stats":
        def call(**kw):
            return gluon_bob_row.gluon_bob_stats(q, k, v, do, uq, uk, uv, lse, delta,
                                                 causal=causal, **kw)
    else:
        def call(**kw):
            return gluon_bob_row.gluon_bob_direct(q, k, v, do, uq, uk, uv, lse, delta, alpha,
                                                  ee, causal=causal, **kw)
    import triton

    b, h, n, d = q.shape
    pairs = b * h * n * n * (0.5 if causal else 1.0)
    rows = []
    # the row passes' outputs are checked against the table's tiles, each key-tile variant's
    # against the first variant's (all tested against the Triton passes and float64 in
    # tests/test_gluon_gpu.py)
    row_pass = kind in ("bob_stats", "bob_direct")
    ref_row = [t.clone() for t in call(**_table_kw(kind, d))] if row_pass else None
    ref = None
    for var in variants:
        kw = _row_kw(kind, var)
        try:
            outs = call(**kw)
            torch.cuda.synchronize()
            extra, note = {}, ""
            if row_pass:
                worst, ok = _row_check(kind, outs, ref_row)
                if not ok:
                    raise RuntimeError(f"disagrees with the table's tiles: by {worst:.2e} of "
                                       "the largest output")
                extra, note = dict(maxdiff_rel=worst), f" ({worst:.1e} from the table's)"
                if kw == _table_kw(kind, d):
                    extra["table"] = True
            elif kind in ("bwd_dkdv", "bob_col"):
                if ref is None:
                    ref, ref_var = [x.float().clone() for x in outs], list(var)
                    units = [x.abs().max().item() * 2.0 ** -8 for x in ref]
                else:
                    diff = max((x.float() - r).abs().max().item() / u
                               for x, r, u in zip(outs, ref, units))
                    if not diff <= KEY_TILE_TOL_UNITS:
                        raise RuntimeError(f"disagrees with {ref_var} by {diff:.2f} bf16 units "
                                           "of its max |output|")
                    note = f" ({diff:.2f} units from {ref_var})"
            ms = triton.testing.do_bench(lambda: call(**kw), warmup=25, rep=100)
            tflops = FLOPS_PER_PAIR_D[kind] * d * pairs / ms / 1e9
            rows.append(dict(kind=kind, variant=list(var), ms=ms, tflops=tflops, **extra))
            print(f"PASS {kind:<10} {str(var):<26} {ms:8.3f} ms {tflops:6.0f} TFLOP/s{note}",
                  flush=True)
        except Exception as ex:  # noqa: BLE001 - a failing variant is a result
            rows.append(dict(kind=kind, variant=list(var), error=f"{type(ex).__name__}: {ex}"))
            print(f"PASS {kind:<10} {str(var):<26} FAILED {type(ex).__name__}: "
                  f"{str(ex)[:300]}", flush=True)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=None)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--n", type=int, default=16384)
    p.add_argument("--causal", action="store_true")
    p.add_argument("--kinds", default="bwd_dkdv,bob_stats,bob_direct,bob_col")
    p.add_argument("--variant", action="append", default=[])
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    hk = a.kv_heads or a.heads
    defaults = dict(DEFAULTS, fwd=FWD_DEFAULTS.get(a.head_dim, FWD_DEFAULTS[64]),
                    bwd_dq=DQ_DEFAULTS.get(a.head_dim, DQ_DEFAULTS[64]),
                    **ROW_DEFAULTS.get(a.head_dim, ROW_DEFAULTS[64]))
    defaults.update(KEY_TILE_DEFAULTS.get(a.head_dim, {}))
    chosen = {kind: list(defaults[kind]) for kind in a.kinds.split(",") if kind}
    given = {}
    for spec in a.variant:
        kind, nums = spec.split("=")
        given.setdefault(kind, []).append(tuple(int(t) for t in nums.split(",")))
    chosen.update(given)
    g = torch.Generator(device="cuda").manual_seed(0)
    n, d = a.n, a.head_dim
    shapes = [a.heads, hk, hk, a.heads, a.heads, hk, hk]
    x = [torch.randn(1, h, n, d, device="cuda", dtype=torch.bfloat16, generator=g)
         for h in shapes]
    r = [torch.randn(1, a.heads, n, device="cuda", generator=g) for _ in range(4)]
    r[0] = r[0].abs() + 8.0  # LSE well above the scores: no overflow in exp2
    print(f"SHAPE H={a.heads}/{hk} N={n} d={d} causal={a.causal}", flush=True)
    rows = []

    def save(more=()):
        if a.out:
            os.makedirs(a.out, exist_ok=True)
            with open(os.path.join(a.out, "gluon_pass_sweep.json"), "w") as f:
                json.dump({"args": vars(a), "rows": rows + list(more)}, f, indent=1)

    for kind, variants in chosen.items():
        if kind == "fwd":
            rows += run_fwd(variants, x, a.causal, on_row=save)
        elif kind == "bwd_dq":
            rows += run_dq(variants, x, a.causal, on_row=save)
        else:
            rows += run_kind(kind, variants, x, r, a.causal)
        save()
    print(format_table(rows), flush=True)
    return 0 if rows and all("ms" in row for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
