"""Implicit MAML and Reptile (ttt_flash.meta and the Lightning MAML module's ``algorithm``).

iMAML's meta-gradient is checked in float64 against the θ-derivative of the exact regularised
solution (a linear model, where φ*(θ) is a linear solve) and against a dense solve of
(I + H/λ) g = ∇L_query with H from torch.func.hessian (an MLP, a GPT through flash_attention,
an ANIL-style subset with its mixed second derivative); conjugate gradient with enough steps
equals the dense solve; Reptile is checked against its definition; both run through the
Lightning module.
"""

import math

import pytest
import torch
from torch import nn
from torch.func import functional_call

from ttt_flash.meta import (
    conjugate_gradient,
    imaml_meta_gradient,
    proximal_inner_loop,
    reptile_meta_gradient,
)

pytestmark = pytest.mark.usefixtures("one_thread")

MODES = ["rev_rev", "fwd_rev"]


def _lbfgs(ps):
    return torch.optim.LBFGS(ps, lr=1, max_iter=200, tolerance_grad=1e-15, tolerance_change=0,
                             line_search_fn="strong_wolfe")


def _flat(tensors, names):
    return torch.cat([tensors[n].reshape(-1) for n in names])


def _unflat(x, like, names):
    out, i = {}, 0
    for n in names:
        k = like[n].numel()
        out[n] = x[i:i + k].reshape(like[n].shape)
        i += k
    return out


def _mlp():
    return nn.Sequential(nn.Linear(2, 4), nn.Tanh(), nn.Linear(4, 1)).double()


def _data(n, d=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g, dtype=torch.float64), torch.randn(n, 1, generator=g, dtype=torch.float64)


def _mse(a, b):
    return nn.functional.mse_loss(a, b)


# --------------------------------------------------------------------------- conjugate gradient


def test_conjugate_gradient_equals_the_dense_solve_in_n_steps():
    g = torch.Generator().manual_seed(1)
    m = torch.randn(12, 12, generator=g, dtype=torch.float64)
    a = m @ m.T / 12 + torch.eye(12, dtype=torch.float64)  # condition number ~10
    b = torch.randn(12, generator=g, dtype=torch.float64)
    # two "parameters" (shapes (3, 2) and (6,)) of one 12-dimensional system
    split = lambda x: [x[:6].reshape(3, 2), x[6:]]  # noqa: E731
    mv = lambda vs: split(a @ torch.cat([v.reshape(-1) for v in vs]))  # noqa: E731
    x, rep = conjugate_gradient(mv, split(b), steps=12, tol=1e-13)
    dense = torch.linalg.solve(a, b)
    assert rep.converged and not rep.negative_curvature and rep.steps <= 12
    assert (torch.cat([t.reshape(-1) for t in x]) - dense).abs().max() <= 1e-8 * dense.abs().max()
    # too few steps: not converged, the residual reported is the true one
    x, rep = conjugate_gradient(mv, split(b), steps=2, tol=1e-13)
    true = (b - a @ torch.cat([t.reshape(-1) for t in x])).norm()
    assert not rep.converged and rep.steps == 2
    assert rep.residual == pytest.approx(float(true), rel=1e-6)
    assert rep.rel_residual == pytest.approx(float(true / b.norm()), rel=1e-6)


def test_conjugate_gradient_reports_negative_curvature():
    a = torch.diag(torch.tensor([1.0, -2.0, 3.0], dtype=torch.float64))
    _, rep = conjugate_gradient(lambda vs: [a @ vs[0]], [torch.ones(3, dtype=torch.float64)], steps=5)
    assert rep.negative_curvature and not rep.converged


def test_conjugate_gradient_zero_rhs_and_bad_arguments():
    x, rep = conjugate_gradient(lambda vs: vs, [torch.zeros(3)], steps=3)
    assert rep.converged and rep.steps == 0 and x[0].abs().max() == 0
    with pytest.raises(ValueError, match="tol"):
        conjugate_gradient(lambda vs: vs, [torch.ones(3)], steps=3, tol=-1.0)
    with pytest.raises(ValueError, match="steps"):
        conjugate_gradient(lambda vs: vs, [torch.ones(3)], steps=-1)


# --------------------------------------------------------------------------- iMAML, float64


@pytest.mark.parametrize("mode", MODES)
def test_imaml_equals_the_derivative_of_the_exact_regularised_solution(mode):
    """Linear regression: L_task is quadratic, φ*(θ) = (A + λI)⁻¹(c + λθ) exactly; autograd of
    L_query(φ*(θ)) w.r.t. θ is the closed form the iMAML meta-gradient must equal."""
    torch.manual_seed(0)
    net = nn.Linear(3, 2).double()
    support, query = _data(10, 3, seed=1), _data(7, 3, seed=2)
    support = (support[0], torch.cat([support[1], -support[1] ** 2], 1))
    query = (query[0], torch.cat([query[1], query[1].sin()], 1))
    lam = 0.7
    names = [n for n, _ in net.named_parameters()]
    params = dict(net.named_parameters())
    theta = _flat(params, names).detach()

    def loss(x, batch):
        return _mse(functional_call(net, _unflat(x, params, names), (batch[0],)), batch[1])

    zero = torch.zeros_like(theta)
    a = torch.func.hessian(lambda x: loss(x, support))(zero)
    c = -torch.func.grad(lambda x: loss(x, support))(zero)
    th = theta.clone().requires_grad_(True)
    phi_star = torch.linalg.solve(a + lam * torch.eye(len(theta), dtype=a.dtype), c + lam * th)
    (closed,) = torch.autograd.grad(loss(phi_star, query), th)

    res = imaml_meta_gradient(net, None, _mse, support, query, 3, 0.0, lam, cg_steps=len(theta),
                              cg_tol=1e-14, optimizer=_lbfgs, hessian_mode=mode)
    assert res.cg.converged
    assert (_flat(res.adapted, names) - phi_star.detach()).abs().max() <= 1e-10
    assert (_flat(res.grads, names) - closed).abs().max() <= 1e-8
    assert res.loss_query == pytest.approx(float(loss(phi_star, query).detach()), rel=1e-10)


def _dense_imaml(net, names, phi, support, query, lam):
    """(I + H/λ)⁻¹ ∇L_query at φ (the adapted ``names``), H = ∇²L_task there, dense."""
    params = dict(net.named_parameters())
    fixed = {n: p.detach() for n, p in params.items() if n not in names}
    like = {n: params[n] for n in names}

    def loss(x, batch):
        return _mse(functional_call(net, {**fixed, **_unflat(x, like, names)}, (batch[0],)), batch[1])

    x = _flat(phi, names)
    h = torch.func.hessian(lambda y: loss(y, support))(x)
    v = torch.func.grad(lambda y: loss(y, query))(x)
    return torch.linalg.solve(torch.eye(len(x), dtype=x.dtype) + h / lam, v), h


@pytest.mark.parametrize("mode", MODES)
def test_imaml_equals_the_dense_solve_at_the_regularised_minimum(mode):
    net = _mlp()
    support, query = _data(12, seed=3), _data(9, seed=4)
    names = [n for n, _ in net.named_parameters()]
    lam = 1.5
    res = imaml_meta_gradient(net, None, _mse, support, query, 2, 0.0, lam, cg_steps=40, cg_tol=1e-14,
                              optimizer=_lbfgs, hessian_mode=mode)
    # the inner loop reached the minimum of the proximal loss
    params = dict(net.named_parameters())
    phi = {n: res.adapted[n].clone().requires_grad_(True) for n in names}
    prox = _mse(functional_call(net, phi, (support[0],)), support[1]) + 0.5 * lam * sum(
        ((phi[n] - params[n].detach()) ** 2).sum() for n in names)
    assert max(g.abs().max() for g in torch.autograd.grad(prox, list(phi.values()))) <= 1e-8
    dense, _ = _dense_imaml(net, names, res.adapted, support, query, lam)
    assert res.cg.converged
    assert (_flat(res.grads, names) - dense).abs().max() <= 1e-8


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_cg_with_enough_steps_equals_the_dense_solve_after_a_few_inner_steps(optimizer):
    """Away from the minimum too: with as many CG steps as parameters, the solve is exact."""
    net = _mlp()
    support, query = _data(12, seed=5), _data(9, seed=6)
    names = [n for n, _ in net.named_parameters()]
    n = sum(p.numel() for p in net.parameters())
    lam = 4.0  # I + H/λ positive definite here
    res = imaml_meta_gradient(net, None, _mse, support, query, 3, 0.1, lam, cg_steps=3 * n, cg_tol=1e-14,
                              optimizer=optimizer)
    dense, h = _dense_imaml(net, names, res.adapted, support, query, lam)
    assert torch.linalg.eigvalsh(torch.eye(n, dtype=h.dtype) + h / lam).min() > 0
    assert res.cg.converged and (_flat(res.grads, names) - dense).abs().max() <= 1e-8
    # fewer steps: an approximation, reported as such
    with pytest.warns(RuntimeWarning, match="did not converge: relative residual"):
        few = imaml_meta_gradient(net, None, _mse, support, query, 3, 0.1, lam, cg_steps=1, cg_tol=1e-14,
                                  optimizer=optimizer)
    assert not few.cg.converged and few.cg.steps == 1 and few.cg.rel_residual > 1e-14


@pytest.mark.parametrize("mode", MODES)
def test_imaml_shared_weights_get_the_mixed_second_derivative(mode):
    """ANIL-style subset: the shared weights w feel φ*(θ, w) through ∂²L_task/∂w∂φ."""
    net = _mlp()
    support, query = _data(12, seed=7), _data(9, seed=8)
    names = [n for n, _ in net.named_parameters()]
    adapted, shared = ["2.weight", "2.bias"], ["0.weight", "0.bias"]
    lam = 1.0
    res = imaml_meta_gradient(net, None, _mse, support, query, 2, 0.0, lam, cg_steps=20, cg_tol=1e-14,
                              optimizer=_lbfgs, adapt=["2"], hessian_mode=mode)
    params = dict(net.named_parameters())
    for n in shared:  # the shared weights are not adapted
        assert res.adapted[n] is params[n]
    # dense: x = (φ, w); dφ*/dw = −(H_φφ + λI)⁻¹ H_φw
    full = {**{n: res.adapted[n] for n in adapted}, **{n: params[n].detach() for n in shared}}
    order = adapted + shared

    def loss(x, batch):
        return _mse(functional_call(net, _unflat(x, params, order), (batch[0],)), batch[1])

    x = _flat(full, order)
    h = torch.func.hessian(lambda y: loss(y, support))(x)
    gq = torch.func.grad(lambda y: loss(y, query))(x)
    k = sum(params[n].numel() for n in adapted)
    g = torch.linalg.solve(torch.eye(k, dtype=x.dtype) + h[:k, :k] / lam, gq[:k])
    gw = gq[k:] - h[k:, :k] @ g / lam
    assert (_flat(res.grads, adapted) - g).abs().max() <= 1e-8
    assert (_flat(res.grads, shared) - gw).abs().max() <= 1e-8


@pytest.mark.parametrize("mode", MODES)
def test_imaml_through_flash_attention_equals_the_dense_solve(mode):
    """A GPT whose attention is ttt_flash.flash_attention (float64: the exact reference), the
    attention's q/k/v projection adapted: H comes from attention's double backward."""
    from ttt_flash.models import NetConfig
    from ttt_flash.tasks import InContextRegressionTasks, incontext_mse

    torch.manual_seed(0)
    net = NetConfig(kind="gpt", in_dim=4, out_dim=1, d_model=8, n_heads=2, n_layers=1).build().double()
    batch = InContextRegressionTasks(dim=2, seq_len=8, support_size=2, query_size=2).sample(
        1, torch.Generator().manual_seed(0), dtype=torch.float64)
    support, query = batch.task(0)
    adapted = ["gpt.blocks.0.attn.qkv.weight"]
    lam = 3.0
    res = imaml_meta_gradient(net, None, incontext_mse, support, query, 2, 0.05, lam, cg_steps=200,
                              cg_tol=1e-13, adapt=adapted, hessian_mode=mode)
    params = dict(net.named_parameters())
    fixed = {n: p.detach() for n, p in params.items() if n not in adapted}

    def loss(x, b):
        return incontext_mse(functional_call(net, {**fixed, **_unflat(x, params, adapted)}, (b[0],)), b[1])

    x = _flat(res.adapted, adapted)
    h = torch.func.hessian(lambda y: loss(y, support))(x)
    v = torch.func.grad(lambda y: loss(y, query))(x)
    dense = torch.linalg.solve(torch.eye(len(x), dtype=x.dtype) + h / lam, v)
    assert res.cg.converged
    assert (_flat(res.grads, adapted) - dense).abs().max() <= 1e-8 * max(1.0, float(dense.abs().max()))


def test_imaml_inner_loop_keeps_no_graph_and_matches_a_manual_loop():
    net = _mlp()
    support = _data(12, seed=9)
    lam, lr, steps = 0.5, 0.1, 4
    fast = proximal_inner_loop(net, None, _mse, support, steps, lr, lam)
    assert all(not t.requires_grad and t.grad_fn is None for t in fast.values())
    theta = {n: p.detach() for n, p in net.named_parameters()}
    phi = {n: t.clone().requires_grad_(True) for n, t in theta.items()}
    for _ in range(steps):
        loss = _mse(functional_call(net, phi, (support[0],)), support[1])
        loss = loss + 0.5 * lam * sum(((phi[n] - theta[n]) ** 2).sum() for n in phi)
        grads = torch.autograd.grad(loss, list(phi.values()))
        phi = {n: (t - lr * g).detach().requires_grad_(True) for (n, t), g in zip(phi.items(), grads)}
    for n in phi:
        torch.testing.assert_close(fast[n], phi[n].detach(), rtol=1e-12, atol=1e-12)


def test_imaml_bad_arguments_name_the_argument():
    net = _mlp()
    s, q = _data(4), _data(4)
    with pytest.raises(ValueError, match="lam"):
        imaml_meta_gradient(net, None, _mse, s, q, 1, 0.1, 0.0)
    with pytest.raises(ValueError, match="hessian_mode"):
        imaml_meta_gradient(net, None, _mse, s, q, 1, 0.1, 1.0, hessian_mode="rev_fwd")
    with pytest.raises(ValueError, match="cg_tol"):
        imaml_meta_gradient(net, None, _mse, s, q, 1, 0.1, 1.0, cg_tol=-1)
    with pytest.raises(ValueError, match="steps"):
        imaml_meta_gradient(net, None, _mse, s, q, 1, 0.1, 1.0, cg_steps=-1)
    with pytest.raises(TypeError, match="query_batch"):
        imaml_meta_gradient(net, None, _mse, s, q[0], 1, 0.1, 1.0)
    with pytest.raises(ValueError, match="optimizer"):
        proximal_inner_loop(net, None, _mse, s, 1, 0.1, 1.0, optimizer="rmsprop")
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        proximal_inner_loop(net, None, _mse, s, 1, 0.1, 1.0, optimizer=lambda ps: None)
    with pytest.raises(ValueError, match="lam"):
        proximal_inner_loop(net, None, _mse, s, 1, 0.1, -1.0)


# --------------------------------------------------------------------------- Reptile


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_reptile_is_theta_minus_the_adapted_weights(optimizer):
    net = _mlp()
    support = _data(10, seed=10)
    lr, steps = 0.05, 5
    res = reptile_meta_gradient(net, None, _mse, support, steps, lr, optimizer=optimizer)
    # the definition: k optimizer steps on L_task from θ, meta-gradient θ − φ
    copy = _mlp()
    copy.load_state_dict(net.state_dict())
    make = torch.optim.SGD if optimizer == "sgd" else torch.optim.Adam
    opt = make(copy.parameters(), lr=lr)
    for _ in range(steps):
        opt.zero_grad()
        _mse(copy(support[0]), support[1]).backward()
        opt.step()
    for (n, p), (_, q) in zip(net.named_parameters(), copy.named_parameters()):
        torch.testing.assert_close(res.grads[n], p.detach() - q.detach(), rtol=1e-12, atol=1e-12)
        assert res.grads[n].abs().max() > 0


def test_reptile_subset_gives_zero_to_the_rest_and_an_outer_sgd_step_is_reptiles_update():
    net = _mlp()
    support = _data(10, seed=11)
    res = reptile_meta_gradient(net, None, _mse, support, 3, 0.1, adapt=["2"])
    assert res.grads["0.weight"].abs().max() == 0 and res.grads["2.weight"].abs().max() > 0
    eps = 0.3
    before = {n: p.detach().clone() for n, p in net.named_parameters()}
    opt = torch.optim.SGD(net.parameters(), lr=eps)
    for n, p in net.named_parameters():
        p.grad = res.grads[n]
    opt.step()
    for n, p in net.named_parameters():  # θ ← θ + ε (φ − θ)
        torch.testing.assert_close(p.detach(), before[n] + eps * (res.adapted[n] - before[n]))


# --------------------------------------------------------------------------- Lightning


def _sinusoid_batch(tasks=3):
    from ttt_flash.tasks import SinusoidTasks

    return SinusoidTasks(k_shot=5, k_query=5).sample(tasks, torch.Generator().manual_seed(0))


@pytest.mark.parametrize("algorithm", ["imaml", "reptile"])
def test_lightning_accumulates_the_mean_task_meta_gradient(algorithm):
    from ttt_flash.lightning import MAML
    from ttt_flash.models import NetConfig

    torch.manual_seed(0)
    kw = dict(imaml_lam=50.0, cg_steps=30, cg_tol=1e-12) if algorithm == "imaml" else {}
    module = MAML(NetConfig(kind="mlp", hidden=8, depth=1), inner_steps=3, inner_lr=0.05,
                  algorithm=algorithm, **kw)
    batch = _sinusoid_batch()
    sums = {}
    for t in range(batch.num_tasks):
        support, query = batch.task(t)
        post = module._first_order_task(support, query, batch.num_tasks, sums)
        assert post["loss"].requires_grad is False
    want = {n: torch.zeros_like(p) for n, p in module.net.named_parameters()}
    for t in range(batch.num_tasks):
        support, query = batch.task(t)
        if algorithm == "imaml":
            g = imaml_meta_gradient(module.net, None, module.loss_fn, support, query, 3, 0.05, 50.0,
                                    cg_steps=30, cg_tol=1e-12).grads
        else:
            g = reptile_meta_gradient(module.net, None, module.loss_fn, support, 3, 0.05).grads
        for n in want:
            want[n] += g[n] / batch.num_tasks
    for n, p in module.net.named_parameters():
        torch.testing.assert_close(p.grad, want[n], rtol=1e-5, atol=1e-7)
    if algorithm == "imaml":
        assert float(sums["cg_rel_residual"]) <= 1e-6


@pytest.mark.parametrize("algorithm,extra", [("imaml", {"hessian_mode": "fwd_rev"}), ("reptile", {})])
def test_lightning_trains_and_logs(algorithm, extra, tmp_path):
    import lightning.pytorch as pl

    from ttt_flash.lightning import MAML, SinusoidDataModule
    from ttt_flash.models import NetConfig

    module = MAML(NetConfig(kind="mlp", hidden=8, depth=1), inner_steps=3, inner_lr=0.05,
                  algorithm=algorithm, eval_inner_steps=3, **extra)
    before = [p.detach().clone() for p in module.parameters()]
    data = SinusoidDataModule(k_shot=5, k_query=5, meta_batch_size=2, train_batches=2, val_batches=1,
                              test_batches=1)
    trainer = pl.Trainer(max_steps=2, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
                         num_sanity_val_steps=0)
    trainer.fit(module, data)
    assert any((p.detach() - b).abs().max() > 0 for p, b in zip(module.parameters(), before))
    metrics = trainer.callback_metrics
    assert math.isfinite(float(metrics["train/loss_post"])) and math.isfinite(float(metrics["val/loss_post"]))
    assert ("train/cg_rel_residual" in metrics) == (algorithm == "imaml")


def test_lightning_refuses_bad_algorithms_and_options_that_do_not_apply():
    from ttt_flash.lightning import MAML

    with pytest.raises(ValueError, match="algorithm must be one of"):
        MAML(algorithm="anil")
    with pytest.raises(ValueError, match="first_order=true applies to algorithm='maml' only"):
        MAML(algorithm="imaml", first_order=True)
    with pytest.raises(ValueError, match="meta_sgd=true applies to algorithm='maml' only"):
        MAML(algorithm="reptile", meta_sgd=True)
    with pytest.raises(ValueError, match="cg_steps applies to algorithm='imaml' only"):
        MAML(algorithm="maml", cg_steps=5)
    with pytest.raises(ValueError, match="imaml_lam, hessian_mode apply to algorithm='imaml' only"):
        MAML(algorithm="reptile", imaml_lam=1.0, hessian_mode="fwd_rev")
    with pytest.raises(ValueError, match="imaml_lam must be a float > 0"):
        MAML(algorithm="imaml", imaml_lam=0.0)
    with pytest.raises(ValueError, match="cg_steps must be an int >= 1"):
        MAML(algorithm="imaml", cg_steps=0)
    with pytest.raises(ValueError, match="hessian_mode must be one of"):
        MAML(algorithm="imaml", hessian_mode="fwd")


# --------------------------------------------------------------------------- recipes and the GPU script


def test_recipes_name_their_algorithm_and_the_long_one_is_32k():
    import yaml
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent / "recipes"
    for name, algorithm in [("imaml_regression", "imaml"), ("imaml_regression_long", "imaml"),
                            ("reptile_sinusoid", "reptile")]:
        config = yaml.safe_load((root / f"{name}.yaml").read_text())
        assert config["model"]["init_args"]["algorithm"] == algorithm
    long = yaml.safe_load((root / "imaml_regression_long.yaml").read_text())
    assert long["data"]["init_args"]["seq_len"] == 32768


def test_imaml_memory_script_runs_on_the_cpu(tmp_path, capsys):
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "scripts" / "imaml_memory.py"
    spec = importlib.util.spec_from_file_location("imaml_memory", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.main(["--out", str(tmp_path), "--device", "cpu", "--tokens", "16", "--ks", "1,2",
                        "--train-steps", "2", "--probe-ks", "3", "--eval-tasks", "1", "--d-model", "8",
                        "--n-heads", "2", "--n-layers", "1"]) == 0
    rows = json.loads((tmp_path / "imaml_memory.json").read_text())["rows"]
    assert [(r["method"], r["k"], r["status"]) for r in rows] == [
        ("maml", 1, "ok"), ("maml", 2, "ok"), ("maml", 3, "ok"),
        ("imaml", 1, "ok"), ("imaml", 2, "ok"), ("imaml", 3, "ok")]
    assert all(math.isfinite(r["eval_post"]) for r in rows if not r["probe"])
    assert capsys.readouterr().out.splitlines()[-1].startswith("imaml     3 ok")


_RESUME = {
    "reptile_sinusoid": ["--data.init_args.train_batches=4", "--data.init_args.meta_batch_size=2",
                         "--data.init_args.val_batches=1", "--model.init_args.inner_steps=2"],
    "imaml_regression": ["--data.init_args.train_batches=4", "--data.init_args.meta_batch_size=1",
                         "--data.init_args.val_batches=1", "--data.init_args.support_size=1",
                         "--data.init_args.query_size=1", "--data.init_args.seq_len=8",
                         "--model.init_args.inner_steps=2", "--model.init_args.eval_inner_steps=2",
                         "--model.init_args.net.d_model=8", "--model.init_args.net.n_layers=1"],
}


@pytest.mark.parametrize("recipe", sorted(_RESUME))
def test_recipe_resumes_exactly_mid_epoch(recipe, tmp_path, monkeypatch):
    """A run resumed from a mid-epoch checkpoint ends with the straight run's weights,
    optimizer state and logged rows (wall-clock columns aside)."""
    import csv
    import shutil
    from pathlib import Path

    from ttt_flash.cli import main

    monkeypatch.chdir(tmp_path)
    argv = ["fit", "--config", str(Path(__file__).resolve().parent.parent / "recipes" / f"{recipe}.yaml"),
            *_RESUME[recipe], "--trainer.max_epochs=3", "--trainer.enable_progress_bar=false",
            "--trainer.enable_model_summary=false", "--trainer.log_every_n_steps=1",
            "--trainer.callbacks.init_args.every_n_train_steps=1", "--trainer.callbacks.init_args.save_top_k=-1",
            "--trainer.callbacks.init_args.filename={step}"]

    def rows(path):
        with open(path, newline="") as f:
            return [{k: v for k, v in r.items() if not k.endswith("_s")} for r in csv.DictReader(f)]

    assert main(argv) == 0
    folder = tmp_path / "runs" / recipe
    reference = torch.load(folder / "checkpoints" / "last.ckpt", weights_only=True)
    reference_rows = rows(folder / "metrics.csv")
    assert reference["global_step"] == 12
    shutil.copy(folder / "checkpoints" / "step=6.ckpt", tmp_path / "k6.ckpt")
    assert main([*argv, "--ckpt_path", str(tmp_path / "k6.ckpt")]) == 0
    resumed = torch.load(folder / "checkpoints" / "last.ckpt", weights_only=True)
    assert resumed["global_step"] == 12
    for name, value in reference["state_dict"].items():
        assert torch.equal(value, resumed["state_dict"][name]), name
    for sa, sb in zip(reference["optimizer_states"], resumed["optimizer_states"]):
        for key, state in sa["state"].items():
            for k, v in state.items():
                if torch.is_tensor(v):
                    assert torch.equal(v, sb["state"][key][k]), (key, k)
    assert rows(folder / "metrics.csv") == reference_rows


@pytest.mark.slow  # two processes (README: the slow tests)
def test_imaml_meta_gradient_under_ddp_equals_one_process(tmp_path):
    """Two processes with 1 and 3 tasks give the one-process meta-gradient of the 4 tasks
    (the module's own gradient averaging, weighted by tasks), through the helpers of
    tests/test_distributed.py."""
    import test_distributed as helpers  # tests/ is on sys.path (pytest's rootdir-relative import)

    from ttt_flash.lightning import MAML
    from ttt_flash.models import NetConfig
    from ttt_flash.tasks import SinusoidTasks

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    tasks = SinusoidTasks(k_shot=5, k_query=5)
    shards = [tasks.sample(1, generator=g), tasks.sample(3, generator=g)]
    model = MAML(net=NetConfig(kind="mlp", hidden=8, depth=1), inner_steps=2, inner_lr=0.05, algorithm="imaml",
                 imaml_lam=50.0, cg_steps=10)
    single, _ = helpers._compare(model, shards, tmp_path)
    assert all(v.abs().max() > 0 for v in single["grads"].values())


def test_cuda_graph_with_imaml_or_reptile_is_refused():
    from ttt_flash.lightning import MAML

    for algorithm in ("imaml", "reptile"):
        with pytest.raises(ValueError, match="cuda_graph=true applies to algorithm='maml' only"):
            MAML(algorithm=algorithm, cuda_graph=True)


@pytest.mark.parametrize("cg_steps,warns", [(5, False), (1, True)], ids=["partial-solve-quiet", "unusable-warns"])
def test_lightning_warns_only_when_the_cg_solve_is_unusable(cg_steps, warns, one_thread):
    """A CG budget that ends above cg_tol but removes most of the residual (5 steps: ~1e-4 here)
    gives a usable meta-gradient: no warning (recipes/imaml_regression.yaml warned on every run);
    one step that leaves more than half of it (CG_WARN_RESIDUAL) warns once."""
    import warnings

    import lightning.pytorch as pl

    from ttt_flash.lightning import MAML, SinusoidDataModule
    from ttt_flash.models import NetConfig
    from ttt_flash.lightning.maml import CG_WARN_RESIDUAL

    torch.manual_seed(0)
    module = MAML(NetConfig(kind="mlp", hidden=8, depth=1), inner_steps=3, inner_lr=0.05, algorithm="imaml",
                  imaml_lam=5.0, cg_steps=cg_steps, cg_tol=1e-12)
    data = SinusoidDataModule(k_shot=5, k_query=5, meta_batch_size=2, train_batches=3, val_batches=1, test_batches=1)
    trainer = pl.Trainer(max_steps=3, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         limit_val_batches=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, data)
    residual = float(trainer.callback_metrics["train/cg_rel_residual"])
    found = [w for w in caught if "conjugate gradient" in str(w.message)]
    assert residual > 1e-12  # CG stopped above cg_tol either way
    assert (residual > CG_WARN_RESIDUAL) == warns and len(found) == int(warns), (residual, found)
