"""ttt_flash.second_order: exact Hessian-vector products through GPT, Hutchinson estimators, power
iteration, parameter subsets and input validation."""

import math

import pytest
import torch
from torch import nn

from ttt_flash.second_order import (
    HessianOperator,
    exact_diagonal,
    hutchinson_diagonal,
    hutchinson_trace,
    hvp,
    probe_like,
    select_params,
    top_eigenvalue,
)
from ttt_flash.models import GPT, GPTConfig


def _flat(ts):
    return torch.cat([t.reshape(-1) for t in ts])


def _gpt_pair(**kw):
    """The same float64 GPT with ttt_flash attention and with materialised (math) attention."""
    ours = GPT(GPTConfig.tiny(attention="ttt_flash", **kw)).double()
    math_ = GPT(GPTConfig.tiny(attention="math", **kw)).double()
    math_.load_state_dict(ours.state_dict())
    return ours, math_


@pytest.mark.parametrize(
    "kw",
    [
        pytest.param(dict(), id="mha"),
        pytest.param(dict(n_kv_head=2, window=5), id="gqa2-window5"),
    ],
)
def test_hvp_through_gpt_matches_materialised_attention(kw):
    ours, ref = _gpt_pair(**kw)
    idx = torch.randint(0, 256, (2, 17))
    vecs = [torch.randn_like(p) for p in ours.parameters()]
    hv = {}
    for name, model in (("ttt_flash", ours), ("math", ref)):
        hv[name] = _flat(hvp(lambda m=model: m.loss(idx[:, :-1], idx[:, 1:]), model, vecs))
    err = (hv["ttt_flash"] - hv["math"]).norm() / hv["math"].norm()
    assert hv["math"].norm() > 0
    assert err <= 1e-8, f"relative error {err:.3e}"


def _small_gpt_subset():
    torch.manual_seed(1)
    model = GPT(GPTConfig.tiny(d_model=16, n_head=2, n_layer=1)).double()
    # Perturb the norm gains so that their Hessian is not degenerate at initialisation.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.3 * torch.randn_like(p))
    idx = torch.randint(0, 256, (2, 9))
    params = select_params(model, ["norm", "blocks.0.attn_norm"])
    op = HessianOperator(model.loss(idx[:, :-1], idx[:, 1:]), params)
    # The exact Hessian of the subset, column by column (32 products).
    cols = []
    for k, p in enumerate(op.params):
        for i in range(p.numel()):
            e = [torch.zeros_like(q) for q in op.params]
            e[k].view(-1)[i] = 1
            cols.append(_flat(op.mv(e)))
    return op, torch.stack(cols, dim=1)


def test_exact_diagonal_and_hutchinson_converge():
    op, H = _small_gpt_subset()
    assert torch.allclose(H, H.T, atol=1e-10), "the Hessian must be symmetric"
    diag = torch.diagonal(H)
    assert torch.allclose(_flat(exact_diagonal(op)), diag, rtol=0, atol=1e-12)
    # One Rademacher sample at i has variance sum_{j != i} H_ij^2.
    sigma = (H.pow(2).sum(1) - diag.pow(2)).sqrt()
    errors = {}
    for n in (16, 256):
        g = torch.Generator().manual_seed(n)
        est = _flat(hutchinson_diagonal(op, n_samples=n, generator=g))
        assert torch.all((est - diag).abs() <= 5 * sigma / math.sqrt(n) + 1e-12)
        errors[n] = (est - diag).norm().item()
    assert errors[256] < errors[16] / 2, errors
    # Trace: one sample has variance 2 * sum_{i != j} H_ij^2.
    trace = diag.sum().item()
    sd = math.sqrt(2 * (H.pow(2).sum() - diag.pow(2).sum()).item() / 100)
    est = hutchinson_trace(op, n_samples=100, generator=torch.Generator().manual_seed(0))
    assert abs(est - trace) <= 5 * sd


def test_hutchinson_gaussian_probe_is_unbiased_and_exact_for_diagonal_rademacher():
    a = torch.tensor([3.0, -1.0, 0.5, 2.0], dtype=torch.float64)
    x = torch.randn(4, dtype=torch.float64, requires_grad=True)
    loss = 0.5 * (a * x * x).sum() + x.sum()
    op = HessianOperator(loss, [x])
    # Diagonal H: z ∘ (H z) = diag(H) exactly for every Rademacher z.
    assert torch.equal(hutchinson_diagonal(op, n_samples=1)[0], a)
    est = hutchinson_diagonal(op, n_samples=4000, probe="gaussian", generator=torch.Generator().manual_seed(0))[0]
    # Gaussian: a_i z_i^2 has standard deviation sqrt(2) |a_i|.
    assert torch.all((est - a).abs() <= 5 * math.sqrt(2) * a.abs() / math.sqrt(4000))


def _quadratic(eigs, seed=0):
    """0.5 x^T A x over x split into a (6,) and a (2, 2) tensor; A = Q diag(eigs) Q^T."""
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(10, 10, generator=g, dtype=torch.float64))
    eigs = torch.tensor(eigs, dtype=torch.float64)
    A = q @ torch.diag(eigs) @ q.T
    a = torch.randn(6, dtype=torch.float64, requires_grad=True)
    b = torch.randn(2, 2, dtype=torch.float64, requires_grad=True)
    x = torch.cat([a, b.reshape(-1)])
    return 0.5 * x @ A @ x, [a, b], q


@pytest.mark.parametrize(
    "eigs, top",
    [
        pytest.param([5.0, 3.0, 2.0, 1.0, 0.5, 0.1, 0.0, -0.2, -1.0, -2.0], 5.0, id="positive-top"),
        pytest.param([-4.0, 2.5, 2.0, 1.0, 0.5, 0.1, 0.0, -0.2, -1.0, -2.0], -4.0, id="negative-top"),
    ],
)
def test_power_iteration_finds_top_eigenvalue(eigs, top):
    loss, params, q = _quadratic(eigs)
    res = top_eigenvalue(loss, params, n_iter=300, tol=1e-13, generator=torch.Generator().manual_seed(0))
    assert res.converged
    assert abs(res.value - top) <= 1e-6 * abs(top)
    v = _flat(res.vector)
    assert abs(v.norm().item() - 1) < 1e-12
    assert abs(abs(v @ q[:, eigs.index(top)]).item() - 1) < 1e-5


def test_hvp_matches_explicit_matrix_and_accepts_mappings():
    loss, params, q = _quadratic([1.0, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    A = q @ torch.diag(torch.arange(1.0, 11, dtype=torch.float64)) @ q.T
    v = [torch.randn(6, dtype=torch.float64), torch.randn(2, 2, dtype=torch.float64)]
    out = hvp(loss, {"a": params[0], "b": params[1]}, {"a": v[0], "b": v[1]})
    assert torch.allclose(_flat(out), A @ _flat(v), atol=1e-12)
    assert [o.shape for o in out] == [p.shape for p in params]


def test_zero_hessian_cases_give_zeros():
    x = torch.randn(3, requires_grad=True)
    unused = torch.randn(2, requires_grad=True)
    loss = (2 * x).sum()  # linear in x: H = 0; unused never reached
    op = HessianOperator(loss, [x, unused])
    assert op.reached == [True, False]
    out = op.mv([torch.ones(3), torch.ones(2)])
    assert all(torch.equal(o, torch.zeros_like(o)) for o in out)
    assert top_eigenvalue(op, n_iter=5).value == 0.0


def test_select_params_by_names_prefixes_and_predicate():
    net = nn.Sequential(nn.Linear(2, 3), nn.Tanh(), nn.Linear(3, 1))
    assert list(select_params(net, "0")) == ["0.weight", "0.bias"]
    assert list(select_params(net, ["2.bias", "0.weight"])) == ["0.weight", "2.bias"]
    assert list(select_params(net, lambda n: n.endswith("bias"))) == ["0.bias", "2.bias"]
    net[0].weight.requires_grad_(False)
    assert "0.weight" not in select_params(net)
    with pytest.raises(ValueError, match="match no parameter"):
        select_params(net, "3")
    with pytest.raises(ValueError, match="selects no parameter"):
        select_params(net, lambda n: False)


def test_probe_like_values():
    t = torch.empty(1000, dtype=torch.float64)
    z = probe_like([t], "rademacher", torch.Generator().manual_seed(0))[0]
    assert z.dtype == torch.float64 and set(z.unique().tolist()) == {-1.0, 1.0}


def test_bad_inputs_raise():
    x = torch.randn(3, requires_grad=True)
    loss = (x ** 3).sum()
    with pytest.raises(ValueError, match="shape"):
        hvp(loss, [x], [torch.ones(4)])
    with pytest.raises(ValueError, match="1 parameters"):
        hvp(loss, [x], [torch.ones(3), torch.ones(3)])
    with pytest.raises(ValueError, match="does not require grad"):
        hvp(loss, [torch.randn(3)], [torch.ones(3)])
    with pytest.raises(ValueError, match="scalar"):
        hvp(x ** 2, [x], [torch.ones(3)])
    with pytest.raises(ValueError, match="does not require grad"):
        hvp(torch.tensor(1.0), [x], [torch.ones(3)])
    with pytest.raises(ValueError, match="empty"):
        hvp(loss, [], [])
    with pytest.raises(TypeError, match="floating-point"):
        hvp(loss, [torch.ones(3, dtype=torch.long)], [torch.ones(3)])
    with pytest.raises(TypeError, match="needs vecs"):
        hvp(loss, [x])
    op = HessianOperator((x ** 3).sum(), [x])
    with pytest.raises(ValueError, match="n_samples"):
        hutchinson_diagonal(op, n_samples=0)
    with pytest.raises(ValueError, match="probe"):
        hutchinson_diagonal(op, probe="uniform")
    with pytest.raises(ValueError, match="only with a loss"):
        hutchinson_trace(op, [x])
    with pytest.raises(ValueError, match="create_graph=True"):
        y = torch.randn(3, requires_grad=True)
        (y ** 2).sum().backward()
        HessianOperator.from_grads([y.grad], [y])
    with pytest.raises(ValueError, match="twice"):
        HessianOperator((x ** 3).sum(), [x, x])
