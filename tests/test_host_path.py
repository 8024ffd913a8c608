"""The host path of the autograd glue: a backward that records no graph calls the next
composer directly (no autograd.Function node), one that records a graph goes through the
Function (whose own backward gives the third derivative), and ``fast_apply`` falls back to
``Function.apply`` under torch.func transforms. Results agree with float64 math attention."""

import pytest
import torch

from ttt_flash.attention import functions as attn_mod
from ttt_flash import flash_attention
from ttt_flash.attention.reference import naive_attention

F64 = torch.float64


def _inputs(seed=0, hkv=2):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 4, 9, 5, dtype=F64, generator=g, requires_grad=True)
    k = torch.randn(1, hkv, 11, 5, dtype=F64, generator=g, requires_grad=True)
    v = torch.randn(1, hkv, 11, 5, dtype=F64, generator=g, requires_grad=True)
    do = torch.randn(1, 4, 9, 5, dtype=F64, generator=g, requires_grad=True)
    u = [torch.randn_like(t) for t in (q, k, v)]
    return q, k, v, do, u


def _chain(attn, q, k, v, do, u):
    o = attn(q, k, v, causal=True)
    g = torch.autograd.grad(o, (q, k, v), do, create_graph=True)
    inner = sum((a * b).sum() for a, b in zip(g, u))
    return (o, *g, *torch.autograd.grad(inner, (q, k, v, do)))


def _forbid(monkeypatch, cls):
    def boom(*args):
        raise AssertionError(f"{cls.__name__} was applied as an autograd.Function")

    monkeypatch.setattr(cls, "fast_apply", classmethod(lambda c, *a: boom()))


def test_first_order_backward_skips_the_backward_function(monkeypatch):
    q, k, v, do, _ = _inputs()
    expected = torch.autograd.grad(naive_attention(q, k, v, causal=True), (q, k, v), do)
    _forbid(monkeypatch, attn_mod._AttentionBackward)
    got = torch.autograd.grad(flash_attention(q, k, v, causal=True), (q, k, v), do)
    for a, e in zip(got, expected):
        torch.testing.assert_close(a, e, rtol=0, atol=1e-12)


def test_second_backward_without_graph_skips_the_bob_function(monkeypatch):
    q, k, v, do, u = _inputs(1, hkv=1)
    expected = _chain(naive_attention, q, k, v, do, u)
    _forbid(monkeypatch, attn_mod._AttentionBoB)
    got = _chain(flash_attention, q, k, v, do, u)
    for a, e in zip(got, expected):
        torch.testing.assert_close(a, e, rtol=0, atol=1e-12)


def test_backward_with_graph_goes_through_the_function(monkeypatch):
    q, k, v, do, _ = _inputs(2)
    _forbid(monkeypatch, attn_mod._AttentionBackward)
    with pytest.raises(AssertionError, match="_AttentionBackward was applied"):
        torch.autograd.grad(flash_attention(q, k, v), (q, k, v), do, create_graph=True)


def test_fast_apply_takes_the_full_path_under_torch_func(monkeypatch):
    from torch.func import grad

    calls = []
    full = torch.autograd.Function.apply.__func__

    def spy(cls, *args, **kwargs):
        calls.append(cls.__name__)
        return full(cls, *args, **kwargs)

    monkeypatch.setattr(attn_mod._Attention, "apply", classmethod(spy))
    q, k, v, _, _ = _inputs(3)
    q, k, v = (t.detach() for t in (q, k, v))
    g = grad(lambda q: flash_attention(q, k, v).sum())(q)
    e = grad(lambda q: naive_attention(q, k, v).sum())(q)
    torch.testing.assert_close(g, e, rtol=0, atol=1e-12)
    assert calls and set(calls) == {"_Attention"}  # Function.apply under the transform
    calls.clear()
    flash_attention(q, k, v)  # eager: the C++ apply, not Function.apply
    assert calls == []
