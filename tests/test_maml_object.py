"""Object-style MAML (``MAML(module, lr)``, ``clone``, ``adapt``, ``learner(x)``) equals the
functional ``inner_loop`` in float64: the adapted parameters and the meta-gradients."""

import pytest
import torch
from torch import nn

from ttt_flash.meta import MAML, Learner, functional_loss, inner_loop

mse = nn.functional.mse_loss


def _net_and_task(seed=0):
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(2, 6), nn.Tanh(), nn.Linear(6, 1)).double()
    support = (torch.randn(5, 2, dtype=torch.float64), torch.randn(5, 1, dtype=torch.float64))
    query = (torch.randn(7, 2, dtype=torch.float64), torch.randn(7, 1, dtype=torch.float64))
    return net, support, query


@pytest.mark.parametrize("first_order", [False, True])
@pytest.mark.parametrize("adapt", [None, ["2"]])
def test_object_maml_equals_inner_loop(first_order, adapt):
    net, (xs, ys), (xq, yq) = _net_and_task()
    params = list(net.parameters())

    fast = inner_loop(net, None, mse, (xs, ys), steps=3, lr=0.3, first_order=first_order, adapt=adapt)
    want = torch.autograd.grad(functional_loss(net, fast, mse, (xq, yq)), params, allow_unused=True,
                               materialize_grads=True)

    maml = MAML(net, lr=0.3, first_order=first_order, adapt=adapt)
    learner = maml.clone()
    for _ in range(3):
        learner.adapt(mse(learner(xs), ys))
    assert isinstance(learner, Learner)
    for name, p in fast.items():
        torch.testing.assert_close(learner.params[name], p, rtol=0, atol=1e-14)
    got = torch.autograd.grad(mse(learner(xq), yq), params, allow_unused=True, materialize_grads=True)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-14)
    # second order differs from first order (the test is not vacuous)
    other = inner_loop(net, None, mse, (xs, ys), steps=3, lr=0.3, first_order=not first_order, adapt=adapt)
    other_g = torch.autograd.grad(functional_loss(net, other, mse, (xq, yq)), params[0] if adapt is None
                                  else params[2])[0]
    assert not torch.allclose(other_g, got[0] if adapt is None else got[2])


def test_meta_gradient_is_exact_second_order():
    # gradcheck of the whole meta-objective w.r.t. the initial weights, through adapt()
    net, (xs, ys), (xq, yq) = _net_and_task(1)
    names = [n for n, _ in net.named_parameters()]
    maml = MAML(net, lr=0.2)

    def objective(*weights):
        learner = Learner(maml, dict(zip(names, weights)))
        learner.adapt(mse(learner(xs), ys)).adapt(mse(learner(xs), ys))
        return mse(learner(xq), yq)

    weights = tuple(p.detach().clone().requires_grad_(True) for p in net.parameters())
    assert torch.autograd.gradcheck(objective, weights)
    assert torch.autograd.gradgradcheck(objective, weights)


def test_clone_branches_and_module_is_untouched():
    net, (xs, ys), _ = _net_and_task()
    before = [p.detach().clone() for p in net.parameters()]
    maml = MAML(net, lr=0.1)
    a = maml.clone()
    a.adapt(mse(a(xs), ys))
    b = a.clone()
    b.adapt(mse(b(xs), ys))
    assert not torch.equal(a.params["0.weight"], b.params["0.weight"])
    assert all(torch.equal(p, q) for p, q in zip(before, net.parameters()))
    torch.testing.assert_close(maml(xs), net(xs))


def test_learnable_lr_gets_a_gradient():
    net, (xs, ys), (xq, yq) = _net_and_task()
    lr = nn.Parameter(torch.tensor(0.1, dtype=torch.float64))
    maml = MAML(net, lr=lr)
    assert any(p is lr for p in maml.parameters())
    learner = maml.clone()
    learner.adapt(mse(learner(xs), ys))
    mse(learner(xq), yq).backward()
    assert lr.grad is not None and lr.grad.abs() > 0


def test_clear_errors():
    net, (xs, ys), _ = _net_and_task()
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        MAML("net", lr=0.1)
    with pytest.raises(ValueError, match="lr must be finite and >= 0"):
        MAML(net, lr=-1.0)
    with pytest.raises(ValueError, match="adapt"):
        MAML(net, lr=0.1, adapt=["nope"])
    learner = MAML(net, lr=0.1).clone()
    with pytest.raises(ValueError, match="scalar tensor"):
        learner.adapt((learner(xs) - ys) ** 2)
    with torch.no_grad():
        loss = mse(learner(xs), ys)
    with pytest.raises(RuntimeError, match="the loss has no graph"):
        learner.adapt(loss)
