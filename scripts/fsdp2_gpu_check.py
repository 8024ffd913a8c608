"""Second order under FSDP2 on a GPU: the sharded run against the unsharded one, step by step.

Two training runs from the same weights on the same batches, in each process:

* ``sophia``: a byte-level GPT (``attention="ttt_flash"``) trained with Sophia-H, the Hessian
  estimate refreshed every ``--k`` steps through the step's ``create_graph`` graph;
* ``maml``: second-order MAML (2 inner SGD steps) of the same GPT on next-token tasks, Adam
  outer steps.

The *unsharded* run is the plain one-process code (``HessianOptimizer.update_hessian``,
``ttt_flash.meta.inner_loop``) on the whole batch; the *sharded* run is the GPT with every
block and the model sharded by ``fully_shard`` (``ttt_flash.fsdp.shard_blocks``), each
process on its part of the batch, the second-order steps inside ``ttt_flash.fsdp.unsharded``
and the plain Sophia-H steps under FSDP2's own reduction. Printed: both loss curves (for
the sharded run the mean of the processes' losses), the largest relative difference of the
losses and of the final weights, whether they match (``--tol``, float32 by default: the
processes' partial sums and the reduce-scatter change the rounding), and the peak memory of
each run's steps (``max_memory_allocated`` over them; both models and their optimizer states
live in each process throughout, so the two peaks share that offset).

    python scripts/fsdp2_gpu_check.py --procs 1            # FSDP2 over one rank (NCCL)
    python scripts/fsdp2_gpu_check.py --procs 2 --backend gloo   # two ranks on one GPU (NCCL's second rank crashes)
    python scripts/fsdp2_gpu_check.py --procs 2 --device cpu --d-model 32 --n-layer 2 --seq-len 32 --steps 4

Two ranks on one GPU: NCCL refuses two ranks on one device in most builds ("Duplicate GPU
detected"); the script then says so and runs the two ranks with gloo on the same GPU, where
gloo's collectives accept CUDA tensors, or reports that they do not. With ``--json PATH`` the
curves and the verdicts are also written as JSON.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import socket
import sys
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item() / max(1e-30, a.double().abs().max().item())


def _full(p):
    """The whole parameter on every rank. With gloo and CUDA tensors the shards travel through
    the CPU (gloo's all-gather of a CUDA DTensor's shards crashes with two ranks on one GPU);
    FSDP2 shards dim 0 as ``torch.chunk`` does, so the shards in rank order concatenate."""
    from torch.distributed.tensor import DTensor

    if not isinstance(p, DTensor):
        return p.detach()
    if dist.get_backend() != "gloo" or p.device.type != "cuda":
        return p.full_tensor().detach()
    shards = [None] * dist.get_world_size()
    dist.all_gather_object(shards, p.to_local().detach().cpu())
    return torch.cat(shards, dim=0).to(p.device)


def _peak(device) -> float:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")


def _reset_peak(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)


def _batches(args, device, steps: int, rows: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        t = torch.randint(0, 256, (rows, args.seq_len + 1), generator=g).to(device)
        out.append((t[:, :-1], t[:, 1:]))
    return out


def _sophia(args, rank, world, device, model_one, model):
    from ttt_flash import fsdp
    from ttt_flash.second_order.optim import SophiaH

    opt_one = SophiaH(model_one.parameters(), lr=args.lr, k=args.k)
    opt = SophiaH(model.parameters(), lr=args.lr, k=args.k)
    data = _batches(args, device, args.steps, args.batch * world, seed=1)
    per = args.batch
    curves = {"unsharded": [], "sharded": []}
    gen_one = torch.Generator(device=device).manual_seed(7)
    gen = torch.Generator(device=device).manual_seed(7)
    _reset_peak(device)
    for x, y in data:
        opt_one.zero_grad()
        loss = model_one.loss(x, y)
        loss.backward(create_graph=opt_one.hessian_due)
        if opt_one.hessian_due:
            opt_one.update_hessian(generator=gen_one)
        opt_one.step()
        curves["unsharded"].append(loss.item())
    peak_one = _peak(device)
    _reset_peak(device)
    for x, y in data:
        xs, ys = x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]
        opt.zero_grad()
        if opt.hessian_due:
            with fsdp.unsharded(model) as full:
                loss = model.loss(xs, ys)
                loss.backward(create_graph=True)
                fsdp.update_hessian(opt, full, generator=gen)
                full.reduce_gradients()
        else:
            loss = model.loss(xs, ys)
            loss.backward()
        opt.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        curves["sharded"].append(mean.item() / world)
    return curves, peak_one, _peak(device)


def _maml(args, rank, world, device, model_one, model):
    from ttt_flash import fsdp
    from ttt_flash.meta import functional_loss, inner_loop

    def ce(logits, target):
        return F.cross_entropy(logits.flatten(0, -2).float(), target.flatten())

    opt_one = torch.optim.Adam(model_one.parameters(), lr=args.lr)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    tasks = args.batch * world
    steps = [[(s, q) for s, q in zip(_batches(args, device, tasks, 2, seed=100 + i),
                                     _batches(args, device, tasks, 2, seed=200 + i))] for i in range(args.steps)]
    curves = {"unsharded": [], "sharded": []}
    _reset_peak(device)
    for step in steps:
        opt_one.zero_grad()
        total = 0.0
        for support, query in step:
            fast = inner_loop(model_one, None, ce, support, steps=2, lr=args.inner_lr)
            q = functional_loss(model_one, fast, ce, query) / len(step)
            q.backward()
            total += q.item()
        opt_one.step()
        curves["unsharded"].append(total)
    peak_one = _peak(device)
    _reset_peak(device)
    for step in steps:
        mine = step[rank * args.batch:(rank + 1) * args.batch]
        opt.zero_grad()
        total = torch.zeros((), device=device, dtype=torch.float64)
        with fsdp.unsharded(model) as full:
            for support, query in mine:
                fast = inner_loop(model, full.params, ce, support, steps=2, lr=args.inner_lr)
                q = functional_loss(model, fast, ce, query) / len(mine)
                q.backward()
                total += q.detach().double()
            full.reduce_gradients()
        opt.step()
        dist.all_reduce(total)
        curves["sharded"].append(total.item() / world)
    return curves, peak_one, _peak(device)


def _worker(rank, world, port, backend, args, out_path):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    result = {"rank": rank, "backend": backend}
    try:
        kw = {"device_id": device} if backend == "nccl" else {}
        dist.init_process_group(backend, rank=rank, world_size=world, **kw)
        from torch.distributed.device_mesh import init_device_mesh

        from ttt_flash import fsdp
        from ttt_flash.models import GPT, GPTConfig

        mesh = init_device_mesh(device.type, (world,))
        cfg = GPTConfig(vocab_size=256, n_layer=args.n_layer, n_head=args.n_head, d_model=args.d_model,
                        attention="ttt_flash")
        for path in args.paths:
            torch.manual_seed(0)
            model_one = GPT(cfg).to(device)
            model = fsdp.shard_blocks(copy.deepcopy(model_one), mesh=mesh)
            curves, peak_one, peak = (_sophia if path == "sophia" else _maml)(args, rank, world, device,
                                                                             model_one, model)
            loss_diff = max(abs(a - b) / max(1e-30, abs(a)) for a, b in zip(curves["unsharded"], curves["sharded"]))
            weight_diff = max(_rel(a.detach(), _full(b)) for a, b in zip(model_one.parameters(), model.parameters()))
            result[path] = {"curves": curves, "loss_rel_diff": loss_diff, "weight_rel_diff": weight_diff,
                            "match": loss_diff <= args.tol and weight_diff <= args.tol,
                            "peak_gib_unsharded": peak_one, "peak_gib_sharded": peak}
    except Exception as e:  # reported by the parent (e.g. NCCL refusing two ranks on one GPU)
        result["error"] = f"{type(e).__name__}: {e}"
        result["traceback"] = traceback.format_exc()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    torch.save(result, os.path.join(out_path, f"rank{rank}.pt"))


def _run(args, backend: str):
    import tempfile

    out = tempfile.mkdtemp()
    mp.start_processes(_worker, args=(args.procs, _free_port(), backend, args, out), nprocs=args.procs,
                       start_method="spawn")
    return [torch.load(os.path.join(out, f"rank{r}.pt")) for r in range(args.procs)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--procs", type=int, default=1, help="FSDP2 ranks, all on GPU 0 (1 or 2)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--backend", choices=("auto", "nccl", "gloo"), default="auto",
                    help="auto: NCCL on the GPU (gloo if NCCL refuses), gloo on the CPU")
    ap.add_argument("--paths", nargs="+", choices=("sophia", "maml"), default=["sophia", "maml"])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--k", type=int, default=5, help="Sophia-H: refresh the Hessian every k steps")
    ap.add_argument("--n-layer", type=int, default=6)
    ap.add_argument("--n-head", type=int, default=8)
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=2, help="sequences (Sophia-H) or tasks (MAML) per rank")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--inner-lr", type=float, default=0.1)
    ap.add_argument("--tol", type=float, default=1e-4, help="largest relative difference that matches")
    ap.add_argument("--json", default=None, help="also write the results as JSON here")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device (use --device cpu)")
    backend = args.backend
    if backend == "auto":
        backend = "nccl" if args.device == "cuda" else "gloo"
    results = _run(args, backend)
    errors = [r["error"] for r in results if "error" in r]
    if errors and args.backend == "auto" and backend == "nccl" and args.procs > 1:
        print(f"NCCL with {args.procs} ranks on one GPU failed: {errors[0].splitlines()[0]}")
        print("running the same ranks with gloo on the GPU")
        backend = "gloo"
        results = _run(args, backend)
        errors = [r["error"] for r in results if "error" in r]
    if errors:
        print(f"backend {backend}, {args.procs} rank(s): failed\n{results[0].get('traceback', errors[0])}")
        return 1
    r0 = results[0]
    print(f"backend {backend}, {args.procs} rank(s) on {args.device}; GPT d_model {args.d_model}, "
          f"{args.n_layer} blocks, {args.seq_len} tokens, {args.batch} per rank")
    ok = True
    for path in args.paths:
        res = r0[path]
        print(f"\n[{path}] step  unsharded        sharded")
        for i, (a, b) in enumerate(zip(res["curves"]["unsharded"], res["curves"]["sharded"])):
            print(f"  {i:4d}  {a:.9f}  {b:.9f}")
        print(f"  largest relative difference: losses {res['loss_rel_diff']:.3e}, final weights "
              f"{res['weight_rel_diff']:.3e}  ->  {'MATCH' if res['match'] else 'DIFFER'} (tol {args.tol:g})")
        print(f"  peak memory (GiB): unsharded {res['peak_gib_unsharded']:.3f}, sharded {res['peak_gib_sharded']:.3f}")
        ok = ok and all(r[path]["match"] for r in results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"backend": backend, "procs": args.procs, "args": vars(args),
                       "results": [{k: v for k, v in r.items() if k != "traceback"} for r in results]}, f, indent=1)
    return 0 if ok else 2


if __name__ == "__main__":
    sys.exit(main())
