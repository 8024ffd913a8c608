"""flash_attention(..., return_lse=True): the row log-sum-exp as a second, differentiable
output. Values, first and second derivatives (autograd of autograd) of losses of (o, lse)
against materialised float64 attention, gradcheck / gradgradcheck of the composed function,
both backends (Triton under the interpreter on the CPU), varlen, rows that see no key."""

import pytest
import torch
from torch.autograd import gradcheck, gradgradcheck

from ttt_flash import flash_attention, flash_attention_varlen
from ttt_flash.attention.reference import attention_mask, naive_attention

DEV = "cuda" if torch.cuda.is_available() else "cpu"
F64 = torch.float64


# --------------------------------------------------------------------------- oracle


def _dense_oracle(q, k, v, *, causal=False, window=None, scale=None):
    """Materialised (o, lse): lse = logsumexp of the scaled, masked scores; -inf (with zero
    gradients) on rows that see no key."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    kk = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    s = torch.matmul(q, kk.transpose(-1, -2)) * scale
    lse = torch.logsumexp(s, dim=-1)
    mask = attention_mask(q.shape[-2], k.shape[-2], causal=causal, window=window, device=q.device)
    if mask is not None:
        empty = ~mask.any(-1)
        s = s.masked_fill(~mask, float("-inf")).masked_fill(empty.unsqueeze(-1), 0.0)
        lse = torch.logsumexp(s, dim=-1).masked_fill(empty, float("-inf"))
    return naive_attention(q, k, v, causal=causal, window=window, scale=scale), lse


def _varlen_oracle(q, k, v, cu_q, cu_k, **kw):
    """:func:`_dense_oracle` per packed sequence; o (T_q, H, D), lse (H, T_q)."""
    cq, ck = cu_q.tolist(), cu_k.tolist()
    os_, ls = [], []
    for b in range(len(cq) - 1):
        qs = q[cq[b]:cq[b + 1]].transpose(0, 1).unsqueeze(0)
        ks = k[ck[b]:ck[b + 1]].transpose(0, 1).unsqueeze(0)
        vs = v[ck[b]:ck[b + 1]].transpose(0, 1).unsqueeze(0)
        if qs.shape[2] == 0:
            continue
        if ks.shape[2] == 0:
            os_.append(q[cq[b]:cq[b + 1]] * 0)
            ls.append(q.new_full((q.shape[1], qs.shape[2]), float("-inf")))
            continue
        o, l = _dense_oracle(qs, ks, vs, **kw)
        os_.append(o[0].transpose(0, 1))
        ls.append(l[0])
    return torch.cat(os_, 0), torch.cat(ls, 1)


def _finite(lse):
    """lse with -inf rows (no key) replaced by 0: a loss of it stays finite."""
    return torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))


def _loss(o, lse, wo, wl):
    """A loss that mixes o and lse (cross terms make the second derivatives couple them)."""
    lf = _finite(lse).to(o.dtype)
    row = lf.transpose(0, 1) if o.dim() == 3 else lf  # varlen lse is (H, T)
    return ((o * wo).sum() + (lf * wl).sum() + 0.5 * (lf * lf).sum()
            + (torch.sin(o) * row.unsqueeze(-1)).sum())


def _chain(fn, xs, wo, wl, us):
    """[o, lse, first derivatives of the loss in (q, k, v), second derivatives: the
    gradients of ⟨us, first derivatives⟩ in (q, k, v)]."""
    o, lse = fn(*xs)
    g = torch.autograd.grad(_loss(o, lse, wo, wl), xs, create_graph=True)
    inner = sum((a * u).sum() for a, u in zip(g, us))
    return [o, lse, *g, *torch.autograd.grad(inner, xs)]


def _leaves(ts, dtype):
    return [t.detach().to(dtype).requires_grad_(True) for t in ts]


def _compare(ours, exact, tol, relative=False):
    for i, (a, e) in enumerate(zip(ours, exact)):
        assert a.shape == e.shape, i
        a = a.double()
        inf = torch.isinf(e)
        assert torch.equal(inf, torch.isinf(a)) and torch.equal(a[inf], e[inf]), i  # -inf rows
        a, e = a[~inf], e[~inf]
        assert torch.isfinite(a).all(), i
        err = (a - e).abs().max().item()
        if relative:
            err /= max(e.abs().max().item(), 1e-30)
        assert err <= tol, (i, err)


# --------------------------------------------------------------------------- dense, float64

DENSE = [
    dict(hq=2, hkv=2, nq=6, nk=6, causal=False, window=None),
    dict(hq=4, hkv=2, nq=6, nk=6, causal=True, window=None),
    dict(hq=4, hkv=1, nq=5, nk=9, causal=True, window=3),
    dict(hq=2, hkv=1, nq=9, nk=5, causal=True, window=None),  # first 4 rows see no key
    dict(hq=2, hkv=2, nq=4, nk=7, causal=False, window=None),
]
DENSE_IDS = ["plain", "causal-gqa", "window-mqa-nq<nk", "causal-nq>nk-empty-rows", "nq<nk"]


def _dense_inputs(c, d=3, b=2, dtype=F64):
    q = torch.randn(b, c["hq"], c["nq"], d, dtype=dtype, device=DEV)
    k = torch.randn(b, c["hkv"], c["nk"], d, dtype=dtype, device=DEV)
    v = torch.randn(b, c["hkv"], c["nk"], d, dtype=dtype, device=DEV)
    return [q, k, v]


@pytest.mark.parametrize("c", DENSE, ids=DENSE_IDS)
def test_dense_values_first_and_second_derivatives_float64(c):
    xs = _dense_inputs(c)
    wo = torch.randn(xs[0].shape, dtype=F64, device=DEV)
    wl = torch.randn(xs[0].shape[:-1], dtype=F64, device=DEV)
    us = [torch.randn_like(x) for x in xs]
    kw = dict(causal=c["causal"], window=c["window"])
    exact = _chain(lambda q, k, v: _dense_oracle(q, k, v, **kw), _leaves(xs, F64), wo, wl, us)
    ours = _chain(lambda q, k, v: flash_attention(q, k, v, return_lse=True, backend="reference", **kw),
                  _leaves(xs, F64), wo, wl, us)
    assert ours[1].dtype == F64 and ours[1].shape == xs[0].shape[:-1]
    _compare(ours, exact, 1e-10)


def test_lse_alone_gradients_and_scale():
    """A loss of lse only (no cotangent reaches o), a custom scale."""
    c = DENSE[2]
    xs = _dense_inputs(c)
    wl = torch.randn(xs[0].shape[:-1], dtype=F64, device=DEV)
    kw = dict(causal=True, window=3, scale=0.7)
    got, want = [], []
    for fn, out in ((lambda *a: flash_attention(*a, return_lse=True, **kw), got),
                    (lambda *a: _dense_oracle(*a, **kw), want)):
        x = _leaves(xs, F64)
        g = torch.autograd.grad((fn(*x)[1] * wl).sum(), x, create_graph=True, allow_unused=True)
        assert g[2] is None  # lse does not depend on v
        out += [*g[:2], *torch.autograd.grad(sum((t * t).sum() for t in g[:2]), x[:2])]
    for a, e in zip(got, want):
        assert (a - e).abs().max().item() <= 1e-10


def test_fully_masked_rows_lse_minus_inf_and_zero_gradients():
    """Causal with N_q > N_k: the first N_q − N_k rows see no key: lse = -inf, o = 0, and a
    cotangent of lse on those rows (even of the -inf itself) gives zero gradients, never NaN,
    at first and second order."""
    q, k, v = _leaves(_dense_inputs(dict(hq=2, hkv=1, nq=7, nk=3)), F64)
    o, lse = flash_attention(q, k, v, causal=True, return_lse=True)
    empty = slice(0, 4)
    assert torch.isneginf(lse[:, :, empty]).all() and torch.isfinite(lse[:, :, 4:]).all()
    assert (o[:, :, empty] == 0).all()
    total = (o * torch.randn_like(o)).sum()
    g = torch.autograd.grad((lse,  total), (q, k, v), (torch.ones_like(lse), None), create_graph=True)
    assert all(torch.isfinite(t).all() for t in g)
    assert (g[0][:, :, empty] == 0).all()
    only_empty = torch.zeros_like(lse)
    only_empty[:, :, empty] = 1.0
    g_empty = torch.autograd.grad(lse, (q, k), only_empty, retain_graph=True)
    assert all((t == 0).all() for t in g_empty)
    h = torch.autograd.grad(sum((t * t).sum() for t in g), (q, k, v))
    assert all(torch.isfinite(t).all() for t in h)
    assert (h[0][:, :, empty] == 0).all()


@pytest.mark.parametrize("c", [DENSE[1], DENSE[2]], ids=["causal-gqa", "window-mqa-nq<nk"])
def test_gradcheck_and_gradgradcheck_dense(c):
    xs = _leaves(_dense_inputs(c, d=2, b=1), F64)
    fn = lambda q, k, v: flash_attention(q, k, v, causal=c["causal"], window=c["window"],  # noqa: E731
                                         return_lse=True)
    assert gradcheck(fn, xs, eps=1e-6, atol=1e-8)
    assert gradgradcheck(fn, xs, eps=1e-6, atol=1e-7)


def test_third_derivative_through_lse():
    """Third order (a gradient of a Hessian-vector product) of a loss of lse alone."""
    c = DENSE[1]
    xs = _dense_inputs(c, d=2, b=1)
    wl = torch.randn(xs[0].shape[:-1], dtype=F64, device=DEV)
    outs = []
    for fn in (lambda *a: flash_attention(*a, causal=True, return_lse=True),
               lambda *a: _dense_oracle(*a, causal=True)):
        x = _leaves(xs, F64)
        g = torch.autograd.grad((fn(*x)[1].square() * wl).sum(), x[:2], create_graph=True)
        h = torch.autograd.grad((g[0] * g[1].sum()).sum() + g[1].square().sum(), x[:2], create_graph=True)
        outs.append(torch.autograd.grad(h[0].sin().sum() + h[1].square().sum(), x[:2]))
    for a, e in zip(*outs):
        assert ((a - e).abs().max() / e.abs().max()).item() <= 1e-10


def test_bnhd_layout_returns_bhn_lse():
    q, k, v = _leaves(_dense_inputs(DENSE[1]), F64)
    o, lse = flash_attention(q, k, v, causal=True, return_lse=True)
    o2, lse2 = flash_attention(*(t.transpose(1, 2) for t in (q, k, v)), causal=True, layout="bnhd",
                               return_lse=True)
    assert lse2.shape == lse.shape == q.shape[:-1]
    assert torch.equal(lse2, lse) and torch.equal(o2.transpose(1, 2), o)
    g = torch.autograd.grad(lse.sum(), (q, k))
    g2 = torch.autograd.grad(lse2.sum(), (q, k))
    assert all((a - b).abs().max() <= 1e-12 for a, b in zip(g, g2))


def test_default_returns_output_alone_and_flag_errors():
    q, k, v = _dense_inputs(DENSE[0])
    o = flash_attention(q, k, v)
    assert isinstance(o, torch.Tensor)
    o2, lse = flash_attention(q, k, v, return_lse=True)
    assert torch.equal(o, o2) and not lse.requires_grad
    for bad in ("yes", 1, None):
        with pytest.raises(TypeError, match="return_lse must be a bool"):
            flash_attention(q, k, v, return_lse=bad)
    cu = torch.tensor([0, 6], dtype=torch.int32, device=DEV)
    with pytest.raises(TypeError, match="return_lse must be a bool"):
        flash_attention_varlen(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), cu, cu,
                               6, 6, return_lse="no")


def test_triton_backend_float64_is_refused_with_the_fix():
    q, k, v = _dense_inputs(DENSE[0])
    with pytest.raises(TypeError, match="backend='reference'"):
        flash_attention(q, k, v, backend="triton", return_lse=True)


# --------------------------------------------------------------------------- varlen


def _varlen_inputs(lengths_q, lengths_k, hq=2, hkv=1, d=3, dtype=F64):
    cu_q = torch.tensor([0, *torch.tensor(lengths_q).cumsum(0).tolist()], dtype=torch.int32, device=DEV)
    cu_k = torch.tensor([0, *torch.tensor(lengths_k).cumsum(0).tolist()], dtype=torch.int32, device=DEV)
    q = torch.randn(sum(lengths_q), hq, d, dtype=dtype, device=DEV)
    k = torch.randn(sum(lengths_k), hkv, d, dtype=dtype, device=DEV)
    v = torch.randn(sum(lengths_k), hkv, d, dtype=dtype, device=DEV)
    return [q, k, v], cu_q, cu_k


@pytest.mark.parametrize("causal,window", [(False, None), (True, None), (True, 2)],
                         ids=["noncausal", "causal", "window2"])
def test_varlen_values_first_and_second_derivatives_float64(causal, window):
    # an empty sequence, one with more queries than keys (rows without keys when causal)
    xs, cu_q, cu_k = _varlen_inputs([3, 0, 5, 2], [4, 0, 2, 3])
    wo = torch.randn(xs[0].shape, dtype=F64, device=DEV)
    wl = torch.randn(xs[0].shape[1], xs[0].shape[0], dtype=F64, device=DEV)
    us = [torch.randn_like(x) for x in xs]
    kw = dict(causal=causal, window=window)
    exact = _chain(lambda q, k, v: _varlen_oracle(q, k, v, cu_q, cu_k, **kw), _leaves(xs, F64), wo, wl, us)
    ours = _chain(lambda q, k, v: flash_attention_varlen(q, k, v, cu_q, cu_k, None, None, return_lse=True, **kw),
                  _leaves(xs, F64), wo, wl, us)
    assert ours[1].shape == (xs[0].shape[1], xs[0].shape[0]) and ours[1].dtype == F64
    if causal:
        assert torch.isneginf(ours[1]).any()
    _compare(ours, exact, 1e-10)


def test_gradcheck_and_gradgradcheck_varlen():
    xs, cu_q, cu_k = _varlen_inputs([2, 3], [3, 3], d=2)
    fn = lambda q, k, v: flash_attention_varlen(q, k, v, cu_q, cu_k, 3, 3, causal=True,  # noqa: E731
                                                return_lse=True)
    x = _leaves(xs, F64)
    assert gradcheck(fn, x, eps=1e-6, atol=1e-8)
    assert gradgradcheck(fn, x, eps=1e-6, atol=1e-7)


# --------------------------------------------------------------------------- forward mode, vmap


def test_jvp_of_lse_matches_float64():
    c = DENSE[2]
    xs = _dense_inputs(c)
    ts = [torch.randn_like(x) for x in xs]
    kw = dict(causal=True, window=3)
    _, (od, ld) = torch.func.jvp(lambda *a: flash_attention(*a, return_lse=True, **kw), tuple(xs), tuple(ts))
    _, (od2, ld2) = torch.func.jvp(lambda *a: _dense_oracle(*a, **kw), tuple(xs), tuple(ts))
    assert (od - od2).abs().max().item() <= 1e-10
    assert (ld - ld2).abs().max().item() <= 1e-10


def _mixed_loss(fn, q, k, v):
    o, lse = fn(q, k, v, causal=True)
    return lse.square().sum() + (torch.sin(o) * lse.unsqueeze(-1)).sum()


def _ours(*a, **kw):
    return flash_attention(*a, return_lse=True, **kw)


def test_hessian_forward_over_reverse_through_lse():
    q, k, v = _dense_inputs(DENSE[1], b=1)
    got = torch.func.hessian(lambda *a: _mixed_loss(_ours, *a), argnums=(0, 1))(q, k, v)
    want = torch.func.hessian(lambda *a: _mixed_loss(_dense_oracle, *a), argnums=(0, 1))(q, k, v)
    for row_got, row_want in zip(got, want):
        for a, e in zip(row_got, row_want):
            assert (a - e).abs().max().item() <= 1e-10


def test_reverse_over_forward_through_lse():
    """Gradients of a loss of the tangents (Ȯ, L̇) in (q, k)."""
    q, k, v = _dense_inputs(DENSE[2])
    tq, tk = torch.randn_like(q), torch.randn_like(k)

    def grads(fn):
        def loss(a, b):
            _, (od, ld) = torch.func.jvp(lambda x, y: fn(x, y, v, causal=True, window=3), (a, b), (tq, tk))
            return ld.square().sum() + (od * ld.unsqueeze(-1)).sum()

        return torch.func.grad(loss, argnums=(0, 1))(q, k)

    for a, e in zip(grads(_ours), grads(_dense_oracle)):
        assert (a - e).abs().max().item() <= 1e-10


def test_vmap_of_grad_through_lse():
    c = DENSE[1]
    q, k, v = _dense_inputs(c)
    qs = torch.stack([q, 2 * q])
    kw = dict(causal=True)

    def g(fn, q1):
        return torch.func.grad(lambda a: fn(a, k, v, **kw)[1].square().sum())(q1)

    got = torch.func.vmap(lambda a: g(lambda *x, **y: flash_attention(*x, return_lse=True, **y), a))(qs)
    want = torch.stack([g(_dense_oracle, x) for x in qs])
    assert (got - want).abs().max().item() <= 1e-10


# --------------------------------------------------------------------------- Triton (interpreter on CPU)


@pytest.mark.parametrize("c", [dict(hq=2, hkv=1, nq=20, nk=20, causal=True, window=None),
                               dict(hq=2, hkv=2, nq=12, nk=20, causal=True, window=7)],
                         ids=["causal-mqa", "window-nq<nk"])
def test_triton_values_first_and_second_derivatives_float32(c):
    xs = _dense_inputs(c, d=16, b=1)
    wo = torch.randn(xs[0].shape, dtype=F64, device=DEV)
    wl = torch.randn(xs[0].shape[:-1], dtype=F64, device=DEV)
    us = [torch.randn_like(x) for x in xs]
    kw = dict(causal=c["causal"], window=c["window"])
    exact = _chain(lambda q, k, v: _dense_oracle(q, k, v, **kw), _leaves(xs, F64), wo, wl, us)
    ours = _chain(lambda q, k, v: flash_attention(q, k, v, return_lse=True, backend="triton", **kw),
                  _leaves(xs, torch.float32), wo.float(), wl.float(), [u.float() for u in us])
    assert ours[1].dtype == torch.float32
    _compare(ours, exact, 1e-4, relative=True)


def test_triton_varlen_float32():
    xs, cu_q, cu_k = _varlen_inputs([7, 0, 9], [9, 0, 6], d=16)
    wo = torch.randn(xs[0].shape, dtype=F64, device=DEV)
    wl = torch.randn(xs[0].shape[1], xs[0].shape[0], dtype=F64, device=DEV)
    us = [torch.randn_like(x) for x in xs]
    exact = _chain(lambda q, k, v: _varlen_oracle(q, k, v, cu_q, cu_k, causal=True), _leaves(xs, F64), wo, wl, us)
    ours = _chain(lambda q, k, v: flash_attention_varlen(q, k, v, cu_q, cu_k, 9, 9, causal=True,
                                                         backend="triton", return_lse=True),
                  _leaves(xs, torch.float32), wo.float(), wl.float(), [u.float() for u in us])
    _compare(ours, exact, 1e-4, relative=True)


# --------------------------------------------------------------------------- torch.compile


def test_under_torch_compile_runs_eagerly_and_matches():
    torch._dynamo.reset()
    try:
        q, k, v = _leaves(_dense_inputs(DENSE[1]), F64)
        fn = torch.compile(lambda a, b, c: flash_attention(a, b, c, causal=True, return_lse=True),
                           backend="eager")
        o, lse = fn(q, k, v)
        o2, lse2 = flash_attention(q, k, v, causal=True, return_lse=True)
        assert torch.equal(o, o2) and torch.equal(lse, lse2)
        g = torch.autograd.grad(lse.sum() + o.sum(), (q, k, v))
        g2 = torch.autograd.grad(lse2.sum() + o2.sum(), (q, k, v))
        assert all(torch.equal(a, b) for a, b in zip(g, g2))
    finally:
        torch._dynamo.reset()


# --------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)], ids=["fp32", "bf16"])
def test_gpu_kernels_chain_matches_float64(dtype, tol):
    c = dict(hq=8, hkv=2, nq=384, nk=512, causal=True, window=None)
    xs = _dense_inputs(c, d=64, b=1)
    wo = torch.randn(xs[0].shape, dtype=F64, device=DEV)
    wl = torch.randn(xs[0].shape[:-1], dtype=F64, device=DEV)
    us = [torch.randn_like(x) for x in xs]
    exact = _chain(lambda *a: flash_attention(*a, causal=True, return_lse=True, backend="reference"),
                   _leaves(xs, F64), wo, wl, us)
    ours = _chain(lambda *a: flash_attention(*a, causal=True, return_lse=True, backend="triton"),
                  _leaves(xs, dtype), wo.to(dtype), wl.float(), [u.to(dtype) for u in us])
    for a, e in zip(ours, exact):
        assert ((a.double() - e).norm() / e.norm()).item() < tol


@pytest.mark.gpu
def test_gpu_second_order_memory_has_no_n_by_n_tensor():
    """The second-order chain of a loss of (o, lse) at N = 16,384 stays far below one head's
    N × N float32 matrix (1 GiB)."""
    n = 16384
    xs = [torch.randn(1, h, n, 64, device=DEV, dtype=torch.bfloat16, requires_grad=True) for h in (4, 2, 2)]
    wl = torch.randn(1, 4, n, device=DEV)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    o, lse = flash_attention(*xs, causal=True, return_lse=True)
    g = torch.autograd.grad(o.float().square().sum() + (lse * wl).sum(), xs, create_graph=True)
    h = torch.autograd.grad(g, xs, [torch.randn_like(t) for t in g])
    torch.cuda.synchronize()
    assert all(torch.isfinite(t).all() for t in h)
    assert torch.cuda.max_memory_allocated() - base < 2**29
