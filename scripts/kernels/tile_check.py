"""Chain time per tile variant, measured in one process: every variant is a set of
``configs.tile_overrides`` on top of the table; the table itself is timed first and last.

    python scripts/kernels/tile_check.py --n 16384,65536 \
        --variant 'direct128={"bob_direct": [128, 64, 8, 2]}' --variant '...'
    python scripts/kernels/tile_check.py --variant best=@tune.best.json   # a tune.py result file
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--n", default="16384,65536")
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--causal", action="store_true")
    p.add_argument("--reps", type=int, default=0, help="0: 10 below 32K, 3 above")
    p.add_argument("--variant", action="append", default=[],
                   help="name=JSON of {kind: tiles}, or name=@file.json")
    p.add_argument("--deterministic", action=argparse.BooleanOptionalAction, default=False,
                   help="flash_attention(deterministic=...) for every variant")
    a = p.parse_args()
    from ttt_flash import flash_attention
    from ttt_flash.bench.common import attention_chain
    from ttt_flash.kernels import configs

    variants = [("table", {})]
    for v in a.variant:
        name, spec = v.split("=", 1)
        if spec.startswith("@"):
            variants.append((name, configs.read_tile_overrides(spec[1:])))
        else:
            variants.append((name, {k: configs.TileConfig(*c) for k, c in json.loads(spec).items()}))
    variants.append(("table(again)", {}))
    rows = []
    for n in (int(x) for x in a.n.split(",")):
        x = [torch.randn(1, a.heads, n, a.head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(7)]
        q, k, v, do = (t.requires_grad_(True) for t in x[:4])
        u = x[4:]

        def chain():
            return attention_chain(
                lambda q_, k_, v_: flash_attention(q_, k_, v_, causal=a.causal, deterministic=a.deterministic),
                q, k, v, do, u)

        reps = a.reps or (10 if n < 32768 else 3)
        for name, ov in variants:
            try:
                with configs.tile_overrides(ov):
                    rows.append((n, name) + _time(chain, reps))
            except Exception as ex:  # noqa: BLE001 - a failing variant is a result
                rows.append((n, name, float("nan"), f"{type(ex).__name__}: {str(ex)[:80]}"))
            print(f"{n:>7} {name:<24} {rows[-1][2]:9.2f} ms  (min {rows[-1][3]})", flush=True)
    return 0


def _time(chain, reps):
    """(median, min) ms of ``reps`` chains after one warm-up (``ttt_flash.bench.common.event_times``)."""
    from ttt_flash.bench.common import event_times

    ts = event_times(chain, reps)
    return statistics.median(ts), min(ts)


if __name__ == "__main__":
    raise SystemExit(main())
