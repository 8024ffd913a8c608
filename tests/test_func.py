"""torch.func transforms through flash_attention: grad, grad(grad), vjp and vmap."""

import pytest
import torch
from torch.func import grad, vjp, vmap

from ttt_flash import flash_attention, flash_attention_varlen
from ttt_flash.attention.reference import naive_attention, naive_attention_varlen

F64 = torch.float64


def _close(a, b, atol=1e-11):
    for x, y in zip(a if isinstance(a, tuple) else (a,), b if isinstance(b, tuple) else (b,)):
        torch.testing.assert_close(x, y, rtol=0, atol=atol)


@pytest.mark.parametrize("hkv", [2, 1], ids=["mha", "mqa"])
def test_grad_and_grad_of_grad(hkv):
    q = torch.randn(1, 2, 7, 4, dtype=F64)
    k, v = torch.randn(1, hkv, 9, 4, dtype=F64), torch.randn(1, hkv, 9, 4, dtype=F64)

    def run(attn):
        def f(q, k, v):
            return attn(q, k, v, causal=True, window=4).tanh().sum()

        g1 = grad(f, argnums=(0, 1, 2))(q, k, v)
        g2 = grad(lambda q, k, v: sum(t.square().sum() for t in grad(f, argnums=(0, 1, 2))(q, k, v)),
                  argnums=(0, 1, 2))(q, k, v)
        return g1 + g2

    _close(run(flash_attention), run(naive_attention))


def test_vjp_of_vjp():
    q, k, v = (torch.randn(1, 2, 6, 3, dtype=F64) for _ in range(3))
    w = torch.randn(1, 2, 6, 3, dtype=F64)

    def run(attn):
        def first(q, k, v):
            _, pull = vjp(lambda q, k, v: attn(q, k, v), q, k, v)
            return pull(w)

        out, pull2 = vjp(first, q, k, v)
        return out + pull2(tuple(torch.ones_like(t) for t in out))

    _close(run(flash_attention), run(naive_attention))


def test_vmap_over_tasks_of_second_order_gradients():
    """Functional MAML-style: per-task grad of a function of the inner gradient, vmapped."""
    tasks = 3
    q = torch.randn(tasks, 1, 4, 6, 5, dtype=F64)       # batched over tasks
    k = torch.randn(1, 2, 6, 5, dtype=F64)              # shared (not vmapped), GQA 2:1
    v = torch.randn(tasks, 1, 2, 6, 5, dtype=F64)

    def run(attn):
        def loss(q, v):
            return attn(q, k, v, causal=True).sin().sum()

        def outer(q, v):
            gq, gv = grad(loss, argnums=(0, 1))(q, v)
            return gq.square().sum() + gv.square().sum()

        return vmap(grad(outer, argnums=(0, 1)))(q, v)

    _close(run(flash_attention), run(naive_attention))


def test_vmap_on_a_non_leading_dim():
    q = torch.randn(1, 2, 3, 5, 4, dtype=F64)  # vmapped dim 2
    k = torch.randn(1, 2, 5, 4, dtype=F64)
    a = vmap(lambda x: flash_attention(x, k, k), in_dims=2, out_dims=1)(q)
    b = vmap(lambda x: naive_attention(x, k, k), in_dims=2, out_dims=1)(q)
    _close(a, b)


def test_vmap_varlen():
    cu = torch.tensor([0, 2, 2, 6], dtype=torch.int32)
    q = torch.randn(3, 6, 4, 5, dtype=F64)
    kv = torch.randn(6, 2, 5, dtype=F64)

    def run(attn):
        return vmap(grad(lambda x: grad(lambda y: attn(y, kv, kv, cu, cu).cos().sum())(x).square().sum()))(q)

    a = run(lambda *x: flash_attention_varlen(*x, 4, 4, causal=True))
    b = run(lambda *x: naive_attention_varlen(*x, causal=True))
    _close(a, b)


def test_vmap_over_cu_seqlens_is_refused():
    cus = torch.tensor([[0, 2, 6], [0, 3, 6]], dtype=torch.int32)
    q = torch.randn(6, 2, 4, dtype=F64)
    with pytest.raises(Exception, match="cu_seqlens"):
        vmap(lambda cu: flash_attention_varlen(q, q, q, cu, cu, 6, 6))(cus)
