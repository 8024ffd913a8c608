"""Context parallelism (ttt_flash.distributed.context_parallel, docs/distributed.md): one sequence across
2 and 4 processes (gloo, float64) equals one process over the whole sequence to 1e-10.

Each rank builds the same full inputs (same seed), runs the chain (output, first backward
with ``create_graph=True``, Hessian-vector product by a second backward) on its block
through :func:`context_parallel_attention`, and the same chain in one process over the whole
sequence with :func:`flash_attention`; it records the largest difference of its block. A
MAML meta-gradient (inner step through the context-parallel attention, the inner gradient
summed over ranks with the differentiable ``all_reduce_sum``) and the GPT switch are checked
the same way. One spawn per world size runs every case (module-scoped fixture); the tests
then assert per case.
"""

import os
import socket

import pytest
from lightning.pytorch import Callback
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ttt_flash import flash_attention, flash_attention_varlen
from ttt_flash.distributed.context_parallel import _seq_to_heads, head_plan
from ttt_flash.distributed import (
    all_reduce_sum,
    block_bounds,
    context_parallel_attention,
    context_parallel_attention_varlen,
    reduce_gradients,
    shard_sequence,
)
from ttt_flash.models import GPT, GPTConfig

TOL = 1e-10
F64 = torch.float64

# name: (H_q, H_kv, N(P), causal, window); N not divisible by P where it ends in "+1"/"+3"
CASES = {
    "causal-mha-uneven": (4, 4, lambda p: 4 * p + 1, True, None),
    "window-gqa-uneven": (4, 2, lambda p: 4 * p + 3, True, 3),
    "mqa-full-even": (4, 1, lambda p: 3 * p, False, None),
    "causal-uneven-heads": (6, 3, lambda p: 5 * p + 1, True, None),
    "causal-short": (4, 2, lambda p: p + 1, True, 2),
}
VARLEN_CASES = {
    "varlen-causal-gqa": ([5, 0, 7, 7], 4, 2, True, None),
    "varlen-window-mha": ([3, 9, 2, 5], 4, 4, True, 2),
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _max_err(ref: torch.Tensor, got: torch.Tensor) -> float:
    assert ref.shape == got.shape, (ref.shape, got.shape)
    return (ref - got).abs().max().item() / max(1.0, ref.abs().max().item()) if ref.numel() else 0.0


def _chain(attn, q, k, v, do, u):
    """Output, first backward (graph kept) and its backward for (q, k, v, dO)."""
    q, k, v, do = (x.detach().clone().requires_grad_(True) for x in (q, k, v, do))
    o = attn(q, k, v)
    grads = torch.autograd.grad(o, (q, k, v), do, create_graph=True)
    inner = sum((g * w).sum() for g, w in zip(grads, u))
    return [o, *grads, *torch.autograd.grad(inner, (q, k, v, do))]


NAMES = ["o", "dq", "dk", "dv", "hvp_q", "hvp_k", "hvp_v", "hvp_do"]


def _dense_case(name, size):
    hq, hkv, n_of, causal, window = CASES[name]
    n = n_of(size)
    g = torch.Generator().manual_seed(list(CASES).index(name))
    r = lambda h: torch.randn(2, h, n, 8, dtype=F64, generator=g)  # noqa: E731
    q, k, v, do = r(hq), r(hkv), r(hkv), r(hq)
    u = [r(hq), r(hkv), r(hkv)]
    kw = dict(causal=causal, window=window)
    ref = _chain(lambda a, b, c: flash_attention(a, b, c, **kw), q, k, v, do, u)
    sh = lambda x: shard_sequence(x, 2)  # noqa: E731
    got = _chain(lambda a, b, c: context_parallel_attention(a, b, c, **kw), sh(q), sh(k), sh(v), sh(do),
                 [sh(x) for x in u])
    return {nm: _max_err(sh(a), b) for nm, a, b in zip(NAMES, ref, got)}


def _varlen_case(name, size):
    lens, hq, hkv, causal, window = VARLEN_CASES[name]
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)
    t, longest = int(cu[-1]), max(lens)
    g = torch.Generator().manual_seed(7)
    r = lambda h: torch.randn(t, h, 8, dtype=F64, generator=g)  # noqa: E731
    q, k, v, do = r(hq), r(hkv), r(hkv), r(hq)
    u = [r(hq), r(hkv), r(hkv)]
    kw = dict(causal=causal, window=window)
    ref = _chain(lambda a, b, c: flash_attention_varlen(a, b, c, cu, cu, longest, longest, **kw), q, k, v, do, u)
    sh = lambda x: shard_sequence(x, 0)  # noqa: E731
    got = _chain(lambda a, b, c: context_parallel_attention_varlen(a, b, c, cu, longest, **kw),
                 sh(q), sh(k), sh(v), sh(do), [sh(x) for x in u])
    return {nm: _max_err(sh(a), b) for nm, a, b in zip(NAMES, ref, got)}


def _maml_case(size):
    """Second-order MAML over a tiny attention model: one inner step on a sequence, the
    meta-gradient of the loss on a second sequence after the step."""
    d, hq, hkv, n = 8, 4, 2, 6 * size + 1
    g = torch.Generator().manual_seed(3)
    params = [torch.randn(d, hq * 4, dtype=F64, generator=g) * 0.5, torch.randn(d, hkv * 4, dtype=F64, generator=g) * 0.5,
              torch.randn(d, hkv * 4, dtype=F64, generator=g) * 0.5, torch.randn(hq * 4, d, dtype=F64, generator=g) * 0.5]
    x_in, y_in, x_out, y_out = (torch.randn(1, n, d, dtype=F64, generator=g) for _ in range(4))

    def model(theta, x, attn):
        wq, wk, wv, wo = theta
        heads = lambda t, h: t.unflatten(-1, (h, 4)).transpose(1, 2)  # noqa: E731
        o = attn(heads(x @ wq, hq), heads(x @ wk, hkv), heads(x @ wv, hkv))
        return o.transpose(1, 2).flatten(-2) @ wo

    def meta_grad(attn, shard, reduce):
        theta = [p.clone().requires_grad_(True) for p in params]
        inner = ((model(theta, shard(x_in), attn) - shard(y_in)) ** 2).sum() / n
        grads = [reduce(gr) for gr in torch.autograd.grad(inner, theta, create_graph=True)]
        fast = [p - 0.3 * gr for p, gr in zip(theta, grads)]
        outer = ((model(fast, shard(x_out), attn) - shard(y_out)) ** 2).sum() / n
        return [reduce(gr).detach() for gr in torch.autograd.grad(outer, theta)]

    kw = dict(causal=True, window=5)
    ref = meta_grad(lambda a, b, c: flash_attention(a, b, c, **kw), lambda t: t, lambda t: t)
    got = meta_grad(lambda a, b, c: context_parallel_attention(a, b, c, **kw), lambda t: shard_sequence(t, 1),
                    all_reduce_sum)
    assert all(r.abs().max() > 0 for r in ref)
    return {f"meta_grad{i}": _max_err(a, b) for i, (a, b) in enumerate(zip(ref, got))}


def _gpt_case(size):
    """GPT(context_parallel=True) (activation checkpointing on: the recomputation in the
    backward runs the exchanges again) vs GPT on the whole sequence: logits, parameter gradients
    (shares summed with reduce_gradients) and a Hessian-vector product."""
    torch.manual_seed(0)
    cfg = GPTConfig.tiny(n_layer=2, d_model=32, n_head=4, n_kv_head=2, window=5, vocab_size=64, checkpoint=True)
    one = GPT(cfg).double()
    cp = GPT(cfg, context_parallel=True).double()
    cp.load_state_dict(one.state_dict())
    n = 7 * size + 1
    idx = torch.randint(0, 64, (2, n + 1), generator=torch.Generator().manual_seed(5))
    x, y = idx[:, :-1], idx[:, 1:]
    params_one, params_cp = list(one.parameters()), list(cp.parameters())
    vecs = [torch.randn(p.shape, dtype=F64, generator=torch.Generator().manual_seed(i)) for i, p in enumerate(params_one)]

    def run(model, params, x, y, reduce):
        logits = model(x)
        # The global mean over all 2·n tokens, as a sum of per-rank parts.
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum") / (2 * n)
        grads = torch.autograd.grad(loss, params, create_graph=True)
        hvp = torch.autograd.grad(sum((gr * w).sum() for gr, w in zip(grads, vecs)), params)
        return logits.detach(), [reduce(gr.detach()) for gr in grads], [reduce(h) for h in hvp]

    lo, go, ho = run(one, params_one, x, y, lambda t: t)
    lc, gc, hc = run(cp, params_cp, shard_sequence(x, 1), shard_sequence(y, 1), all_reduce_sum)
    out = {"logits": _max_err(shard_sequence(lo, 1), lc)}
    out.update({f"grad{i}": _max_err(a, b) for i, (a, b) in enumerate(zip(go, gc))})
    out.update({f"hvp{i}": _max_err(a, b) for i, (a, b) in enumerate(zip(ho, hc))})
    # reduce_gradients: the same sums through p.grad
    for p in params_cp:
        p.grad = None
    logits = cp(shard_sequence(x, 1))
    (torch.nn.functional.cross_entropy(logits.flatten(0, 1), shard_sequence(y, 1).flatten(), reduction="sum") / (2 * n)).backward()
    reduce_gradients(params_cp, cp_group=dist.group.WORLD)
    out.update({f"reduce_gradients{i}": _max_err(a, p.grad) for i, (a, p) in enumerate(zip(go, params_cp))})
    return out


def _groups_case(size):
    """Context-parallel groups of 2 ranks, data parallel across them (the Lightning path's
    arithmetic, ContextParallelPlan + average_gradients): the gradient equals one process's on
    the groups' batches together (of different sizes: the weights matter)."""
    from ttt_flash.distributed import average_gradients
    from ttt_flash.lightning.context_parallel import ContextParallelPlan

    rank = dist.get_rank()
    cfg = GPTConfig.tiny(n_layer=1, d_model=16, n_head=2, vocab_size=32)
    torch.manual_seed(0)
    one = GPT(cfg).double()
    cp = GPT(cfg).double()
    cp.load_state_dict(one.state_dict())
    g = torch.Generator().manual_seed(11)
    # rank r's own batch; group g (ranks 2g, 2g+1) trains on rank 2g's, of 1 + g % 2 sequences
    batches = [torch.randint(0, 32, (1 + (r // 2) % 2, 10), generator=g) for r in range(size)]
    plan = ContextParallelPlan(2)
    plan.setup(cp)
    t = batches[rank]
    x, y, n = plan.shard(t[:, :-1], t[:, 1:])
    part, mean = plan.loss(cp(x), y, n)
    part.backward()
    average_gradients(cp.parameters(), weight=n)
    leaders = torch.cat(batches[::2])
    loss = one.loss(leaders[:, :-1], leaders[:, 1:])
    loss.backward()
    own = batches[rank // 2 * 2]
    own_loss = one.loss(own[:, :-1], own[:, 1:]).item()
    out = {f"grad{i}": _max_err(a.grad, b.grad) for i, (a, b) in enumerate(zip(one.parameters(), cp.parameters()))}
    out["group_loss"] = abs(mean.item() - own_loss)
    return out


def _jvp_case(size):
    """Forward-mode tangents through the all-to-all: the tangent of the head shard is the
    head shard of the tangent (the exchange is linear)."""
    import torch.autograd.forward_ad as fwAD

    rank = dist.get_rank()
    x, t = torch.randn(2, 4, 3 + (rank == 0), 5, dtype=F64), torch.randn(2, 4, 3 + (rank == 0), 5, dtype=F64)
    lens = [4] + [3] * (size - 1)
    splits = [4 * (s + 1) // size - 4 * s // size for s in range(size)]
    with fwAD.dual_level():
        y = _seq_to_heads(fwAD.make_dual(x, t), 2, 1, lens, splits, rank, None)
        tangent = fwAD.unpack_dual(y).tangent
    return {"tangent": _max_err(_seq_to_heads(t, 2, 1, lens, splits, rank, None), tangent)}


def _errors_case(size):
    out = {}
    q = torch.randn(1, 4, 3, 8, dtype=F64)
    try:  # a block that is not rank r's share of seq_len
        context_parallel_attention(q, q, q, seq_len=3 * size + size)
        out["wrong_block"] = 1.0
    except ValueError:
        out["wrong_block"] = 0.0
    few = torch.randn(1, size - 1, 3, 8, dtype=F64)
    try:  # fewer heads than ranks
        context_parallel_attention(few, few, few, seq_len=3 * size)
        out["few_heads"] = 1.0
    except ValueError:
        out["few_heads"] = 0.0
    return out


def _worker(rank: int, size: int, port: int, path: str):
    torch.set_num_threads(1)  # P processes share the cores
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
    try:
        results = {name: _dense_case(name, size) for name in CASES}
        results.update({name: _varlen_case(name, size) for name in VARLEN_CASES})
        results["maml"] = _maml_case(size)
        results["jvp"] = _jvp_case(size)
        results["errors"] = _errors_case(size)
        results["gpt"] = _gpt_case(size)
        results["groups"] = _groups_case(size)
        torch.save(results, os.path.join(path, f"cp{size}-rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _warm_up():
    """First calls (attention's lazy set-up, forward-mode AD's) in the parent: the forked
    children inherit them instead of paying for them each."""
    import torch.autograd.forward_ad as fwAD

    x = torch.randn(1, 2, 3, 4, dtype=F64)
    _chain(lambda a, b, c: flash_attention(a, b, c, causal=True), x, x, x, x, [x, x, x])
    with fwAD.dual_level():
        dual = fwAD.make_dual(x, x)
        torch.cat([dual, dual], 2).movedim(1, 0).contiguous().unflatten(0, (1, 2))


@pytest.fixture(scope="module", params=[2, 4], ids=["P2", "P4"])
def results(request, tmp_path_factory):
    size = request.param
    path = str(tmp_path_factory.mktemp(f"cp{size}"))
    _warm_up()
    # fork: the children inherit the imported modules (spawn re-imports torch in each, ~4 s)
    mp.start_processes(_worker, args=(size, _free_port(), path), nprocs=size, start_method="fork")
    return size, [torch.load(os.path.join(path, f"cp{size}-rank{r}.pt")) for r in range(size)]


def _check(results, case):
    size, per_rank = results
    for rank, res in enumerate(per_rank):
        for name, err in res[case].items():
            assert err <= TOL, f"P={size} rank {rank} {case} {name}: {err:.3e}"


@pytest.mark.parametrize("case", list(CASES) + list(VARLEN_CASES))
def test_chain_equals_one_process(results, case):
    _check(results, case)


def test_maml_meta_gradient_equals_one_process(results):
    _check(results, "maml")


def test_forward_mode_tangent_through_all_to_all(results):
    _check(results, "jvp")


def test_bad_blocks_and_too_few_heads_raise(results):
    _check(results, "errors")


def test_gpt_context_parallel_equals_one_process(results):
    _check(results, "gpt")


def test_data_parallel_across_context_parallel_groups(results):
    _check(results, "groups")


# --------------------------------------------------------------------------- one process


def test_head_plan():
    assert head_plan(12, 12, 2) == (1, [6, 6], [6, 6])
    assert head_plan(8, 2, 4) == (2, [2, 2, 2, 2], [1, 1, 1, 1])  # kv heads repeated twice
    assert head_plan(4, 1, 2) == (2, [2, 2], [1, 1])
    assert head_plan(6, 3, 4) == (2, [1, 2, 1, 2], [1, 2, 1, 2])  # uneven: no even split exists
    with pytest.raises(ValueError, match="at least 4 query heads"):
        head_plan(2, 1, 4)


def test_block_bounds_cover_the_sequence():
    for n in (0, 1, 7, 13, 100):
        for p in (1, 2, 3, 4):
            b = [block_bounds(n, r, p) for r in range(p)]
            assert b[0][0] == 0 and b[-1][1] == n and all(b[i][1] == b[i + 1][0] for i in range(p - 1))
            assert max(e - s for s, e in b) - min(e - s for s, e in b) <= 1


def test_one_process_is_flash_attention():
    q = torch.randn(1, 2, 5, 4, dtype=F64)
    assert torch.equal(context_parallel_attention(q, q, q, causal=True), flash_attention(q, q, q, causal=True))


def test_gpt_context_parallel_needs_ttt_flash_attention():
    with pytest.raises(ValueError, match="attention='ttt_flash'"):
        GPT(GPTConfig.tiny(attention="math"), context_parallel=True)


def test_bench_context_parallel_on_cpu(tmp_path, capsys):
    """``ttt-flash bench --context-parallel 2`` on the CPU (gloo): checked, timed, speed-up."""
    import json

    from ttt_flash.bench import main as bench_main

    _warm_up()
    rc = bench_main(["--context-parallel", "2", "--device", "cpu", "--seq-lens", "33", "--heads", "2",
                     "--kv-heads", "1", "--head-dim", "8", "--dtype", "float64", "--causal", "--rep-ms", "1",
                     "--out", str(tmp_path)])
    assert rc == 0
    result = json.load(open(tmp_path / "bench_cp.json"))
    assert result["check"]["ok"] and result["config"]["processes"] == 2
    worst = max(v["context_parallel"] for k, v in result["check"].items() if k != "ok")
    assert worst <= 1e-12
    (row,) = result["rows"]
    assert row["N"] == 33 and row["ms_cp"] > 0 and row["ms_one"] > 0
    assert row["speedup"] == pytest.approx(row["ms_one"] / row["ms_cp"])
    assert "speed-up" in capsys.readouterr().out


def test_bench_context_parallel_refuses_too_few_heads():
    from ttt_flash.bench.cp import CPBenchConfig

    with pytest.raises(ValueError, match="at least as many heads"):
        CPBenchConfig(processes=4, heads=2, device="cpu")


# --------------------------------------------------------------------------- Lightning


class _RecordStep(Callback):
    """After the single step: this rank's gradients, Sophia-H Hessian estimates and loss."""

    def __init__(self, path: str):
        self.path = path

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        torch.manual_seed(1234)  # the Hutchinson probes (rank 0's, broadcast)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        params = dict(pl_module.named_parameters())
        opt = trainer.optimizers[0]
        out = {"grads": {n: p.grad.detach().clone() for n, p in params.items() if p.grad is not None},
               "hessian": {n: opt.state[p]["hessian"].clone() for n, p in params.items() if "hessian" in opt.state.get(p, {})},
               "loss": trainer.callback_metrics["train/loss"].item()}
        torch.save(out, os.path.join(self.path, f"rank{trainer.global_rank}-world{trainer.world_size}.pt"))


def _fit_lm(model, batches, path, devices):
    from lightning.pytorch import Trainer
    from torch.utils.data import DataLoader

    kw = dict(strategy="ddp_fork") if devices > 1 else {}
    if devices > 1:
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(_free_port())
    trainer = Trainer(accelerator="cpu", devices=devices, max_steps=1, precision="64-true", logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      num_sanity_val_steps=0, limit_val_batches=0, callbacks=[_RecordStep(path)],
                      default_root_dir=path, **kw)
    # batch_size=None: item r goes to rank r (DistributedSampler without shuffling)
    trainer.fit(model, train_dataloaders=DataLoader(batches, batch_size=None))
    return [torch.load(os.path.join(path, f"rank{r}-world{devices}.pt")) for r in range(devices)]


def test_lightning_context_parallel_sophia_step_equals_one_process(tmp_path):
    """LanguageModel(context_parallel=2) under DDP (2 processes = one context-parallel group):
    the step's gradients, Sophia-H Hessian estimate and loss equal one process on the group's
    batch (the first rank's; the second rank's batch is not used)."""
    from ttt_flash.lightning import LanguageModel

    torch.manual_seed(0)
    tokens = torch.randint(0, 256, (2, 2, 18), generator=torch.Generator().manual_seed(4))
    batches = [(t[:, :-1], t[:, 1:]) for t in tokens]  # 17 tokens: blocks of 8 and 9
    kw = dict(gpt=GPTConfig.tiny(n_layer=1, d_model=16, n_head=2, window=6), optimizer="sophiah",
              schedule="constant", weight_decay=0.0)
    model = LanguageModel(**kw, context_parallel=2)
    twin = LanguageModel(**kw)
    twin.load_state_dict(model.state_dict())
    dist_out = _fit_lm(model, batches, str(tmp_path), devices=2)
    (single,) = _fit_lm(twin, batches[:1], str(tmp_path), devices=1)
    assert single["grads"] and single["hessian"]
    for rank_out in dist_out:
        assert abs(rank_out["loss"] - single["loss"]) <= TOL
        for key in ("grads", "hessian"):
            assert rank_out[key].keys() == single[key].keys()
            for n, ref in single[key].items():
                err = _max_err(ref, rank_out[key][n])
                assert err <= TOL, f"{key} {n}: {err:.3e}"


def test_context_parallel_plan_needs_a_multiple_of_processes():
    from ttt_flash.lightning.context_parallel import ContextParallelPlan

    with pytest.raises(ValueError, match="context_parallel must be an int >= 1"):
        ContextParallelPlan(0)
    with pytest.raises(ValueError, match="needs a multiple of 2 processes"):
        ContextParallelPlan(2).setup(GPT(GPTConfig.tiny()))
