"""Does test-time training help a byte-level language model use a long document? The loss per token
position, in log-spaced bins, of three byte-level LMs on held-out text: a sliding-window GPT
with end-to-end test-time training (TTT-E2E), the same model without its update, and a
full-attention GPT of the same size.

    python3 scripts/real_text_positions.py --out DIR                          # GPU defaults: evaluate 131,072-byte documents
    python3 scripts/real_text_positions.py --out DIR --eval-only              # evaluate the checkpoints DIR/<model>.pt again
    python3 scripts/real_text_positions.py --out DIR --bf16 --deadline 500    # pause after 500 s; the same command continues
    python3 scripts/real_text_positions.py --out DIR --tiny                   # the same on the CPU, tiny shapes (a dry run)
    python3 scripts/real_text_positions.py --out DIR --paths /usr/lib/python3*/ /usr/share/doc   # another offline corpus

The corpus is read with the library's byte corpus reader (``ttt_flash.lightning.ByteTextDataModule``:
the running Python's standard-library sources by default, or ``--paths``; nothing is downloaded).
Its last ``--val-fraction`` is held out; the held-out documents are ``--docs`` disjoint, evenly
spaced windows of ``--eval-len`` bytes of it (consecutive files, sorted by path, so a document is
a run of neighbouring modules). The three models:

* ``ttt``: GPT with a ``--window``-token sliding window; the MLP of its last block is a fast
  weight (``ttt_flash.memory.FastWeightTTT``). The document is read in chunks of ``--chunk``
  bytes: each chunk is predicted with the fast weights so far, then the fast weights take one
  gradient step of that chunk's next-byte loss. Training differentiates through every step
  (second order); evaluation takes the same steps without the outer graph.
* ``no_update``: the same model (same initial weights, data and steps) with the step switched
  off: a sliding-window GPT.
* ``full``: the same GPT with full causal attention (``window`` None): every byte sees the whole
  document; its attention costs O(N^2) where the others' is O(N).

All three train on the same windows (``--curriculum`` of lengths, ``--tokens-per-step`` bytes per
step: the batch is ``tokens_per_step // length``), AdamW with warm-up and cosine decay, for the
same number of steps; each model's training wall time is recorded (a model may also stop at
``--max-train-s``). Checkpoints go to DIR/<model>.pt; a model whose checkpoint is there is not
trained again, and an interrupted one continues exactly from DIR/<model>.partial.pt (saved every
``--save-every`` steps). Each evaluated model is kept in DIR/<model>.eval.json; DIR/positions.json
gathers every model evaluated in DIR with the same configuration, also by other processes, so
three processes with ``--models`` one each leave the whole comparison (per model: mean loss per
bin in nats and bits per byte, the overall mean, steps, training time, parameters; the bins; the
configuration). Also writes DIR/positions.png (bits per byte against position, log scale; needs
matplotlib) and prints a table last.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

ROOT = Path(__file__).resolve().parent.parent
MODELS = ("ttt", "no_update", "full")
#: --tiny: a CPU dry run (1 MiB of corpus, a tiny model, 256-byte documents, 4 steps)
TINY = dict(max_bytes=2**20, eval_len=256, docs=2, bins=8, steps=4, curriculum="0:64,2:256", tokens_per_step=256,
            n_layer=2, n_head=2, d_model=32, window=16, chunk=32, attention="math", bf16=False)
LABELS = {"ttt": "TTT-E2E (fast-weight MLP, sliding window)", "no_update": "same model, no update (sliding window)",
          "full": "full attention"}


# --------------------------------------------------------------------------- models


def build(name: str, a) -> "torch.nn.Module":
    """The model ``name`` (a FastWeightTTT around a GPT; for ``full`` a plain GPT), seeded by
    ``a.seed`` so that the three start from the same weights."""
    from ttt_flash.memory import FastWeightTTT
    from ttt_flash.models import GPT, GPTConfig

    torch.manual_seed(a.seed)
    window = None if name == "full" else a.window
    gpt = GPT(GPTConfig(vocab_size=256, n_layer=a.n_layer, n_head=a.n_head, d_model=a.d_model, window=window,
                        attention=a.attention, rope_base=a.rope_base, checkpoint=a.checkpoint))
    if name == "full":
        return gpt
    return FastWeightTTT(gpt, fast_layers=[-1], chunk_size=a.chunk, inner_steps=1 if name == "ttt" else 0,
                         inner_lr=a.inner_lr)


def _upcast(logits: Tensor) -> Tensor:
    """The loss in float32 for half-precision logits; float32 and float64 stay as they are."""
    return logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits


def token_nll(model, name: str, x: Tensor, y: Tensor, create_graph: bool) -> Tensor:
    """(B, N) next-byte losses of ``x`` (B, N) against ``y``. For ``ttt`` the chunks are read in
    order: chunk c is predicted with the fast weights after chunks < c, then they take one step
    of its mean loss (per sequence; ``create_graph``: second order through the step)."""
    if name == "full":
        logits = model(x)
        return F.cross_entropy(_upcast(logits).flatten(0, 1), y.flatten(), reduction="none").view(y.shape)
    batch, length = x.shape
    fast = model.initial_fast_weights(batch)
    lr = model.inner_lr
    out = []
    for start in range(0, length, model.chunk_size):
        end = min(length, start + model.chunk_size)
        logits = model.predict(fast, x[:, :start], x[:, start:end])
        nll = F.cross_entropy(_upcast(logits).flatten(0, 1), y[:, start:end].flatten(), reduction="none")
        nll = nll.view(batch, end - start)
        if name == "ttt" and end < length:  # the last chunk's step would be read by nothing
            names = list(fast)
            grads = torch.autograd.grad(nll.mean(1).sum(), [fast[n] for n in names], create_graph=create_graph)
            fast = {n: fast[n] - lr * g for n, g in zip(names, grads)}
        out.append(nll if create_graph else nll.detach())
    return torch.cat(out, 1)


# --------------------------------------------------------------------------- data


def corpus(a):
    """(train tokens, held-out tokens, files) through ByteTextDataModule."""
    from ttt_flash.lightning import ByteTextDataModule

    dm = ByteTextDataModule(paths=a.paths, seq_len=a.eval_len, batch_size=1, max_bytes=a.max_bytes,
                            val_fraction=a.val_fraction, seed=a.seed)
    dm.setup("fit")
    return dm.train_tokens, dm.val_tokens, dm.files


def documents(val_tokens: Tensor, length: int, count: int) -> List[tuple]:
    """``count`` disjoint, evenly spaced (x, y) windows of ``length`` bytes of the held-out split."""
    from ttt_flash.tasks import ByteWindows

    need = count * (length + 1)
    if val_tokens.numel() < need:
        raise ValueError(
            f"the held-out split has {val_tokens.numel():,} bytes, fewer than --docs x (--eval-len + 1) = {need:,}: "
            f"give fewer --docs, a shorter --eval-len, a larger --val-fraction or --max-bytes, or more text (--paths)")
    windows = ByteWindows(val_tokens, length, seed=0, random=False, count=count)
    return [windows[i] for i in range(count)]


def log_bins(length: int, count: int) -> List[List[int]]:
    """Position bins [lo, hi) covering 0 … length − 1, log-spaced (the first ones merged where
    they would be empty): lo of bin k is about length^(k / count) − 1."""
    edges = np.unique(np.round(np.geomspace(1, length + 1, count + 1)).astype(int) - 1)
    edges[0], edges[-1] = 0, length
    return [[int(lo), int(hi)] for lo, hi in zip(edges[:-1], edges[1:]) if hi > lo]


def parse_curriculum(text: str):
    from ttt_flash.lightning.curriculum import LengthCurriculum

    try:
        stages = [[int(p) for p in stage.split(":")] for stage in text.split(",") if stage.strip()]
    except ValueError:
        raise ValueError(f"--curriculum must be FIRST_STEP:LENGTH pairs separated by commas, got {text!r}") from None
    return LengthCurriculum(stages, what="--curriculum")


# --------------------------------------------------------------------------- train and evaluate


def _progress(total: int, desc: str):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, file=sys.stderr, mininterval=5.0, dynamic_ncols=True)


def _autocast(a, device):
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=a.bf16)


def train(name: str, a, train_tokens: Tensor, device, stop_after: Optional[int] = None,
          deadline: Optional[float] = None) -> Optional[Dict]:
    """Train the model ``name``; its checkpoint DIR/<name>.pt at the end. Every ``a.save_every``
    steps (and at ``stop_after``, or once ``time.perf_counter()`` passes ``deadline``: both
    then return None) the whole state goes to
    DIR/<name>.partial.pt, from which a later call continues exactly: the windows are a function
    of (seed, index) and nothing else is random."""
    from ttt_flash.tasks import ByteWindows

    model = build(name, a).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.1)
    warmup = max(1, a.steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min((s + 1) / warmup, 0.1 + 0.45 * (
        1 + math.cos(math.pi * min(1.0, max(0, s - warmup) / max(1, a.steps - warmup))))))
    partial = a.out / f"{name}.partial.pt"
    state = {"step": 0, "seen": 0, "trained_bytes": 0, "losses": [], "elapsed": 0.0}
    if partial.is_file():
        saved = torch.load(partial, map_location=device)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        sched.load_state_dict(saved["sched"])
        state = saved["state"]
        print(f"{name}: continuing from step {state['step']} ({partial})", flush=True)

    def save(path: Path) -> None:
        tmp = path.with_suffix(".tmp")
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                    "state": state}, tmp)
        tmp.replace(path)

    curriculum, started = a.curriculum, time.perf_counter() - state["elapsed"]
    bar = _progress(a.steps, f"train {name}")
    bar.update(state["step"])
    while state["step"] < a.steps:
        if a.max_train_s and time.perf_counter() - started > a.max_train_s:
            break
        if deadline is not None and time.perf_counter() > deadline and state["step"] > 0:
            save(partial)
            bar.close()
            print(f"{name}: paused at step {state['step']} of {a.steps} (--deadline); run the same command "
                  f"again to continue from {partial}", flush=True)
            return None
        length = curriculum.length_at(state["step"])
        batch, seen = max(1, a.tokens_per_step // length), state["seen"]
        windows = ByteWindows(train_tokens, length, a.seed, random=True, count=seen + batch)
        x, y = (torch.stack(t).to(device) for t in zip(*(windows[seen + b] for b in range(batch))))
        with _autocast(a, device):
            loss = token_nll(model, name, x, y, create_graph=True).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        state["losses"].append(float(loss.detach()))
        state["step"] += 1
        state["seen"] += batch
        state["trained_bytes"] += batch * length
        state["elapsed"] = time.perf_counter() - started
        bar.update(1)
        bar.set_postfix(len=length, loss=f"{state['losses'][-1]:.3f}", refresh=False)
        if state["step"] == stop_after or (a.save_every and state["step"] % a.save_every == 0):
            save(partial)
            if state["step"] == stop_after:
                bar.close()
                return None
    bar.close()
    if device.type == "cuda":
        torch.cuda.synchronize()
    record = {"steps": state["step"], "train_s": round(time.perf_counter() - started, 1),
              "train_loss_last": state["losses"][-1] if state["losses"] else None,
              "train_bytes": state["trained_bytes"], "params": sum(p.numel() for p in model.parameters())}
    if name == "ttt":
        record["inner_lr"] = float(model.inner_lr.detach())
    torch.save({"model": model.state_dict(), "record": record}, a.out / f"{name}.pt")
    partial.unlink(missing_ok=True)
    return record


def evaluate(name: str, a, docs: List[tuple], bins: List[List[int]], device) -> Dict:
    model = build(name, a).to(device)
    state = torch.load(a.out / f"{name}.pt", map_location=device)
    model.load_state_dict(state["model"])
    model.eval()
    total = torch.zeros(a.eval_len, dtype=torch.float64)
    started = time.perf_counter()
    bar = _progress(len(docs), f"evaluate {name}")
    for x, y in docs:
        # the fast weights' steps need gradients; no outer graph is kept
        with torch.enable_grad() if name == "ttt" else torch.no_grad(), _autocast(a, device):
            nll = token_nll(model, name, x[None].to(device), y[None].to(device), create_graph=False)
        total += nll.detach()[0].double().cpu()
        bar.update(1)
    bar.close()
    mean = total / len(docs)
    per_bin = [float(mean[lo:hi].mean()) for lo, hi in bins]
    return {**state["record"], "eval_s": round(time.perf_counter() - started, 1),
            "loss_nats": per_bin, "bits_per_byte": [v / math.log(2) for v in per_bin],
            "mean_nats": float(mean.mean()), "mean_bits_per_byte": float(mean.mean()) / math.log(2)}


#: Options that do not change what a model is or how it is evaluated.
_RUN_ONLY = ("out", "models", "eval_only", "deadline", "max_train_s", "save_every", "tiny")


def setup(result: dict) -> dict:
    """What makes two evaluations comparable: the configuration without the run-only options,
    the corpus sizes and the bins."""
    config = {k: v for k, v in result["config"].items() if k not in _RUN_ONLY}
    return {"config": config, "corpus_bytes": result["corpus_bytes"], "held_out_bytes": result["held_out_bytes"],
            "bins": result["bins"]}


def _write_json(path: Path, obj) -> None:
    """Written whole, then renamed: a process reading it never sees half a file."""
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)


def gathered(out: Path, result: dict) -> Dict[str, dict]:
    """The models evaluated in ``out`` (``<model>.eval.json``) with the same setup as ``result``,
    in the order of MODELS; one evaluated with another setup is left out with a note."""
    want, models = json.loads(json.dumps(setup(result))), {}
    for name in MODELS:
        path = out / f"{name}.eval.json"
        if not path.is_file():
            continue
        saved = json.loads(path.read_text())
        if saved["setup"] != want:
            print(f"{path.name}: evaluated with another configuration; left out of positions.json "
                  f"(evaluate it again with --eval-only --models {name})", flush=True)
            continue
        models[name] = saved["model"]
    return models


def plot(path: Path, result: dict) -> Optional[str]:
    """The PNG of bits per byte against position; the reason when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        from ttt_flash.lightning.curves import PLOT_EXTRA_MESSAGE

        return PLOT_EXTRA_MESSAGE
    centers = [math.sqrt((lo + 1) * hi) for lo, hi in result["bins"]]  # 1-based positions lo + 1 … hi
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, style in zip(MODELS, ("-o", "--s", ":^")):
        if name in result["models"]:
            ax.plot(centers, result["models"][name]["bits_per_byte"], style, ms=3, label=LABELS[name])
    ax.set_xscale("log")
    ax.set_xlabel("byte position in the document (1 = first)")
    ax.set_ylabel("loss (bits per byte), mean over documents")
    c = result["config"]
    ax.set_title(f"{c['docs']} held-out documents of {c['eval_len']:,} bytes; trained on "
                 f"{result['corpus_bytes'] - result['held_out_bytes']:,} bytes", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


def table(result: dict) -> str:
    bins = result["bins"]
    show = sorted({0, len(bins) // 4, len(bins) // 2, 3 * len(bins) // 4, len(bins) - 1})
    head = " | ".join(f"[{bins[i][0]:,}, {bins[i][1]:,})" for i in show)
    rows = [f"| model | params | steps | train s | mean bpb | {head} |",
            "| --- | --- | --- | --- | --- |" + " --- |" * len(show)]
    for name, m in result["models"].items():
        cells = " | ".join(f"{m['bits_per_byte'][i]:.3f}" for i in show)
        rows.append(f"| {name} | {m['params']:,} | {m['steps']} | {m['train_s']} | {m['mean_bits_per_byte']:.3f} | {cells} |")
    return "\n".join(rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="folder for checkpoints, positions.json, positions.png")
    p.add_argument("--paths", nargs="*", default=None, help="text files, folders or globs (default: the stdlib sources)")
    p.add_argument("--max-bytes", type=int, default=None, help="corpus cap in bytes (default: all of it)")
    p.add_argument("--val-fraction", type=float, default=0.05, help="held-out fraction of the corpus (its end)")
    p.add_argument("--eval-len", type=int, default=131072, help="bytes per held-out document")
    p.add_argument("--docs", type=int, default=8, help="held-out documents")
    p.add_argument("--bins", type=int, default=24, help="log-spaced position bins")
    p.add_argument("--curriculum", default="0:8192,400:32768,520:131072",
                   help="training length by step, FIRST_STEP:LENGTH,... (the last stage: the evaluation length)")
    p.add_argument("--steps", type=int, default=560, help="optimizer steps per model")
    p.add_argument("--tokens-per-step", type=int, default=131072, help="bytes per step (batch = this // length)")
    p.add_argument("--save-every", type=int, default=50, help="steps between resumable saves (DIR/<model>.partial.pt; 0: none)")
    p.add_argument("--max-train-s", type=float, default=0.0, help="stop a model's training after this many seconds (0: never)")
    p.add_argument("--deadline", type=float, default=0.0,
                   help="pause after this many seconds of this call (saving DIR/<model>.partial.pt; the same "
                        "command continues it); 0: never")
    p.add_argument("--n-layer", type=int, default=4, help="transformer blocks")
    p.add_argument("--n-head", type=int, default=4, help="attention heads")
    p.add_argument("--d-model", type=int, default=256, help="residual width")
    p.add_argument("--window", type=int, default=1024, help="attention window of ttt and no_update")
    p.add_argument("--chunk", type=int, default=2048, help="bytes per fast-weight step (ttt; shorter than every training length)")
    p.add_argument("--inner-lr", type=float, default=0.1, help="initial fast-weight step size (learned as its log)")
    p.add_argument("--rope-base", type=float, default=1e6, help="RoPE base")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW peak learning rate")
    p.add_argument("--attention", default="ttt_flash", help="attention implementation (math: materialised, for the CPU)")
    p.add_argument("--checkpoint", action="store_true", help="activation checkpointing of every block")
    p.add_argument("--bf16", action="store_true", help="bf16 autocast (GPU)")
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated subset of {','.join(MODELS)}")
    p.add_argument("--seed", type=int, default=0, help="weights and training windows")
    p.add_argument("--eval-only", action="store_true", help="no training: evaluate the checkpoints in --out")
    p.add_argument("--tiny", action="store_true", help="CPU dry run: 1 MiB of corpus, tiny model and lengths, 4 steps (options given still apply)")
    a = p.parse_args(argv)
    if a.tiny:  # tiny values for every option left at its default
        for key, value in TINY.items():
            if getattr(a, key) == p.get_default(key):
                setattr(a, key, value)
    models = [m.strip() for m in a.models.split(",") if m.strip()]
    bad = sorted(set(models) - set(MODELS))
    if bad or not models:
        p.error(f"--models must name some of {MODELS}, got {a.models!r}")
    for flag in ("eval_len", "docs", "bins", "steps", "tokens_per_step", "window", "chunk"):
        if getattr(a, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(a, flag)}")
    for flag in ("save_every", "max_train_s", "deadline"):
        if getattr(a, flag) < 0:
            p.error(f"--{flag.replace('_', '-')} must be >= 0, got {getattr(a, flag)}")
    deadline = time.perf_counter() + a.deadline if a.deadline else None
    try:
        a.curriculum = parse_curriculum(a.curriculum)
    except ValueError as e:
        p.error(str(e))
    if a.curriculum.lengths[-1] != a.eval_len:
        p.error(f"--curriculum ends at length {a.curriculum.lengths[-1]}, not at --eval-len {a.eval_len}: "
                f"train the models at the length they are evaluated at")
    a.out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if a.chunk >= a.curriculum.lengths[0]:
        p.error(f"--chunk {a.chunk} must be shorter than the first training length {a.curriculum.lengths[0]}: "
                f"otherwise the first stage trains the TTT model without a single fast-weight step")
    try:
        train_tokens, val_tokens, files = corpus(a)
        docs = documents(val_tokens, a.eval_len, a.docs)
    except (ValueError, FileNotFoundError) as e:
        p.error(str(e))
    bins = log_bins(a.eval_len, a.bins)
    result = {"config": {k: (v.as_list() if k == "curriculum" else str(v) if isinstance(v, Path) else v)
                         for k, v in vars(a).items()},
              "corpus_bytes": int(train_tokens.numel() + val_tokens.numel()), "held_out_bytes": int(val_tokens.numel()),
              "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
              "bins": bins, "models": {}}
    result["config"]["corpus_files"] = len(files)
    for name in models:
        if not a.eval_only and not (a.out / f"{name}.pt").is_file():
            if train(name, a, train_tokens, device, deadline=deadline) is None:
                return 0  # paused at --deadline: no evaluation until every model has trained
        if not (a.out / f"{name}.pt").is_file():
            p.error(f"no checkpoint {a.out / f'{name}.pt'} to evaluate (run without --eval-only first)")
        evaluated = evaluate(name, a, docs, bins, device)
        _write_json(a.out / f"{name}.eval.json", {"setup": setup(result), "model": evaluated})
    # every model evaluated in DIR with this setup, also by other processes (--models one each)
    result["models"] = gathered(a.out, result)
    message = plot(a.out / "positions.png", result)
    if message:
        print(message, flush=True)
    else:
        result["png"] = "positions.png"
    _write_json(a.out / "positions.json", result)
    print(table(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
