"""Recomputation units (ttt_flash.second_order.recomputation) in Hessian-vector products: forward over
reverse with the transformer blocks and the vocabulary head recomputed gives the reverse-over-
reverse product (float64, 1e-10), keeps only the units' inputs, and peaks well below reverse
over reverse; the units fall back to checkpointing / plain calls where they must."""

import contextlib

import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F
from torch.autograd.graph import saved_tensors_hooks

from ttt_flash.attention import functions as attention_module
from ttt_flash.bench.jvp import LiveBytes, chunked_lm_loss
from ttt_flash.second_order import HessianOperator, hutchinson_diagonal, hvp, recompute, recomputed
from ttt_flash.second_order.recomputation import forward_over_reverse, unit_modules
from ttt_flash.models import GPT, GPTConfig

F64 = torch.float64


def _close(a, b, tol=1e-10):
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=0, atol=tol)


def _gpt(n_layer=2, batch=2, n=16, **kw):
    torch.manual_seed(0)
    model = GPT(GPTConfig.tiny(n_layer=n_layer, d_model=32, n_head=2, **kw)).double()
    idx = torch.randint(0, 256, (batch, n + 1))
    return model, idx[:, :-1], idx[:, 1:]


@pytest.mark.parametrize("head", ["plain", "chunked"])
def test_fwd_rev_with_recomputed_blocks_equals_rev_rev(head):
    model, x, y = _gpt(n_kv_head=1)
    loss = (lambda: model.loss(x, y)) if head == "plain" else (lambda: chunked_lm_loss(model, x, y, 6))
    vecs = [torch.randn_like(p) for p in model.parameters()]
    rr = hvp(lambda: model.loss(x, y), model, vecs)
    fr = hvp(loss, model, vecs, mode="fwd_rev", recompute="blocks")
    _close(fr, rr)
    assert max(h.abs().max().item() for h in fr) > 1e-3  # not trivially zero
    # reverse over reverse through the same units (torch.utils.checkpoint regions): same product
    _close(hvp(loss, model, vecs, recompute="blocks"), rr)
    # the gradient of the product's loss call comes with it
    op = HessianOperator(loss, model, mode="fwd_rev", recompute="blocks")
    op.mv(vecs)
    _close(op.gradient, torch.autograd.grad(model.loss(x, y), list(model.parameters())))


def test_recompute_of_a_subset_of_parameters_and_the_estimators():
    model, x, y = _gpt()
    params = {n: p for n, p in model.named_parameters() if n.startswith("blocks.1")}
    loss = lambda: model.loss(x, y)  # noqa: E731
    vecs = [torch.randn_like(p) for p in params.values()]
    _close(hvp(loss, params, vecs, mode="fwd_rev", module=model, recompute="blocks"), hvp(loss, params, vecs))
    d_rr = hutchinson_diagonal(loss, params, 2, generator=torch.Generator().manual_seed(3))
    d_fr = hutchinson_diagonal(loss, params, 2, generator=torch.Generator().manual_seed(3), mode="fwd_rev",
                               module=model, recompute=["blocks.0", "blocks.1"])
    _close(d_fr, d_rr)


def test_the_tangent_kernel_runs_in_the_units_forward(monkeypatch):
    """The units' forward carries tangents through attention by its jvp rule (_AttentionTangent),
    once per block and product."""
    model, x, y = _gpt(n_layer=3)
    calls = []
    forward = attention_module._AttentionTangent.forward

    def counting(*args):
        calls.append(1)
        return forward(*args)

    monkeypatch.setattr(attention_module._AttentionTangent, "forward", staticmethod(counting))
    hvp(lambda: model.loss(x, y), model, [torch.randn_like(p) for p in model.parameters()],
        mode="fwd_rev", recompute="blocks")
    assert len(calls) == 3


def _saved_shapes(model, x, units: bool):
    """Shapes of the tensors saved for backward while the model runs forward under forward mode
    with the parameters dual (as in a fwd_rev product)."""
    shapes = []

    def pack(t):
        shapes.append(tuple(t.shape))
        return t

    params = list(model.parameters())
    ctx = recomputed(model, "blocks") if units else contextlib.nullcontext()
    with fwAD.dual_level(), ctx, forward_over_reverse():
        with torch.no_grad():
            for p in params:
                p.copy_(fwAD.make_dual(p.detach().clone(), torch.randn_like(p)))
        with torch.enable_grad(), saved_tensors_hooks(pack, lambda t: t):
            model(x)
    return shapes


def test_units_keep_only_their_inputs():
    """With the blocks as units, no (B, N, MLP hidden) activation is saved in the forward pass,
    only the blocks' inputs (and parameters); without, the blocks save them (the test can fail)."""
    model, x, _ = _gpt()
    inner, width = (*x.shape, model.config.mlp_hidden), (*x.shape, model.config.d_model)
    kept = _saved_shapes(model, x, units=True)
    assert inner not in kept
    assert inner in _saved_shapes(model, x, units=False)
    # one more block keeps one more (B, N, d_model) tensor: its input
    deeper, x3, _ = _gpt(n_layer=3)
    assert _saved_shapes(deeper, x3, units=True).count(width) - kept.count(width) == 1


def test_fwd_rev_with_recompute_peaks_well_below_rev_rev():
    """Peak bytes of live tensors (CPU): forward over reverse with recomputed blocks and head
    against reverse over reverse with and without the same recomputation, and against forward
    over reverse without it (torch.func, which keeps every activation and its tangent)."""
    model, x, y = _gpt(batch=8, n=8)  # many tokens for the parameters, as in a language model
    vecs = [torch.randn_like(p) for p in model.parameters()]
    plain = lambda: model.loss(x, y)  # noqa: E731
    chunked = lambda: chunked_lm_loss(model, x, y, 16)  # noqa: E731

    def peak(fn):
        with LiveBytes() as m:
            fn()
        return m.peak

    rev = min(peak(lambda: hvp(plain, model, vecs)), peak(lambda: hvp(chunked, model, vecs, recompute="blocks")))
    fwd = peak(lambda: hvp(chunked, model, vecs, mode="fwd_rev", recompute="blocks"))
    fwd_all = peak(lambda: hvp(plain, model, vecs, mode="fwd_rev"))
    assert fwd < 0.7 * rev, (fwd, rev)  # measured 0.52 (GPT-2 small shapes: docs/benchmarks.md)
    assert fwd < 0.6 * fwd_all, (fwd, fwd_all)  # measured 0.43


def test_recompute_falls_back_outside_forward_over_reverse():
    """Outside forward_over_reverse a unit under forward mode is a plain call: reverse mode
    through the tangent (consistency-model training) stays exact; under reverse mode alone it
    is a checkpoint; with no grad a plain call."""
    torch.manual_seed(0)
    w = torch.randn(4, 4, dtype=F64, requires_grad=True)
    h, t = torch.randn(3, 4, dtype=F64), torch.randn(3, 4, dtype=F64)
    f = lambda h, w: (h @ w).tanh().sum()  # noqa: E731

    def tangent_loss(unit):
        with fwAD.dual_level():
            out = unit(fwAD.make_dual(h, t), w)
            return fwAD.unpack_dual(out).tangent

    g_plain = torch.autograd.grad(tangent_loss(f), w)[0]
    g_unit = torch.autograd.grad(tangent_loss(lambda *a: recompute(f, *a)), w)[0]
    torch.testing.assert_close(g_unit, g_plain, rtol=0, atol=1e-14)
    out = recompute(f, h, w)
    assert "Checkpoint" in type(out.grad_fn).__name__ or out.grad_fn is not None
    torch.testing.assert_close(torch.autograd.grad(out, w)[0], torch.autograd.grad(f(h, w), w)[0])
    with torch.no_grad():
        assert recompute(f, h, w).grad_fn is None


def test_recompute_errors_name_the_fix():
    model, x, y = _gpt(n_layer=1)
    vecs = [torch.randn_like(p) for p in model.parameters()]
    with pytest.raises(ValueError, match="no submodule 'block'.*children"):
        hvp(lambda: model.loss(x, y), model, vecs, mode="fwd_rev", recompute="block")
    with pytest.raises(ValueError, match="module"):
        hvp(lambda: model.loss(x, y), list(model.parameters()), vecs, mode="fwd_rev", recompute="blocks")
    with pytest.raises(TypeError, match="callable"):
        hvp(model.loss(x, y), model, vecs, recompute="blocks")
    with pytest.raises(ValueError, match="inside unit"):
        unit_modules(model, ["blocks", "blocks.0.mlp"])
    # a unit whose function reads a parameter it was not given loses that gradient: refused
    w = model.output_weight

    def closure_loss():
        h = model(x, return_hidden=True)
        return recompute(lambda h: F.linear(h, w).logsumexp(-1).mean(), h)

    with pytest.raises(RuntimeError, match="not one of its arguments"):
        hvp(closure_loss, model, vecs, mode="fwd_rev", recompute="blocks")
    with recomputed(model, "blocks"), pytest.raises(RuntimeError, match="already"):
        with recomputed(model, "blocks"):
            pass
    assert "forward" not in model.blocks[0].__dict__  # restored after the error


def test_docstring_examples():
    import doctest

    import ttt_flash.bench.common
    import ttt_flash.second_order.recomputation

    for module in (ttt_flash.second_order.recomputation, ttt_flash.bench.common):
        result = doctest.testmod(module)
        assert result.attempted > 0 and result.failed == 0, module.__name__
