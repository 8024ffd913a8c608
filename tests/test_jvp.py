"""Forward-mode AD through flash_attention: jvp, jacfwd, torch.func.hessian, forward_ad,
forward-over-reverse HVPs and reverse mode through a jvp, against materialised attention
differentiated by torch.func (float64, <= 1e-9); the Triton tangent kernel under the
interpreter against the reference."""

import pytest
import torch
import torch.autograd.forward_ad as fwAD
from torch.func import grad, hessian, jacfwd, jacrev, jvp, vmap

from ttt_flash import flash_attention, flash_attention_varlen
from ttt_flash.attention import reference
from ttt_flash.attention.reference import naive_attention, naive_attention_varlen

F64 = torch.float64
TOL = 1e-9

# (H_q, H_kv, N_q, N_k, D, causal, window)
VARIANTS = [
    pytest.param((2, 2, 6, 6, 3, True, None), id="N6-d3-causal"),
    pytest.param((2, 2, 7, 7, 3, True, 3), id="N7-d3-window3"),
    pytest.param((4, 2, 5, 5, 3, False, None), id="N5-d3-gqa2"),
    pytest.param((2, 1, 4, 7, 3, True, None), id="Nq4-Nk7-causal-mqa"),
    pytest.param((2, 2, 7, 4, 3, True, None), id="Nq7-Nk4-causal-rows-without-keys"),
]


def _inputs(hq, hkv, nq, nk, d, b=1):
    return (torch.randn(b, hq, nq, d, dtype=F64), torch.randn(b, hkv, nk, d, dtype=F64),
            torch.randn(b, hkv, nk, d, dtype=F64))


def _close(a, b, tol=TOL):
    a = a if isinstance(a, (tuple, list)) else (a,)
    b = b if isinstance(b, (tuple, list)) else (b,)
    assert len(a) == len(b)
    for x, y in zip(a, b):
        if isinstance(x, (tuple, list)):
            _close(x, y, tol)
        else:
            torch.testing.assert_close(x, y, rtol=0, atol=tol)


def _pair(variant):
    hq, hkv, nq, nk, d, causal, window = variant
    ours = lambda q, k, v: flash_attention(q, k, v, causal=causal, window=window)  # noqa: E731
    naive = lambda q, k, v: naive_attention(q, k, v, causal=causal, window=window)  # noqa: E731
    return ours, naive, _inputs(hq, hkv, nq, nk, d)


# --------------------------------------------------------------------------- torch.func, dense


@pytest.mark.parametrize("variant", VARIANTS)
def test_jvp_and_partial_tangents(variant):
    ours, naive, x = _pair(variant)
    t = tuple(torch.randn_like(a) for a in x)
    _close(jvp(ours, x, t), jvp(naive, x, t))
    # one input varied at a time: the other tangents are None inside the Function
    for i in range(3):
        f = lambda a, i=i: ours(*x[:i], a, *x[i + 1:])  # noqa: E731
        g = lambda a, i=i: naive(*x[:i], a, *x[i + 1:])  # noqa: E731
        _close(jvp(f, (x[i],), (t[i],)), jvp(g, (x[i],), (t[i],)))


@pytest.mark.parametrize("variant", VARIANTS)
def test_jacfwd(variant):
    ours, naive, x = _pair(variant)
    _close(jacfwd(ours, argnums=(0, 1, 2))(*x), jacfwd(naive, argnums=(0, 1, 2))(*x))


@pytest.mark.parametrize("variant", VARIANTS)
def test_hessian_is_forward_over_reverse(variant):
    ours, naive, x = _pair(variant)
    w = torch.randn_like(x[0])

    def loss(attn):
        return lambda q, k, v: (attn(q, k, v).sin() * w).sum()

    _close(hessian(loss(ours), argnums=(0, 1, 2))(*x), hessian(loss(naive), argnums=(0, 1, 2))(*x))


@pytest.mark.parametrize("variant", VARIANTS)
def test_forward_over_reverse_hvp_and_jvp_of_the_first_backward(variant):
    ours, naive, x = _pair(variant)
    t = tuple(torch.randn_like(a) for a in x)
    w = torch.randn_like(x[0])

    def hvp(attn):
        g = grad(lambda q, k, v: (attn(q, k, v).tanh() * w).sum(), argnums=(0, 1, 2))
        return jvp(g, x, t)

    _close(hvp(ours), hvp(naive))
    # the direction includes the upstream gradient dO: jvp of vjp(dO) in (q, k, v, dO)
    dout, ddout = torch.randn_like(x[0]), torch.randn_like(x[0])

    def pull(attn):
        return lambda q, k, v, do: torch.func.vjp(attn, q, k, v)[1](do)

    _close(jvp(pull(ours), (*x, dout), (*t, ddout)), jvp(pull(naive), (*x, dout), (*t, ddout)))


@pytest.mark.parametrize("variant", VARIANTS)
def test_backward_through_jvp_outputs(variant):
    """Consistency-model training: a loss of (O, Ȯ) back-propagated to x and ẋ."""
    ours, naive, x = _pair(variant)
    t = tuple(torch.randn_like(a) for a in x)
    w1, w2 = torch.randn_like(x[0]), torch.randn_like(x[0])

    def step(attn):
        def loss(q, k, v, qd, kd, vd):
            o, od = jvp(attn, (q, k, v), (qd, kd, vd))
            return (o * w1).sum() + (od * w2).sum() + od.square().sum()

        return grad(loss, argnums=tuple(range(6)))(*x, *t)

    _close(step(ours), step(naive))


def test_vmap_of_jvp_and_of_forward_over_reverse():
    """vmap over a batch of tangents (and of inputs) of jvp and jvp(grad)."""
    q, k, v = _inputs(4, 2, 5, 6, 3)
    tq = torch.randn(3, *q.shape, dtype=F64)
    vs = torch.randn(3, *v.shape, dtype=F64)

    def run(attn):
        f = lambda q, k, v: attn(q, k, v, causal=True)  # noqa: E731
        a = vmap(lambda tq, v: jvp(lambda q: f(q, k, v), (q,), (tq,))[1])(tq, vs)
        g = grad(lambda q, k, v: f(q, k, v).cos().sum(), argnums=(0, 1, 2))
        b = vmap(lambda tq, v: jvp(g, (q, k, v), (tq, k, v))[1])(tq, vs)
        return a, b

    _close(run(flash_attention), run(naive_attention))


# --------------------------------------------------------------------------- forward_ad


def test_forward_ad_jvp_forward_over_reverse_and_backward_through_tangent():
    q, k, v = _inputs(4, 2, 5, 7, 3)
    tq, tk, tv = (torch.randn_like(a) for a in (q, k, v))
    w = torch.randn_like(q)

    def run(attn):
        f = lambda q, k, v: attn(q, k, v, causal=True, window=4)  # noqa: E731
        with fwAD.dual_level():
            o = f(fwAD.make_dual(q, tq), fwAD.make_dual(k, tk), fwAD.make_dual(v, tv))
            od = fwAD.unpack_dual(o).tangent
        # forward-over-reverse: gradient computed inside the level carries H·t as its tangent
        leaf = q.clone().requires_grad_()
        with fwAD.dual_level():
            dual = fwAD.make_dual(leaf, tq)
            (gq,) = torch.autograd.grad((f(dual, k, v).sin() * w).sum(), dual)
            hq = fwAD.unpack_dual(gq).tangent
        # reverse through the tangent: computed in the level, back-propagated after it
        xs = [a.clone().requires_grad_() for a in (q, k, v, tq, tk, tv)]
        with fwAD.dual_level():
            o2 = f(*(fwAD.make_dual(a, t) for a, t in zip(xs[:3], xs[3:])))
            p2, t2 = fwAD.unpack_dual(o2)
            loss = (p2 * w).sum() + t2.square().sum()
        gs = torch.autograd.grad(loss, xs)
        return od, hq, gs

    ours = run(flash_attention)
    # the materialised oracle through torch.func (its in-place masking does not allow the
    # forward_ad reverse pattern)
    f = lambda q, k, v: naive_attention(q, k, v, causal=True, window=4)  # noqa: E731
    _close(ours[0], jvp(f, (q, k, v), (tq, tk, tv))[1])
    _close(ours[1], jvp(grad(lambda q: (f(q, k, v).sin() * w).sum()), (q,), (tq,))[1])

    def loss(q, k, v, a, b, c):
        o, od = jvp(f, (q, k, v), (a, b, c))
        return (o * w).sum() + od.square().sum()

    _close(ours[2], grad(loss, argnums=tuple(range(6)))(q, k, v, tq, tk, tv))


def test_backward_inside_a_dual_level_gives_gradients():
    """loss.backward() inside the dual level: the gradients are right (their own tangents,
    a third derivative, are not computed)."""
    q, k, v = _inputs(2, 2, 5, 5, 3)
    tq = torch.randn_like(q)
    xs = [a.clone().requires_grad_() for a in (q, tq)]
    with fwAD.dual_level():
        o = flash_attention(fwAD.make_dual(xs[0], xs[1]), k, v, causal=True)
        p, t = fwAD.unpack_dual(o)
        (p.sum() + t.square().sum()).backward()
    f = lambda q: naive_attention(q, k, v, causal=True)  # noqa: E731
    ref = grad(lambda q, a: f(q).sum() + jvp(f, (q,), (a,))[1].square().sum(), argnums=(0, 1))(q, tq)
    _close((xs[0].grad, xs[1].grad), ref)


# --------------------------------------------------------------------------- varlen


def _varlen_case():
    # lengths (q, k): (3, 3), (0, 2) empty queries, (4, 0) rows with no key, (5, 3) causal
    # with more queries than keys (rows without keys)
    cq = torch.tensor([0, 3, 3, 7, 12], dtype=torch.int32)
    ck = torch.tensor([0, 3, 5, 5, 8], dtype=torch.int32)
    q = torch.randn(12, 4, 3, dtype=F64)
    k, v = torch.randn(8, 2, 3, dtype=F64), torch.randn(8, 2, 3, dtype=F64)
    ours = lambda q, k, v: flash_attention_varlen(q, k, v, cq, ck, 5, 3, causal=True)  # noqa: E731
    naive = lambda q, k, v: naive_attention_varlen(q, k, v, cq, ck, causal=True)  # noqa: E731
    return ours, naive, (q, k, v)


def test_varlen_every_mode():
    ours, naive, x = _varlen_case()
    t = tuple(torch.randn_like(a) for a in x)
    w = torch.randn_like(x[0])
    _close(jvp(ours, x, t), jvp(naive, x, t))
    _close(jacfwd(ours, argnums=(0, 1, 2))(*x), jacfwd(naive, argnums=(0, 1, 2))(*x))

    def loss(attn):
        return lambda q, k, v: (attn(q, k, v).sin() * w).sum()

    _close(hessian(loss(ours), argnums=(1, 2))(*x), hessian(loss(naive), argnums=(1, 2))(*x))
    _close(jvp(grad(loss(ours), argnums=(0, 1, 2)), x, t), jvp(grad(loss(naive), argnums=(0, 1, 2)), x, t))

    def through(attn):
        def f(q, k, v, a, b, c):
            o, od = jvp(attn, (q, k, v), (a, b, c))
            return (o * w).sum() + od.square().sum()

        return grad(f, argnums=tuple(range(6)))(*x, *t)

    _close(through(ours), through(naive))


# --------------------------------------------------------------------------- gradcheck family


def test_gradcheck_forward_ad_and_gradgradcheck_forward_over_reverse():
    q, k, v = (a.requires_grad_() for a in _inputs(2, 1, 4, 5, 2))
    f = lambda q, k, v: flash_attention(q, k, v, causal=True)  # noqa: E731
    assert torch.autograd.gradcheck(f, (q, k, v), check_forward_ad=True, check_backward_ad=True)
    assert torch.autograd.gradgradcheck(f, (q, k, v), check_fwd_over_rev=True, check_rev_over_rev=True)


def test_gradcheck_of_the_tangent_output():
    """Reverse mode through the jvp (backward through Ȯ), against finite differences."""
    x = [a.requires_grad_() for a in _inputs(2, 1, 4, 5, 2)]
    t = [torch.randn_like(a).requires_grad_() for a in x]

    def tangent(q, k, v, qd, kd, vd):
        return jvp(lambda q, k, v: flash_attention(q, k, v, causal=True), (q, k, v), (qd, kd, vd))[1]

    assert torch.autograd.gradcheck(tangent, (*x, *t))


# --------------------------------------------------------------------------- unsupported modes


def test_unsupported_compositions_name_what_is_supported():
    q, k, v = _inputs(2, 2, 4, 4, 2)
    f = lambda q: flash_attention(q, k, v).sum()  # noqa: E731
    with pytest.raises(NotImplementedError, match="forward-over-forward") as e:
        jacfwd(jacfwd(f))(q)
    assert "forward-over-reverse" in str(e.value) and "You must implement" not in str(e.value)


# --------------------------------------------------------------------------- Triton kernel (interpreter)

# (B, H_q, H_kv, N_q, N_k, D, causal, window, tangents present (q, k, v))
KERNEL_CASES = [
    pytest.param((1, 2, 1, 37, 45, 16, True, None, (1, 1, 1)), id="Nq37-Nk45-d16-causal-mqa"),
    pytest.param((1, 2, 2, 40, 23, 24, True, 7, (1, 1, 1)), id="Nq40-Nk23-d24-window7-rows-without-keys"),
    pytest.param((2, 2, 1, 33, 33, 16, False, None, (0, 1, 0)), id="N33-d16-only-kd"),
    pytest.param((1, 2, 2, 17, 17, 40, True, None, (1, 0, 1)), id="N17-d40-causal-no-kd"),
]


def _kernel_inputs(b, hq, hkv, nq, nk, d, dtype, present, varlen=None):
    if varlen is None:
        shapes = ((b, hq, nq, d), (b, hkv, nk, d), (b, hkv, nk, d))
    else:
        shapes = ((varlen[0], hq, d), (varlen[1], hkv, d), (varlen[1], hkv, d))
    x = [torch.randn(s, dtype=dtype) for s in shapes]
    t = [torch.randn(s, dtype=dtype) if p else None for s, p in zip(shapes, present)]
    return x, t


def _check_kernel(x, t, kw, tol_o, tol_row):
    from ttt_flash import kernels

    up = lambda a: None if a is None else a.double()  # noqa: E731
    kernels.host.POISON_OUTPUTS = True
    try:
        got = kernels.attn_jvp(*x, *t, **kw)
    finally:
        kernels.host.POISON_OUTPUTS = False
    ref = reference.attn_jvp(*(up(a) for a in x), *(up(a) for a in t), **kw)
    for name, g, r, tol in zip(("o", "lse", "od", "lsed"), got, ref, (tol_o, tol_row, tol_o, tol_row)):
        assert not torch.isnan(g).any(), f"{name} has NaN (unwritten element)"
        fin = torch.isfinite(r)
        assert torch.equal(fin, torch.isfinite(g)), f"{name}: -inf rows differ"
        err = (g.double()[fin] - r[fin]).abs().max().item() if fin.any() else 0.0
        assert err <= tol, f"{name}: max error {err:.2e} > {tol:.0e}"


@pytest.mark.parametrize("case", KERNEL_CASES)
def test_tangent_kernel_fp32_interpreter(case, one_thread):
    b, hq, hkv, nq, nk, d, causal, window, present = case
    x, t = _kernel_inputs(b, hq, hkv, nq, nk, d, torch.float32, present)
    _check_kernel(x, t, dict(scale=d ** -0.5, causal=causal, window=window), 2e-5, 2e-5)


def test_tangent_kernel_varlen_fp32_interpreter(one_thread):
    cq = torch.tensor([0, 20, 20, 29, 40], dtype=torch.int32)
    ck = torch.tensor([0, 33, 38, 38, 45], dtype=torch.int32)  # an empty key sequence
    x, t = _kernel_inputs(None, 2, 1, None, None, 16, torch.float32, (1, 1, 1), varlen=(40, 45))
    kw = dict(scale=0.25, causal=True, window=None, cu_seqlens_q=cq, cu_seqlens_k=ck,
              max_seqlen_q=20, max_seqlen_k=33)
    _check_kernel(x, t, kw, 2e-5, 2e-5)


def test_tangent_kernel_fp16_interpreter(one_thread):
    x, t = _kernel_inputs(1, 2, 1, 37, 45, 16, torch.float16, (1, 1, 1))
    # fp16 inputs: P and P∘Ṡ are rounded to fp16 for the products (as the forward rounds P)
    _check_kernel(x, t, dict(scale=0.25, causal=True, window=None), 3e-3, 1e-4)


def test_tangent_kernel_cancels_a_shared_key_tangent(one_thread):
    """K̇ equal for every key shifts each row of S by a constant: Ȯ = 0 and L̇ = q·k̇ τ.
    The per-row reference c keeps the fp16 Ȯ at rounding level, not at |L̇|·|O|."""
    from ttt_flash import kernels

    q, k, v = (torch.randn(1, 1, 33, 16, dtype=torch.float16) * 3 for _ in range(3))
    kd = (torch.randn(1, 1, 1, 16) * 50).expand(1, 1, 33, 16).to(torch.float16)
    o, lse, od, lsed = kernels.attn_jvp(q, k, v, None, kd, None, scale=0.25, causal=False, window=None)
    assert od.abs().max().item() < 0.05 * o.abs().max().item()
    expect = 0.25 * (q.double() @ kd[0, 0, 0].double())
    torch.testing.assert_close(lsed.double(), expect, rtol=1e-3, atol=1e-2)


def test_autograd_modes_on_the_triton_backend_interpreter(one_thread):
    """The Functions' jvp and the backward through it run the Triton composers: same
    results as the reference backend (fp32)."""
    q, k, v = (torch.randn(1, 1, 17, 16) for _ in range(3))
    tq, tk, tv = (torch.randn_like(a) for a in (q, k, v))
    w = torch.randn_like(q)

    def run(backend):
        f = lambda q, k, v: flash_attention(q, k, v, causal=True, backend=backend)  # noqa: E731

        def loss(q, k, v, a, b, c):
            o, od = jvp(f, (q, k, v), (a, b, c))
            return (o * w).sum() + od.square().sum()

        hv = jvp(grad(lambda q, k, v: (f(q, k, v) * w).sum(), argnums=(0, 1, 2)), (q, k, v), (tq, tk, tv))[1]
        return jvp(f, (q, k, v), (tq, tk, tv))[1], grad(loss, argnums=tuple(range(6)))(q, k, v, tq, tk, tv), hv

    _close(run("triton"), run("reference"), tol=2e-4)


def test_reverse_over_forward_hessian():
    """jacrev(jacfwd(f)): reverse mode through a vmapped jvp (the tangent's backward under vmap)."""
    ours, naive, x = _pair((2, 1, 4, 5, 3, True, None))
    w = torch.randn_like(x[0])

    def hess(attn):
        f = lambda q, k, v: (attn(q, k, v).sin() * w).sum()  # noqa: E731
        return jacrev(jacfwd(f, argnums=(0, 1, 2)), argnums=(0, 1, 2))(*x)

    _close(hess(ours), hess(naive))


def test_tangent_kernel_strided_tangents_interpreter(one_thread):
    """Tangents with their own (non-contiguous) strides, different from the primals'."""
    x, _ = _kernel_inputs(1, 2, 1, 19, 21, 16, torch.float32, (0, 0, 0))
    t = [torch.randn(1, a.shape[2], a.shape[1], 16).transpose(1, 2) for a in x]
    assert not t[0].is_contiguous()
    _check_kernel(x, t, dict(scale=0.25, causal=True, window=None), 2e-5, 2e-5)


def _check_tangent_kernel(x, t, kw, tol):
    """kernels.attn_tangent (from the kernels' own forward) against reference.attn_tangent in
    float64 and against the one-pass kernel attn_jvp."""
    from ttt_flash import kernels

    up = lambda a: None if a is None else a.double()  # noqa: E731
    o, lse = kernels.attn_fwd(*x, **kw)
    kernels.host.POISON_OUTPUTS = True
    try:
        got = kernels.attn_tangent(*x, o, lse, *t, **kw)
    finally:
        kernels.host.POISON_OUTPUTS = False
    ref = reference.attn_tangent(*(up(a) for a in x), up(o), lse.double(), *(up(a) for a in t), **kw)
    one_pass = kernels.attn_jvp(*x, *t, **kw)
    for name, g, r, j in zip(("od", "lsed", "rho"), got, ref, (one_pass[2], one_pass[3], None)):
        assert not torch.isnan(g).any(), f"{name} has NaN (unwritten element)"
        assert (g.double() - r).abs().max().item() <= tol, f"{name} differs from the reference"
        if j is not None:
            assert (g.double() - j.double()).abs().max().item() <= tol, f"{name} differs from attn_jvp"


@pytest.mark.parametrize("case", KERNEL_CASES)
def test_tangent_from_saved_forward_kernel_fp32_interpreter(case, one_thread):
    """attn_tangent (P = exp(S − L) from the forward's L, no online softmax) = the reference
    and the one-pass tangent kernel; rows that see no key get Ȯ = L̇ = 0, ρ = 1."""
    b, hq, hkv, nq, nk, d, causal, window, present = case
    x, t = _kernel_inputs(b, hq, hkv, nq, nk, d, torch.float32, present)
    _check_tangent_kernel(x, t, dict(scale=d ** -0.5, causal=causal, window=window), 2e-5)


def test_tangent_from_saved_forward_kernel_varlen_fp32_interpreter(one_thread):
    cq = torch.tensor([0, 20, 20, 29, 40], dtype=torch.int32)
    ck = torch.tensor([0, 33, 38, 38, 45], dtype=torch.int32)  # an empty key sequence
    x, t = _kernel_inputs(None, 2, 1, None, None, 16, torch.float32, (1, 1, 1), varlen=(40, 45))
    kw = dict(scale=0.25, causal=True, window=None, cu_seqlens_q=cq, cu_seqlens_k=ck,
              max_seqlen_q=20, max_seqlen_k=33)
    _check_tangent_kernel(x, t, kw, 2e-5)


def test_tangent_from_saved_forward_cancels_a_shared_key_tangent(one_thread):
    """As the one-pass kernel: the per-row reference c keeps the fp16 Ȯ at rounding level."""
    from ttt_flash import kernels

    q, k, v = (torch.randn(1, 1, 33, 16, dtype=torch.float16) * 3 for _ in range(3))
    kd = (torch.randn(1, 1, 1, 16) * 50).expand(1, 1, 33, 16).to(torch.float16)
    kw = dict(scale=0.25, causal=False, window=None)
    o, lse = kernels.attn_fwd(q, k, v, **kw)
    od, lsed, _ = kernels.attn_tangent(q, k, v, o, lse, None, kd, None, **kw)
    assert od.abs().max().item() < 0.05 * o.abs().max().item()
    expect = 0.25 * (q.double() @ kd[0, 0, 0].double())
    torch.testing.assert_close(lsed.double(), expect, rtol=1e-3, atol=1e-2)


# (B, H_q, H_kv, N_q, N_k, D, causal, window, tangents present (q, k, v)), varlen or not
BOB_STATS_CASES = [
    pytest.param((1, 2, 1, 37, 45, 16, True, None, (1, 1, 1)), id="Nq37-Nk45-d16-causal-mqa"),
    pytest.param((1, 2, 2, 40, 23, 24, True, 7, (1, 1, 1)), id="Nq40-Nk23-d24-window7-rows-without-keys"),
    pytest.param((2, 2, 1, 33, 33, 16, False, None, (0, 1, 0)), id="N33-d16-only-kd"),
    pytest.param((1, 2, 2, 17, 17, 40, True, None, (0, 0, 1)), id="N17-d40-causal-only-vd"),
]


@pytest.mark.parametrize("deterministic", [True, False], ids=["direct+column", "fused"])
@pytest.mark.parametrize("case", BOB_STATS_CASES)
def test_bob_with_the_tangent_statistics_interpreter(case, deterministic, one_thread):
    """The BoB with U = ẋ and its row statistics from the tangent forward (α = L̇,
    E + αD = rowsum(dO∘Ȯ), ρ; no statistics pass) = the BoB that forms them (fp32, with the
    row-sum correction on)."""
    from ttt_flash import kernels

    b, hq, hkv, nq, nk, d, causal, window, present = case
    x, t = _kernel_inputs(b, hq, hkv, nq, nk, d, torch.float32, present)
    kw = dict(scale=d ** -0.5, causal=causal, window=window)
    o, lse = kernels.attn_fwd(*x, **kw)
    do = torch.randn_like(o)
    _, _, _, delta = kernels.attn_bwd(*x, o, lse, do, **kw)
    od, lsed, rho = kernels.attn_tangent(*x, o, lse, *t, **kw)
    ee = (do.double() * od.double()).sum(-1).float()
    needs = (True, True, True, False)
    plain = kernels.attn_bob(*x, o, lse, do, delta, *t, needs=needs, deterministic=deterministic, **kw)
    kernels.host.POISON_OUTPUTS = True
    try:
        given = kernels.attn_bob(*x, o, lse, do, delta, *t, needs=needs, deterministic=deterministic,
                                 stats=(lsed, ee, rho), **kw)
    finally:
        kernels.host.POISON_OUTPUTS = False
    for name, g, p in zip(("qb", "kb", "vb"), given, plain):
        assert not torch.isnan(g).any(), f"{name} has NaN (unwritten element)"
        scale = max(p.abs().max().item(), 1.0)
        assert (g - p).abs().max().item() <= 1e-4 * scale, f"{name} differs"
    # the given statistics are the ones used (no statistics pass of its own)
    off = kernels.attn_bob(*x, o, lse, do, delta, *t, needs=needs, deterministic=deterministic,
                           stats=(lsed, ee + 1.0, rho), **kw)
    assert (off[0] - plain[0]).abs().max().item() > 1e-2 * max(plain[0].abs().max().item(), 1.0)
