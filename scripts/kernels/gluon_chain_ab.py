"""Chain time with the Gluon passes on and off, against first-order SDPA flash, in one process.

    python scripts/kernels/gluon_chain_ab.py --seq-lens 4096,16384,65536 --causal both --out DIR

Per (N, causal): the chain of ``ttt_flash.bench`` (forward, ``autograd.grad(...,
create_graph=True)``, backward-over-backward) of ``flash_attention`` with the Gluon passes on
(the plan's choice, ``kernels/plan.py``) and off (``configs.use_gluon_passes(False)``),
and SDPA flash forward + backward on the same shapes; the three are timed in interleaved
rounds (one call of each per round, CUDA events), so drifts of the machine hit all three.
Prints one line per measurement, then a table: medians, the ratios chain / SDPA, the on / off
speed-up and how many Gluon launches one chain made (0: the table chose Triton). ``--device
cpu`` runs the same code on the CPU (reference path, PyTorch's SDPA; no Gluon) as a smoke test.
``--kv-heads`` sets H_kv for GQA (default: ``--heads``). ``--profile`` adds, per (N, causal),
the CUDA time of every kernel in one chain with the passes on, off and in each variant
(``torch.profiler``; lines ``K on|off N=... name ms xcount``, and ``kernels_on`` /
``kernels_off`` in the JSON). ``--variant NAME=SPEC`` (repeatable) adds a chain with the
Gluon table changed for this head dim, timed in the same rounds: SPEC is ``+``-joined
``kind:block_n,block_m,num_warps,stages,warp_specialize,maxnreg`` entries (maxnreg 0: none;
the table's ``min_keys`` is kept; for ``fwd`` and ``bwd_dq``, warp_specialize 2 runs two
consumer partitions, and for ``fwd`` 3 makes them take turns) or ``kind:triton`` (that pass
takes the Triton kernel);
each variant's outputs are compared with the chain's with the Gluon passes off
(``NAME_maxrel_vs_off``: the largest max |difference| / max |off| over the eight outputs).
Writes ``gluon_chain_ab.json`` into ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import statistics
import sys

import torch


def _counter():
    """Wrap the Gluon launchers; return the list their calls append to."""
    from ttt_flash.kernels.gluon import bob_col, bob_row, dkdv, dq, fwd

    calls = []
    for mod, name in ((fwd, "launch_fwd"), (dq, "launch_dq"), (dkdv, "launch_dkdv"),
                      (bob_col, "launch_bob_col"), (bob_row, "launch_bob_row")):
        real = getattr(mod, name)

        def counted(*a, _real=real, _name=name, **kw):
            calls.append(_name)
            return _real(*a, **kw)

        setattr(mod, name, counted)
    return calls


def _timer(device):
    """ms of one call of a warmed-up function (``ttt_flash.bench.common.event_times``)."""
    from ttt_flash.bench.common import event_times

    cuda = device.startswith("cuda")
    return lambda fn: event_times(fn, reps=1, warmup=0, cuda=cuda)[0]


def parse_variant(text):
    """``NAME=kind:a,b,c,d,e,f+kind:triton`` -> (NAME, {kind: GluonConfig fields or None})."""
    name, spec = text.split("=", 1)
    out = {}
    for part in spec.split("+"):
        kind, nums = part.split(":")
        if nums == "triton":
            out[kind] = None
        else:
            bn, bm, w, st, ws, mr = (int(t) for t in nums.split(","))
            out[kind] = dict(block_n=bn, block_m=bm, num_warps=w, stages=st,
                             warp_specialize=bool(ws), maxnreg=mr or None)
            if kind == "fwd":  # ws 2: two consumer partitions, 3: taking turns
                out[kind].update(consumers=2 if ws >= 2 else 1, pingpong=ws == 3)
            elif kind == "bwd_dq":  # ws 2: two consumer partitions
                if ws > 2:
                    raise ValueError(f"{text}: bwd_dq takes warp_specialize 0, 1 or 2 here "
                                     "(the table has no field for deferred waits)")
                out[kind].update(consumers=2 if ws == 2 else 1)
    return name, out


@contextlib.contextmanager
def gluon_table(changes, head_dim):
    """``configs.GLUON`` with ``changes`` ({kind: fields or None}) applied at ``head_dim``."""
    from ttt_flash.kernels import configs, plan

    saved = configs.GLUON
    table = dict(saved)
    for kind, fields in changes.items():
        key = (kind, head_dim)
        if fields is None:
            table.pop(key, None)
        else:
            base = saved.get(key) or configs.GluonConfig(64, 64, 4, min_keys=16384)
            table[key] = dataclasses.replace(base, **fields)
    configs.GLUON = table
    plan.clear_cache()
    try:
        yield
    finally:
        configs.GLUON = saved
        plan.clear_cache()


def _maxrel(outs, ref):
    return max(((x.float() - y.float()).abs().max() / y.float().abs().max().clamp_min(1e-30))
               .item() for x, y in zip(outs, ref))


def measure(n, causal, a, calls):
    """Medians (ms) of the three providers at one (N, causal), and the Gluon launches per
    chain with the passes on."""
    from ttt_flash import bench
    from ttt_flash.kernels import configs

    cuda = a.device.startswith("cuda")
    sdpa = "sdpa_flash" if cuda else "sdpa"
    cfg = bench.BenchConfig(seq_lens=[n], batch=a.batch, heads=a.heads, kv_heads=a.kv_heads,
                            head_dim=a.head_dim, dtype=a.dtype, causal=causal, providers=["ttt_flash", sdpa],
                            device=a.device, check=False, out=None)
    chain, _ = bench.make_provider(cfg, "ttt_flash", n)
    first, _ = bench.make_provider(cfg, sdpa, n)

    def off():
        with configs.use_gluon_passes(False):
            return chain()

    fns = {"on": chain, "off": off, "sdpa": first}
    variants = dict(parse_variant(v) for v in a.variant)
    a.variant_specs = [tuple(v.split("=", 1)) for v in a.variant]
    for name, changes in variants.items():
        def run(_changes=changes):
            with gluon_table(_changes, a.head_dim):
                return chain()

        fns[name] = run
    timer = _timer(a.device)
    for fn in fns.values():  # compile and warm up
        fn()
    if cuda:
        torch.cuda.synchronize()
    agree = {}
    if variants:
        ref = [t.detach().clone() for t in off()]
        for name in ["on", *variants]:
            agree[f"{name}_maxrel_vs_off"] = _maxrel(fns[name](), ref)
        del ref
    del calls[:]
    chain()
    launches = len(calls)
    if cuda:
        torch.cuda.synchronize()
    reps = a.reps if n < 32768 else a.reps_long
    times = {k: [] for k in fns}
    for _ in range(reps):
        for k, fn in fns.items():
            times[k].append(timer(fn))
    row = {"N": n, "causal": causal, "reps": reps, "gluon_launches_per_chain": launches}
    for k, ts in times.items():
        row[f"{k}_ms"] = statistics.median(ts)
        row[f"{k}_all_ms"] = ts
    row["ratio_on"] = row["on_ms"] / row["sdpa_ms"]
    row["ratio_off"] = row["off_ms"] / row["sdpa_ms"]
    row["speedup"] = row["off_ms"] / row["on_ms"]
    row.update(agree)
    for name in variants:
        row[f"ratio_{name}"] = row[f"{name}_ms"] / row["sdpa_ms"]
        print(f"VARIANT N={n} causal={int(causal)} {name} {row[f'{name}_ms']:.3f} ms ratio "
              f"{row[f'ratio_{name}']:.3f} maxrel vs off {agree[f'{name}_maxrel_vs_off']:.2e} "
              f"({dict(a.variant_specs)[name]})", flush=True)
    if agree:
        print(f"AGREE on maxrel vs off {agree['on_maxrel_vs_off']:.2e}", flush=True)
    print(f"ROW N={n} causal={int(causal)} on {row['on_ms']:.3f} off {row['off_ms']:.3f} "
          f"sdpa {row['sdpa_ms']:.3f} ms (reps {reps}, gluon launches {launches})", flush=True)
    if a.profile and cuda:
        for k in [k for k in fns if k != "sdpa"]:  # on, off and the variants
            row[f"kernels_{k}"] = kernel_times(fns[k])
            for name, ms, count in row[f"kernels_{k}"]:
                print(f"K {k:<3} N={n} causal={int(causal)} {name[:60]:<60} {ms:8.3f} ms "
                      f"x{count}", flush=True)
    del chain, first, fns
    if cuda:
        torch.cuda.empty_cache()
    return row


def kernel_times(fn):
    """[(kernel name, CUDA ms, launches)] of one call of ``fn``, longest first."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    evs = [e for e in prof.key_averages() if e.device_time_total > 0]
    evs.sort(key=lambda e: -e.device_time_total)
    return [(e.key, e.device_time_total / 1e3, e.count) for e in evs[:16]]


def format_table(rows):
    out = ["| N | causal | Gluon on | Gluon off | SDPA flash fwd+bwd | ratio on | ratio off | on / off speed-up | Gluon launches |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        out.append(f"| {r['N']:,} | {'yes' if r['causal'] else 'no'} | {r['on_ms']:.3f} ms | "
                   f"{r['off_ms']:.3f} ms | {r['sdpa_ms']:.3f} ms | {r['ratio_on']:.2f} | "
                   f"{r['ratio_off']:.2f} | {r['speedup']:.3f}x | {r['gluon_launches_per_chain']} |")
    return "\n".join(out)


def build_parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq-lens", default="4096,16384,65536")
    p.add_argument("--causal", choices=["no", "yes", "both"], default="both")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--kv-heads", type=int, default=None, help="H_kv (GQA); default: --heads")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--reps", type=int, default=10, help="timed rounds below N = 32,768")
    p.add_argument("--reps-long", type=int, default=3, help="timed rounds from N = 32,768")
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", default=None, help="folder for gluon_chain_ab.json")
    p.add_argument("--variant", action="append", default=[],
                   help="NAME=kind:bn,bm,warps,stages,ws,maxnreg+kind:triton (Gluon table "
                        "variant at this head dim, timed beside the table's choice)")
    p.add_argument("--profile", action="store_true",
                   help="per-kernel CUDA times of one chain, Gluon on and off")
    return p


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    calls = _counter()
    env = {"torch": torch.__version__}
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        pass
    if a.device.startswith("cuda"):
        env["gpu"] = torch.cuda.get_device_name(a.device)
    print("ENV", json.dumps(env), flush=True)
    modes = {"no": [False], "yes": [True], "both": [False, True]}[a.causal]
    rows = []
    for causal in modes:
        for n in (int(x) for x in a.seq_lens.split(",") if x):
            try:
                rows.append(measure(n, causal, a, calls))
            except Exception as ex:  # noqa: BLE001 - one failing size is a result, go on
                print(f"ROW N={n} causal={int(causal)} FAILED {type(ex).__name__}: "
                      f"{str(ex)[:300]}", flush=True)
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "gluon_chain_ab.json"), "w") as f:
            json.dump({"env": env, "args": vars(a), "rows": rows}, f, indent=1)
    print(format_table(rows), flush=True)
    return 0 if rows else 1


if __name__ == "__main__":
    sys.exit(main())
