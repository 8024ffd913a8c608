"""Context parallelism of the memory models (ttt_flash.memory, docs/distributed.md): GradMem and
FastWeightTTT over 2 processes (gloo, float64) equal one process over the whole sequence to
1e-10: the inner (write) losses, the written memory, the query logits, the outer loss and the
outer (meta) gradient of every parameter, second order through the inner steps.

Every rank passes the whole context and query; the written sequence is cut across the ranks
(lengths not divisible by 2, memory tokens on one rank or on both). The outer loss is the same
on every rank, and the mean over the ranks of their parameter-gradient shares is its gradient.
One forked group of 2 runs every case (module-scoped fixture); the tests then assert per case.
A Lightning step of ``GradMemKV(context_parallel=2)`` under DDP is checked against one process.
"""

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from lightning.pytorch import Callback

from ttt_flash.distributed import all_reduce_sum
from ttt_flash.memory import FastWeightTTT, GradientMemoryAttention, GradMem, MemoryLM
from ttt_flash.models import GPT, GPTConfig
from ttt_flash.tasks import RecallBatch

TOL = 1e-10
F64 = torch.float64
SIZE = 2
VOCAB = 17

# name: (memory tokens, context length, inner steps, first order); the written sequence
# [memory; context] has m + L tokens, cut 7 | 8, 4 | 5 (memory on both ranks) and 5 | 6.
GRADMEM_CASES = {
    "gradmem-2steps-15tokens": (3, 12, 2, False),
    "gradmem-memory-on-both-ranks": (5, 4, 1, False),
    "gradmem-first-order": (2, 9, 1, True),
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _max_err(ref: torch.Tensor, got: torch.Tensor) -> float:
    assert ref.shape == got.shape, (ref.shape, got.shape)
    return (ref - got).abs().max().item() / max(1.0, ref.abs().max().item()) if ref.numel() else 0.0


def _data(length: int, queries: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    context = torch.randint(0, VOCAB, (2, length), generator=g)
    targets = context.roll(-1, 1).clone()
    targets[0, ::3] = -100  # unscored positions: the per-sequence counts differ
    query = torch.randint(0, VOCAB, (2, queries), generator=g)
    query_targets = torch.randint(0, VOCAB, (2, queries), generator=g)
    return context, targets, query, query_targets


def _outer(net, run, query_targets, cp: bool):
    """Inner losses, written state, query logits, outer loss and outer gradients (the mean of
    the ranks' shares under context parallelism)."""
    params = [p for p in net.parameters() if p.requires_grad]
    losses, state, logits = run()
    loss = F.cross_entropy(logits.flatten(0, 1), query_targets.flatten())
    grads = torch.autograd.grad(loss, params)
    if cp:
        grads = [all_reduce_sum(g) / SIZE for g in grads]
    assert all(g.abs().max() > 0 for g in grads)
    return torch.stack(losses), state.detach(), logits.detach(), loss.detach(), grads


def _compare(ref, got) -> dict:
    out = {name: _max_err(a, b) for name, a, b in zip(("inner_losses", "state", "logits", "loss"), ref[:4], got[:4])}
    out.update({f"grad{i}": _max_err(a, b) for i, (a, b) in enumerate(zip(ref[4], got[4]))})
    return out


def _gradmem_case(name):
    m, length, steps, first_order = GRADMEM_CASES[name]
    cfg = GPTConfig.tiny(n_layer=2, d_model=16, n_head=2, vocab_size=VOCAB, checkpoint=True)
    torch.manual_seed(0)
    one = GradMem(GPT(cfg), memory_tokens=m, inner_steps=steps, inner_lr=0.5, first_order=first_order).double()
    cp = GradMem(GPT(cfg), memory_tokens=m, inner_steps=steps, inner_lr=0.5, first_order=first_order).double()
    cp.load_state_dict(one.state_dict())
    cp.set_context_parallel(True)
    context, targets, query, query_targets = _data(length, 3, seed=m + length)

    def run(net):
        def go():
            memory, losses = net.write(context, targets)
            return losses, memory, net.read(memory, query)
        return go

    return _compare(_outer(one, run(one), query_targets, False), _outer(cp, run(cp), query_targets, True))


def _fast_weight_case():
    """Chunks of 5 with a window of 3 over 13 context tokens: chunk sequences of 5, 7 and 5
    tokens (2 overlap tokens recomputed), each cut across the 2 ranks."""
    cfg = GPTConfig.tiny(n_layer=2, d_model=16, n_head=2, vocab_size=VOCAB, window=3, checkpoint=True)
    torch.manual_seed(1)
    one = FastWeightTTT(GPT(cfg), fast_layers=[-1], chunk_size=5, inner_lr=0.5).double()
    cp = FastWeightTTT(GPT(cfg), fast_layers=[-1], chunk_size=5, inner_lr=0.5).double()
    cp.load_state_dict(one.state_dict())
    cp.set_context_parallel(True)
    context, targets, query, query_targets = _data(13, 3, seed=5)

    def run(net):
        def go():
            fast, losses = net.adapt(context, targets)
            return losses, torch.cat([w.flatten() for w in fast.values()]), net.predict(fast, context, query)
        return go

    return _compare(_outer(one, run(one), query_targets, False), _outer(cp, run(cp), query_targets, True))


def _worker(rank: int, port: int, path: str):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=SIZE)
    try:
        results = {name: _gradmem_case(name) for name in GRADMEM_CASES}
        results["fast-weight"] = _fast_weight_case()
        torch.save(results, os.path.join(path, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("cp_memory"))
    x = torch.randn(1, 2, 3, 4, dtype=F64)  # attention's lazy set-up, inherited by the children
    GPT(GPTConfig.tiny(n_layer=1, d_model=16, n_head=2, vocab_size=VOCAB)).double()(torch.zeros(1, 3, dtype=torch.long))
    del x
    mp.start_processes(_worker, args=(_free_port(), path), nprocs=SIZE, start_method="fork")
    return [torch.load(os.path.join(path, f"rank{r}.pt")) for r in range(SIZE)]


def _check(results, case):
    for rank, res in enumerate(results):
        for name, err in res[case].items():
            assert err <= TOL, f"rank {rank} {case} {name}: {err:.3e}"


@pytest.mark.parametrize("case", list(GRADMEM_CASES))
def test_gradmem_context_parallel_equals_one_process(results, case):
    _check(results, case)


def test_fast_weight_ttt_context_parallel_equals_one_process(results):
    _check(results, "fast-weight")


# --------------------------------------------------------------------------- Lightning


class _RecordStep(Callback):
    def __init__(self, path: str):
        self.path = path

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        out = {"grads": {n: p.grad.detach().clone() for n, p in pl_module.named_parameters() if p.grad is not None},
               "loss": trainer.callback_metrics["train/loss_post"].item(),
               "inner": trainer.callback_metrics["train/inner_loss"].item(),
               "context_parallel": pl_module.net.model.context_parallel}
        torch.save(out, os.path.join(self.path, f"rank{trainer.global_rank}-world{trainer.world_size}.pt"))


def _fit(model, batches, path, devices):
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


def test_lightning_gradmem_context_parallel_step_equals_one_process(tmp_path):
    """GradMemKV(context_parallel=2) under DDP (2 processes, one group): the step's gradients
    (after the explicit averaging), outer loss and inner loss equal one process on the group's
    batch (the first rank's; the second rank's is not used)."""
    from ttt_flash.lightning import GradMemKV

    batches = []
    for seed in (1, 2):  # 2 + 11 = 13 written tokens: blocks of 6 and 7
        context, targets, query, query_targets = _data(11, 2, seed)
        batches.append(RecallBatch(context, targets, query, query_targets))
    config = GPTConfig(vocab_size=VOCAB, n_layer=1, n_head=2, d_model=16, checkpoint=True)
    torch.manual_seed(0)
    model = GradMemKV(GradMem(config, memory_tokens=2, inner_steps=1), warmup_steps=0, context_parallel=2)
    twin = GradMemKV(GradMem(config, memory_tokens=2, inner_steps=1), warmup_steps=0)
    twin.load_state_dict(model.state_dict())
    dist_out = _fit(model, batches, str(tmp_path), devices=2)
    (single,) = _fit(twin, batches[:1], str(tmp_path), devices=1)
    assert single["grads"] and not single["context_parallel"]
    for rank_out in dist_out:
        assert rank_out["context_parallel"]  # the GPT was switched (not two whole copies)
        assert abs(rank_out["loss"] - single["loss"]) <= TOL
        assert abs(rank_out["inner"] - single["inner"]) <= TOL
        assert rank_out["grads"].keys() == single["grads"].keys()
        for n, ref in single["grads"].items():
            err = _max_err(ref, rank_out["grads"][n])
            assert err <= TOL, f"grad {n}: {err:.3e}"


# --------------------------------------------------------------------------- errors (one process)


def test_memory_layer_refuses_context_parallel():
    from ttt_flash.lightning import MemoryLayerMQAR

    with pytest.raises(ValueError, match="MemoryLayerMQAR does not take context_parallel=2"):
        MemoryLayerMQAR(MemoryLM(17), context_parallel=2)


def test_gpt_with_a_memory_layer_refuses_context_parallel():
    model = GPT(GPTConfig.tiny(n_layer=1, d_model=16, n_head=2))
    model.blocks[0].attn = GradientMemoryAttention(16, 2, memory_slots=2, chunk_size=4)
    with pytest.raises(ValueError, match="block 0 has GradientMemoryAttention"):
        model.set_context_parallel(True)


def test_gradmem_context_parallel_needs_a_multiple_of_processes():
    from ttt_flash.lightning import GradMemKV

    with pytest.raises(ValueError, match="needs a multiple of 2 processes"):
        GradMemKV(GradMem(GPTConfig(vocab_size=17, n_layer=1, n_head=2, d_model=16)), context_parallel=2).setup("fit")
