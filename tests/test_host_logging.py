"""The per-step numbers the Lightning modules log stay on the host (docs/cuda-graphs.md): a
Python number logged on a CUDA module is copied to the GPU by Lightning, a blocking copy that
waits for the step queued before it (a replayed graph).

On the CPU: :func:`ttt_flash.lightning._step.host_number` gives the value and dtype Lightning
gives a logged number; no module logs a Python number; the logged rows equal those of logging
the Python numbers (a fake clock makes the times repeatable). On a GPU (``-m gpu``): a graphed
LanguageModel logs its per-step numbers as CPU tensors.
"""

import numbers

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.loggers import Logger

from ttt_flash.lightning import _step, hessian_refresh, lm, maml, memory
from ttt_flash.lightning._step import host_number
from ttt_flash.cuda_graph import StepGraphs

#: The per-step numbers the modules compute on the host.
HOST_METRICS = {"train/lr", "train/step_time_s", "train/peak_mem_gib", "train/hessian_refresh_s", "train/seq_len",
                "train/context_len", "train/tokens_per_s"}


class Rows(Logger):
    """Every logged row, as the loggers receive it (Python numbers)."""

    name = "rows"
    version = 0

    def __init__(self):
        super().__init__()
        self.rows = []

    def log_hyperparams(self, params, *args, **kwargs) -> None:
        pass

    def log_metrics(self, metrics, step=None) -> None:
        self.rows.append((step, dict(metrics)))


class Clock:
    """A ``time`` module whose ``perf_counter`` advances a quarter second per call."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self) -> float:
        self.now += 0.25
        return self.now


@pytest.fixture
def logged(monkeypatch):
    """(name, value) of every ``LightningModule.log`` call, as the module passed it."""
    calls = []
    original = LightningModule.log

    def log(self, name, value, *args, **kwargs):
        calls.append((name, value))
        return original(self, name, value, *args, **kwargs)

    monkeypatch.setattr(LightningModule, "log", log)
    return calls


@pytest.fixture
def clock(monkeypatch):
    c = Clock()
    monkeypatch.setattr(_step, "time", c)
    monkeypatch.setattr(hessian_refresh, "time", c)
    return c


def _as_python_numbers(monkeypatch):
    """The modules log Python numbers, as without host_number."""
    for module in (_step, lm, hessian_refresh, maml, memory):
        monkeypatch.setattr(module, "host_number", float)


def _graph_as_eager(monkeypatch):
    """The modules' cuda_graph path with each captured step run eagerly (tests/test_cuda_graph.py)."""
    monkeypatch.setattr(_step.GraphedTraining, "usable", lambda self, cuda, why_not=None: self.enabled and why_not is None)
    monkeypatch.setattr(StepGraphs, "__call__", lambda self, *inputs: self._eager(inputs))


def _fit(make, steps: int, accelerator: str = "cpu"):
    pl.seed_everything(0, verbose=False)
    model, data = make()
    rows = Rows()
    trainer = pl.Trainer(max_steps=steps, accelerator=accelerator, devices=1, logger=rows, log_every_n_steps=1,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         limit_val_batches=0)
    trainer.fit(model, data)
    return rows.rows, trainer


def _lm(cuda_graph: bool = False):
    from ttt_flash.lightning import ByteTextDataModule, LanguageModel
    from ttt_flash.models import GPTConfig

    model = LanguageModel(GPTConfig.tiny(n_layer=1, d_model=32, n_head=2), optimizer="sophiah", lr=1e-3,
                          hessian_every=2, warmup_steps=1, cuda_graph=cuda_graph)
    return model, ByteTextDataModule(seq_len=16, batch_size=2, max_bytes=2**15, train_batches=8, val_batches=1)


def _maml():
    from ttt_flash.lightning import MAML
    from ttt_flash.lightning.data import InContextRegressionDataModule
    from ttt_flash.models import NetConfig

    net = NetConfig(kind="transformer", in_dim=6, d_model=16, n_heads=2, n_layers=1)
    model = MAML(net=net, inner_steps=1, inner_lr=0.05, loss="incontext_mse", grad_clip=1.0)
    return model, InContextRegressionDataModule(dim=4, seq_len=8, support_size=2, query_size=2, meta_batch_size=2,
                                                train_batches=3, val_batches=1)


def _memory():
    from ttt_flash.lightning.memory import AssociativeRecallDataModule, GradMemKV
    from ttt_flash.memory import GradMem
    from ttt_flash.models import GPTConfig

    model = GradMemKV(GradMem(GPTConfig(vocab_size=9, n_layer=1, n_head=2, d_model=16), memory_tokens=2), warmup_steps=1)
    return model, AssociativeRecallDataModule(num_keys=4, num_values=4, num_pairs=2, num_queries=2, context_len=8,
                                              batch_size=2, train_batches=3, val_batches=1)


def test_host_number_is_the_tensor_lightning_makes_of_a_number_on_the_cpu():
    from lightning.pytorch.trainer.connectors.logger_connector.result import _get_default_dtype

    default = torch.get_default_dtype()
    try:
        for dtype in (torch.float32, torch.float64):
            torch.set_default_dtype(dtype)
            for value in (3e-4, 0.1, 7, 2**40 / 3, 0.0, 1e-30):
                t = host_number(value)
                want = torch.tensor(value, device="cpu", dtype=_get_default_dtype())  # LightningModule.log's
                assert t.device.type == "cpu" and t.dim() == 0 and t.dtype == dtype
                assert t.dtype == want.dtype and torch.equal(t, want), value
    finally:
        torch.set_default_dtype(default)


@pytest.mark.parametrize("make, steps, graph", [
    pytest.param(_lm, 4, False, id="LanguageModel"),
    pytest.param(lambda: _lm(cuda_graph=True), 4, True, id="LanguageModel-graph-path"),
    pytest.param(_maml, 2, False, id="MAML"),
    pytest.param(_memory, 2, False, id="GradMemKV"),
])
def test_modules_log_no_python_number_and_the_same_rows(make, steps, graph, logged, clock, monkeypatch, one_thread):
    if graph:
        _graph_as_eager(monkeypatch)
    rows, trainer = _fit(make, steps)
    numbers_logged = [(name, v) for name, v in logged if isinstance(v, numbers.Number)]
    assert not numbers_logged, f"Python numbers logged (copied to the module's device on CUDA): {numbers_logged}"
    host = [(name, v) for name, v in logged if name in HOST_METRICS]
    assert host and all(v.device.type == "cpu" and v.numel() == 1 for _, v in host)
    for name in {name for name, _ in host} & set(trainer.callback_metrics):
        assert trainer.callback_metrics[name].device.type == "cpu", name
    # the same rows as logging the Python numbers (the clock restarted)
    logged.clear()
    clock.now = 0.0
    _as_python_numbers(monkeypatch)
    before, _ = _fit(make, steps)
    assert any(isinstance(v, numbers.Number) for name, v in logged if name in HOST_METRICS)  # the old way ran
    assert rows == before and len(rows) == steps
    assert {name for _, r in rows for name in r} >= {name for name, _ in host}


@pytest.mark.gpu
def test_graphed_lm_on_cuda_logs_its_host_numbers_as_cpu_tensors(logged):
    rows, trainer = _fit(lambda: _lm(cuda_graph=True), 6, accelerator="gpu")
    model = trainer.lightning_module
    assert {k: g.eager_calls for k, g in model._graphed.graphs.items()} == {"refresh_update": 0, "update": 0}
    assert not [(name, v) for name, v in logged if isinstance(v, numbers.Number)]
    host = {name for name, _ in logged if name in HOST_METRICS}
    assert host == {"train/lr", "train/step_time_s", "train/peak_mem_gib", "train/hessian_refresh_s"}
    assert all(v.device.type == "cpu" for name, v in logged if name in host)
    metrics = trainer.callback_metrics
    assert all(metrics[name].device.type == "cpu" for name in host)
    assert "train/loss" in metrics  # logged (Lightning moves every metric to the CPU at the epoch end)
    assert len(rows) == 6 and all(r["train/peak_mem_gib"] > 0 for _, r in rows)


def test_late_host_value_returns_the_previous_push():
    from ttt_flash.lightning._step import LateHostValue

    late = LateHostValue()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    values = [torch.tensor(v, device=device) for v in (2.5, 1.25, 0.5)]
    out = [late.push(v) for v in values]
    assert out[0] is None and [o.item() for o in out[1:]] == [2.5, 1.25]
    assert all(o.device.type == "cpu" for o in out[1:])
    late.reset()
    assert late.push(values[0]) is None


class ProgressBarLosses(pl.Callback):
    def __init__(self):
        self.shown, self.losses = [], []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.losses.append(trainer.callback_metrics["train/loss"])  # read after the run: no wait here
        self.shown.append(trainer.progress_bar_metrics.get("train/loss_prev"))


def test_graph_path_shows_the_previous_loss_on_the_progress_bar(monkeypatch, one_thread):
    _graph_as_eager(monkeypatch)
    pl.seed_everything(0, verbose=False)
    model, data = _lm(cuda_graph=True)
    rec = ProgressBarLosses()
    trainer = pl.Trainer(max_steps=4, accelerator="cpu", logger=Rows(), log_every_n_steps=1, callbacks=[rec],
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         limit_val_batches=0)
    trainer.fit(model, data)
    assert "train/loss" not in trainer.progress_bar_metrics
    assert rec.shown[0] is None and rec.shown[1:] == [loss.item() for loss in rec.losses[:-1]]


class Census(pl.Callback):
    """The synchronising calls of training batches ``first`` to ``last`` (ttt_flash.bench.common.SyncCensus)."""

    def __init__(self, first: int, last: int):
        from ttt_flash.bench.common import SyncCensus

        self.first, self.last, self.census = first, last, SyncCensus()

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if batch_idx == self.first:
            self.census.start()

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if batch_idx == self.last:
            self.census.stop()


@pytest.mark.gpu
def test_graphed_lm_steps_make_no_synchronising_call():
    """Once both graphs are captured, a graphed LanguageModel step (no logger) waits for the
    GPU only at the CUDA events of the step before (the step time, the progress bar's loss)."""
    pl.seed_everything(0, verbose=False)
    model, data = _lm(cuda_graph=True)
    rec, census = ProgressBarLosses(), Census(first=3, last=6)
    trainer = pl.Trainer(max_steps=8, accelerator="gpu", devices=1, logger=False, callbacks=[census, rec],
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         limit_val_batches=0)
    try:
        trainer.fit(model, data)
    finally:
        census.census.stop()
    assert {k: g.eager_calls for k, g in model._graphed.graphs.items()} == {"refresh_update": 0, "update": 0}
    assert not census.census.calls, "synchronising calls:\n" + "\n".join(census.census.calls)
    assert rec.shown[0] is None and rec.shown[1:] == [loss.item() for loss in rec.losses[:-1]]
