"""Train a MemoryLM on MQAR at a short context on the CPU and report what it recalls.

    OMP_NUM_THREADS=1 python scripts/memory_recall_probe.py --steps 400 --context 256 --seed 0
    OMP_NUM_THREADS=1 python scripts/memory_recall_probe.py --write-rule slot_normalized --pairs 16

Prints validation accuracy every ``--eval-every`` steps and, at the end: recall per pair by its
order in the context (first pair ... last pair), and per layer and head the addressing of the
pair tokens' keys against the slot keys (the largest address weight, the number of distinct
arg-max slots the pairs' value tokens hit). One JSON line per run with ``--json``; with
``--out FILE`` the same JSON, with the exact command, the date and the versions, goes to FILE
(the numbers docs/memory.md quotes come from such files in docs/results/; tests/test_docs.py
checks them).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import shlex
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from ttt_flash.memory import MemoryLM
from ttt_flash.tasks import AssociativeRecallTasks


@torch.no_grad()
def diagnose(net, batches, args) -> dict:
    """Where the recall goes wrong: the share of wrong answers that name another pair's value of
    the same context (the binding of key to value lost, not the value), and per layer how the
    pairs' value tokens (the tokens that carry key and value after the short convolution)
    address the slots: the largest address weight, the effective number of slots addressed
    (1 / Σ a²), the mean cosine between two pairs' address vectors of one sequence, and the
    number of distinct arg-max slots the pairs hit."""
    net.eval()
    captured = {}
    hooks = [blk.attn.register_forward_pre_hook(lambda m, inp, i=i: captured.__setitem__(i, inp[0]))
             for i, blk in enumerate(net.blocks)]
    wrong = other = 0
    stats = {i: {"max": [], "eff": [], "cos": [], "distinct": []} for i in range(len(net.blocks))}
    for b in batches:
        logits = net(torch.cat([b.context, b.query], 1))[:, b.context.shape[1]:]
        pred = logits.argmax(-1)
        bad = pred != b.query_targets
        values = b.context[:, 1::2]
        in_ctx = (pred.unsqueeze(-1) == values.unsqueeze(1)).any(-1)
        wrong += int(bad.sum())
        other += int((bad & in_ctx).sum())
        pair_pos = (b.context[:, 0::2] < args.keys).nonzero()  # (row, slot index)
        for i, blk in enumerate(net.blocks):
            layer = blk.attn
            x = captured[i][:, : b.context.shape[1]]
            q, k, v = layer.qkv(x).view(x.shape[0], x.shape[1], 3, layer.heads, layer.head_dim).permute(2, 0, 3, 1, 4)
            sk = layer.slot_k.unsqueeze(0).expand(x.shape[0], -1, -1, -1)
            _, _, k_addr, sk = layer.addresses(q, k, sk)
            a = torch.softmax(k_addr @ sk.transpose(-1, -2) * layer.head_dim ** -0.5, -1)  # (B,H,N,S)
            rows, cols = pair_pos[:, 0], 2 * pair_pos[:, 1] + 1 - int(layer.kv_shift)  # the tokens whose key addresses the value's write
            ap = a[rows, :, cols].view(x.shape[0], args.pairs, layer.heads, -1).transpose(1, 2)  # (B,H,P,S)
            stats[i]["max"].append(ap.max(-1).values.mean().item())
            stats[i]["eff"].append((1 / ap.square().sum(-1)).mean().item())
            an = torch.nn.functional.normalize(ap, dim=-1)
            cos = an @ an.transpose(-1, -2)
            off = ~torch.eye(args.pairs, dtype=torch.bool)
            stats[i]["cos"].append(cos[..., off].mean().item())
            arg = ap.argmax(-1)  # (B,H,P)
            stats[i]["distinct"].append(torch.tensor([[len(set(r.tolist())) for r in h] for h in arg]).float().mean().item())
    for h in hooks:
        h.remove()
    net.train()
    out = {"wrong": wrong, "wrong_other_pair_value": other, "layers": {}}
    lines = [f"wrong answers: {wrong}, of them another pair's value of the context: {other} "
             f"({other / max(wrong, 1):.2f})"]
    for i, st in stats.items():
        row = {key: sum(val) / len(val) for key, val in st.items()}
        out["layers"][i] = row
        lines.append(f"layer {i}: pair address max weight {row['max']:.3f}, effective slots {row['eff']:.1f} "
                     f"of {args.slots}, cosine between two pairs' addresses {row['cos']:.3f}, "
                     f"distinct arg-max slots {row['distinct']:.2f} of {args.pairs}")
    out["lines"] = lines
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--pairs", type=int, default=4)
    ap.add_argument("--keys", type=int, default=32)
    ap.add_argument("--values", type=int, default=64)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--chunk", type=int, default=128)
    ap.add_argument("--slots", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--inner-lr", type=float, default=1.0)
    ap.add_argument("--write-rule", default="slot_normalized")
    ap.add_argument("--no-gate", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--eval-context", type=int, default=None, help="validation context (default --context)")
    ap.add_argument("--final-contexts", default="", help="comma-separated longer contexts to validate at the end")
    ap.add_argument("--extra", default="{}", help="JSON of extra MemoryLM keyword arguments")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", default=None, help="also write the result JSON (with the command) to this file")
    args = ap.parse_args()
    if args.out is not None and not Path(args.out).parent.is_dir():
        ap.error(f"--out {args.out}: folder {Path(args.out).parent} does not exist")
    if os.environ.get("OMP_NUM_THREADS") != "1":
        torch.set_num_threads(1)  # the quoted numbers are one-thread runs (deterministic)

    torch.manual_seed(args.seed)
    tasks = AssociativeRecallTasks(num_keys=args.keys, num_values=args.values, num_pairs=args.pairs,
                                   num_queries=args.pairs, context_len=args.context)
    val_tasks = AssociativeRecallTasks(num_keys=args.keys, num_values=args.values, num_pairs=args.pairs,
                                       num_queries=args.pairs, context_len=args.eval_context or args.context)
    net = MemoryLM(tasks.vocab_size, args.d_model, args.layers, args.heads, args.slots, 1, args.inner_lr, args.chunk,
                   attention="math", write_gate=not args.no_gate, write_rule=args.write_rule,
                   **json.loads(args.extra))
    decay = [p for p in net.parameters() if p.requires_grad and p.dim() >= 2]
    rest = [p for p in net.parameters() if p.requires_grad and p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.0}, {"params": rest, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20))
    gen = torch.Generator().manual_seed(1000 + args.seed)
    val = [val_tasks.sample(args.batch, generator=torch.Generator().manual_seed(10_000 + i)) for i in range(4)]

    def evaluate():
        net.eval()
        hits, by_pos = [], []
        with torch.no_grad():
            for b in val:
                logits = net(torch.cat([b.context, b.query], 1))[:, b.context.shape[1]:]
                hit = logits.argmax(-1) == b.query_targets
                # order of each queried pair among the context's pairs
                keys_in_order = b.context[:, 0::2]
                pos = torch.zeros_like(b.query)
                for i in range(b.query.shape[0]):
                    ks = [int(t) for t in keys_in_order[i] if t < args.keys]
                    pos[i] = torch.tensor([ks.index(int(t)) for t in b.query[i]])
                hits.append(hit.flatten())
                by_pos.append(pos.flatten())
        net.train()
        hits, by_pos = torch.cat(hits).float(), torch.cat(by_pos)
        return hits.mean().item(), [hits[by_pos == p].mean().item() for p in range(args.pairs)]

    curve = []
    t0 = time.time()
    for step in range(1, args.steps + 1):
        b = tasks.sample(args.batch, generator=gen)
        logits = net(torch.cat([b.context, b.query], 1))[:, b.context.shape[1]:]
        loss = F.cross_entropy(logits.flatten(0, 1), b.query_targets.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % args.eval_every == 0 or step == args.steps:
            acc, per = evaluate()
            curve.append((step, round(acc, 3)))
            print(f"step {step} loss {loss.item():.3f} val_acc {acc:.3f} per_pair {[round(x, 2) for x in per]} "
                  f"({time.time() - t0:.0f}s)", flush=True)
    acc, per = evaluate()
    longer = {}
    for length in (int(x) for x in args.final_contexts.split(",") if x):
        t = AssociativeRecallTasks(num_keys=args.keys, num_values=args.values, num_pairs=args.pairs,
                                   num_queries=args.pairs, context_len=length)
        batches = [t.sample(8, generator=torch.Generator().manual_seed(20_000 + i)) for i in range(4)]
        net.eval()
        with torch.no_grad():
            hits = [(net(torch.cat([b.context, b.query], 1))[:, length:].argmax(-1) == b.query_targets).float()
                    for b in batches]
        net.train()
        longer[length] = torch.cat(hits).mean().item()
        print(f"context {length}: val_acc {longer[length]:.3f}", flush=True)
    diag = diagnose(net, val, args)
    for line in diag["lines"]:
        print(line)
    out = {"longer": longer, "diagnosis": {k: v for k, v in diag.items() if k != "lines"},"rule": args.write_rule, "extra": args.extra, "seed": args.seed, "context": args.context,
           "pairs": args.pairs, "steps": args.steps, "acc": acc, "per_pair": per, "curve": curve,
           "time_s": round(time.time() - t0, 1)}
    print(json.dumps(out) if args.json else out)
    if args.out is not None:
        record = {"commands": [f"OMP_NUM_THREADS=1 python scripts/memory_recall_probe.py {shlex.join(sys.argv[1:])}"],
                  "date": datetime.date.today().isoformat(), "machine": f"{platform.machine()}, {os.cpu_count()} cores",
                  "torch": torch.__version__, **out}
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
