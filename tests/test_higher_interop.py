"""``higher`` interop: a model calling flash_attention inside ``higher.innerloop_ctx``.

The second-order MAML meta-gradient through higher's monkeypatched model equals the
functional path (``ttt_flash.meta.inner_loop``, torch.func.functional_call) and the same
computation with materialised attention (``ttt_flash.attention.reference.naive_attention``), in
float64 to 1e-10 relative.
"""

import pytest
import torch
from torch import nn

higher = pytest.importorskip("higher", reason="the higher interop tests need the higher package")

from ttt_flash import flash_attention  # noqa: E402
from ttt_flash.meta import functional_loss, higher_inner_loop, inner_loop  # noqa: E402
from ttt_flash.attention.reference import naive_attention  # noqa: E402

F64 = torch.float64
REL = 1e-10
STEPS, LR = 2, 0.3


class AttentionRegressor(nn.Module):
    """One causal GQA sliding-window attention block and a linear readout per token."""

    def __init__(self, attention, d=12, heads=4, kv_heads=2, head_dim=4, window=5):
        super().__init__()
        self.attention, self.window = attention, window
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.inp = nn.Linear(1, d)
        self.qkv = nn.Linear(d, (heads + 2 * kv_heads) * head_dim)
        self.out = nn.Linear(heads * head_dim, d)
        self.readout = nn.Linear(d, 1)

    def forward(self, x):  # x: (B, N, 1) -> (B, N, 1)
        b, n, _ = x.shape
        h = torch.tanh(self.inp(x))
        q, k, v = self.qkv(h).split(
            [self.heads * self.head_dim, self.kv_heads * self.head_dim, self.kv_heads * self.head_dim], dim=-1
        )
        q = q.view(b, n, self.heads, self.head_dim).transpose(1, 2)
        k = k.view(b, n, self.kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(b, n, self.kv_heads, self.head_dim).transpose(1, 2)
        o = self.attention(q, k, v, causal=True, window=self.window)
        h = h + self.out(o.transpose(1, 2).reshape(b, n, -1))
        return self.readout(torch.tanh(h))


def _pair():
    """The same weights with flash_attention and with naive materialised attention."""
    flash = AttentionRegressor(flash_attention).to(F64)
    naive = AttentionRegressor(naive_attention).to(F64)
    naive.load_state_dict(flash.state_dict())
    return flash, naive


def _task():
    x_s, x_q = torch.randn(3, 9, 1, dtype=F64), torch.randn(3, 9, 1, dtype=F64)
    return (x_s, torch.sin(3 * x_s).cumsum(1) / 3), (x_q, torch.sin(3 * x_q).cumsum(1) / 3)


mse = nn.functional.mse_loss


def _higher_meta_grad(model, support, query, optimizer, *, first_order=False):
    """The textbook higher loop: innerloop_ctx, diffopt.step, outer backward."""
    model.zero_grad(set_to_none=True)
    (xs, ys), (xq, yq) = support, query
    detach = (lambda grads: [g.detach() for g in grads]) if first_order else None
    with higher.innerloop_ctx(model, optimizer, copy_initial_weights=False) as (fmodel, diffopt):
        for _ in range(STEPS):
            diffopt.step(mse(fmodel(xs), ys), grad_callback=detach)
        mse(fmodel(xq), yq).backward()
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def _functional_meta_grad(model, support, query):
    fast = inner_loop(model, None, mse, support, steps=STEPS, lr=LR)
    grads = torch.autograd.grad(functional_loss(model, fast, mse, query), list(model.parameters()))
    return torch.cat([g.reshape(-1) for g in grads])


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def test_higher_matches_functional_path():
    model, _ = _pair()
    support, query = _task()
    via_higher = _higher_meta_grad(model, support, query, torch.optim.SGD(model.parameters(), lr=LR))
    functional = _functional_meta_grad(model, support, query)
    fast = higher_inner_loop(model, mse, support, STEPS, torch.optim.SGD(model.parameters(), lr=LR))
    library = torch.autograd.grad(functional_loss(model, fast, mse, query), list(model.parameters()))
    assert _rel(via_higher, functional) <= REL
    assert _rel(torch.cat([g.reshape(-1) for g in library]), functional) <= REL


@pytest.mark.parametrize(
    "make_opt",
    [
        pytest.param(lambda ps: torch.optim.SGD(ps, lr=LR), id="sgd"),
        pytest.param(lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), id="sgd-momentum"),
        pytest.param(lambda ps: torch.optim.Adam(ps, lr=0.01), id="adam"),
    ],
)
def test_higher_flash_matches_naive_attention(make_opt):
    flash, naive = _pair()
    support, query = _task()
    g_flash = _higher_meta_grad(flash, support, query, make_opt(flash.parameters()))
    g_naive = _higher_meta_grad(naive, support, query, make_opt(naive.parameters()))
    assert torch.isfinite(g_flash).all()
    assert _rel(g_flash, g_naive) <= REL


def test_second_order_terms_are_present():
    model, _ = _pair()
    support, query = _task()
    second = _higher_meta_grad(model, support, query, torch.optim.SGD(model.parameters(), lr=LR))
    first = _higher_meta_grad(model, support, query, torch.optim.SGD(model.parameters(), lr=LR), first_order=True)
    assert _rel(first, second) > 1e-3
