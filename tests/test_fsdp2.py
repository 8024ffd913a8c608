"""Second order under FSDP2 (ttt_flash.fsdp, docs/distributed.md): a GPT whose blocks are
sharded with ``fully_shard`` over 2 CPU processes (gloo, float64) gives the same
Hessian-vector product, Sophia-H refresh, Sophia-H run and second-order MAML meta-gradient
as one unsharded process on the concatenated batch, to 1e-10 (relative to the largest entry).

The shards' batches differ in size (2 and 1 sequences or tasks) where a weight is passed, so
a dropped weighting fails. One fork of 2 processes runs every case (module-scoped fixture);
the tests then assert per case. Unsupported combinations (FSDP1 wrappers, CPU offload, nested
blocks, an optimizer over other tensors) raise errors that name what to use instead.
"""

import copy
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from lightning.pytorch import Callback, Trainer

from ttt_flash import fsdp
from ttt_flash.second_order import hvp as one_process_hvp
from ttt_flash.meta import functional_loss, inner_loop
from ttt_flash.models import GPT, GPTConfig
from ttt_flash.second_order.optim import AdaHessian, SophiaH
from ttt_flash.tasks import MetaBatch

TOL = 1e-10
F64 = torch.float64
CFG = dict(vocab_size=32, n_layer=2, n_head=2, d_model=16, attention="ttt_flash")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _err(ref: torch.Tensor, got) -> float:
    from torch.distributed.tensor import DTensor

    if isinstance(got, DTensor):
        got = got.full_tensor()
    assert ref.shape == got.shape, (ref.shape, got.shape)
    return (ref - got).abs().max().item() / max(1.0, ref.abs().max().item())


def _models(seed: int = 0):
    """(one-process GPT, its copy sharded block by block and as a whole), float64."""
    torch.manual_seed(seed)
    one = GPT(GPTConfig(**CFG)).to(F64)
    return one, fsdp.shard_blocks(copy.deepcopy(one))


def _tokens(rows: int, n: int = 9, seed: int = 1):
    t = torch.randint(0, CFG["vocab_size"], (rows, n + 1), generator=torch.Generator().manual_seed(seed))
    return t[:, :-1], t[:, 1:]


def _rows(rank: int, sizes):
    start = sum(sizes[:rank])
    return slice(start, start + sizes[rank])


def _hvp_case(rank):
    """H v of the mean loss over 3 sequences (2 on rank 0, 1 on rank 1): vectors as DTensor
    shards, and as full tensors."""
    from torch.distributed.tensor import Shard, distribute_tensor

    one, model = _models()
    x, y = _tokens(3)
    mine = _rows(rank, [2, 1])
    params = [p for p in one.parameters()]
    gen = torch.Generator().manual_seed(2)
    vecs = [torch.randn(p.shape, dtype=F64, generator=gen) for p in params]
    ref = one_process_hvp(one.loss(x, y), params, vecs)
    sharded = [distribute_tensor(v, p.device_mesh, [Shard(0)]) for v, p in zip(vecs, model.parameters())]
    out = {}
    for how, v in (("dtensor-vecs", sharded), ("full-vecs", vecs)):
        got = fsdp.hvp(model, lambda: model.loss(x[mine], y[mine]), v, weight=x[mine].numel())
        out[how] = max(_err(r, g) for r, g in zip(ref, got))
    # the model is sharded again afterwards, and a plain FSDP2 forward still works
    out["resharded"] = float(not all(type(p).__name__ == "DTensor" for p in model.parameters()))
    out["plain-forward"] = abs(model.loss(x, y).item() - one.loss(x, y).item())
    # reshard_after_forward=False: a no-grad forward leaves the full weights in place
    kept = fsdp.shard_blocks(copy.deepcopy(one), reshard_after_forward=False)
    with torch.no_grad():
        kept.loss(x, y)
    got = fsdp.hvp(kept, lambda: kept.loss(x[mine], y[mine]), vecs, weight=x[mine].numel())
    out["after-no-grad-forward"] = max(_err(r, g) for r, g in zip(ref, got))
    return out


def _sophia_refresh_case(rank, make=lambda ps: SophiaH(ps, lr=0.05, weight_decay=0.1, k=1), key="hessian"):
    """One Sophia-H (AdaHessian) step with a refresh: gradients, Hessian estimates and the new
    weights."""
    one, model = _models()
    x, y = _tokens(3, seed=3)
    mine = _rows(rank, [2, 1])
    opt_one, opt = make(one.parameters()), make(model.parameters())
    one.loss(x, y).backward(create_graph=True)
    grads_one = [p.grad.detach().clone() for p in one.parameters()]
    opt_one.update_hessian(generator=torch.Generator().manual_seed(5))
    n = x[mine].numel()
    with fsdp.unsharded(model) as full:
        model.loss(x[mine], y[mine]).backward(create_graph=True)
        fsdp.update_hessian(opt, full, generator=torch.Generator().manual_seed(5), weight=n)
        full.reduce_gradients(weight=n)
    out = {
        "grad": max(_err(g, p.grad) for g, p in zip(grads_one, model.parameters())),
        "hessian": max(_err(opt_one.state[a][key], opt.state[b][key])
                       for a, b in zip(one.parameters(), model.parameters())),
    }
    opt_one.step()
    opt.step()
    out["weights"] = max(_err(a.detach(), b.detach()) for a, b in zip(one.parameters(), model.parameters()))
    return out


def _sophia_run_case(rank):
    """Four Sophia-H steps, refreshing at steps 0 and 2 (unsharded block) and plain FSDP2
    steps between: losses and final weights. Equal shards (FSDP2's own reduction is a plain
    mean)."""
    one, model = _models(seed=4)
    opt_one = SophiaH(one.parameters(), lr=0.02, k=2)
    opt = SophiaH(model.parameters(), lr=0.02, k=2)
    gen_one, gen = torch.Generator().manual_seed(6), torch.Generator().manual_seed(6)
    losses = []
    for step in range(4):
        x, y = _tokens(4, seed=10 + step)
        mine = _rows(rank, [2, 2])
        opt_one.zero_grad()
        loss_one = one.loss(x, y)
        loss_one.backward(create_graph=opt_one.hessian_due)
        if opt_one.hessian_due:
            opt_one.update_hessian(generator=gen_one)
        opt_one.step()
        opt.zero_grad()
        if opt.hessian_due:
            with fsdp.unsharded(model) as full:
                loss = model.loss(x[mine], y[mine])
                loss.backward(create_graph=True)
                fsdp.update_hessian(opt, full, generator=gen)
                full.reduce_gradients()
        else:
            loss = model.loss(x[mine], y[mine])
            loss.backward()  # FSDP2's own reduce-scatter
        opt.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(abs(mean.item() / 2 - loss_one.item()))
    return {"loss": max(losses),
            "weights": max(_err(a.detach(), b.detach()) for a, b in zip(one.parameters(), model.parameters()))}


def _ce(logits, target):
    return F.cross_entropy(logits.flatten(0, -2), target.flatten())


def _maml_case(rank):
    """Second-order MAML (2 inner SGD steps) over 3 tasks (2 on rank 0, 1 on rank 1): the
    meta-gradient of every parameter."""
    one, model = _models(seed=7)
    tasks = [(_tokens(2, n=7, seed=20 + t), _tokens(2, n=7, seed=40 + t)) for t in range(3)]
    for support, query in tasks:
        fast = inner_loop(one, None, _ce, support, steps=2, lr=0.3)
        (functional_loss(one, fast, _ce, query) / len(tasks)).backward()
    mine = tasks[_rows(rank, [2, 1])]
    with fsdp.unsharded(model) as full:
        for support, query in mine:
            fast = inner_loop(model, full.params, _ce, support, steps=2, lr=0.3)
            (functional_loss(model, fast, _ce, query) / len(mine)).backward()
        full.reduce_gradients(weight=len(mine))
    return {"meta-grad": max(_err(a.grad, b.grad) for a, b in zip(one.parameters(), model.parameters())),
            "reached": float(not all(b.grad is not None for b in model.parameters()))}


def _raises(fn, exc, *words) -> float:
    """0 if ``fn()`` raises ``exc`` whose message holds every word, else 1."""
    try:
        fn()
    except exc as e:
        return 0.0 if all(w in str(e) for w in words) else 1.0
    return 1.0


def _errors_case(rank):
    from torch.distributed.fsdp import CPUOffloadPolicy, FullyShardedDataParallel, fully_shard

    one, model = _models()
    out = {}
    fsdp1 = FullyShardedDataParallel(copy.deepcopy(one), device_id=torch.device("cpu"), use_orig_params=True)
    out["fsdp1"] = _raises(lambda: fsdp.unsharded(fsdp1).__enter__(), TypeError, "FSDP1", "fully_shard", "DDP")
    offload = copy.deepcopy(one)
    fully_shard(offload, offload_policy=CPUOffloadPolicy(pin_memory=False))
    out["cpu-offload"] = _raises(lambda: fsdp.unsharded(offload).__enter__(), ValueError, "CPU offload",
                                 "offload_policy")
    out["not-sharded"] = _raises(lambda: fsdp.unsharded(one).__enter__(), ValueError, "fully_shard")

    def nested():
        with fsdp.unsharded(model):
            with fsdp.unsharded(model):
                pass

    out["nested"] = _raises(nested, RuntimeError, "do not nest")
    out["resharded-after-error"] = float(not all(type(p).__name__ == "DTensor" for p in model.parameters()))
    opt = SophiaH(one.parameters())

    def foreign():
        with fsdp.unsharded(model) as full:
            model.loss(*_tokens(1)).backward(create_graph=True)
            fsdp.update_hessian(opt, full)

    out["foreign-optimizer"] = _raises(foreign, ValueError, "not the sharded model's")
    opt2 = SophiaH(model.parameters())

    def no_graph():
        with fsdp.unsharded(model) as full:
            model.loss(*_tokens(1)).backward()
            fsdp.update_hessian(opt2, full)

    out["no-graph"] = _raises(no_graph, ValueError, "create_graph=True")

    # the Lightning modules' configure_model under the fsdp2 strategy's mesh
    from torch.distributed.device_mesh import init_device_mesh

    from ttt_flash.lightning import MAML, LanguageModel
    from ttt_flash.models import NetConfig

    dp = init_device_mesh("cpu", (2, 1), mesh_dim_names=("data_parallel", "tensor_parallel"))
    tp = init_device_mesh("cpu", (1, 2), mesh_dim_names=("data_parallel", "tensor_parallel"))
    net = NetConfig(kind="gpt", in_dim=5, d_model=16, n_heads=2, n_layers=1)
    for name, module, mesh, exc, words in (
        ("maml-meta-sgd", MAML(net=net, meta_sgd=True), dp, ValueError, ("meta_sgd", "strategy=ddp")),
        ("maml-imaml", MAML(net=net, algorithm="imaml"), dp, ValueError, ("imaml", "strategy=ddp")),
        ("lm-fwd-rev", LanguageModel(GPTConfig(**CFG), hessian_mode="fwd_rev"), dp, ValueError, ("rev_rev",)),
        ("tensor-parallel", LanguageModel(GPTConfig(**CFG)), tp, ValueError, ("tensor_parallel_size", "fsdp2")),
    ):
        module._device_mesh = mesh
        out[name] = _raises(module.configure_model, exc, *words)
    return out


def _adahessian_refresh_case(rank):
    return _sophia_refresh_case(rank, lambda ps: AdaHessian(ps, lr=0.05, k=1), "exp_hessian_diag_sq")


CASES = {"hvp": _hvp_case, "sophia-refresh": _sophia_refresh_case, "adahessian-refresh": _adahessian_refresh_case,
         "sophia-run": _sophia_run_case,
         "maml": _maml_case, "errors": _errors_case}


def _worker(rank, size, port, path):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=size)
    try:
        results = {}
        for name, case in CASES.items():
            results[name] = case(rank)
            dist.barrier()
        torch.save(results, os.path.join(path, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("fsdp2"))
    one, _ = GPT(GPTConfig(**CFG)).to(F64), None
    one.loss(*_tokens(1)).backward(create_graph=True)  # attention's first call in the parent
    mp.start_processes(_worker, args=(2, _free_port(), path), nprocs=2, start_method="fork")
    return [torch.load(os.path.join(path, f"rank{r}.pt")) for r in range(2)]


def _check(results, case, tol=TOL):
    for rank, res in enumerate(results):
        for name, err in res[case].items():
            assert err <= tol, f"rank {rank} {case} {name}: {err:.3e}"


def test_hvp_equals_one_process(results):
    _check(results, "hvp")


def test_sophia_refresh_equals_one_process(results):
    _check(results, "sophia-refresh")


def test_adahessian_refresh_equals_one_process(results):
    _check(results, "adahessian-refresh")


def test_sophia_run_equals_one_process(results):
    _check(results, "sophia-run")


def test_maml_meta_gradient_equals_one_process(results):
    _check(results, "maml")


def test_unsupported_combinations_raise(results):
    _check(results, "errors", tol=0.0)


# --------------------------------------------------------------------------- Lightning


class _Record(Callback):
    """Each step's logged (local) loss; at the end the full weights (all-gathered)."""

    def __init__(self, path: str, key: str):
        self.path, self.key, self.losses = path, key, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.losses.append(float(loss))

    def on_train_end(self, trainer, pl_module):
        from torch.distributed.tensor import DTensor

        weights = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
                   for n, p in pl_module.named_parameters()}
        out = {"losses": self.losses, "weights": weights,
               "sharded": all(isinstance(p, DTensor) for p in pl_module.parameters())}
        torch.save(out, os.path.join(self.path, f"{self.key}-rank{trainer.global_rank}-world{trainer.world_size}.pt"))


class _PerRank(torch.utils.data.IterableDataset):
    """Step s yields rank r's batch ``steps[s][r]`` under torch.distributed, else the
    concatenation of the step's batches (no sampler decides who gets what)."""

    def __init__(self, steps):
        self.steps = steps

    def __iter__(self):
        for pair in self.steps:
            yield pair[dist.get_rank()] if dist.is_initialized() else _cat(pair)


def _fit(model, steps, path, devices: int, key: str, clip=None):
    from torch.utils.data import DataLoader

    from ttt_flash.lightning.fsdp2 import FSDP2Strategy

    kw = dict(strategy=FSDP2Strategy(start_method="fork")) if devices > 1 else {}
    if devices > 1:
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(_free_port())
    # the model is float64 already ("32-true" leaves it so; ModelParallelStrategy refuses "64-true")
    trainer = Trainer(accelerator="cpu", devices=devices, max_steps=len(steps), precision="32-true", logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      num_sanity_val_steps=0, limit_val_batches=0, callbacks=[_Record(path, key)],
                      default_root_dir=path, gradient_clip_val=clip, **kw)
    trainer.fit(model, train_dataloaders=DataLoader(_PerRank(steps), batch_size=None))
    return [torch.load(os.path.join(path, f"{key}-rank{r}-world{devices}.pt")) for r in range(devices)]


def _cat(batches):
    fields = [None if xs[0] is None else torch.cat(xs) for xs in zip(*batches)]
    return type(batches[0])(*fields) if hasattr(batches[0], "_fields") else type(batches[0])(fields)


def _compare_runs(model, steps, path, key, clip=None):
    """``steps[s]`` = (rank 0's batch, rank 1's batch) of step s: 2 processes under the fsdp2
    strategy against one process on the concatenated batches."""
    twin = copy.deepcopy(model)
    sharded = _fit(model, steps, path, 2, key, clip)
    (one,) = _fit(twin, steps, path, 1, key, clip)
    for rank, out in enumerate(sharded):
        assert out["sharded"], "the model was not sharded"
        assert out["weights"].keys() == one["weights"].keys()
        for n, ref in one["weights"].items():
            assert _err(ref, out["weights"][n]) <= TOL, f"rank {rank} {n}"
    assert len(one["losses"]) == len(steps)
    for s, ref in enumerate(one["losses"]):  # the mean of the ranks' losses (equal shards)
        assert abs((sharded[0]["losses"][s] + sharded[1]["losses"][s]) / 2 - ref) <= TOL, f"step {s}"
    return one


def test_lightning_sophia_under_fsdp2_equals_one_process(tmp_path):
    """LanguageModel with Sophia-H under --trainer.strategy=fsdp2 (2 CPU processes): 3 steps,
    Hessian refreshes at steps 0 and 2 through the full parameters, plain FSDP2 step between,
    gradient clipping on the sharded gradients: losses and weights equal one process."""
    from ttt_flash.lightning import LanguageModel

    torch.manual_seed(0)
    model = LanguageModel(GPTConfig(**CFG), optimizer="sophiah", lr=0.02, hessian_every=2,
                          schedule="constant").to(F64)
    steps = [(_tokens(2, seed=60 + 2 * s), _tokens(2, seed=61 + 2 * s)) for s in range(3)]
    _compare_runs(model, steps, str(tmp_path), "lm", clip=0.5)


def test_lightning_maml_under_fsdp2_equals_one_process(tmp_path):
    """MAML (second order, 2 inner steps) through a GPT regressor whose blocks are sharded,
    under --trainer.strategy=fsdp2: 2 meta-updates of 2 + 2 tasks equal one process on 4."""
    from ttt_flash.lightning import MAML
    from ttt_flash.models import NetConfig
    from ttt_flash.tasks import InContextRegressionTasks

    torch.manual_seed(0)
    model = MAML(net=NetConfig(kind="gpt", in_dim=5, d_model=16, n_heads=2, n_layers=2), inner_steps=2,
                 inner_lr=0.05, loss="incontext_mse", grad_clip=1.0).to(F64)
    g = torch.Generator().manual_seed(3)
    tasks = InContextRegressionTasks(dim=3, seq_len=8, support_size=2, query_size=2)
    steps = [tuple(MetaBatch(*(None if t is None else t.to(F64) for t in tasks.sample(2, generator=g)))
                   for _ in range(2)) for _ in range(2)]
    _compare_runs(model, steps, str(tmp_path), "maml")
