"""GPU tests of forward mode (bf16, fp16, fp32) against a float64 reference.

The Triton tangent forward (``attn_jvp``: o, lse, ȯ, l̇) for every variant, and the
autograd modes built on it (torch.func.jvp, backward through (o, ȯ), forward-over-reverse
HVP) on a few: each output's max error against float64 torch.func through
``naive_attention`` must be at most 2x the error of PyTorch's own math path in the same
dtype (torch.func.jvp of ``naive_attention``), plus one rounding unit at the output's scale
(FlashAttention's rule).
"""

from __future__ import annotations

import pytest
import torch
import torch.autograd.forward_ad as fwAD
from torch.func import grad, jvp

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from ttt_flash import flash_attention, flash_attention_varlen  # noqa: E402
from ttt_flash.kernels import attn_jvp, host  # noqa: E402
from ttt_flash.attention.reference import naive_attention, naive_attention_varlen  # noqa: E402

DEV = "cuda"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
UNIT = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-20}

CASES = {
    "Nq200-Nk200-d64-b2-gqa2": dict(b=2, hq=4, hkv=2, nq=200, nk=200, d=64, causal=False),
    "Nq150-Nk250-d64-causal": dict(b=1, hq=2, hkv=2, nq=150, nk=250, d=64, causal=True),
    "Nq250-Nk150-d64-causal-emptyrows": dict(b=1, hq=2, hkv=2, nq=250, nk=150, d=64, causal=True),
    "Nq180-Nk160-d64-window40-mqa4": dict(b=1, hq=4, hkv=1, nq=180, nk=160, d=64, causal=True, window=40),
    "N1-d40": dict(b=1, hq=2, hkv=2, nq=1, nk=1, d=40, causal=False),
    "N130-d96-causal-gqa3": dict(b=1, hq=3, hkv=1, nq=130, nk=130, d=96, causal=True),
    "N257-d128-causal": dict(b=1, hq=2, hkv=2, nq=257, nk=257, d=128, causal=True),
    "Nq100-Nk140-d256-window64": dict(b=1, hq=2, hkv=2, nq=100, nk=140, d=256, causal=True, window=64),
    "varlen-d128-causal-gqa2": dict(lens_q=[100, 0, 37, 200, 1], lens_k=[120, 0, 0, 190, 9],
                                    hq=4, hkv=2, d=128, causal=True),
    "varlen-d16-noncausal": dict(lens_q=[33, 0, 140], lens_k=[50, 7, 0], hq=2, hkv=2, d=16, causal=False),
}


def _make(case, dtype, seed=0):
    """(x, t, fn_ours_kernel, fn_naive): inputs (float64), tangents, and the two functions."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    c = CASES[case]
    window = c.get("window")
    if "lens_q" in c:
        cq = torch.tensor([0] + list(torch.tensor(c["lens_q"]).cumsum(0)), dtype=torch.int32, device=DEV)
        ck = torch.tensor([0] + list(torch.tensor(c["lens_k"]).cumsum(0)), dtype=torch.int32, device=DEV)
        shapes = ((sum(c["lens_q"]), c["hq"], c["d"]), (sum(c["lens_k"]), c["hkv"], c["d"]),
                  (sum(c["lens_k"]), c["hkv"], c["d"]))
        kw = dict(cu_seqlens_q=cq, cu_seqlens_k=ck, max_seqlen_q=max(c["lens_q"]), max_seqlen_k=max(c["lens_k"]))

        def naive(q, k, v):
            return naive_attention_varlen(q, k, v, cq, ck, causal=c["causal"], window=window)

        def ours(q, k, v):
            return flash_attention_varlen(q, k, v, cq, ck, kw["max_seqlen_q"], kw["max_seqlen_k"],
                                          causal=c["causal"], window=window)
    else:
        shapes = ((c["b"], c["hq"], c["nq"], c["d"]), (c["b"], c["hkv"], c["nk"], c["d"]),
                  (c["b"], c["hkv"], c["nk"], c["d"]))
        kw = {}

        def naive(q, k, v):
            return naive_attention(q, k, v, causal=c["causal"], window=window)

        def ours(q, k, v):
            return flash_attention(q, k, v, causal=c["causal"], window=window)

    x = [torch.randn(s, device=DEV, dtype=torch.float64, generator=g) for s in shapes]
    t = [torch.randn(s, device=DEV, dtype=torch.float64, generator=g) for s in shapes]
    kern = dict(scale=c["d"] ** -0.5, causal=c["causal"], window=window, **kw)
    return x, t, kern, ours, naive


def _err(a, e):
    return (a.double() - e).abs().max().item() if e.numel() else 0.0


def _rule(name, ours, math, exact, dtype):
    scale = max(exact.abs().max().item(), 1.0) if exact.numel() else 1.0
    e_ours, e_math = _err(ours, exact), _err(math, exact)
    bound = 2 * e_math + UNIT[dtype] * scale
    assert e_ours <= bound, f"{name}: error {e_ours:.3e} > 2 x math {e_math:.3e} + unit ({bound:.3e})"


@pytest.mark.parametrize("dt", list(DTYPES))
@pytest.mark.parametrize("case", list(CASES))
def test_tangent_kernel_gpu(case, dt):
    dtype = DTYPES[dt]
    x, t, kern, _, naive = _make(case, dtype)
    exact = jvp(naive, tuple(x), tuple(t))
    low = [a.to(dtype) for a in x]
    lowt = [a.to(dtype) for a in t]
    math = jvp(naive, tuple(low), tuple(lowt))
    host.POISON_OUTPUTS = True
    try:
        o, lse, od, lsed = attn_jvp(*low, *lowt, **kern)
    finally:
        host.POISON_OUTPUTS = False
    assert not torch.isnan(o).any() and not torch.isnan(od).any() and not torch.isnan(lsed).any()
    _rule("o", o, math[0], exact[0], dtype)
    _rule("od", od, math[1], exact[1], dtype)


@pytest.mark.parametrize("dt", list(DTYPES))
@pytest.mark.parametrize("case", ["Nq150-Nk250-d64-causal", "Nq180-Nk160-d64-window40-mqa4", "varlen-d128-causal-gqa2"])
def test_autograd_modes_gpu(case, dt):
    """jvp, backward through (o, ȯ) and forward-over-reverse HVP through the Triton path."""
    dtype = DTYPES[dt]
    x, t, _, ours, naive = _make(case, dtype, seed=1)
    g = torch.Generator(device=DEV).manual_seed(2)
    w1 = torch.randn(x[0].shape, device=DEV, dtype=torch.float64, generator=g)
    w2 = torch.randn(x[0].shape, device=DEV, dtype=torch.float64, generator=g)

    def modes(attn, x, t, w1, w2):
        def loss(q, k, v, a, b, c):
            o, od = jvp(attn, (q, k, v), (a, b, c))
            return (o * w1).sum() + (od * w2).sum()

        through = grad(loss, argnums=tuple(range(6)))(*x, *t)
        hvp = jvp(grad(lambda q, k, v: (attn(q, k, v) * w1).sum(), argnums=(0, 1, 2)), tuple(x), tuple(t))[1]
        return (jvp(attn, tuple(x), tuple(t))[1], *through, *hvp)

    exact = modes(naive, x, t, w1, w2)
    low = lambda seq: [a.to(dtype) for a in seq]  # noqa: E731
    args = (low(x), low(t), w1.to(dtype), w2.to(dtype))
    mine, math = modes(ours, *args), modes(naive, *args)
    names = ["od"] + [f"through_{n}" for n in ("q", "k", "v", "qd", "kd", "vd")] + ["hvp_q", "hvp_k", "hvp_v"]
    for name, a, m, e in zip(names, mine, math, exact):
        _rule(name, a, m, e, dtype)


@pytest.mark.parametrize("dt", list(DTYPES))
@pytest.mark.parametrize("case", ["Nq250-Nk150-d64-causal-emptyrows", "Nq180-Nk160-d64-window40-mqa4",
                                  "N257-d128-causal", "varlen-d16-noncausal"])
def test_tangent_from_saved_forward_gpu(case, dt):
    """``attn_tangent`` (Ȯ, L̇ from the forward's O and L, the path of ``_Attention.jvp``)."""
    from ttt_flash.kernels import attn_fwd, attn_tangent

    dtype = DTYPES[dt]
    x, t, kern, _, naive = _make(case, dtype)
    exact = jvp(naive, tuple(x), tuple(t))
    low = [a.to(dtype) for a in x]
    lowt = [a.to(dtype) for a in t]
    math = jvp(naive, tuple(low), tuple(lowt))
    o, lse = attn_fwd(*low, **kern)
    host.POISON_OUTPUTS = True
    try:
        od, lsed, rho = attn_tangent(*low, o, lse, *lowt, **kern)
    finally:
        host.POISON_OUTPUTS = False
    assert not torch.isnan(od).any() and not torch.isnan(lsed).any() and not torch.isnan(rho).any()
    _rule("od", od, math[1], exact[1], dtype)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_jvp_then_backward_gluon_passes_gpu(causal, monkeypatch, request):
    """Backward through (o, ȯ) where the Gluon passes run (sm_90; their shortest-sequence
    threshold lifted): the BoB takes the tangent forward's statistics (no statistics pass)
    and the Gluon column pass; within the float64 bound, and within a few bf16 units of the
    Triton-only path."""
    import dataclasses

    from ttt_flash.kernels import configs, plan
    from ttt_flash.kernels.gluon import bob_col, bob_row, dkdv

    if not dkdv.available():
        pytest.skip("needs triton.experimental.gluon and an sm_90 GPU")
    monkeypatch.setattr(configs, "GLUON", {key: dataclasses.replace(c, min_keys=0)
                                           for key, c in configs.GLUON.items()})
    plan.clear_cache()  # plans are cached per call shape: none made with the lifted thresholds stays
    request.addfinalizer(plan.clear_cache)
    calls = []
    for mod, name in ((dkdv, "launch_dkdv"), (bob_col, "launch_bob_col"),
                      (bob_row, "launch_bob_row")):
        real = getattr(mod, name)

        def counted(*a, _real=real, _name=name, **kw):
            calls.append(_name)
            return _real(*a, **kw)

        monkeypatch.setattr(mod, name, counted)
    g = torch.Generator(device=DEV).manual_seed(3)
    x = [torch.randn(1, 4, 1024, 64, device=DEV, dtype=torch.float64, generator=g) for _ in range(8)]

    def step(attn, dtype):  # as ``ttt-flash bench --jvp``'s jvp_bwd row
        leaves = [a.to(dtype).requires_grad_() for a in x[:6]]
        with fwAD.dual_level():
            dual = attn(*(fwAD.make_dual(a, d) for a, d in zip(leaves[:3], leaves[3:])), causal=causal)
            o, od = fwAD.unpack_dual(dual)
        return torch.autograd.grad((o, od), leaves, (x[6].to(dtype), x[7].to(dtype)))

    def loss(q, k, v, a, b, c):  # float64 reference through torch.func
        o, od = jvp(lambda q, k, v: naive_attention(q, k, v, causal=causal), (q, k, v), (a, b, c))
        return (o * x[6]).sum() + (od * x[7]).sum()

    exact = grad(loss, argnums=tuple(range(6)))(*x[:6])
    on = step(flash_attention, torch.bfloat16)
    assert calls == ["launch_dkdv", "launch_bob_col", "launch_dkdv"]
    with configs.use_gluon_passes(False):
        off = step(flash_attention, torch.bfloat16)
    for name, a, b, e in zip(("q", "k", "v", "qd", "kd", "vd"), on, off, exact):
        ulp = e.abs().max().item() * 2.0 ** -8
        err_on, err_off = _err(a, e), _err(b, e)
        assert err_on <= 2 * err_off + ulp, (name, err_on, err_off, ulp)
        assert (a.float() - b.float()).abs().max().item() <= 4 * ulp, name
