"""CUDA-graph capture of second-order steps (ttt_flash.cuda_graph, docs/cuda-graphs.md).

On the CPU: the API, its errors and the eager fallback of the Lightning option. On a GPU
(``-m gpu``): capture, replay with new data bitwise equal to eager, the chain free of host
synchronisations for every variant, recapture on a new shape, a MAML meta-step and a graphed
MAML run equal to eager.
"""

import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from ttt_flash import flash_attention, flash_attention_varlen
from ttt_flash.bench.common import attention_chain
from ttt_flash.cuda_graph import (
    CapturedStep,
    GraphCaptureError,
    StepGraphs,
    check_graphable,
    graph_safe_generator,
    shape_key,
)
from ttt_flash.cuda_graph import _check_optimizer, _explain

cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without CUDA")


# --------------------------------------------------------------------------- CPU: API and errors


@cpu_only
def test_captured_step_on_cpu_raises_naming_cuda():
    with pytest.raises(GraphCaptureError, match=r"CapturedStep|step: CUDA graphs need an NVIDIA GPU"):
        CapturedStep(lambda x: x * 2, (torch.ones(3),))


@cpu_only
def test_graph_safe_generator_on_cpu_raises():
    with pytest.raises(GraphCaptureError, match="CUDA graphs need an NVIDIA GPU"):
        graph_safe_generator()


def test_bad_arguments_are_named():
    with pytest.raises(TypeError, match="fn must be callable"):
        CapturedStep(3, (torch.ones(1),))
    with pytest.raises(ValueError, match="warmup must be an int >= 2"):
        CapturedStep(lambda x: x, (torch.ones(1),), warmup=1)
    with pytest.raises(TypeError, match="example_inputs must be a tuple or list"):
        CapturedStep(lambda x: x, torch.ones(1))
    with pytest.raises(ValueError, match="max_graphs must be an int >= 1"):
        StepGraphs(lambda x: x, max_graphs=0)


def test_check_graphable_names_the_cpu_tensor():
    if torch.cuda.is_available():
        check_graphable([("input 0", torch.ones(2, device="cuda"))])
    with pytest.raises(GraphCaptureError, match=r"input 1 is a cpu tensor \(shape \(2, 3\)\).*\.cuda\(\)"):
        check_graphable([("input 0", None), ("input 1", torch.ones(2, 3))], "mystep")


def test_shape_key_separates_shapes_and_dtypes():
    a, b = torch.ones(2, 3), torch.ones(2, 4)
    assert shape_key((a, None)) == shape_key((torch.zeros(2, 3), None))
    assert shape_key((a,)) != shape_key((b,))
    assert shape_key((a,)) != shape_key((a.double(),))
    assert shape_key((a, 1)) != shape_key((a, 2))


def test_non_capturable_optimizer_is_named():
    w = torch.nn.Parameter(torch.ones(2))
    with pytest.raises(GraphCaptureError, match=r"optimizer Adam \(param group 0\) is not capturable: .*capturable=True"):
        _check_optimizer(torch.optim.Adam([w]), "step")
    _check_optimizer(torch.optim.Adam([w], capturable=True), "step")


def _synchronising_step(x):
    raise RuntimeError("Synchronizing operation: called a synchronizing CUDA operation")  # the line named


def test_capture_errors_name_the_operation_and_line():
    try:
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing")
    except RuntimeError as e:
        err = _explain(e, "mystep", "capture")
    text = str(err)
    assert text.startswith("mystep: capture failed at ")
    assert "test_cuda_graph.py" in text and "host synchronisation" in text
    try:
        _synchronising_step(torch.ones(2))
    except RuntimeError as e:
        err = _explain(e, "mystep", "warm-up")
    assert "_synchronising_step" in str(err) and "raise RuntimeError" in str(err)
    assert "host synchronisation" in str(err)
    try:
        raise RuntimeError("Expected all tensors to be on the same device, but found cuda:0 and cpu")
    except RuntimeError as e:
        assert "a CPU tensor" in str(_explain(e, "s", "capture"))
    try:
        raise RuntimeError("Attempt to use generator during capture without registering it")
    except RuntimeError as e:
        assert "generators=[...]" in str(_explain(e, "s", "capture"))


@cpu_only
def test_step_graphs_without_cuda_falls_back_once_with_one_warning():
    calls = []

    def step(x):
        calls.append(x.shape)
        return x * 2

    graphs = StepGraphs(step, name="toy")
    with pytest.warns(RuntimeWarning, match="toy: running eagerly, not as a CUDA graph: CUDA is not available"):
        out = graphs(torch.ones(3))
    torch.testing.assert_close(out, torch.full((3,), 2.0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        graphs(torch.ones(4))
    assert graphs.eager_calls == 2 and len(calls) == 2 and not graphs.graphs
    with pytest.raises(GraphCaptureError, match="CUDA graphs need an NVIDIA GPU"):
        StepGraphs(step, fallback=False)(torch.ones(3))


def test_varlen_with_max_seqlen_still_checks_cu_seqlens_on_cpu():
    q = torch.randn(8, 2, 4)
    bad = torch.tensor([0, 5, 3, 8], dtype=torch.int32)
    with pytest.raises(ValueError, match="non-decreasing"):
        flash_attention_varlen(q, q, q, bad, bad, 5, 5)
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"max_seqlen_q \(2\) is smaller than the longest sequence \(5\)"):
        flash_attention_varlen(q, q, q, cu, cu, 2, 5)
    with pytest.raises(ValueError, match="same number of sequences"):
        flash_attention_varlen(q, q, q, cu, torch.tensor([0, 8], dtype=torch.int32), 5, 8)


def _maml_fit(cuda_graph: bool, accelerator: str, steps: int, tmp_path, net=None):
    import lightning.pytorch as pl

    from ttt_flash.lightning import MAML
    from ttt_flash.models import NetConfig
    from ttt_flash.lightning.data import InContextRegressionDataModule

    class Losses(pl.Callback):
        def __init__(self):
            self.losses = []

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            self.losses.append(float(trainer.callback_metrics["train/loss_post"]))

    pl.seed_everything(0, verbose=False)
    net = net or NetConfig(kind="transformer", in_dim=6, d_model=16, n_heads=2, n_layers=1)
    model = MAML(net=net, inner_steps=1, inner_lr=0.05, loss="incontext_mse", grad_clip=1.0, cuda_graph=cuda_graph)
    data = InContextRegressionDataModule(dim=4, seq_len=8, support_size=2, query_size=2, meta_batch_size=2,
                                         train_batches=steps, val_batches=1)
    rec = Losses()
    trainer = pl.Trainer(max_steps=steps, accelerator=accelerator, devices=1, logger=False, callbacks=[rec],
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         limit_val_batches=0, default_root_dir=str(tmp_path))
    trainer.fit(model, data)
    return rec.losses, model, trainer


@cpu_only
def test_maml_cuda_graph_on_cpu_warns_once_and_trains_eagerly(tmp_path, one_thread):
    eager, _, _ = _maml_fit(False, "cpu", 3, tmp_path)
    with pytest.warns(RuntimeWarning, match="cuda_graph=True: the training step runs eagerly: the batch is not on a CUDA device") as rec:
        graphed, model, trainer = _maml_fit(True, "cpu", 3, tmp_path)
    assert sum("cuda_graph=True" in str(w.message) for w in rec) == 1
    # attributed to the module's training step, not to Lightning's strategy.py that calls it
    assert {Path(w.filename).name for w in rec if "cuda_graph=True" in str(w.message)} == {"maml.py"}
    assert graphed == eager and trainer.global_step == 3
    assert model.hparams.cuda_graph is True


# --------------------------------------------------------------------------- GPU


def _chain_inputs(shape_q, shape_k, seed=0, dtype=torch.bfloat16):
    g = torch.Generator(device="cuda").manual_seed(seed)
    r = lambda s: torch.randn(*s, device="cuda", dtype=dtype, generator=g)  # noqa: E731
    return [r(shape_q), r(shape_k), r(shape_k), r(shape_q), r(shape_q), r(shape_k), r(shape_k)]


def _chain_step(attn):
    def step(q, k, v, do, uq, uk, uv):
        leaves = [t.detach().requires_grad_() for t in (q, k, v, do)]
        return attention_chain(attn, *leaves, (uq, uk, uv))

    return step


VARIANTS = {
    "noncausal": ((1, 4, 128, 64), (1, 4, 128, 64), dict(causal=False)),
    "causal": ((1, 4, 128, 64), (1, 4, 128, 64), dict(causal=True)),
    "window": ((1, 4, 160, 64), (1, 4, 160, 64), dict(causal=True, window=48)),
    "gqa": ((2, 8, 96, 64), (2, 2, 96, 64), dict(causal=True)),
    "nq-ne-nk": ((1, 4, 80, 64), (1, 4, 200, 64), dict(causal=True)),
}


@pytest.mark.gpu
@pytest.mark.parametrize("variant", list(VARIANTS) + ["varlen"])
def test_chain_is_sync_free_and_replays_bitwise_equal_to_eager(variant):
    if variant == "varlen":
        cu = torch.tensor([0, 37, 37, 100, 160], dtype=torch.int32, device="cuda")
        attn = lambda q, k, v: flash_attention_varlen(q, k, v, cu, cu, 63, 63, causal=True)  # noqa: E731
        shapes = ((160, 4, 64), (160, 2, 64))
    else:
        sq, sk, kw = VARIANTS[variant]
        attn = lambda q, k, v: flash_attention(q, k, v, layout="bhnd", deterministic=True, **kw)  # noqa: E731
        shapes = (sq, sk)
    step = _chain_step(attn)
    x0 = _chain_inputs(*shapes, seed=0)
    step(*x0)  # compile the kernels
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step(*x0)  # any host synchronisation raises here
    finally:
        torch.cuda.set_sync_debug_mode(0)
    graphed = CapturedStep(step, x0, name=f"chain-{variant}")
    x1 = _chain_inputs(*shapes, seed=1)
    got = [t.clone() for t in graphed(*x1)]
    want = step(*x1)
    for a, b in zip(got, want):
        assert torch.isfinite(b.float()).all()
        assert torch.equal(a, b)
    assert graphed.replays == 1


@pytest.mark.gpu
def test_recapture_on_new_shape_and_shape_errors():
    attn = lambda q, k, v: flash_attention(q, k, v, causal=True, deterministic=True)  # noqa: E731
    step = _chain_step(attn)
    graphs = StepGraphs(step, max_graphs=2, fallback=False, name="chain")
    for n, seed in ((64, 0), (128, 1), (64, 2)):
        x = _chain_inputs((1, 2, n, 32), (1, 2, n, 32), seed=seed, dtype=torch.float32)
        got = [t.clone() for t in graphs(*x)]
        for a, b in zip(got, step(*x)):
            assert torch.equal(a, b)
    assert len(graphs.graphs) == 2 and graphs.eager_calls == 0
    x = _chain_inputs((1, 2, 96, 32), (1, 2, 96, 32), dtype=torch.float32)
    with pytest.warns(RuntimeWarning, match="max_graphs=2"):
        graphs(*x)
    assert graphs.eager_calls == 1
    one = next(iter(graphs.graphs.values()))
    with pytest.raises(GraphCaptureError, match=r"input 0 has shape \(1, 2, 96, 32\).*captured for shape"):
        one(*x)


@pytest.mark.gpu
def test_host_sync_and_cpu_tensor_fail_with_the_line_named():
    def syncing(x):
        y = x * 2
        return y * float(y.sum())

    with pytest.raises(GraphCaptureError, match=r"warm-up .* failed at .*test_cuda_graph.py:\d+ in syncing: return y \* float"):
        CapturedStep(syncing, (torch.ones(4, device="cuda"),))
    with pytest.raises(GraphCaptureError, match=r"input 0 is a cpu tensor"):
        CapturedStep(lambda x: x, (torch.ones(4),))
    graphs = StepGraphs(syncing, name="syncing")
    with pytest.warns(RuntimeWarning, match="syncing: running eagerly"):
        out = graphs(torch.ones(4, device="cuda"))
    assert out.sum().item() == 64.0


@pytest.mark.gpu
def test_warm_up_leaves_no_trace_and_training_step_equals_eager():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 1)).cuda()
    twin = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 1)).cuda()
    twin.load_state_dict(model.state_dict())
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, capturable=True)
    opt2 = torch.optim.Adam(twin.parameters(), lr=1e-2, capturable=True)

    def make_step(m, o):
        def step(x, y):
            o.zero_grad(set_to_none=False)
            loss = F.mse_loss(m(x), y)
            loss.backward()
            o.step()
            return loss.detach()
        return step

    data = [(torch.randn(32, 8, device="cuda"), torch.randn(32, 1, device="cuda")) for _ in range(5)]
    graphed = CapturedStep(make_step(model, opt), data[0], params=model.parameters(), optimizers=[opt])
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q)  # the warm-up's three steps were undone
    eager_step = make_step(twin, opt2)
    for x, y in data:
        for p in twin.parameters():
            p.grad = torch.zeros_like(p) if p.grad is None else p.grad
        assert torch.equal(graphed(x, y).clone(), eager_step(x, y))
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q)


@pytest.mark.gpu
def test_graph_safe_generator_draws_fresh_numbers_per_replay():
    gen = graph_safe_generator(seed=3)
    ref = graph_safe_generator(seed=3)
    graphed = CapturedStep(lambda x: x + torch.randn(x.shape, device="cuda", generator=gen), (torch.zeros(5, device="cuda"),),
                           generators=[gen])
    first = graphed(torch.zeros(5, device="cuda")).clone()
    second = graphed(torch.zeros(5, device="cuda")).clone()
    assert not torch.equal(first, second)
    assert torch.equal(first, torch.randn(5, device="cuda", generator=ref))
    assert torch.equal(second, torch.randn(5, device="cuda", generator=ref))


@pytest.mark.gpu
def test_maml_meta_step_graphed_equals_eager():
    from ttt_flash.meta import functional_loss, inner_loop
    from ttt_flash.models.regressors import TinyTransformer

    torch.manual_seed(0)
    net = TinyTransformer(8, 1, d_model=64, n_heads=2, n_layers=2).cuda()
    params = list(net.parameters())

    def meta_step(xs, ys, xq, yq):
        for p in params:
            p.grad.zero_()
        total = 0.0
        for t in range(xs.shape[0]):
            fast = inner_loop(net, dict(net.named_parameters()), F.mse_loss, (xs[t], ys[t]), 1, 0.01)
            total = total + functional_loss(net, fast, F.mse_loss, (xq[t], yq[t]))
        total.backward()
        return total.detach()

    def batch(seed):
        g = torch.Generator(device="cuda").manual_seed(seed)
        return [torch.randn(3, 1, 64, d, device="cuda", generator=g) for d in (8, 1, 8, 1)]

    for p in params:
        p.grad = torch.zeros_like(p)
    graphed = CapturedStep(meta_step, batch(0), params=params)
    for seed in (1, 2):
        b = batch(seed)
        loss = graphed(*b).clone()
        grads = [p.grad.clone() for p in params]
        assert torch.equal(loss, meta_step(*b))
        for g, p in zip(grads, params):
            assert torch.equal(g, p.grad)


@pytest.mark.gpu
def test_maml_lightning_graphed_run_equals_eager(tmp_path):
    eager, _, _ = _maml_fit(False, "gpu", 6, tmp_path)
    graphed, model, trainer = _maml_fit(True, "gpu", 6, tmp_path)
    assert trainer.global_step == 6
    assert set(model._graphed.graphs) == {"step"}
    step_graphs = model._graphed.graphs["step"]
    assert len(step_graphs.graphs) == 1 and step_graphs.eager_calls == 0
    assert graphed == eager


# --------------------------------------------------------------------------- memory and language-model modules


def _fit_losses(model, data, accelerator: str, steps: int, key: str, precision=None, **trainer_kw):
    import lightning.pytorch as pl

    class Losses(pl.Callback):
        def __init__(self):
            self.losses = []

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            self.losses.append(float(trainer.callback_metrics[key]))

    rec = Losses()
    trainer = pl.Trainer(max_steps=steps, accelerator=accelerator, devices=1, logger=False, callbacks=[rec],
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         limit_val_batches=0, **({} if precision is None else {"precision": precision}), **trainer_kw)
    trainer.fit(model, data)
    return rec.losses, trainer


def _memory_run(cls, cuda_graph: bool, accelerator: str, steps: int = 3):
    import lightning.pytorch as pl

    from ttt_flash.lightning.memory import AssociativeRecallDataModule
    from ttt_flash.memory import FastWeightTTT, GradMem, MemoryLM
    from ttt_flash.models import GPTConfig

    pl.seed_everything(0, verbose=False)
    gpt = dict(vocab_size=9, n_layer=1, n_head=2, d_model=16)
    net = {"GradMemKV": lambda: GradMem(GPTConfig(**gpt), memory_tokens=2),
           "TTTE2EMQAR": lambda: FastWeightTTT(GPTConfig(**gpt, window=2), chunk_size=4),
           "MemoryLayerMQAR": lambda: MemoryLM(9, 16, 1, 2, memory_slots=2, chunk_size=4)}[cls.__name__]()
    model = cls(net, warmup_steps=1, cuda_graph=cuda_graph)
    data = AssociativeRecallDataModule(num_keys=4, num_values=4, num_pairs=2, num_queries=2, context_len=8,
                                       batch_size=2, train_batches=steps, val_batches=1)
    return _fit_losses(model, data, accelerator, steps, "train/loss_post")


def _lm_run(cuda_graph: bool, accelerator: str, steps: int = 3, precision=None, optimizer="sophiah", **trainer_kw):
    import lightning.pytorch as pl

    from ttt_flash.lightning import ByteTextDataModule, LanguageModel
    from ttt_flash.models import GPTConfig

    pl.seed_everything(0, verbose=False)
    model = LanguageModel(GPTConfig.tiny(n_layer=1, d_model=32, n_head=2), optimizer=optimizer, lr=1e-3,
                          hessian_every=2, warmup_steps=1, cuda_graph=cuda_graph)
    data = ByteTextDataModule(seq_len=16, batch_size=2, max_bytes=2**15, train_batches=steps, val_batches=1)
    return _fit_losses(model, data, accelerator, steps, "train/loss", precision, **trainer_kw)


@cpu_only
def test_memory_and_lm_cuda_graph_on_cpu_warn_once_and_train_eagerly(one_thread):
    from ttt_flash.lightning.memory import GradMemKV

    eager, _ = _memory_run(GradMemKV, False, "cpu")
    with pytest.warns(RuntimeWarning, match="cuda_graph=True: the training step runs eagerly") as rec:
        graphed, trainer = _memory_run(GradMemKV, True, "cpu")
    assert sum("cuda_graph=True" in str(w.message) for w in rec) == 1
    assert graphed == eager and trainer.global_step == 3
    eager, _ = _lm_run(False, "cpu")
    with pytest.warns(RuntimeWarning, match="cuda_graph=True: the training step runs eagerly"):
        graphed, trainer = _lm_run(True, "cpu")
    assert graphed == eager and trainer.global_step == 3


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["GradMemKV", "TTTE2EMQAR", "MemoryLayerMQAR"])
def test_memory_modules_graphed_equal_eager(name):
    import ttt_flash.lightning.memory as mem

    cls = getattr(mem, name)
    eager, _ = _memory_run(cls, False, "gpu", steps=4)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no fallback to eager
        graphed, trainer = _memory_run(cls, True, "gpu", steps=4)
    assert trainer.global_step == 4
    torch.testing.assert_close(graphed, eager, rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("optimizer", ["sophiah", "adahessian"])
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_lm_whole_step_graphs_replay_bitwise_equal_to_eager(optimizer, precision):
    """10 steps (hessian_every=2: 5 refresh and 5 plain steps) with gradient clipping: every
    step is one replayed graph (update included), the losses, parameters and optimizer state
    bitwise those of the eager module."""
    kw = dict(steps=10, precision=precision, optimizer=optimizer, gradient_clip_val=0.5)
    eager, eager_trainer = _lm_run(False, "gpu", **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no fallback to eager
        graphed, trainer = _lm_run(True, "gpu", **kw)
    model = trainer.lightning_module
    graphs = model._graphed.graphs
    assert set(graphs) == {"update", "refresh_update"}
    assert {k: g.eager_calls for k, g in graphs.items()} == {"update": 0, "refresh_update": 0}
    assert {k: next(iter(g.graphs.values())).replays for k, g in graphs.items()} == {"update": 5, "refresh_update": 5}
    assert trainer.global_step == 10
    assert graphed == eager
    for p, q in zip(eager_trainer.lightning_module.parameters(), model.parameters()):
        assert torch.equal(p.cpu(), q.cpu())
    opt = trainer.optimizers[0]
    assert all(s["step"].item() == 10 and s["hessian_step"].item() == 5 for s in opt.state.values())


@pytest.fixture
def graph_as_eager(monkeypatch):
    """The modules' graphed path with each captured step run eagerly: the Lightning side of
    cuda_graph=True (what the graph computes, backward skipped, refresh folded in, step
    counts) checked on the CPU."""
    from ttt_flash.lightning import _step

    monkeypatch.setattr(_step.GraphedTraining, "usable", lambda self, cuda, why_not=None: self.enabled and why_not is None)
    monkeypatch.setattr(StepGraphs, "__call__", lambda self, *inputs: self._eager(inputs))


def test_graphed_path_of_each_module_equals_eager_on_cpu(graph_as_eager, tmp_path, one_thread):
    from ttt_flash.lightning.memory import TTTE2EMQAR

    eager, _, _ = _maml_fit(False, "cpu", 3, tmp_path)
    graphed, model, trainer = _maml_fit(True, "cpu", 3, tmp_path)
    assert trainer.global_step == 3 and model._graphed.graphs["step"].eager_calls == 3
    assert graphed == eager
    eager, _ = _memory_run(TTTE2EMQAR, False, "cpu")
    graphed, trainer = _memory_run(TTTE2EMQAR, True, "cpu")
    assert trainer.lightning_module._graphed.graphs["step"].eager_calls == 3
    assert graphed == eager
    eager, _ = _lm_run(False, "cpu", steps=4)
    graphed, trainer = _lm_run(True, "cpu", steps=4)
    model = trainer.lightning_module
    calls = {k: g.eager_calls for k, g in model._graphed.graphs.items()}
    assert calls == {"refresh_update": 2, "update": 2}  # hessian_every=2: steps 0 and 2 refresh
    refresh = next(c for c in trainer.callbacks if type(c).__name__ == "HessianRefresh")
    assert refresh.refreshes == 2
    assert graphed == eager  # the whole step (update included) is the eager step's arithmetic
    # bf16 autocast: the graphed step's backward passes run outside it, as Lightning's eager backward
    eager, _ = _lm_run(False, "cpu", steps=3, precision="bf16-mixed")
    graphed, _ = _lm_run(True, "cpu", steps=3, precision="bf16-mixed")
    assert graphed == eager


@pytest.mark.parametrize("optimizer", ["sophiah", "adahessian"])
def test_lm_whole_step_path_with_clipping_equals_eager_on_cpu(graph_as_eager, optimizer, one_thread):
    """The whole-step function (host part, then forward, backward, refresh, the Trainer's
    clipping and the optimizer's device update in one function; Lightning's own clipping and
    update skipped) gives the eager module's losses and parameters bit for bit."""
    kw = dict(steps=5, optimizer=optimizer, gradient_clip_val=0.05)
    eager, eager_trainer = _lm_run(False, "cpu", **kw)
    graphed, trainer = _lm_run(True, "cpu", **kw)
    model = trainer.lightning_module
    assert {k: g.eager_calls for k, g in model._graphed.graphs.items()} == {"refresh_update": 3, "update": 2}
    assert graphed == eager and trainer.global_step == 5
    for p, q in zip(eager_trainer.lightning_module.parameters(), model.parameters()):
        assert torch.equal(p, q)
    opt = trainer.optimizers[0]
    assert all(isinstance(s["step"], torch.Tensor) and s["step"].item() == 5 for s in opt.state.values())
    # clipping matters at this gradient_clip_val: without it the run differs
    unclipped, _ = _lm_run(False, "cpu", steps=5, optimizer=optimizer)
    assert unclipped[1:] != eager[1:]


# --------------------------------------------------------------------------- exact resume with cuda_graph


_RESUME = {
    "maml": ("maml_sinusoid", ["--data.init_args.train_batches=4", "--data.init_args.meta_batch_size=2",
                               "--data.init_args.val_batches=1", "--trainer.max_epochs=2"]),
    "lm": ("sophia_gpt_tiny", [
        "--data.init_args.train_batches=4", "--data.init_args.batch_size=2", "--data.init_args.seq_len=16",
        "--data.init_args.max_bytes=20000", "--data.init_args.val_batches=1",
        "--model.init_args.gpt.n_layer=1", "--model.init_args.gpt.d_model=16", "--model.init_args.gpt.n_head=4",
        "--model.init_args.hessian_every=3", "--model.init_args.warmup_steps=2",
        "--trainer.max_steps=8", "--trainer.val_check_interval=2"]),
}


def _resumed_equals_straight(case, tmp_path, monkeypatch, extra=()):
    import csv
    import shutil
    from pathlib import Path

    from ttt_flash.cli import main

    def rows(path):
        with open(path, newline="") as f:
            # every column but wall-clock times and peak memory (a resumed run captures its graphs again)
            return [{k: v for k, v in r.items() if not k.endswith(("_s", "peak_mem_gib"))} for r in csv.DictReader(f)]

    recipe, overrides = _RESUME[case]
    monkeypatch.chdir(tmp_path)
    # the command refuses cuda_graph=true without CUDA (one line naming the fix); the module's
    # eager fallback is what a CPU run of this test checks
    monkeypatch.setattr("ttt_flash._recipe_cli.gpu_only_message", lambda *args, **kwargs: None)
    recipes = Path(__file__).resolve().parent.parent / "recipes"
    argv = ["fit", "--config", str(recipes / f"{recipe}.yaml"), *overrides, "--model.init_args.cuda_graph=true",
            *extra, "--trainer.callbacks.init_args.every_n_train_steps=1", "--trainer.callbacks.init_args.save_top_k=-1",
            "--trainer.callbacks.init_args.filename={step}", "--trainer.log_every_n_steps=1",
            "--trainer.enable_model_summary=false", "--trainer.enable_progress_bar=false"]
    assert main(argv) == 0
    folder = tmp_path / "runs" / recipe
    straight = torch.load(folder / "checkpoints" / "last.ckpt", weights_only=True)
    straight_rows = rows(folder / "metrics.csv")
    shutil.copy(folder / "checkpoints" / "step=5.ckpt", tmp_path / "k5.ckpt")  # mid-epoch
    assert main([*argv, "--ckpt_path", str(tmp_path / "k5.ckpt")]) == 0
    resumed = torch.load(folder / "checkpoints" / "last.ckpt", weights_only=True)
    assert resumed["global_step"] == straight["global_step"] == 8
    for name in straight["state_dict"]:
        assert torch.equal(resumed["state_dict"][name], straight["state_dict"][name]), name
    assert rows(folder / "metrics.csv") == straight_rows


def test_graphed_lm_run_resumes_exactly_on_cpu(graph_as_eager, tmp_path, monkeypatch, one_thread):
    _resumed_equals_straight("lm", tmp_path, monkeypatch)


@pytest.mark.gpu
@pytest.mark.parametrize("case", sorted(_RESUME))
def test_graphed_run_resumes_exactly(case, tmp_path, monkeypatch):
    _resumed_equals_straight(case, tmp_path, monkeypatch, extra=["--trainer.accelerator=gpu"])
