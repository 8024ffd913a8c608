"""Data parallelism for second-order training (ttt_flash.distributed, docs/distributed.md).

Each test runs one training step of a Lightning module under ``Trainer(strategy="ddp_spawn",
accelerator="cpu", devices=2)`` (gloo, float64) on two shards of a global batch of *unequal*
sizes, and the same step in one process on the whole global batch; the averaged gradients
(MAML meta-gradients, gradient-written memory's outer gradients) and the Hutchinson
Hessian-diagonal estimate (same probes) must agree to 1e-10. Only localhost traffic.
"""

import copy
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from lightning.pytorch import Callback, Trainer
from torch.utils.data import DataLoader

from ttt_flash.distributed import all_reduce_mean_, average_gradients, is_distributed, world_size
from ttt_flash.lightning import MAML, GradMemKV, LanguageModel
from ttt_flash.memory import GradMem
from ttt_flash.models import NetConfig
from ttt_flash.models import GPTConfig
from ttt_flash.tasks import AssociativeRecallTasks, SinusoidTasks

pytestmark = pytest.mark.slow  # each test starts two processes (README: the slow tests)

TOL = 1e-10


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Record(Callback):
    """After the (single) step: save this rank's gradients and Hessian estimates."""

    def __init__(self, path: str, probe_seed: int = 1234):
        self.path, self.probe_seed = path, probe_seed

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        # The Hutchinson probes come from the global RNG (rank 0's, broadcast): the same
        # seed in both runs gives the same probes.
        torch.manual_seed(self.probe_seed)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        params = dict(pl_module.named_parameters())
        out = {"grads": {n: p.grad.detach().clone() for n, p in params.items() if p.grad is not None},
               "hessian": {}}
        for opt in trainer.optimizers:
            for n, p in params.items():
                if "hessian" in opt.state.get(p, {}):
                    out["hessian"][n] = opt.state[p]["hessian"].clone()
        torch.save(out, os.path.join(self.path, f"rank{trainer.global_rank}-world{trainer.world_size}.pt"))


def _fit(model, batches, tmp_path, devices: int, steps: int = 1):
    kw = dict(strategy="ddp_spawn") if devices > 1 else {}
    if devices > 1:
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(_free_port())
    trainer = Trainer(accelerator="cpu", devices=devices, max_steps=steps, precision="64-true", logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      num_sanity_val_steps=0, limit_val_batches=0, callbacks=[_Record(str(tmp_path))],
                      default_root_dir=str(tmp_path), **kw)
    # batch_size=None: each item is a whole batch; under DDP Lightning's DistributedSampler
    # (shuffle off) gives item r to rank r.
    trainer.fit(model, train_dataloaders=DataLoader(batches, batch_size=None))
    return [torch.load(os.path.join(tmp_path, f"rank{r}-world{devices}.pt")) for r in range(devices)]


def _cat(batches):
    fields = [None if xs[0] is None else torch.cat(xs) for xs in zip(*batches)]
    return type(batches[0])(*fields) if hasattr(batches[0], "_fields") else type(batches[0])(fields)


def _compare(model, shards, tmp_path):
    """One step on the shards over 2 processes vs one step on their concatenation."""
    twin = copy.deepcopy(model)
    dist_out = _fit(model, shards, tmp_path, devices=2)
    single = _fit(twin, [_cat(shards)], tmp_path, devices=1)[0]
    assert single["grads"], "no gradient recorded"
    for rank_out in dist_out:  # every rank holds the global-batch result
        for key in ("grads", "hessian"):
            assert rank_out[key].keys() == single[key].keys()
            for n, ref in single[key].items():
                err = (rank_out[key][n] - ref).abs().max().item()
                assert err <= TOL * max(1.0, ref.abs().max().item()), f"{key} {n}: {err}"
    return single, dist_out


def test_maml_second_order_meta_gradient_ddp_equals_one_process(tmp_path):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    tasks = SinusoidTasks(k_shot=5, k_query=5)
    shards = [tasks.sample(1, generator=g), tasks.sample(3, generator=g)]  # unequal shares: 1 and 3 tasks
    model = MAML(net=NetConfig(kind="mlp", hidden=8, depth=1), inner_steps=2, inner_lr=0.05)
    single, _ = _compare(model, shards, tmp_path)
    assert all(v.abs().max() > 0 for v in single["grads"].values())


def test_maml_second_step_under_ddp_equals_one_process(tmp_path):
    """Two steps: the second step's meta-gradients (after one averaged Adam update) still
    equal one process's. Lightning re-enables DDP's gradient sync after every manual-
    optimization forward; MAML must switch it off again at each step (else DDP's reducer
    runs on the inner loop's backward and fails or double-reduces)."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(2)
    tasks = SinusoidTasks(k_shot=5, k_query=5)
    a0, a1, b0, b1 = (tasks.sample(n, generator=g) for n in (1, 3, 3, 1))  # unequal shares each step
    model = MAML(net=NetConfig(kind="mlp", hidden=8, depth=1), inner_steps=2, inner_lr=0.05)
    twin = copy.deepcopy(model)
    # DistributedSampler without shuffling: rank r gets items r, r + 2, ...
    dist_out = _fit(model, [a0, a1, b0, b1], tmp_path, devices=2, steps=2)
    single = _fit(twin, [_cat([a0, a1]), _cat([b0, b1])], tmp_path, devices=1, steps=2)[0]
    for rank_out in dist_out:
        for n, ref in single["grads"].items():
            err = (rank_out["grads"][n] - ref).abs().max().item()
            assert err <= TOL * max(1.0, ref.abs().max().item()), f"{n}: {err}"


def test_gradmem_meta_gradient_ddp_equals_one_process(tmp_path):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    tasks = AssociativeRecallTasks(num_keys=8, num_values=8, num_pairs=3)
    shards = [tasks.sample(2, generator=g), tasks.sample(3, generator=g)]  # 2 and 3 sequences
    model = GradMemKV(GradMem(GPTConfig(vocab_size=17, n_layer=1, n_head=2, d_model=16), memory_tokens=2,
                              inner_steps=1), warmup_steps=0)
    _compare(model, shards, tmp_path)


def test_sophia_hessian_estimate_ddp_equals_one_process(tmp_path):
    torch.manual_seed(0)
    x = torch.randint(0, 256, (4, 17))
    shards = [(x[:1, :-1], x[:1, 1:]), (x[1:, :-1], x[1:, 1:])]  # 1 and 3 sequences
    model = LanguageModel(GPTConfig.tiny(n_layer=1, d_model=16, n_head=2), optimizer="sophiah",
                          schedule="constant", weight_decay=0.0)
    single, _ = _compare(model, shards, tmp_path)
    assert single["hessian"] and all(v.abs().max() > 0 for v in single["hessian"].values())


class _RecordTasks(Callback):
    def __init__(self, path: str):
        self.path, self.seen = path, []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.seen.append(batch.task_params.clone())

    def on_train_epoch_end(self, trainer, pl_module):
        torch.save(self.seen, os.path.join(self.path, f"tasks{trainer.global_rank}.pt"))


def test_datamodule_gives_each_process_distinct_meta_batches(tmp_path):
    from ttt_flash.lightning import SinusoidDataModule
    from ttt_flash.lightning.data import SeededBatches

    dm = SinusoidDataModule(meta_batch_size=2, train_batches=4, val_batches=1, test_batches=1)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(_free_port())
    trainer = Trainer(accelerator="cpu", devices=2, strategy="ddp_spawn", max_epochs=1, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      limit_val_batches=0, num_sanity_val_steps=0, callbacks=[_RecordTasks(str(tmp_path))])
    trainer.fit(MAML(net=NetConfig(kind="mlp", hidden=8, depth=1)), dm)
    seen = [torch.load(os.path.join(tmp_path, f"tasks{r}.pt")) for r in range(2)]
    assert [len(s) for s in seen] == [2, 2]
    epoch = [SeededBatches(dm.tasks, 2, 0, "train")[i].task_params for i in range(4)]
    index = [[next(i for i, e in enumerate(epoch) if torch.equal(e, t)) for t in s] for s in seen]
    assert sorted(index[0] + index[1]) == [0, 1, 2, 3]


# --------------------------------------------------------------------------- the helpers alone


def _helpers_worker(rank: int, port: int, path: str):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        assert world_size() == 2 and is_distributed()
        t = torch.full((3,), float(rank + 1), dtype=torch.float64)  # rank 0: 1, rank 1: 2
        all_reduce_mean_([t], weight=1 + 2 * rank)  # weights 1 and 3: (1 + 6) / 4
        p = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))
        if rank == 1:
            p.grad = torch.ones(2, dtype=torch.float64)  # rank 0 has none: counts as zero
        average_gradients([p])
        torch.save({"t": t, "g": p.grad}, os.path.join(path, f"helpers{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_helpers_weighted_mean_over_two_processes(tmp_path):
    mp.spawn(_helpers_worker, args=(_free_port(), str(tmp_path)), nprocs=2)
    for r in range(2):
        out = torch.load(os.path.join(tmp_path, f"helpers{r}.pt"))
        assert torch.equal(out["t"], torch.full((3,), 7 / 4, dtype=torch.float64))
        assert torch.equal(out["g"], torch.full((2,), 0.5, dtype=torch.float64))


def test_helpers_are_no_ops_in_one_process():
    assert world_size() == 1 and not is_distributed()
    t = torch.ones(3)
    assert all_reduce_mean_([t], weight=5)[0] is t and torch.equal(t, torch.ones(3))
