"""The forward-mode examples run: a MeanFlow-style step back-propagated through a jvp of
attention, and forward-over-reverse torch.func.hessian of a small attention model."""

import importlib.util
from pathlib import Path

import torch

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _load(name):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_meanflow_example_trains_and_matches_materialised_attention(one_thread):
    ex = _load("meanflow_jvp")
    result = ex.main(steps=3, batch=4, seq_len=8, verbose=False)
    assert all(torch.isfinite(torch.tensor(result["losses"])))
    assert result["losses"][-1] < result["losses"][0]
    assert result["gradient_difference"] <= 1e-9
    # the stop-gradient variant runs too, and its gradients differ from the residual loss's
    torch.manual_seed(0)
    model = ex.FlowTransformer().double()
    gen = lambda: torch.Generator().manual_seed(1)  # noqa: E731
    x = ex.make_batch(gen(), 2, 8, torch.float64)
    g1 = torch.autograd.grad(ex.meanflow_loss(model, x, gen(), stop_gradient=True)[0], model.out.weight)[0]
    g2 = torch.autograd.grad(ex.meanflow_loss(model, x, gen())[0], model.out.weight)[0]
    assert (g1 - g2).abs().max() > 1e-6


def test_hessian_example_is_exact(one_thread):
    result = _load("hessian_fwd_rev").main(verbose=False)
    assert result["hessian_difference_to_math"] <= 1e-12
    assert result["symmetry_error"] <= 1e-12
    assert result["hvp_fwd_rev_vs_hessian"] <= 1e-12 and result["hvp_rev_rev_vs_hessian"] <= 1e-12
    assert result["eigenvalues"][1] > 0
