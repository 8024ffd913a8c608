"""Time and peak memory of one third-order meta-step: MAML over a gradient-memory network.

The model is ttt_flash.models.MemoryRegressor (one GradientMemoryAttention block: memory slots
written by a gradient step through softmax attention, second-order writes) over real-valued
tokens, one sequence of N tokens. One meta-step:

  inner   one differentiable SGD step on the support sequence (meta.inner_loop,
          create_graph: the write's gradient is then differentiated again)
  outer   the query loss of the adapted weights, backward into the initial weights: a third
          derivative through the write's attention, a second through the reads

with attention="ttt_flash" (Triton kernels; the third-order terms by blockwise recomputation,
docs/second-order.md) and attention="math" (materialised softmax attention). The sequence is
cut into --chunks chunks (--chunks - 1 writes); a chunk reads the slots and itself
(N/chunks x (N/chunks + slots) scores per head).

Before timing, the meta-gradient through ttt_flash is compared with the one through math at
N = 256 in float32 (relative L2 <= GATE = 1e-2); no time is reported for ttt_flash if it fails. Times
are medians over --reps after one warm-up; peak memory is torch.cuda.max_memory_allocated of a
step. Each configuration runs in its own process; one that runs out of memory is reported as OOM.

    python scripts/third_order_bench.py --seq-lens 8192,32768 --out runs/third_order_bench

Each ttt_flash row also gives the memory allocated when the third derivative starts (the first
recompute.bob_vjp call: what the step holds for its outer backward) and the peak inside it.
--recompute sweeps the score elements per block of that recomputation ("auto": the library's
rule, recompute._recompute_rows; an integer: that many elements per block, floor and cap).

--device cpu: no allocator statistics there, so the peak is an account of live tensor bytes
(LiveBytes: the storage bytes of every tensor created during the step, summed while alive).
The attention composers (forward, first backward, BoB, tangent) count as their outputs only,
as the GPU kernels allocate: their chunked CPU arithmetic is left out. Weights and the batch
(created before the step) are not counted; they are small here (a few MiB).

    python scripts/third_order_bench.py --device cpu --attentions ttt_flash --seq-lens 1024,2048 --reps 1 --out /tmp/t3acct

--per-order: instead, what each order of derivative of one attention call costs (B = 1,
--heads heads of dimension --d-model / --heads, causal, ttt_flash only): order 1 = forward +
backward; order 2 = forward + create_graph backward + a vector-Jacobian product of the
gradient (one HVP); order 3 = that with create_graph, then a vjp of the HVP.

    python scripts/third_order_bench.py --per-order --seq-lens 8192,32768 --out runs/third_order_per_order
    python scripts/third_order_bench.py --device cpu --dtype float32 --seq-lens 64 --d-model 32 --heads 2 --slots 8 --reps 1 --out /tmp/t3   # smoke run
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

#: Relative L2 tolerance of the correctness gate (float32 kernels, TF32-free math path).
GATE = 1e-2

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class LiveBytes:
    """Live tensor bytes on any device: a TorchDispatchMode that adds the storage bytes of
    every new storage an op creates and subtracts them when the storage is freed (weakref
    finalizer); ``peak`` is the largest sum. ``opaque`` names functions of modules whose
    allocations count as their outputs only (:meth:`opaque`). Reads: ``live``, ``peak``, and
    :meth:`composition` (what was alive at the peak, by shape and dtype)."""

    def __init__(self):
        import weakref

        from torch.utils._python_dispatch import TorchDispatchMode

        tracker = self
        self.live = self.peak = 0
        self._seen, self._hidden, self._weakref = {}, 0, weakref
        self._kind, self._at_peak, self._snap_bytes = {}, {}, 0

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                if not tracker._hidden:
                    tracker.add(out)
                return out

        self.mode = _Mode()

    def add(self, out):
        """Count the storages of the tensors in ``out`` (a tensor or a nest of tuples/lists)."""
        if isinstance(out, (tuple, list)):
            for o in out:
                self.add(o)
            return
        if not isinstance(out, torch.Tensor):
            return
        st = out.untyped_storage()
        key, n = st.data_ptr(), st.nbytes()
        if n == 0 or key in self._seen:
            return
        self._seen[key] = n
        self._kind[key] = (tuple(out.shape), str(out.dtype).removeprefix("torch."))
        self.live += n
        self.peak = max(self.peak, self.live)
        if self.live > self._snap_bytes * 1.01:  # a new peak (by 1 %): note what is alive
            self._snap_bytes = self.live
            self._at_peak = {}
            for k, b in self._seen.items():
                self._at_peak[self._kind[k]] = self._at_peak.get(self._kind[k], 0) + b
        self._weakref.finalize(st, self._free, key, n)

    def composition(self, top: int = 12):
        """[(shape, dtype, MiB)] of the tensors alive at the peak (within 1 %), largest first,
        summed over tensors of the same shape and dtype."""
        rows = sorted(self._at_peak.items(), key=lambda kv: -kv[1])[:top]
        return [(list(shape), dtype, round(b / 2**20, 1)) for (shape, dtype), b in rows]

    def _free(self, key, n):
        if self._seen.pop(key, None) is not None:
            self._kind.pop(key, None)
            self.live -= n

    def opaque(self, module, names):
        """Replace ``module.<name>`` (each of ``names``) by a wrapper under which nothing is
        counted but the returned tensors: a fused kernel's footprint. Returns an undo function."""
        saved = {n: getattr(module, n) for n in names}

        def wrap(fn):
            def inner(*a, **k):
                self._hidden += 1
                try:
                    out = fn(*a, **k)
                finally:
                    self._hidden -= 1
                self.add(out)
                return out
            return inner

        for n, fn in saved.items():
            setattr(module, n, wrap(fn))
        return lambda: [setattr(module, n, fn) for n, fn in saved.items()]


def _is_oom(e: BaseException) -> bool:
    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()


def _model(args, attention: str, dtype, device, seed=0):
    from ttt_flash.models import MemoryRegressor

    torch.manual_seed(seed)
    return MemoryRegressor(args.in_dim, 1, args.d_model, args.heads, 1, attention, args.slots,
                           args.chunk_size, 1.0, False).to(device=device, dtype=dtype)


def _batch(args, n, dtype, device, seed=1):
    g = torch.Generator(device="cpu").manual_seed(seed)
    return [torch.randn(1, n, w, generator=g).to(device=device, dtype=dtype) for w in (args.in_dim, 1, args.in_dim, 1)]


def _meta_step(net, batch, inner_lr: float):
    from torch.nn.functional import mse_loss

    from ttt_flash.meta import functional_loss, inner_loop

    xs, ys, xq, yq = batch
    params = dict(net.named_parameters())
    fast = inner_loop(net, params, mse_loss, (xs, ys), 1, inner_lr)
    loss = functional_loss(net, fast, mse_loss, (xq, yq))
    return torch.autograd.grad(loss, list(params.values()))


def _check(args, device) -> float:
    """Relative L2 difference of the meta-gradients, ttt_flash vs math, float32, N = 256."""
    n, saved = 256, args.chunk_size
    args.chunk_size = n // args.chunks
    try:
        batch = _batch(args, n, torch.float32, device)
        ours = _meta_step(_model(args, "ttt_flash", torch.float32, device), batch, args.inner_lr)
        ref = _meta_step(_model(args, "math", torch.float32, device), batch, args.inner_lr)
    finally:
        args.chunk_size = saved
    num = sum((a.double() - b.double()).square().sum() for a, b in zip(ours, ref)).sqrt()
    den = sum(b.double().square().sum() for b in ref).sqrt()
    return float(num / den)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _order_step(order: int, q, k, v):
    """Derivatives of one causal attention call up to ``order`` (1, 2 or 3)."""
    from ttt_flash import flash_attention

    x = (q, k, v)
    out = flash_attention(q, k, v, causal=True)
    g = torch.autograd.grad((out.float() * 1e-3).sum(), x, create_graph=order > 1)
    if order == 1:
        return g
    h = torch.autograd.grad(g, x, [torch.ones_like(a) for a in g], create_graph=order > 2)
    if order == 2:
        return h
    return torch.autograd.grad(h, x, [torch.ones_like(a) for a in h])


def _order_worker(args) -> dict:
    device, dtype, n = torch.device(args.device), DTYPES[args.dtype], args.worker_n
    order = int(args.worker_attention.removeprefix("order"))
    d = args.d_model // args.heads
    row = {"attention": f"order{order}", "seq_len": n, "dtype": args.dtype, "heads": args.heads, "head_dim": d}
    try:
        g = torch.Generator(device="cpu").manual_seed(0)
        q, k, v = (torch.randn(1, args.heads, n, d, generator=g).to(device=device, dtype=dtype).requires_grad_()
                   for _ in range(3))
        times, peaks = [], []
        for rep in range(args.reps + 1):
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            _sync(device)
            start = time.perf_counter()
            res = _order_step(order, q, k, v)
            _sync(device)
            if not all(torch.isfinite(r).all() for r in res):
                raise RuntimeError("non-finite derivative")
            del res
            if rep:
                times.append(time.perf_counter() - start)
                if device.type == "cuda":
                    peaks.append(torch.cuda.max_memory_allocated(device) / 2**30)
        row.update(status="ok", step_ms=1e3 * statistics.median(times), peak_gib=max(peaks) if peaks else None)
    except Exception as e:  # noqa: BLE001 - reported, not hidden
        if not _is_oom(e):
            raise
        row.update(status="OOM", step_ms=None, peak_gib=None)
    return row


def _set_recompute(value: str) -> None:
    """``auto``: the library's block rule; an integer: that many score elements per block."""
    from ttt_flash.attention.reference import recompute

    if value != "auto":
        recompute.RECOMPUTE_BLOCK_ELEMENTS = recompute.RECOMPUTE_BLOCK_FLOOR = int(value)


def _watch_third(device, tracker):
    """Wrap recompute.bob_vjp (the third derivative's recomputation): record the memory
    allocated at the first call's entry and the largest peak inside a call (GiB). On CUDA the
    peak statistics are reset at each entry; ``step_floor`` keeps the step's peak before it.
    Returns (record dict, undo)."""
    from ttt_flash.attention.reference import recompute

    rec = {"third_entry_gib": None, "third_peak_gib": 0.0, "step_floor": 0}
    orig = recompute.bob_vjp
    cuda = device.type == "cuda"

    def watched(*a, **k):
        if cuda:
            torch.cuda.synchronize(device)
            live, before = torch.cuda.memory_allocated(device), torch.cuda.max_memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
        else:
            live, before = tracker.live, tracker.peak
            tracker.peak = live
        if rec["third_entry_gib"] is None:
            rec["third_entry_gib"] = live / 2**30
        rec["step_floor"] = max(rec["step_floor"], before)
        try:
            return orig(*a, **k)
        finally:
            if cuda:
                torch.cuda.synchronize(device)
            inside = torch.cuda.max_memory_allocated(device) if cuda else tracker.peak
            rec["third_peak_gib"] = max(rec["third_peak_gib"], inside / 2**30)
            if not cuda:
                tracker.peak = max(before, inside)

    recompute.bob_vjp = watched
    return rec, lambda: setattr(recompute, "bob_vjp", orig)


def _worker(args) -> dict:
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype]
    n = args.worker_n
    args.chunk_size = n // args.chunks
    attention, _, recompute = args.worker_attention.partition("@")
    row = {"attention": attention, "seq_len": n, "dtype": args.dtype, "chunk_size": args.chunk_size,
           "slots": args.slots, "d_model": args.d_model, "heads": args.heads}
    if attention == "ttt_flash":
        row["recompute"] = recompute or "auto"
        _set_recompute(row["recompute"])
    try:
        net = _model(args, attention, dtype, device)
        batch = _batch(args, n, dtype, device)
        times, peaks, thirds = [], [], []
        cuda = device.type == "cuda"
        # rep 0: warm-up; 1..reps: timed; on CUDA one more, untimed, with the third derivative
        # watched (its synchronisations would perturb the times)
        for rep in range(args.reps + 1 + (cuda and attention == "ttt_flash")):
            tracker = LiveBytes() if not cuda else None
            undo = []
            if tracker is not None:
                from ttt_flash.attention import reference
                undo.append(tracker.opaque(reference, ("attn_fwd", "attn_bwd", "attn_bob", "attn_tangent")))
            watch = not cuda or rep > args.reps
            rec = {"third_entry_gib": None, "step_floor": 0}
            if watch:
                rec, restore = _watch_third(device, tracker)
                undo.append(restore)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            _sync(device)
            start = time.perf_counter()
            try:
                if tracker is not None:
                    with tracker.mode:
                        grads = _meta_step(net, batch, args.inner_lr)
                else:
                    grads = _meta_step(net, batch, args.inner_lr)
                _sync(device)
                elapsed = time.perf_counter() - start
            finally:
                for u in undo:
                    u()
            if not all(torch.isfinite(g).all() for g in grads):
                raise RuntimeError("non-finite meta-gradient")
            del grads
            if watch and rep:
                thirds.append(rec)
            if 0 < rep <= args.reps:  # the first is a warm-up (kernel compilation)
                times.append(elapsed)
                if cuda:
                    peaks.append(max(rec["step_floor"], torch.cuda.max_memory_allocated(device)) / 2**30)
                else:
                    peaks.append(tracker.peak / 2**30)
                    row["peak_composition_mib"] = tracker.composition()
        row.update(status="ok", step_ms=1e3 * statistics.median(times),
                   peak_gib=max(peaks) if peaks else None,
                   peak_kind="max_memory_allocated" if device.type == "cuda" else "live tensor bytes (LiveBytes)")
        if thirds and thirds[-1]["third_entry_gib"] is not None:  # on CUDA: from the watched run
            row.update(third_entry_gib=max(t["third_entry_gib"] for t in thirds),
                       third_peak_gib=max(t["third_peak_gib"] for t in thirds))
    except Exception as e:  # noqa: BLE001 - reported, not hidden
        if not _is_oom(e):
            raise
        row.update(status="OOM", step_ms=None, peak_gib=None)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq-lens", default="8192,32768", help="comma-separated token counts N")
    ap.add_argument("--attentions", default="ttt_flash,math", help="comma-separated: ttt_flash, math")
    ap.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--slots", type=int, default=512, help="memory slots per head")
    ap.add_argument("--chunks", type=int, default=2, help="chunks per sequence (chunks - 1 writes)")
    ap.add_argument("--in-dim", type=int, default=8)
    ap.add_argument("--inner-lr", type=float, default=0.01)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--timeout", type=int, default=900, help="seconds per configuration")
    ap.add_argument("--per-order", action="store_true", help="time orders 1-3 of one attention call instead")
    ap.add_argument("--recompute", default="auto",
                    help="comma-separated score elements per block of the third derivative's recomputation "
                         "for the ttt_flash rows: auto (the library's rule) or integers (one row each)")
    ap.add_argument("--out", help="folder for results.json (required unless --worker-n)")
    ap.add_argument("--worker-n", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--worker-attention", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.chunk_size = None
    if args.worker_n is not None:
        fn = _order_worker if args.worker_attention.startswith("order") else _worker
        print("RESULT " + json.dumps(fn(args)), flush=True)
        return 0
    if not args.out:
        ap.error("--out is required")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.per_order:
        check, passed, configs = None, True, ["order1", "order2", "order3"]
    else:
        check = _check(args, torch.device(args.device))
        passed = check <= GATE
        print(f"correctness gate (N = 256, float32, meta-gradient ttt_flash vs math): relative L2 {check:.2e} "
              f"({'pass' if passed else 'FAIL'}, tolerance {GATE})", flush=True)
        configs = []
        for a in args.attentions.split(","):
            configs += [f"{a}@{r}" for r in args.recompute.split(",")] if a == "ttt_flash" else [a]
    rows = []
    for n in (int(s) for s in args.seq_lens.split(",")):
        for attention in configs:
            if attention.startswith("ttt_flash") and not passed:
                rows.append({"attention": "ttt_flash", "seq_len": n, "status": "not timed (gate failed)"})
                continue
            cmd = [sys.executable, __file__, "--worker-n", str(n), "--worker-attention", attention]
            cmd += [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
                    if k in ("dtype", "device", "d_model", "heads", "slots", "chunks", "in_dim", "inner_lr", "reps")]
            try:
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
                lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
                if lines:
                    rows.append(json.loads(lines[-1][7:]))
                else:
                    tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
                    status = "OOM" if any("out of memory" in t.lower() for t in tail) else "error: " + " | ".join(tail)
                    rows.append({"attention": attention.split("@")[0], "seq_len": n, "status": status})
            except subprocess.TimeoutExpired:
                rows.append({"attention": attention.split("@")[0], "seq_len": n,
                             "status": f"timeout ({args.timeout} s)"})
            print(json.dumps(rows[-1]), flush=True)
    info = {"device": torch.cuda.get_device_name() if args.device == "cuda" and torch.cuda.is_available() else args.device,
            "torch": torch.__version__, "gate_rel_l2": check, "args": {k: v for k, v in vars(args).items()
                                                                      if not k.startswith("worker")},
            "rows": rows}
    (out / "results.json").write_text(json.dumps(info, indent=1))
    print(f"\n{'N':>7} {'attention':>10} {'recompute':>10} {'status':>8} {'step ms':>9} {'peak GiB':>9} "
          f"{'peak vs math':>13} {'at 3rd GiB':>11} {'in 3rd GiB':>11}")
    for r in rows:
        math_peak = next((m.get("peak_gib") for m in rows if m["seq_len"] == r["seq_len"]
                          and m["attention"] == "math" and m.get("status") == "ok"), None)
        ratio = (f"{r['peak_gib'] / math_peak:.1%}" if r.get("peak_gib") and math_peak and r["attention"] != "math"
                 else "")
        ms = f"{r['step_ms']:.1f}" if r.get("step_ms") is not None else "-"
        gib = f"{r['peak_gib']:.2f}" if r.get("peak_gib") is not None else "-"
        third = [f"{r[k]:.2f}" if r.get(k) is not None else "-" for k in ("third_entry_gib", "third_peak_gib")]
        print(f"{r['seq_len']:>7} {r['attention']:>10} {r.get('recompute', ''):>10} {str(r.get('status'))[:8]:>8} "
              f"{ms:>9} {gib:>9} {ratio:>13} {third[0]:>11} {third[1]:>11}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
