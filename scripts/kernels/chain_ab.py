"""Chain time (forward, create_graph backward, BoB) and per-kernel CUDA time of the installed
ttt_flash, per variant, in one process: the input to the cost of the row-sum correction.

    python scripts/kernels/chain_ab.py --n 4096,16384,65536 [--causal] --variants det,rho --tag new

Variants: ``det`` deterministic=True; ``rho`` det with the row-sum correction forced on for
16-bit inputs; ``default`` the call as users make it. Prints one line per (N, variant) and, with --profile,
the per-kernel table of one chain at the first N.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import statistics

import torch


@contextlib.contextmanager
def variant(name):
    from ttt_flash.kernels import configs, plan

    saved_r = dict(configs.ROWSUM_CORRECTION)
    try:
        if name == "rho":
            configs.ROWSUM_CORRECTION[torch.bfloat16] = True
            configs.ROWSUM_CORRECTION[torch.float16] = True
            plan.clear_cache()
        yield
    finally:
        configs.ROWSUM_CORRECTION.update(saved_r)
        plan.clear_cache()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--n", default="16384,65536")
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--kv-heads", type=int, default=None)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--causal", action="store_true")
    p.add_argument("--variants", default="det,rho")
    p.add_argument("--tag", default="")
    p.add_argument("--profile", action="store_true")
    a = p.parse_args()
    from ttt_flash import flash_attention
    from ttt_flash.bench.common import attention_chain, event_times

    has_det = "deterministic" in inspect.signature(flash_attention).parameters
    names = [v for v in a.variants.split(",") if v]
    if not has_det:
        names = ["default"]
    for n in (int(x) for x in a.n.split(",")):
        hk = a.kv_heads or a.heads
        shapes = [(1, a.heads, n, a.head_dim), (1, hk, n, a.head_dim), (1, hk, n, a.head_dim)]
        x = [torch.randn(s, device="cuda", dtype=torch.bfloat16) for s in shapes * 2]
        x.insert(3, torch.randn(shapes[0], device="cuda", dtype=torch.bfloat16))
        q, k, v, do = (t.requires_grad_(True) for t in x[:4])
        u = x[4:]
        for name in names:
            kw = {} if name == "default" else {"deterministic": True}

            def chain():
                return attention_chain(lambda q_, k_, v_: flash_attention(q_, k_, v_, causal=a.causal, **kw),
                                       q, k, v, do, u)

            try:
                with variant(name):
                    ts = event_times(chain, reps=10 if n < 32768 else 3)
                    print(f"AB {a.tag:<5} N={n:<6} causal={int(a.causal)} {name:<9} median {statistics.median(ts):9.3f} ms"
                          f"  min {min(ts):9.3f} ms", flush=True)
                    if a.profile and n == int(a.n.split(",")[0]):
                        from torch.profiler import ProfilerActivity, profile

                        with profile(activities=[ProfilerActivity.CUDA]) as prof:
                            chain()
                            torch.cuda.synchronize()
                        for ev in sorted(prof.key_averages(), key=lambda e: -e.device_time_total)[:12]:
                            if ev.device_time_total > 0:
                                print(f"K  {a.tag:<5} N={n} {name:<9} {ev.key[:40]:<40} {ev.device_time_total / 1e3:8.3f} ms"
                                      f" x{ev.count}", flush=True)
            except Exception as ex:  # noqa: BLE001 - a failing variant is a result
                print(f"AB {a.tag} N={n} {name} FAILED {type(ex).__name__}: {str(ex)[:200]}", flush=True)
        del q, k, v, do, x, u
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
