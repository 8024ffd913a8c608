"""Second-order MAML against implicit MAML (iMAML) at long context: peak memory, step time and
post-adaptation loss per number of inner steps k.

The model is the in-context regression transformer of recipes/maml_transformer_long.yaml and
recipes/imaml_regression_long.yaml (a 2-layer, 4-head GPT, d_model 128, attention
``ttt_flash.flash_attention``), one task per meta-update with one support and one query
sequence of ``--tokens`` tokens. For each method and each k in ``--ks`` it meta-trains a fresh
model (seed 0) for ``--train-steps`` meta-updates (outer Adam, meta-gradient clipped to norm 1)
and records

* the peak CUDA memory of a meta-update (``torch.cuda.max_memory_allocated``; the max over the
  steps) and its median wall time over the steps after the first (which compiles the kernels);
* the query MSE before and after adaptation on ``--eval-tasks`` fixed tasks, after that budget
  (each method adapts as it trains: MAML with k SGD steps, iMAML with k SGD steps on
  L_task + (λ/2)‖φ − θ‖²);
* an out-of-memory error as ``"oom"`` (then larger k of that method are not tried).

MAML differentiates through its k inner steps (k graphs alive); iMAML keeps no inner graph and
solves (I + H/λ) g = ∇L_query by ``--cg-steps`` conjugate-gradient steps of exact
Hessian-vector products, so its memory should not grow with k. ``--probe-ks`` adds k (one
meta-update each, memory and time only) to show MAML's growth up to its out-of-memory point.

Usage (repository root, one GPU)::

    python scripts/imaml_memory.py --out runs/imaml_memory            # ~15-25 min on an H200
    python scripts/imaml_memory.py --out /tmp/x --device cpu --tokens 64 --ks 1,2 --train-steps 2 --probe-ks ""

Prints a table last and writes ``imaml_memory.json`` (every row, the arguments, the device) to
``--out``.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import re
import statistics
import sys
import time
from pathlib import Path

import torch

from ttt_flash.meta import functional_loss, imaml_meta_gradient, inner_loop, proximal_inner_loop
from ttt_flash.models import NetConfig
from ttt_flash.tasks import InContextRegressionTasks, incontext_mse


def _ks(text: str):
    return [int(x) for x in text.split(",") if x.strip()]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="folder for imaml_memory.json")
    p.add_argument("--tokens", type=int, default=32768, help="sequence length of a support / query sequence")
    p.add_argument("--ks", type=_ks, default=[1, 5, 20, 50], help="inner steps, comma separated")
    p.add_argument("--probe-ks", type=_ks, default=[100, 200],
                   help="extra k run for one meta-update (memory, time) until out of memory; '' for none")
    p.add_argument("--methods", default="maml,imaml", help="comma separated: maml, imaml")
    p.add_argument("--train-steps", type=int, default=4, help="meta-updates per (method, k)")
    p.add_argument("--max-config-seconds", type=float, default=None,
                   help="stop a (method, k) training early after this many seconds (the row records steps_done)")
    p.add_argument("--eval-tasks", type=int, default=4, help="fixed tasks scored after training")
    p.add_argument("--inner-lr", type=float, default=0.01, help="inner SGD step size (both methods)")
    p.add_argument("--outer-lr", type=float, default=3e-4, help="outer Adam learning rate")
    p.add_argument("--lam", type=float, default=5.0, help="iMAML's proximal weight lambda (as the recipes)")
    p.add_argument("--cg-steps", type=int, default=5, help="iMAML's conjugate-gradient steps")
    p.add_argument("--hessian-mode", default="rev_rev", choices=["rev_rev", "fwd_rev"], help="iMAML's HVPs")
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--n-heads", type=int, default=4)
    p.add_argument("--n-layers", type=int, default=2)
    p.add_argument("--dim", type=int, default=4, help="regression input dimension")
    p.add_argument("--device", default="cuda", help="cuda (measurements) or cpu (a smoke run)")
    args = p.parse_args(argv)
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    bad = [m for m in args.methods if m not in ("maml", "imaml")]
    if bad:
        p.error(f"--methods: unknown {bad}; use maml and/or imaml")
    if args.tokens % 2 or args.tokens < 2:
        p.error("--tokens must be an even number >= 2 (x- and y-tokens alternate)")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda but CUDA is not available (use --device cpu for a smoke run)")
    return args


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def _adapt(method, net, support, k, args):
    if method == "maml":
        return inner_loop(net, None, incontext_mse, support, k, args.inner_lr, first_order=True)
    return proximal_inner_loop(net, None, incontext_mse, support, k, args.inner_lr, args.lam)


def _meta_update(method, net, opt, support, query, k, args):
    """One meta-update; returns (query loss after adaptation, CG relative residual or None)."""
    opt.zero_grad(set_to_none=True)
    if method == "maml":
        fast = inner_loop(net, None, incontext_mse, support, k, args.inner_lr)  # second order
        loss = functional_loss(net, fast, incontext_mse, query)
        loss.backward()
        post, residual = float(loss.detach()), None
    else:
        res = imaml_meta_gradient(net, None, incontext_mse, support, query, k, args.inner_lr, args.lam,
                                  cg_steps=args.cg_steps, cg_tol=1e-3, hessian_mode=args.hessian_mode, warn=False)
        for n, p in net.named_parameters():
            p.grad = res.grads[n]
        post, residual = float(res.loss_query), res.cg.rel_residual
    torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
    opt.step()
    return post, residual


def run_one(method, k, steps, args, device, evaluate=True):
    """Train a fresh model for ``steps`` meta-updates; a result row (``status`` ok / oom)."""
    torch.manual_seed(0)
    cfg = NetConfig(kind="gpt", in_dim=args.dim + 2, out_dim=1, d_model=args.d_model, n_heads=args.n_heads,
                    n_layers=args.n_layers, attention="ttt_flash")
    net = cfg.build().to(device)
    opt = torch.optim.Adam(net.parameters(), lr=args.outer_lr)
    tasks = InContextRegressionTasks(dim=args.dim, seq_len=args.tokens, support_size=1, query_size=1)
    gen = torch.Generator().manual_seed(1)
    row = {"method": method, "k": k, "train_steps": steps, "status": "ok"}
    times, peaks, posts, residuals = [], [], [], []
    try:
        for step in range(steps):
            batch = tasks.sample(1, gen)
            (s_in, s_t), (q_in, q_t) = batch.task(0)
            support = (s_in.to(device), s_t.to(device))
            query = (q_in.to(device), q_t.to(device))
            _sync(device)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            start = time.perf_counter()
            post, residual = _meta_update(method, net, opt, support, query, k, args)
            _sync(device)
            times.append(time.perf_counter() - start)
            if device.type == "cuda":
                peaks.append(torch.cuda.max_memory_allocated() / 2**30)
            posts.append(post)
            if residual is not None:
                residuals.append(residual)
            print(f"  {method} k={k} step {step + 1}/{steps}: {times[-1]:.2f} s"
                  + (f", peak {peaks[-1]:.2f} GiB" if peaks else "") + f", train query MSE {post:.4f}",
                  file=sys.stderr, flush=True)
            if args.max_config_seconds is not None and sum(times) > args.max_config_seconds:
                break
    except torch.cuda.OutOfMemoryError as e:
        oom = str(e).splitlines()[0][:300]
    else:
        oom = None
    if oom is not None:  # outside the except block: the traceback (and its tensors) is gone
        row.update(status="oom", error=oom, steps_done=len(times),
                   peak_mem_gib=torch.cuda.max_memory_allocated() / 2**30)
        del opt, net
        gc.collect()
        torch.cuda.empty_cache()
        return row
    row.update(
        steps_done=len(times),
        step_time_s=statistics.median(times[1:]) if len(times) > 1 else times[0],
        first_step_s=times[0],
        peak_mem_gib=max(peaks) if peaks else None,
        train_post_last=posts[-1],
        cg_rel_residual_max=max(residuals) if residuals else None,
    )
    if evaluate:
        eval_gen = torch.Generator().manual_seed(12345)  # the same tasks for every row
        batch = tasks.sample(args.eval_tasks, eval_gen)
        pre, post = [], []
        for t in range(args.eval_tasks):
            (s_in, s_t), (q_in, q_t) = batch.task(t)
            support, query = (s_in.to(device), s_t.to(device)), (q_in.to(device), q_t.to(device))
            fast = _adapt(method, net, support, k, args)
            with torch.no_grad():
                pre.append(float(functional_loss(net, None, incontext_mse, query)))
                post.append(float(functional_loss(net, fast, incontext_mse, query)))
        row.update(eval_pre=statistics.mean(pre), eval_post=statistics.mean(post))
    del opt, net
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def _fmt(x, spec):
    width = re.match(r"\d*", spec).group()  # "5d" -> "5", "9.2f" -> "9"
    return format("-", ">" + width) if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def table(rows):
    lines = [f"{'method':<6} {'k':>4} {'status':<6} {'steps':>5} {'peak GiB':>9} {'step s':>8} {'eval pre':>9} "
             f"{'eval post':>9} {'CG res':>8}"]
    for r in rows:
        lines.append(
            f"{r['method']:<6} {r['k']:>4} {r['status']:<6} {_fmt(r.get('steps_done'), '5d')} "
            f"{_fmt(r.get('peak_mem_gib'), '9.2f')} "
            f"{_fmt(r.get('step_time_s'), '8.2f')} {_fmt(r.get('eval_pre'), '9.4f')} "
            f"{_fmt(r.get('eval_post'), '9.4f')} {_fmt(r.get('cg_rel_residual_max'), '8.1e')}")
    return "\n".join(lines)


def main(argv=None):
    args = parse_args(argv)
    device = torch.device(args.device)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    started = time.perf_counter()
    for method in args.methods:
        oom_at = None
        plan = [(k, args.train_steps, True) for k in args.ks] + [(k, 1, False) for k in args.probe_ks]
        for k, steps, evaluate in plan:
            if oom_at is not None and k > oom_at:
                rows.append({"method": method, "k": k, "train_steps": steps, "status": "skip",
                             "note": f"not run: out of memory at k={oom_at}"})
                continue
            print(f"{method} k={k}: {steps} meta-update(s) at {args.tokens} tokens", file=sys.stderr, flush=True)
            row = run_one(method, k, steps, args, device, evaluate)
            row["probe"] = not evaluate
            rows.append(row)
            if row["status"] == "oom":
                oom_at = k
            (out / "imaml_memory.json").write_text(json.dumps({  # after every row: a killed run keeps them
                "args": {k_: v for k_, v in vars(args).items()},
                "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                "torch": torch.__version__,
                "rows": rows,
            }, indent=1))
    print(f"total {time.perf_counter() - started:.0f} s; rows in {out / 'imaml_memory.json'}", file=sys.stderr)
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
