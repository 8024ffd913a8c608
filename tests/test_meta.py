"""Inner loops (ttt_flash.meta), task generators (ttt_flash.tasks) and the MAML LightningModule.

Everything in float64 on tiny shapes: each test takes well under a second on one CPU core.
"""

import math

import pytest
import torch
from torch import nn

from ttt_flash.lightning import MAML, InContextRegressionDataModule, SinusoidDataModule
from ttt_flash.models import NetConfig
from ttt_flash.models import SinusoidMLP
from ttt_flash.meta import functional_loss, higher_inner_loop, inner_loop, meta_sgd_lrs, select_adapted
from ttt_flash.tasks import InContextRegressionTasks, MetaBatch, SinusoidTasks, incontext_mse

pytestmark = pytest.mark.usefixtures("one_thread")


mse = nn.functional.mse_loss
F64 = torch.float64


def _mlp(hidden=8):
    return nn.Sequential(nn.Linear(2, hidden), nn.Tanh(), nn.Linear(hidden, 1)).to(F64)


def _regression(k=6, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2 * k, 2, generator=g, dtype=F64)
    y = torch.sin(x.sum(-1, keepdim=True))
    return (x[:k], y[:k]), (x[k:], y[k:])


def _meta_grad(model, params, query, loss_fn=mse, **inner_kw):
    fast = inner_loop(model, params, loss_fn, **inner_kw)
    loss = functional_loss(model, fast, loss_fn, query)  # (GPT's token embedding is unused: zero grad)
    return torch.autograd.grad(loss, list(params.values()), allow_unused=True, materialize_grads=True)


def _max_rel_diff(a, b):
    return max(((x - y).abs().max() / y.abs().max().clamp_min(1e-300)).item() for x, y in zip(a, b) if y.any())


# --------------------------------------------------------------------------- second order through attention


def _transformer_pair(kind):
    torch.manual_seed(0)
    nets = {
        attention: NetConfig(kind=kind, in_dim=6, d_model=16, n_heads=2, n_layers=2, attention=attention).build().to(F64)
        for attention in ("ttt_flash", "math")
    }
    nets["math"].load_state_dict(nets["ttt_flash"].state_dict())
    tasks = InContextRegressionTasks(dim=4, seq_len=10, support_size=2, query_size=3)
    batch = tasks.sample(1, torch.Generator().manual_seed(0), dtype=F64)
    return nets["ttt_flash"], nets["math"], batch.task(0)


@pytest.mark.parametrize("kind", ["transformer", "gpt"], ids=["TinyTransformer", "models.GPT"])
def test_transformer_second_order_meta_grad_flash_equals_materialised(kind):
    flash, naive, (support, query) = _transformer_pair(kind)
    kw = dict(loss_fn=incontext_mse, support_batch=support, steps=2, lr=0.1)
    g_flash = _meta_grad(flash, dict(flash.named_parameters()), query, **kw)
    g_naive = _meta_grad(naive, dict(naive.named_parameters()), query, **kw)
    for a, b in zip(g_flash, g_naive):
        assert (a - b).abs().max().item() <= 1e-9 * max(1.0, b.abs().max().item())
    # the second-order terms are really there: first-order MAML gives another meta-gradient
    g_first = _meta_grad(flash, dict(flash.named_parameters()), query, first_order=True, **kw)
    assert _max_rel_diff(g_first, g_flash) > 1e-3


@pytest.mark.parametrize("kind, module", [("transformer", "ttt_flash.attention.registry"), ("gpt", "ttt_flash.attention.registry")],
                         ids=["TinyTransformer", "models.GPT"])
def test_flash_attention_actually_used_in_transformer(kind, module, monkeypatch):
    import importlib

    mod = importlib.import_module(module)
    calls = []
    real = mod.flash_attention
    monkeypatch.setattr(mod, "flash_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    flash, _, (support, _) = _transformer_pair(kind)
    flash(support[0])
    assert len(calls) == 2  # one per layer


# --------------------------------------------------------------------------- functional vs higher


@pytest.mark.parametrize("first_order", [False, True], ids=["second-order", "first-order"])
def test_functional_and_higher_paths_agree_for_sgd(first_order):
    model = _mlp()
    support, query = _regression()
    params = dict(model.named_parameters())
    fast = inner_loop(model, params, mse, support, 3, 0.05, first_order=first_order)
    fast_h = higher_inner_loop(model, mse, support, 3, torch.optim.SGD(model.parameters(), lr=0.05),
                               first_order=first_order)
    assert list(fast) == list(fast_h)
    for n in fast:
        torch.testing.assert_close(fast[n], fast_h[n], rtol=0, atol=1e-13)
    g = torch.autograd.grad(functional_loss(model, fast, mse, query), list(params.values()))
    g_h = torch.autograd.grad(functional_loss(model, fast_h, mse, query), list(params.values()))
    for a, b in zip(g, g_h):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-13)


def test_higher_accepts_optimizer_factory():
    model = _mlp()
    support, _ = _regression()
    fast = higher_inner_loop(model, mse, support, 1, lambda ps: torch.optim.SGD(ps, lr=0.1))
    ref = inner_loop(model, None, mse, support, 1, 0.1)
    for n in ref:
        torch.testing.assert_close(fast[n], ref[n], rtol=0, atol=1e-13)


# --------------------------------------------------------------------------- Meta-SGD, ANIL


def test_meta_sgd_lrs_receive_gradients():
    model = _mlp()
    support, query = _regression()
    params = dict(model.named_parameters())
    lrs = meta_sgd_lrs(params, 0.05)
    assert all(lrs[n].shape == params[n].shape and lrs[n].requires_grad for n in params)
    for first_order in (False, True):
        fast = inner_loop(model, params, mse, support, 2, 0.0, lrs=lrs, first_order=first_order)
        grads = torch.autograd.grad(functional_loss(model, fast, mse, query), list(lrs.values()))
        assert all(torch.isfinite(g).all() and g.abs().sum() > 0 for g in grads)
    # constant per-element step sizes are plain SGD
    plain = inner_loop(model, params, mse, support, 2, 0.05)
    fast = inner_loop(model, params, mse, support, 2, 123.0, lrs=lrs)
    for n in params:
        torch.testing.assert_close(fast[n], plain[n], rtol=0, atol=1e-14)


def test_anil_adapts_only_the_head():
    model = SinusoidMLP(in_dim=2, hidden=8).to(F64)
    support, query = _regression()
    params = dict(model.named_parameters())
    fast = inner_loop(model, params, mse, support, 3, 0.1, adapt=["head"])
    for n in params:
        if n.startswith("head."):
            assert not torch.equal(fast[n], params[n])
        else:
            assert fast[n] is params[n]
    # the body still gets a meta-gradient, through the head's adaptation and the query
    grads = torch.autograd.grad(functional_loss(model, fast, mse, query), list(params.values()))
    assert all(g.abs().sum() > 0 for g in grads)
    # a predicate selects the same subset
    assert select_adapted(list(params), lambda n: n.startswith("head")) == ["head.weight", "head.bias"]


# --------------------------------------------------------------------------- differentiable Adam


def test_adam_inner_loop_follows_torch_adam():
    model = _mlp()
    support, _ = _regression()
    fast = inner_loop(model, None, mse, support, 4, 0.01, optimizer="adam")
    twin = _mlp()
    twin.load_state_dict(model.state_dict())
    opt = torch.optim.Adam(twin.parameters(), lr=0.01)
    for _ in range(4):
        opt.zero_grad()
        mse(twin(support[0]), support[1]).backward()
        opt.step()
    for n, p in twin.named_parameters():
        torch.testing.assert_close(fast[n], p, rtol=0, atol=1e-14)


def test_adam_meta_gradient_matches_finite_differences():
    model = nn.Sequential(nn.Linear(2, 3), nn.Tanh(), nn.Linear(3, 1)).to(F64)
    support, query = _regression(k=5)
    names = [n for n, _ in model.named_parameters()]
    theta = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    shapes = [p.shape for p in model.parameters()]

    def meta_loss(flat, first_order=False):
        params, i = {}, 0
        for n, s in zip(names, shapes):
            params[n] = flat[i:i + s.numel()].view(s)
            i += s.numel()
        fast = inner_loop(model, params, mse, support, 3, 0.05, optimizer="adam", first_order=first_order)
        return functional_loss(model, fast, mse, query)

    flat = theta.clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(meta_loss(flat), flat)
    (grad_first,) = torch.autograd.grad(meta_loss(flat, first_order=True), flat)
    g = torch.Generator().manual_seed(0)
    h = 1e-6
    with torch.no_grad():
        for _ in range(4):
            v = torch.randn(theta.shape, generator=g, dtype=F64)
            fd = (meta_loss(theta + h * v) - meta_loss(theta - h * v)) / (2 * h)
            assert abs(fd - grad @ v) <= 1e-7 * max(1.0, abs(fd))
    assert (grad - grad_first).norm() > 1e-3 * grad.norm()


def test_adam_unused_parameter_gives_finite_second_order_grads():
    class WithUnused(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(2, 1).to(F64)
            self.unused = nn.Parameter(torch.ones(3, dtype=F64))

        def forward(self, x):  # `unused` is in the graph but gets an exactly-zero gradient
            return self.lin(x) + 0.0 * self.unused.sum()

    model = WithUnused()
    support, query = _regression()
    fast = inner_loop(model, None, mse, support, 2, 0.1, optimizer="adam")
    assert torch.equal(fast["unused"], model.unused)  # zero gradient, zero Adam step
    grads = torch.autograd.grad(functional_loss(model, fast, mse, query), list(model.parameters()))
    assert all(torch.isfinite(g).all() for g in grads)


# --------------------------------------------------------------------------- semantics and errors


def test_zero_steps_and_no_grad_context():
    model = _mlp()
    support, _ = _regression()
    params = dict(model.named_parameters())
    same = inner_loop(model, params, mse, support, 0, 0.1)
    assert all(same[n] is params[n] for n in params)
    with torch.no_grad():  # as in a validation loop
        fast = inner_loop(model, params, mse, support, 1, 0.1, first_order=True)
    assert not torch.equal(fast["0.weight"], params["0.weight"])
    with torch.inference_mode(), pytest.raises(RuntimeError, match="inference_mode"):
        inner_loop(model, params, mse, support, 1, 0.1)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(steps=-1), ValueError, "steps must be >= 0"),
        (dict(steps=1.5), TypeError, "steps must be an int"),
        (dict(steps=True), TypeError, "steps must be an int"),
        (dict(lr=-0.1), ValueError, "lr must be finite and >= 0"),
        (dict(lr=float("nan")), ValueError, "lr must be finite"),
        (dict(optimizer="lbfgs"), ValueError, "optimizer must be one of"),
        (dict(adapt=["head"]), ValueError, r"adapt names \['head'\] match no parameter"),
        (dict(adapt=lambda n: False), ValueError, "selects no parameter"),
        (dict(adapt=["2"], lrs={"0.weight": torch.tensor(0.1)}), ValueError, "not adapted"),
        (dict(lrs={"0.bias": torch.ones(3)}), ValueError, "scalar or have the parameter's shape"),
        (dict(params={"nope": torch.zeros(1)}), ValueError, "not parameters of the model"),
        (dict(params={"0.bias": torch.zeros(3)}), ValueError, "has shape"),
        (dict(params=[torch.zeros(1)]), TypeError, "mapping"),
        (dict(support_batch=torch.zeros(3)), TypeError, r"\(inputs, target\) pair"),
        (dict(loss_fn=lambda o, t: (o - t) ** 2), ValueError, "scalar"),
        (dict(model=lambda x: x), TypeError, "nn.Module"),
    ],
    ids=["steps-neg", "steps-float", "steps-bool", "lr-neg", "lr-nan", "optimizer", "adapt-unknown",
         "adapt-empty", "lrs-not-adapted", "lrs-shape", "params-unknown", "params-shape",
         "params-list", "batch", "loss-not-scalar", "model"],
)
def test_inner_loop_rejects_bad_input(kwargs, error, match):
    model = _mlp()
    support, _ = _regression()
    args = dict(model=model, params=None, loss_fn=mse, support_batch=support, steps=1, lr=0.1)
    args.update(kwargs)
    with pytest.raises(error, match=match):
        inner_loop(**args)


# --------------------------------------------------------------------------- tasks


def test_sinusoid_tasks():
    tasks = SinusoidTasks(k_shot=5, k_query=7)
    b = tasks.sample(64, torch.Generator().manual_seed(0))
    assert b.support_inputs.shape == (64, 5, 1) and b.query_targets.shape == (64, 7, 1)
    amp, phase = b.task_params[:, 0], b.task_params[:, 1]
    assert amp.min() >= 0.1 and amp.max() <= 5.0 and phase.min() >= 0 and phase.max() <= math.pi
    x = torch.cat([b.support_inputs, b.query_inputs], 1)
    y = torch.cat([b.support_targets, b.query_targets], 1)
    assert x.abs().max() <= 5.0
    torch.testing.assert_close(y, amp[:, None, None] * torch.sin(x - phase[:, None, None]))
    again = tasks.sample(64, torch.Generator().manual_seed(0))
    assert all(torch.equal(a, c) for a, c in zip(b, again))
    with pytest.raises(ValueError, match="k_shot"):
        SinusoidTasks(k_shot=0)


def test_incontext_regression_tasks():
    tasks = InContextRegressionTasks(dim=3, seq_len=8, support_size=2, query_size=5, noise_std=0.0)
    b = tasks.sample(4, torch.Generator().manual_seed(0), dtype=F64)
    assert b.support_inputs.shape == (4, 2, 8, 5) and b.query_inputs.shape == (4, 5, 8, 5)
    assert b.support_targets.shape == (4, 2, 4) and b.task_params.shape == (4, 3)
    x = b.query_inputs[..., 0::2, :3]
    torch.testing.assert_close(b.query_targets, torch.einsum("tspd,td->tsp", x, b.task_params))
    assert torch.equal(b.query_inputs[..., 1::2, 3], b.query_targets)  # y-tokens carry y
    assert (b.query_inputs[..., 1::2, 4] == 1).all() and (b.query_inputs[..., 0::2, 3:] == 0).all()
    pred = torch.zeros(2, 8, 1, dtype=F64)
    pred[:, 0::2, 0] = b.support_targets[0]
    assert incontext_mse(pred, b.support_targets[0]) == 0
    with pytest.raises(ValueError, match="even"):
        InContextRegressionTasks(seq_len=7)
    with pytest.raises(ValueError, match="incontext_mse expects"):
        incontext_mse(torch.zeros(2, 7, 1), torch.zeros(2, 4))


def test_datamodules_are_seeded_fresh_for_train_fixed_for_val():
    dm = SinusoidDataModule(meta_batch_size=3, train_batches=2, val_batches=2, seed=5)
    twin = SinusoidDataModule(meta_batch_size=3, train_batches=2, val_batches=2, seed=5)
    first = list(dm.train_dataloader())
    assert isinstance(first[0], MetaBatch) and first[0].support_inputs.shape == (3, 10, 1)
    assert torch.equal(first[0].support_inputs, next(iter(twin.train_dataloader())).support_inputs)
    loader = dm.train_dataloader()
    second_epoch = list(loader)  # the datamodule's sampler moved on: new tasks
    assert not torch.equal(first[0].support_inputs, second_epoch[0].support_inputs)
    v1, v2 = list(dm.val_dataloader()), list(dm.val_dataloader())
    assert torch.equal(v1[1].query_inputs, v2[1].query_inputs)
    ic = InContextRegressionDataModule(dim=2, seq_len=6, meta_batch_size=2)
    assert ic.token_dim == 4 and next(iter(ic.val_dataloader())).support_inputs.shape == (2, 4, 6, 4)


# --------------------------------------------------------------------------- the LightningModule


class _ClassificationData:
    """Random linear 3-way classification tasks on 4-d inputs, as a LightningDataModule."""

    @staticmethod
    def make():
        from lightning.pytorch import LightningDataModule

        class DM(LightningDataModule):
            def _loader(self):
                g = torch.Generator().manual_seed(0)
                x = torch.randn(2, 2, 12, 4, generator=g)  # (meta-batches, tasks, K, in)
                w = torch.randn(2, 2, 4, 3, generator=g)
                y = torch.einsum("btki,btio->btko", x, w).argmax(-1)
                batches = [MetaBatch(x[i, :, :6], y[i, :, :6], x[i, :, 6:], y[i, :, 6:]) for i in range(2)]
                return torch.utils.data.DataLoader(batches, batch_size=None)

            train_dataloader = val_dataloader = _loader

        return DM()


def _fit(model, data, tmp_path):
    from lightning.pytorch import Trainer

    trainer = Trainer(fast_dev_run=True, accelerator="cpu", default_root_dir=tmp_path,
                      enable_progress_bar=False, enable_model_summary=False, logger=False)
    trainer.fit(model, data)
    return trainer.callback_metrics


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(),
        dict(first_order=True, inner_optimizer="adam"),
        dict(meta_sgd=True, adapt=["head"], grad_clip=1.0),
    ],
    ids=["maml", "fomaml-adam", "metasgd-anil"],
)
def test_maml_module_trains_on_sinusoid(kwargs, tmp_path):
    model = MAML(net=NetConfig(kind="mlp", hidden=16), inner_steps=2, inner_lr=0.05, **kwargs)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    metrics = _fit(model, SinusoidDataModule(meta_batch_size=2, train_batches=1, val_batches=1), tmp_path)
    for key in ("train/loss_pre", "train/loss_post", "val/loss_pre", "val/loss_post", "train/step_time_s"):
        assert torch.isfinite(metrics[key]), key
    assert any(not torch.equal(before[n], p) for n, p in model.named_parameters())
    if kwargs.get("meta_sgd"):
        assert set(model.inner_lrs) == {"head__weight", "head__bias"}
        assert not torch.equal(model.inner_lrs["head__bias"], torch.full_like(model.inner_lrs["head__bias"], 0.05))


def test_maml_module_logs_accuracy_for_classification(tmp_path):
    model = MAML(net=NetConfig(kind="mlp", in_dim=4, out_dim=3, hidden=8), loss="cross_entropy", inner_lr=0.1)
    metrics = _fit(model, _ClassificationData.make(), tmp_path)
    for key in ("train/acc_pre", "train/acc_post", "val/acc_pre", "val/acc_post"):
        assert 0 <= metrics[key] <= 1, key


def test_maml_module_checks_its_arguments_and_data(tmp_path):
    assert MAML(net={"kind": "mlp", "hidden": 4}).net_config.hidden == 4  # checkpoint hparams
    with pytest.raises(ValueError, match="adapt names"):
        MAML(adapt=["nope"])
    with pytest.raises(ValueError, match="inner_steps"):
        MAML(inner_steps=-1)
    with pytest.raises(ValueError, match="multiple of n_heads"):
        NetConfig(kind="transformer", d_model=10, n_heads=4)
    model = MAML(net=NetConfig(kind="transformer", in_dim=5, d_model=8, n_heads=2))
    with pytest.raises(ValueError, match="net.in_dim"):
        _fit(model, InContextRegressionDataModule(dim=2, seq_len=4, meta_batch_size=1), tmp_path)


def test_lightning_maml_takes_an_injected_network():
    # `net:` with class_path in a recipe: the module uses the network as given, its weights are
    # saved with the module and it is no hyperparameter
    from ttt_flash.models import SinusoidMLP

    net = SinusoidMLP(hidden=4)
    module = MAML(net=net, inner_steps=1)
    assert module.net is net and module.net_config is None and "net" not in module.hparams
    assert {n for n, _ in module.named_parameters()} == {f"net.{n}" for n, _ in net.named_parameters()}
