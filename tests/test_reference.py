"""The exact PyTorch reference and the autograd structure around it (float64, CPU)."""

from __future__ import annotations

import pytest
import torch
from torch.autograd import gradcheck, gradgradcheck
from torch.utils._python_dispatch import TorchDispatchMode

from ttt_flash import flash_attention, flash_attention_varlen
from ttt_flash.attention import reference
from ttt_flash.attention.reference import naive_attention, naive_attention_varlen

F64 = torch.float64


def _rand(*shape, dtype=F64, requires_grad=True):
    return torch.randn(*shape, dtype=dtype).requires_grad_(requires_grad)


def _chain(fn, q, k, v, do, u):
    """o, first gradients and the BoB products for cotangents u of (dq, dk, dv)."""
    o = fn(q, k, v)
    grads = torch.autograd.grad(o, (q, k, v), do, create_graph=True)
    inner = sum((g * w).sum() for g, w in zip(grads, u))
    second = torch.autograd.grad(inner, (q, k, v, do))
    return [o, *grads, *second]


# --------------------------------------------------------------------------- gradcheck / gradgradcheck

# (B, H_q, H_kv, N_q, N_k, D, causal, window)
DENSE_CASES = [
    pytest.param(1, 2, 2, 5, 5, 3, False, None, id="noncausal"),
    pytest.param(1, 2, 2, 6, 6, 3, True, None, id="causal"),
    pytest.param(1, 2, 2, 4, 7, 3, True, None, id="causal-nq<nk"),
    pytest.param(1, 2, 2, 7, 4, 3, True, None, id="causal-nq>nk-empty-rows"),
    pytest.param(1, 2, 2, 7, 7, 3, True, 3, id="window3"),
    pytest.param(1, 4, 1, 5, 5, 3, False, None, id="gqa4"),
    pytest.param(1, 3, 1, 5, 5, 3, True, None, id="mqa"),
    pytest.param(2, 4, 1, 5, 6, 2, True, 2, id="gqa4-window-nq!=nk-b2"),
]


@pytest.mark.parametrize("b,hq,hkv,nq,nk,d,causal,window", DENSE_CASES)
def test_gradcheck_and_gradgradcheck(b, hq, hkv, nq, nk, d, causal, window):
    q, k, v = _rand(b, hq, nq, d), _rand(b, hkv, nk, d), _rand(b, hkv, nk, d)

    def fn(q, k, v):
        return flash_attention(q, k, v, causal=causal, window=window, backend="reference")

    assert gradcheck(fn, (q, k, v))
    assert gradgradcheck(fn, (q, k, v))


def test_gradgradcheck_varlen_with_empty_sequence():
    cu_q = torch.tensor([0, 3, 3, 7], dtype=torch.int32)
    cu_k = torch.tensor([0, 4, 6, 9], dtype=torch.int32)  # sequence 1: 0 queries, 2 keys
    q, k, v = _rand(7, 2, 3), _rand(9, 1, 3), _rand(9, 1, 3)

    def fn(q, k, v):
        return flash_attention_varlen(q, k, v, cu_q, cu_k, 4, 4, causal=True, backend="reference")

    assert gradcheck(fn, (q, k, v))
    assert gradgradcheck(fn, (q, k, v))


@pytest.mark.parametrize("nq, nk, window", [(9, 9, None), (7, 12, 3), (12, 5, 2)], ids=["square", "nk-gt-nq-w3", "nq-gt-nk-w2"])
def test_a_block_of_the_mask_is_that_block_of_the_full_mask(nq, nk, window):
    # the blocks of the BoB's recomputation ask for rows r0:r1 and keys k0:k1 only
    full = reference.attention_mask(nq, nk, causal=True, window=window)
    for r0, r1, c0, c1 in [(0, nq, 0, nk), (2, 5, 1, 4), (nq - 3, nq, nk - 2, nk), (1, 2, 0, 1)]:
        block = reference.attention_mask(nq, nk, causal=True, window=window, row_start=r0, row_end=r1,
                                         col_start=c0, col_end=c1)
        assert torch.equal(block, full[r0:r1, c0:c1]), (r0, r1, c0, c1)
    assert reference.attention_mask(nq, nk, causal=False, window=None, col_start=1) is None


def test_rows_that_see_no_key_are_exactly_zero():
    # N_q > N_k causal: the first N_q - N_k rows see no key; window 1 with shift keeps others alive
    q, k, v = _rand(1, 2, 6, 4), _rand(1, 2, 3, 4), _rand(1, 2, 3, 4)
    do = _rand(1, 2, 6, 4)
    u = [torch.randn_like(q), torch.randn_like(k), torch.randn_like(v)]
    out = _chain(lambda q, k, v: flash_attention(q, k, v, causal=True, backend="reference"), q, k, v, do, u)
    o, dq, qb, dob = out[0], out[1], out[4], out[7]
    for t in (o, dq, qb, dob):
        assert torch.isfinite(t).all()
        assert torch.equal(t[:, :, :3], torch.zeros_like(t[:, :, :3]))
        assert t[:, :, 3:].abs().sum() > 0


def test_varlen_empty_key_sequence_gives_zero_rows():
    cu_q = torch.tensor([0, 2, 5], dtype=torch.int32)
    cu_k = torch.tensor([0, 0, 4], dtype=torch.int32)  # first sequence has no keys
    q, k, v = _rand(5, 2, 3), _rand(4, 2, 3), _rand(4, 2, 3)
    o = flash_attention_varlen(q, k, v, cu_q, cu_k, 3, 4, backend="reference")
    assert torch.equal(o[:2], torch.zeros_like(o[:2]))
    (gq,) = torch.autograd.grad(o.square().sum(), (q,))
    assert torch.equal(gq[:2], torch.zeros_like(gq[:2]))
    assert torch.isfinite(gq).all()


# --------------------------------------------------------------------------- closed form vs autograd twice


SHAPES = [
    pytest.param(1, 4, 1, 1, 4, False, None, id="N1-d4"),
    pytest.param(2, 2, 2, 17, 20, False, None, id="N17-d20"),
    pytest.param(1, 2, 2, 37, 4, True, None, id="N37-d4-causal"),
    pytest.param(1, 4, 2, 17, 20, True, 5, id="N17-d20-window5-gqa2"),
    pytest.param(1, 3, 1, 37, 20, True, None, id="N37-d20-causal-mqa"),
]


@pytest.mark.parametrize("b,hq,hkv,n,d,causal,window", SHAPES)
@pytest.mark.parametrize("nk_delta", [0, 5, -7], ids=["nk=nq", "nk>nq", "nk<nq"])
def test_closed_form_equals_autograd_twice(b, hq, hkv, n, d, causal, window, nk_delta):
    nk = max(1, n + nk_delta)
    q, k, v = _rand(b, hq, n, d), _rand(b, hkv, nk, d), _rand(b, hkv, nk, d)
    do = _rand(b, hq, n, d)
    u = [torch.randn_like(q), torch.randn_like(k), torch.randn_like(v)]
    ours = _chain(
        lambda q, k, v: flash_attention(q, k, v, causal=causal, window=window, backend="reference"),
        q, k, v, do, u,
    )
    naive = _chain(lambda q, k, v: naive_attention(q, k, v, causal=causal, window=window), q, k, v, do, u)
    for name, a, e in zip(["o", "dq", "dk", "dv", "qb", "kb", "vb", "dob"], ours, naive):
        assert (a - e).abs().max().item() <= 1e-9, name


def test_small_chunks_give_the_same_result():
    q, k, v, do = _rand(1, 2, 50, 8), _rand(1, 2, 50, 8), _rand(1, 2, 50, 8), _rand(1, 2, 50, 8)
    uq, uk, uv = torch.randn_like(q), torch.randn_like(k), torch.randn_like(v)
    kw = dict(scale=0.3, causal=True, window=9)
    results = []
    for chunk in (7, 256):
        o, lse = reference.attn_fwd(q, k, v, chunk=chunk, **kw)
        dq, dk, dv, delta = reference.attn_bwd(q, k, v, o, lse, do, chunk=chunk, **kw)
        bob = reference.attn_bob(q, k, v, o, lse, do, delta, uq, uk, uv, chunk=chunk, **kw)
        results.append([o, lse, dq, dk, dv, delta, *bob])
    for a, e in zip(*results):
        torch.testing.assert_close(a, e, rtol=0, atol=1e-12)


def test_cotangent_subsets_match_autograd():
    q, k, v, do = _rand(1, 2, 9, 4), _rand(1, 2, 9, 4), _rand(1, 2, 9, 4), _rand(1, 2, 9, 4)
    o = flash_attention(q, k, v, causal=True, backend="reference")
    dq, dk, dv = torch.autograd.grad(o, (q, k, v), do, create_graph=True)
    on = naive_attention(q, k, v, causal=True)
    nq, nk, nv = torch.autograd.grad(on, (q, k, v), do, create_graph=True)
    w = torch.randn_like(dk)
    ours = torch.autograd.grad((dk * w).sum(), (q, k, v, do), allow_unused=True)
    ref = torch.autograd.grad((nk * w).sum(), (q, k, v, do), allow_unused=True)
    for a, e in zip(ours, ref):
        assert (a - e).abs().max() <= 1e-12


def test_varlen_equals_dense_per_sequence():
    lens_q, lens_k = [5, 0, 9, 1], [7, 3, 9, 2]
    cu_q = torch.tensor([0] + list(torch.tensor(lens_q).cumsum(0)), dtype=torch.int32)
    cu_k = torch.tensor([0] + list(torch.tensor(lens_k).cumsum(0)), dtype=torch.int32)
    q, k, v = _rand(sum(lens_q), 4, 6), _rand(sum(lens_k), 2, 6), _rand(sum(lens_k), 2, 6)
    do = _rand(sum(lens_q), 4, 6)
    u = [torch.randn_like(q), torch.randn_like(k), torch.randn_like(v)]
    ours = _chain(
        lambda q, k, v: flash_attention_varlen(q, k, v, cu_q, cu_k, 9, 9, causal=True, window=4, backend="reference"),
        q, k, v, do, u,
    )
    naive = _chain(
        lambda q, k, v: naive_attention_varlen(q, k, v, cu_q, cu_k, causal=True, window=4), q, k, v, do, u
    )
    for a, e in zip(ours, naive):
        assert (a - e).abs().max().item() <= 1e-12


# --------------------------------------------------------------------------- dtypes, layouts, autograd structure


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_low_precision_returns_input_dtype_and_is_accurate(dtype):
    q, k, v = (torch.randn(1, 2, 33, 16, dtype=dtype, requires_grad=True) for _ in range(3))
    o = flash_attention(q, k, v, causal=True, backend="reference")
    assert o.dtype == dtype
    dq, dk, dv = torch.autograd.grad(o.float().square().sum(), (q, k, v))
    assert dq.dtype == dk.dtype == dv.dtype == dtype
    exact = naive_attention(q.double(), k.double(), v.double(), causal=True)
    err = (o.double() - exact).norm() / exact.norm()
    tol = {torch.float16: 2e-3, torch.bfloat16: 1e-2, torch.float32: 1e-6}[dtype]
    assert err < tol


def test_non_contiguous_inputs_give_the_same_result():
    base = _rand(1, 12, 2, 8, requires_grad=False)  # (B, N, H, D): a transpose gives (B, H, N, D)
    q = base.transpose(1, 2).requires_grad_(True)
    k = _rand(1, 12, 2, 8, requires_grad=False).transpose(1, 2).requires_grad_(True)
    v = _rand(1, 12, 2, 8, requires_grad=False).transpose(1, 2).requires_grad_(True)
    assert not q.is_contiguous()
    o1 = flash_attention(q, k, v, causal=True, backend="reference")
    qc, kc, vc = (x.detach().contiguous().requires_grad_(True) for x in (q, k, v))
    o2 = flash_attention(qc, kc, vc, causal=True, backend="reference")
    torch.testing.assert_close(o1, o2, rtol=0, atol=0)
    g1 = torch.autograd.grad(o1.sum(), (q, k, v))
    g2 = torch.autograd.grad(o2.sum(), (qc, kc, vc))
    for a, e in zip(g1, g2):
        torch.testing.assert_close(a, e, rtol=0, atol=0)


def test_torch_func_grad_of_grad():
    from torch.func import grad

    q, k, v = (torch.randn(1, 2, 6, 4, dtype=F64) for _ in range(3))

    def second(attn):
        def f(q):
            return attn(q, k, v, causal=True).sin().sum()

        return grad(lambda q: grad(f)(q).square().sum())(q)

    torch.testing.assert_close(second(flash_attention), second(naive_attention), rtol=0, atol=1e-12)


def test_gradient_reaches_do_of_first_backward():
    q, k, v, do = _rand(1, 2, 5, 3), _rand(1, 2, 5, 3), _rand(1, 2, 5, 3), _rand(1, 2, 5, 3)
    (dv,) = torch.autograd.grad(flash_attention(q, k, v), (v,), do, create_graph=True)
    (gdo,) = torch.autograd.grad(dv.sum(), (do,))
    (gdo_naive,) = torch.autograd.grad(
        torch.autograd.grad(naive_attention(q, k, v), (v,), do, create_graph=True)[0].sum(), (do,)
    )
    torch.testing.assert_close(gdo, gdo_naive, rtol=0, atol=1e-12)


# --------------------------------------------------------------------------- memory


class _LargestTensor(TorchDispatchMode):
    """Records the largest number of elements of any tensor an operator produced."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_chunked_reference_never_allocates_n_by_n_by_h():
    n, h, d = 2048, 2, 16
    q, k, v, do = (torch.randn(1, h, n, d) for _ in range(4))
    uq, uk, uv = (torch.randn(1, h, n, d) for _ in range(3))
    kw = dict(scale=d**-0.5, causal=True, window=None)
    with _LargestTensor() as mode:
        o, lse = reference.attn_fwd(q, k, v, **kw)
        dq, dk, dv, delta = reference.attn_bwd(q, k, v, o, lse, do, **kw)
        reference.attn_bob(q, k, v, o, lse, do, delta, uq, uk, uv, **kw)
    assert mode.largest >= h * reference.DEFAULT_CHUNK * n  # the score chunks were seen
    assert mode.largest <= h * reference.DEFAULT_CHUNK * n < h * n * n
