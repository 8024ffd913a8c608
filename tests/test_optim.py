"""ttt_flash.second_order.optim: one Sophia-H / AdaHessian step against hand-computed updates on a
quadratic with a diagonal Hessian (where one Rademacher Hutchinson probe is exact), the
three ways to refresh the Hessian, the refresh schedule, state_dict and bad inputs."""

import copy
import warnings

import pytest
import torch
from torch import nn

from ttt_flash.second_order.optim import AdaHessian, SophiaH

# f(x) = ½ xᵀ A x − bᵀ x with A = diag(a): ∇f = a ∘ x − b, ∇²f = diag(a).
A = torch.tensor([1.0, 100.0, 2.0, 0.5], dtype=torch.float64)
X0 = torch.tensor([0.5, 0.03, -2.0, 1.0], dtype=torch.float64)
B = torch.tensor([0.4, 2.0, 1.0, 0.0], dtype=torch.float64)
G0 = A * X0 - B  # [0.1, 1.0, -5.0, 0.5]


def quad(x):
    return 0.5 * (A * x * x).sum() - (B * x).sum()


@pytest.fixture(autouse=True)
def _quiet_create_graph_warning():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Using backward\\(\\) with create_graph=True")
        yield


def _param():
    return nn.Parameter(X0.clone())


def _run(opt_cls, mode, steps=1, **kw):
    x = _param()
    opt = opt_cls([x], **kw)
    for _ in range(steps):
        opt.zero_grad()
        if mode == "backward":  # 1. create_graph backward, step refreshes when due
            quad(x).backward(create_graph=opt.hessian_due)
            opt.step()
        elif mode == "explicit":  # 2. update_hessian() from p.grad's graph
            quad(x).backward(create_graph=True)
            opt.update_hessian()
            assert not x.grad.requires_grad, "update_hessian() must detach p.grad"
            opt.step()
        elif mode == "loss":  # 3. update_hessian(loss), plain backward
            if opt.hessian_due:
                opt.update_hessian(quad(x))
            quad(x).backward()
            opt.step()
        elif mode == "closure":
            def closure():
                opt.zero_grad()
                loss = quad(x)
                loss.backward(create_graph=opt.hessian_due)
                return loss

            loss = opt.step(closure)
            assert isinstance(loss, torch.Tensor) and loss.dim() == 0  # step returns the closure's loss
        assert x.grad is None or not x.grad.requires_grad
    return x, opt


MODES = ["backward", "explicit", "loss", "closure"]


@pytest.mark.parametrize("mode", MODES)
def test_sophiah_one_step_matches_hand_computed(mode):
    lr, (b1, b2), rho, wd = 0.1, (0.965, 0.99), 1.0, 0.1
    x, opt = _run(SophiaH, mode, lr=lr, betas=(b1, b2), rho=rho, weight_decay=wd)
    h = (1 - b2) * A
    m = (1 - b1) * G0
    ratio = m / torch.clamp(rho * h, min=1e-15)  # [0.35, 0.035, -8.75 -> clipped, 7 -> clipped]
    expected = X0 * (1 - lr * wd) - lr * ratio.clamp(-1, 1)
    assert torch.allclose(x.detach(), expected, rtol=0, atol=1e-14)
    assert torch.allclose(opt.state[x]["hessian"], h, rtol=0, atol=1e-15)
    assert opt.clip_fraction.item() == pytest.approx(0.5)


def test_sophiah_negative_curvature_and_zero_hessian_take_sign_steps():
    a = torch.tensor([-3.0, 0.0], dtype=torch.float64)
    x = nn.Parameter(torch.tensor([1.0, 1.0], dtype=torch.float64))
    opt = SophiaH([x], lr=0.01, weight_decay=0.0)
    (0.5 * (a * x * x).sum() + 2 * x.sum()).backward(create_graph=True)  # g = a x + 2 = [-1, 2]
    opt.step()
    assert torch.allclose(x.detach(), torch.tensor([1.01, 0.99], dtype=torch.float64), atol=1e-15)


def test_sophiah_refreshes_every_k_steps():
    x, opt = _run(SophiaH, "backward", steps=5, k=2, lr=0.01)
    st = opt.state[x]
    assert st["step"] == 5 and st["hessian_step"] == 3  # refreshed before steps 1, 3, 5
    assert not opt.hessian_due  # 5 steps done: the next refresh is before step 7
    b2 = 0.99
    assert torch.allclose(st["hessian"], (1 - b2 ** 3) * A, atol=1e-14)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("power", [1.0, 0.5])
def test_adahessian_one_step_matches_hand_computed(mode, power):
    lr, (b1, b2), eps, wd = 0.15, (0.9, 0.999), 1e-4, 0.01
    x, opt = _run(AdaHessian, mode, lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd, hessian_power=power)
    # Step 1: m / (1 − β₁) = g, sqrt(v / (1 − β₂)) = |a|.
    expected = X0 - lr * (G0 / (A.abs() ** power + eps) + wd * X0)
    assert torch.allclose(x.detach(), expected, rtol=0, atol=1e-14)
    assert torch.allclose(opt.state[x]["exp_hessian_diag_sq"], (1 - b2) * A * A, atol=1e-15)


def test_adahessian_two_steps():
    lr, (b1, b2), eps = 0.05, (0.9, 0.999), 1e-4
    x, _ = _run(AdaHessian, "backward", steps=2, lr=lr, betas=(b1, b2), eps=eps)
    x1 = X0 - lr * G0 / (A + eps)
    g1 = A * x1 - B
    m = b1 * (1 - b1) * G0 + (1 - b1) * g1
    v = (1 - b2 ** 2) * A * A  # the same exact estimate twice
    x2 = x1 - lr * (m / (1 - b1 ** 2)) / ((v / (1 - b2 ** 2)).sqrt() + eps)
    assert torch.allclose(x.detach(), x2, rtol=0, atol=1e-14)


def test_adahessian_spatial_average_of_conv_kernels():
    a = torch.rand(2, 3, 3, 3, dtype=torch.float64) - 0.3  # some negative curvature
    w = nn.Parameter(torch.randn(2, 3, 3, 3, dtype=torch.float64))
    bias = nn.Parameter(torch.randn(2, dtype=torch.float64))
    opt = AdaHessian([w, bias], betas=(0.9, 0.5))
    (0.5 * (a * w * w).sum() + (bias ** 3).sum()).backward(create_graph=True)
    opt.update_hessian()
    avg = a.abs().mean(dim=(2, 3), keepdim=True).expand_as(a)
    assert torch.allclose(opt.state[w]["exp_hessian_diag_sq"], 0.5 * avg ** 2, atol=1e-15)
    assert torch.allclose(opt.state[bias]["exp_hessian_diag_sq"], 0.5 * (6 * bias.detach()) ** 2, atol=1e-12)
    opt2 = AdaHessian([w], betas=(0.9, 0.5), spatial_average=False)
    (0.5 * (a * w * w).sum()).backward(create_graph=True)
    opt2.update_hessian()
    assert torch.allclose(opt2.state[w]["exp_hessian_diag_sq"], 0.5 * a ** 2, atol=1e-15)


def test_state_dict_round_trip_continues_identically():
    x, opt = _run(SophiaH, "backward", steps=3, k=2, lr=0.01)
    y = nn.Parameter(x.detach().clone())
    opt2 = SophiaH([y], k=2, lr=0.01)
    opt2.load_state_dict(copy.deepcopy(opt.state_dict()))
    for p, o in ((x, opt), (y, opt2)):
        o.zero_grad()
        quad(p).backward(create_graph=o.hessian_due)
        o.step()
    assert torch.equal(x, y)
    assert opt2.state[y]["hessian_step"] == opt.state[x]["hessian_step"] == 2


def test_unused_parameter_is_skipped():
    x, unused = _param(), nn.Parameter(torch.ones(3, dtype=torch.float64))
    opt = SophiaH([x, unused], lr=0.01)
    quad(x).backward(create_graph=True)
    opt.step()
    assert unused.grad is None and len(opt.state[unused]) == 0
    assert torch.equal(unused.detach(), torch.ones(3, dtype=torch.float64))


def test_step_without_hessian_raises():
    for cls in (SophiaH, AdaHessian):
        x = _param()
        opt = cls([x])
        quad(x).backward()  # no create_graph: nothing to estimate from
        with pytest.raises(RuntimeError, match="no Hessian estimate"):
            opt.step()
        with pytest.raises(ValueError, match="create_graph=True"):
            opt.update_hessian()
        opt.zero_grad()
        with pytest.raises(ValueError, match="no gradients"):
            opt.update_hessian()


@pytest.mark.parametrize(
    "cls, kw, err",
    [
        (SophiaH, dict(lr=-1.0), ValueError),
        (SophiaH, dict(betas=(1.0, 0.99)), ValueError),
        (SophiaH, dict(betas=(0.9,)), TypeError),
        (SophiaH, dict(rho=0.0), ValueError),
        (SophiaH, dict(weight_decay=-0.1), ValueError),
        (SophiaH, dict(k=0), ValueError),
        (SophiaH, dict(k=2.5), ValueError),
        (SophiaH, dict(probe="uniform"), ValueError),
        (AdaHessian, dict(hessian_power=0.0), ValueError),
        (AdaHessian, dict(hessian_power=1.5), ValueError),
        (AdaHessian, dict(eps=-1e-4), ValueError),
        (AdaHessian, dict(spatial_average=1), TypeError),
    ],
    ids=lambda v: v.__name__ if isinstance(v, type) else str(v),
)
def test_bad_hyperparameters_raise(cls, kw, err):
    with pytest.raises(err):
        cls([_param()], **kw)


def test_sophiah_trains_a_small_network():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))
    x = torch.randn(64, 4)
    y = torch.sin(x.sum(1, keepdim=True))
    opt = SophiaH(net.parameters(), lr=0.02, rho=0.05, weight_decay=0.0)
    first = None
    for _ in range(60):
        opt.zero_grad()
        loss = nn.functional.mse_loss(net(x), y)
        first = first if first is not None else loss.item()
        loss.backward(create_graph=opt.hessian_due)
        opt.step()
    assert loss.item() < 0.5 * first
