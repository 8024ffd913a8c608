"""GPU tests of the Gluon passes (kernels/gluon/fwd.py, dq.py, dkdv.py, bob_col.py,
bob_row.py) on sm_90.

O and L of the Gluon forward are compared with float64 attention and the Triton forward
(the bound below), full and causal, d = 64 / 128, GQA, several tile variants. dQ of the
Gluon dQ pass (fed the Triton forward's O and L) meets the same bound against float64
autograd and the Triton dQ pass, and its D = rowsum(dO∘O) agrees with the Triton pass's and
float64 to float32 rounding.

dK and dV of the Gluon pass, fed the Triton forward's LSE and the Triton backward's
D = rowsum(dO∘O), are compared with float64 autograd through ``naive_attention``: the max
error must be at most 2x the Triton pass's own error plus one bf16 rounding unit at the
output's scale (the bound tests/test_kernels_gpu.py uses). K̄ and V̄ of the Gluon BoB column
pass (fed α and E + αD computed in float64) meet the same bound against float64 double
backward, and agree with the Triton column pass (``attn_bob`` with the Gluon passes off) to
four bf16 units. Q̄ and dŌ of the Gluon BoB direct pass (fed float64 α, E + αD), and the
Gluon statistics pass feeding it, meet the same bounds against the Triton statistics and
direct passes and float64 double backward. The library chain (``flash_attention`` forward, ``autograd.grad(...,
create_graph=True)``, backward-over-backward) with the Gluon passes on (where
the plan (kernels/plan.py) selects them; checked by counting their calls) and off: every output
within the float64 bound, the two within a few bf16 units of each other. The same at
d = 128 and with GQA (H_q a multiple of H_kv), with the table's tiles, and for the key-tile
passes' two-consumer-partition variants (``consumers=2``). Skipped where
Gluon's Hopper ops or an sm_90 device are missing.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from ttt_flash.kernels import attn_bwd, attn_fwd, configs  # noqa: E402
from ttt_flash.kernels.gluon.dkdv import available, gluon_dkdv  # noqa: E402
from ttt_flash.attention.reference import naive_attention  # noqa: E402

if not available():
    pytest.skip("needs triton.experimental.gluon and an sm_90 GPU", allow_module_level=True)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("tiles", [(128, 64, 8), (64, 32, 4)], ids=["kt128-qt64-w8", "kt64-qt32-w4"])
def test_gluon_dkdv_matches_float64(causal, tiles):
    torch.manual_seed(0)
    q, k, v, do = (torch.randn(2, 3, 512, 64, device="cuda", dtype=torch.bfloat16)
                   for _ in range(4))
    kw = dict(scale=None, causal=causal, window=None)
    with configs.use_gluon_passes(False):  # the Triton forward and dK/dV pass as the baseline
        o, lse = attn_fwd(q, k, v, **kw)
        _, dk_t, dv_t, delta = attn_bwd(q, k, v, o, lse, do, deterministic=True, **kw)
    bn, bm, w = tiles
    dk_g, dv_g = gluon_dkdv(q, k, v, do, lse, delta, causal=causal, block_n=bn, block_m=bm,
                            num_warps=w)
    q64, k64, v64 = (x.double().requires_grad_() for x in (q, k, v))
    o64 = naive_attention(q64, k64, v64, causal=causal)
    _, dk64, dv64 = torch.autograd.grad(o64, (q64, k64, v64), do.double())
    for name, got, tri, ref in (("dk", dk_g, dk_t, dk64), ("dv", dv_g, dv_t, dv64)):
        err = (got.double() - ref).abs().max().item()
        tri_err = (tri.double() - ref).abs().max().item()
        ulp = ref.abs().max().item() * 2.0 ** -8
        assert err <= 2 * tri_err + ulp, (name, err, tri_err, ulp)


def test_gluon_dkdv_rejects_unsupported_shapes():
    q = torch.randn(1, 2, 200, 64, device="cuda", dtype=torch.bfloat16)
    lse = torch.zeros(1, 2, 200, device="cuda")
    with pytest.raises(ValueError, match="multiple of block_n"):
        gluon_dkdv(q, q, q, q, lse, lse)


# --------------------------------------------------------------------------- BoB column pass

from ttt_flash.kernels import attn_bob  # noqa: E402
from ttt_flash.kernels.gluon.bob_col import gluon_bob_col  # noqa: E402


def _bob_inputs(causal, n=512, heads=(3, 3), d=64):
    """Seven bf16 tensors (q, do, uq: (2, H_q, n, d); k, v, uk, uv: (2, H_kv, n, d), with
    ``heads`` = (H_q, H_kv)), L and D of the Triton passes, α and E + αD in float64 from
    bob-math.md's formulas (rounded to float32, as the statistics pass stores them)."""
    torch.manual_seed(0)
    h, hk = heads
    q, k, v, do, uq, uk, uv = (
        torch.randn(2, hh, n, d, device="cuda", dtype=torch.bfloat16)
        for hh in (h, hk, hk, h, h, hk, hk))
    kw = dict(scale=None, causal=causal, window=None)
    with configs.use_gluon_passes(False):  # the Triton passes' L and D
        o, lse = attn_fwd(q, k, v, **kw)
        _, _, _, delta = attn_bwd(q, k, v, o, lse, do, deterministic=True, **kw)
    tau = d ** -0.5
    f = [x.double().repeat_interleave(h // x.shape[1], dim=1)
         for x in (q, k, v, do, uq, uk, uv)]  # key side repeated to the query heads
    s = tau * f[0] @ f[1].transpose(-1, -2)
    if causal:
        s = s.masked_fill(torch.ones(n, n, device="cuda", dtype=torch.bool).triu(1), float("-inf"))
    p = torch.softmax(s, -1)
    g = tau * (f[4] @ f[1].transpose(-1, -2) + f[0] @ f[5].transpose(-1, -2))
    dp = f[3] @ f[2].transpose(-1, -2)
    bm = f[3] @ f[6].transpose(-1, -2)
    alpha = (p * g).sum(-1)
    ee = (p * (g * dp + bm)).sum(-1) - alpha * delta.double()
    return (q, k, v, do, uq, uk, uv), o, lse, delta, alpha.float(), ee.float()


def _float64_col(x, causal):
    q64, k64, v64, do64 = (t.double().requires_grad_() for t in x[:4])
    o64 = naive_attention(q64, k64, v64, causal=causal)
    dq, dk, dv = torch.autograd.grad(o64, (q64, k64, v64), do64, create_graph=True)
    inner = sum((a * u.double()).sum() for a, u in zip((dq, dk, dv), x[4:]))
    _, kb64, vb64 = torch.autograd.grad(inner, (q64, k64, v64))
    return kb64, vb64


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("variant", [(64, 64, 4, 2, 0, None), (128, 64, 8, 2, 0, None),
                                     (64, 32, 4, 3, 1, 128), (128, 64, 8, 2, 1, 168),
                                     (64, 64, 4, 3, 2, 128)],
                         ids=["kt64-qt64-w4", "kt128-qt64-w8", "ws-kt64-qt32-w4-s3",
                              "ws-kt128-qt64-w8", "ws-defer-kt64-qt64-w4-s3"])
def test_gluon_bob_col_matches_triton_and_float64(causal, variant):
    x, o, lse, delta, alpha, ee = _bob_inputs(causal)
    with configs.use_gluon_passes(False):  # the Triton column pass as the baseline
        _, kb_t, vb_t, _ = attn_bob(*x[:3], o, lse, x[3], delta, *x[4:], scale=None,
                                    causal=causal, window=None, needs=(False, True, True, False),
                                    deterministic=True)
    bn, bm, w, st, ws, mr = variant
    kb_g, vb_g = gluon_bob_col(*x, lse, delta, alpha, ee, causal=causal, block_n=bn,
                               block_m=bm, num_warps=w, stages=st, warp_specialize=ws > 0,
                               defer=ws == 2, maxnreg=mr)
    kb64, vb64 = _float64_col(x, causal)
    for name, got, tri, ref in (("kb", kb_g, kb_t, kb64), ("vb", vb_g, vb_t, vb64)):
        err = (got.double() - ref).abs().max().item()
        tri_err = (tri.double() - ref).abs().max().item()
        ulp = ref.abs().max().item() * 2.0 ** -8
        assert err <= 2 * tri_err + ulp, (name, err, tri_err, ulp)
        # same pass, same rounding: the two kernels agree to a few bf16 units
        diff = (got.float() - tri.float()).abs().max().item()
        assert diff <= 4 * ulp, (name, diff, ulp)


def test_gluon_bob_col_rejects_unsupported_inputs():
    q = torch.randn(1, 2, 256, 64, device="cuda", dtype=torch.bfloat16)
    r = torch.zeros(1, 2, 256, device="cuda")
    with pytest.raises(ValueError, match="uk is None"):
        gluon_bob_col(q, q, q, q, q, None, q, r, r, r, r)
    with pytest.raises(ValueError, match="multiple of block_n"):
        gluon_bob_col(*(q[:, :, :200],) * 7, *(r[:, :, :200],) * 4)
    with pytest.raises(ValueError, match="defer=True needs warp_specialize"):
        gluon_bob_col(*(q,) * 7, r, r, r, r, defer=True)
    with pytest.raises(ValueError, match="alpha must be float32"):
        gluon_bob_col(*(q,) * 7, r, r, r.double(), r)


# --------------------------------------------------------------------------- library chain

from ttt_flash import flash_attention  # noqa: E402
from ttt_flash.kernels import plan  # noqa: E402
from ttt_flash.kernels.gluon import bob_col as gluon_bob_col_mod  # noqa: E402
from ttt_flash.kernels.gluon import bob_row as gluon_bob_row_mod  # noqa: E402
from ttt_flash.kernels.gluon import dkdv as gluon_dkdv_mod  # noqa: E402
from ttt_flash.kernels.gluon import dq as gluon_dq_mod  # noqa: E402
from ttt_flash.kernels.gluon import fwd as gluon_fwd_mod  # noqa: E402

#: the Gluon launches of one in-scope chain, in order, and their table kinds
GLUON_CHAIN = ["gluon_fwd", "gluon_dq", "gluon_dkdv", "gluon_bob_stats", "gluon_bob_direct",
               "gluon_bob_col"]
GLUON_KINDS = ["fwd", "bwd_dq", "bwd_dkdv", "bob_stats", "bob_direct", "bob_col"]


def _expected_chain(d):
    """The Gluon launches of an in-scope chain at head dim ``d``: the passes the table
    lists there."""
    return [name for name, kind in zip(GLUON_CHAIN, GLUON_KINDS) if (kind, d) in configs.GLUON]

CHAIN_NAMES = ("o", "dq", "dk", "dv", "qb", "kb", "vb", "dob")


def _chain(x, causal, dtype):
    """Forward, create_graph first backward and backward-over-backward of flash_attention
    (float64: through naive_attention)."""
    q, k, v, do = (t.to(dtype).detach().requires_grad_() for t in x[:4])
    u = [t.to(dtype) for t in x[4:]]
    attend = naive_attention if dtype == torch.float64 else flash_attention
    o = attend(q, k, v, causal=causal)
    g = torch.autograd.grad(o, (q, k, v), do, create_graph=True)
    inner = sum((a * w).sum() for a, w in zip(g, u))
    return dict(zip(CHAIN_NAMES, (o, *g, *torch.autograd.grad(inner, (q, k, v, do)))))


@pytest.fixture(autouse=True)
def _gluon_at_test_lengths(monkeypatch):
    """The table's Gluon tiles without its shortest-sequence threshold (``min_keys``), so
    that test-sized chains take the Gluon passes."""
    import dataclasses

    monkeypatch.setattr(configs, "GLUON", {key: dataclasses.replace(c, min_keys=0)
                                           for key, c in configs.GLUON.items()})
    plan.clear_cache()  # plans are cached per call shape
    yield
    plan.clear_cache()


@pytest.fixture
def gluon_calls(monkeypatch):
    """Names of the Gluon passes the library launches during the test."""
    calls = []
    for mod, name, label in ((gluon_fwd_mod, "launch_fwd", "gluon_fwd"),
                             (gluon_dq_mod, "launch_dq", "gluon_dq"),
                             (gluon_dkdv_mod, "launch_dkdv", "gluon_dkdv"),
                             (gluon_bob_col_mod, "launch_bob_col", "gluon_bob_col"),
                             (gluon_bob_row_mod, "launch_bob_row", None)):
        real = getattr(mod, name)

        def counted(*a, _real=real, _label=label, **kw):
            calls.append(_label or ("gluon_bob_stats" if kw["stats"] else "gluon_bob_direct"))
            return _real(*a, **kw)

        monkeypatch.setattr(mod, name, counted)
    return calls


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", [(1, 4, 4, 1024, 64), (2, 2, 2, 512, 64), (1, 4, 2, 512, 64),
                                   (1, 2, 2, 512, 128), (1, 4, 1, 512, 128)],
                         ids=["B1-H4-N1024", "B2-H2-N512", "GQA-4-2", "d128-H2", "GQA-4-1-d128"])
def test_chain_gluon_on_off_vs_float64(causal, shape, gluon_calls):
    b, h, hk, n, d = shape
    torch.manual_seed(0)
    x = [torch.randn(b, hh, n, d, device="cuda", dtype=torch.bfloat16)
         for hh in (h, hk, hk, h, h, hk, hk)]
    ref = _chain(x, causal, torch.float64)
    base = _chain(x, causal, torch.bfloat16)  # the same call, first with the table's choice
    expected = _expected_chain(d)
    assert gluon_calls == expected and "gluon_bob_col" in expected
    with configs.use_gluon_passes(False):
        off = _chain(x, causal, torch.bfloat16)
    assert gluon_calls == expected  # no Gluon call when off
    for name in CHAIN_NAMES:
        r = ref[name].double()
        ulp = r.abs().max().item() * 2.0 ** -8
        err_on = (base[name].double() - r).abs().max().item()
        err_off = (off[name].double() - r).abs().max().item()
        assert err_on <= 2 * err_off + ulp, (name, err_on, err_off, ulp)
        diff = (base[name].float() - off[name].float()).abs().max().item()
        assert diff <= 4 * ulp, (name, diff, ulp)


@pytest.mark.parametrize("case", ["d32", "window", "N-not-tiled", "bnhd-views"])
def test_chain_outside_gluon_scope_runs_triton(case, gluon_calls):
    torch.manual_seed(0)
    d = 32 if case == "d32" else 64
    n = 200 if case == "N-not-tiled" else 256
    hk = 2
    shapes = [(1, 2, n, d), (1, hk, n, d), (1, hk, n, d), (1, 2, n, d), (1, 2, n, d),
              (1, hk, n, d), (1, hk, n, d)]
    x = [torch.randn(s, device="cuda", dtype=torch.bfloat16) for s in shapes]
    q, k, v, do = (t.requires_grad_() for t in x[:4])
    kw = dict(window=64) if case == "window" else {}
    if case == "bnhd-views":  # (B, N, H, D) tensors: the kernels see strided views
        q, k, v, do = (t.detach().transpose(1, 2).contiguous().requires_grad_()
                       for t in (q, k, v, do))
        kw = dict(layout="bnhd")
    o = flash_attention(q, k, v, causal=True, **kw)
    g = torch.autograd.grad(o, (q, k, v), do, create_graph=True)
    u = x[4:] if case != "bnhd-views" else [t.transpose(1, 2).contiguous() for t in x[4:]]
    inner = sum((a * w).sum() for a, w in zip(g, u))
    outs = torch.autograd.grad(inner, (q, k, v, do))
    torch.cuda.synchronize()
    assert all(torch.isfinite(t).all() for t in outs)
    assert gluon_calls == []


# --------------------------------------------------------------------------- BoB row passes
# (kernels/gluon/bob_row.py; the chain tests above see them through attn_bob)

from ttt_flash.kernels import bob as bob_mod  # noqa: E402
from ttt_flash.kernels.gluon.bob_row import gluon_bob_direct, gluon_bob_stats  # noqa: E402


def _float64_row(x, causal):
    """Q̄ and dŌ of float64 double backward through naive attention."""
    q64, k64, v64, do64 = (t.double().requires_grad_() for t in x[:4])
    o64 = naive_attention(q64, k64, v64, causal=causal)
    dq, dk, dv = torch.autograd.grad(o64, (q64, k64, v64), do64, create_graph=True)
    inner = sum((a * u.double()).sum() for a, u in zip((dq, dk, dv), x[4:]))
    qb64, dob64 = torch.autograd.grad(inner, (q64, do64))
    return qb64, dob64


def _triton_row(x, o, lse, delta, causal, monkeypatch):
    """Q̄, dŌ of the Triton statistics + direct passes (``attn_bob`` with the Gluon passes
    off, atomic-free, K̄ wanted so that α, E + αD go through HBM) and the α, E + αD they
    passed between them."""
    made = []
    real = bob_mod.new_rowvecs

    def capture(lay, device, count):  # α, E + αD are the composer's first two row vectors
        rows = real(lay, device, count)
        made.extend(rows)
        return rows

    monkeypatch.setattr(bob_mod, "new_rowvecs", capture)
    with configs.use_gluon_passes(False):
        qb, _, _, dob = attn_bob(*x[:3], o, lse, x[3], delta, *x[4:], scale=None,
                                 causal=causal, window=None, needs=(True, True, False, True),
                                 deterministic=True)
    return qb, dob, made[0], made[1]


ROW_VARIANTS = [(64, 64, 4, 2, 0, None), (64, 64, 4, 2, 1, 168), (128, 64, 8, 2, 1, 168)]
ROW_IDS = ["qt64-kt64-w4", "ws-qt64-kt64-w4", "ws-qt128-kt64-w8"]


def _row_kw(variant, causal):
    bm, bn, w, st, ws, mr = variant
    return dict(causal=causal, block_m=bm, block_n=bn, num_warps=w, stages=st,
                warp_specialize=bool(ws), maxnreg=mr)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("variant", ROW_VARIANTS, ids=ROW_IDS)
def test_gluon_bob_direct_matches_triton_and_float64(causal, variant, monkeypatch):
    x, o, lse, delta, alpha, ee = _bob_inputs(causal)
    qb_t, dob_t, _, _ = _triton_row(x, o, lse, delta, causal, monkeypatch)
    qb_g, dob_g = gluon_bob_direct(*x, lse, delta, alpha, ee, **_row_kw(variant, causal))
    qb64, dob64 = _float64_row(x, causal)
    for name, got, tri, ref in (("qb", qb_g, qb_t, qb64), ("dob", dob_g, dob_t, dob64)):
        err = (got.double() - ref).abs().max().item()
        tri_err = (tri.double() - ref).abs().max().item()
        ulp = ref.abs().max().item() * 2.0 ** -8
        assert err <= 2 * tri_err + ulp, (name, err, tri_err, ulp)
        diff = (got.float() - tri.float()).abs().max().item()
        assert diff <= 4 * ulp, (name, diff, ulp)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("variant", ROW_VARIANTS[:2], ids=ROW_IDS[:2])
def test_gluon_bob_stats_then_direct_match_triton_and_float64(causal, variant, monkeypatch):
    x, o, lse, delta, alpha64, ee64 = _bob_inputs(causal)
    qb_t, dob_t, alpha_t, ee_t = _triton_row(x, o, lse, delta, causal, monkeypatch)
    alpha_g, ee_g = gluon_bob_stats(*x, lse, delta, **_row_kw(variant, causal))
    for name, got, tri, ref in (("alpha", alpha_g, alpha_t, alpha64),
                                ("ee", ee_g, ee_t, ee64)):
        err = (got.double() - ref.double()).abs().max().item()
        tri_err = (tri.double() - ref.double()).abs().max().item()
        floor = ref.abs().max().item() * 2.0 ** -16
        assert err <= 2 * tri_err + floor, (name, err, tri_err, floor)
    # the Gluon statistics feeding the Gluon direct pass: as accurate as the Triton pair
    qb_g, dob_g = gluon_bob_direct(*x, lse, delta, alpha_g, ee_g, **_row_kw(variant, causal))
    qb64, dob64 = _float64_row(x, causal)
    for name, got, tri, ref in (("qb", qb_g, qb_t, qb64), ("dob", dob_g, dob_t, dob64)):
        err = (got.double() - ref).abs().max().item()
        tri_err = (tri.double() - ref).abs().max().item()
        ulp = ref.abs().max().item() * 2.0 ** -8
        assert err <= 2 * tri_err + ulp, (name, err, tri_err, ulp)


def test_gluon_bob_row_rejects_unsupported_inputs():
    q = torch.randn(1, 2, 256, 64, device="cuda", dtype=torch.bfloat16)
    r = torch.zeros(1, 2, 256, device="cuda")
    with pytest.raises(ValueError, match="uk is None"):
        gluon_bob_direct(q, q, q, q, q, None, q, r, r, r, r)
    with pytest.raises(ValueError, match="multiple of block_m"):
        gluon_bob_stats(*(q[:, :, :200],) * 7, *(r[:, :, :200],) * 2)
    with pytest.raises(ValueError, match="alpha must be contiguous float32"):
        gluon_bob_direct(*(q,) * 7, r, r, r.double(), r)
    with pytest.raises(ValueError, match="block_m == 16"):
        gluon_bob_direct(*(q,) * 7, r, r, r, r, block_m=128, num_warps=4)


# --------------------------------------------------------------------------- d = 128 and GQA
# Each Gluon pass against the Triton pass and float64 at d = 128 and with GQA (the key-tile
# passes sum over the query heads of a kv head; the row passes read kv head h // G), with
# the table's tiles for that head dim.

EXT_CASES = {"gqa-4-2-d64": ((4, 2), 64), "d128": ((2, 2), 128), "gqa-4-1-d128": ((4, 1), 128)}


def _table_kw(kind, d):
    c = configs.GLUON[(kind, d)]
    kw = dict(block_n=c.block_n, block_m=c.block_m, num_warps=c.num_warps, maxnreg=c.maxnreg)
    if kind != "bwd_dkdv":
        kw.update(stages=c.stages, warp_specialize=c.warp_specialize)
    if kind in ("bwd_dkdv", "bob_col") and c.consumers != 1:
        kw.update(consumers=c.consumers, stages=c.stages)
    return kw


def _variants(kind, d):
    """The table's tiles for ``kind`` at head dim ``d``."""
    return [_table_kw(kind, d)]


#: d = 128 statistics-pass tiles besides the table's (no accumulators: wide tiles fit)
STATS_D128 = [dict(block_m=64, block_n=64, num_warps=4, stages=2, warp_specialize=False,
                   maxnreg=None)]


def _close(name, got, tri, ref, units=4):
    """The bound of the tests above: float64 error at most 2x the Triton pass's plus one bf16
    unit, and within ``units`` bf16 units of the Triton pass."""
    err = (got.double() - ref).abs().max().item()
    tri_err = (tri.double() - ref).abs().max().item()
    ulp = ref.abs().max().item() * 2.0 ** -8
    assert err <= 2 * tri_err + ulp, (name, err, tri_err, ulp)
    diff = (got.float() - tri.float()).abs().max().item()
    assert diff <= units * ulp, (name, diff, ulp)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("case", list(EXT_CASES))
def test_gluon_dkdv_gqa_d128(causal, case):
    heads, d = EXT_CASES[case]
    x, o, lse, delta, _, _ = _bob_inputs(causal, heads=heads, d=d)
    q, k, v, do = x[:4]
    kw = dict(scale=None, causal=causal, window=None)
    with configs.use_gluon_passes(False):
        _, dk_t, dv_t, _ = attn_bwd(q, k, v, o, lse, do, deterministic=True, **kw)
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    o64 = naive_attention(q64, k64, v64, causal=causal)
    _, dk64, dv64 = torch.autograd.grad(o64, (q64, k64, v64), do.double())
    for tiles in _variants("bwd_dkdv", d):
        dk_g, dv_g = gluon_dkdv(q, k, v, do, lse, delta, causal=causal, **tiles)
        assert dk_g.shape == k.shape and dv_g.shape == v.shape
        _close(f"dk {tiles}", dk_g, dk_t, dk64)
        _close(f"dv {tiles}", dv_g, dv_t, dv64)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("case", list(EXT_CASES))
def test_gluon_bob_col_gqa_d128(causal, case):
    heads, d = EXT_CASES[case]
    x, o, lse, delta, alpha, ee = _bob_inputs(causal, heads=heads, d=d)
    with configs.use_gluon_passes(False):
        _, kb_t, vb_t, _ = attn_bob(*x[:3], o, lse, x[3], delta, *x[4:], scale=None,
                                    causal=causal, window=None, needs=(False, True, True, False),
                                    deterministic=True)
    kb64, vb64 = _float64_col(x, causal)
    for tiles in _variants("bob_col", d):
        kb_g, vb_g = gluon_bob_col(*x, lse, delta, alpha, ee, causal=causal, **tiles)
        assert kb_g.shape == x[1].shape
        _close(f"kb {tiles}", kb_g, kb_t, kb64)
        _close(f"vb {tiles}", vb_g, vb_t, vb64)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("case", list(EXT_CASES))
def test_gluon_bob_row_passes_gqa_d128(causal, case, monkeypatch):
    heads, d = EXT_CASES[case]
    x, o, lse, delta, alpha64, ee64 = _bob_inputs(causal, heads=heads, d=d)
    qb_t, dob_t, alpha_t, ee_t = _triton_row(x, o, lse, delta, causal, monkeypatch)
    qb64, dob64 = _float64_row(x, causal)
    stats_tiles = _variants("bob_stats", d) + (STATS_D128 if d == 128 else [])
    for tiles in stats_tiles:
        alpha_g, ee_g = gluon_bob_stats(*x, lse, delta, causal=causal, **tiles)
        for name, got, tri, ref in (("alpha", alpha_g, alpha_t, alpha64),
                                    ("ee", ee_g, ee_t, ee64)):
            err = (got.double() - ref.double()).abs().max().item()
            tri_err = (tri.double() - ref.double()).abs().max().item()
            floor = ref.abs().max().item() * 2.0 ** -16
            assert err <= 2 * tri_err + floor, (name, tiles, err, tri_err, floor)
    for tiles in _variants("bob_direct", d):  # fed the table's statistics pass
        alpha_g, ee_g = gluon_bob_stats(*x, lse, delta, causal=causal,
                                        **_variants("bob_stats", d)[0])
        qb_g, dob_g = gluon_bob_direct(*x, lse, delta, alpha_g, ee_g, causal=causal, **tiles)
        assert qb_g.shape == x[0].shape
        _close(f"qb {tiles}", qb_g, qb_t, qb64)
        _close(f"dob {tiles}", dob_g, dob_t, dob64)


def test_gluon_passes_reject_bad_head_counts():
    q = torch.randn(1, 3, 256, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 2, 256, 64, device="cuda", dtype=torch.bfloat16)
    r = torch.zeros(1, 3, 256, device="cuda")
    with pytest.raises(ValueError, match="multiple of k's"):
        gluon_dkdv(q, k, k, q, r, r)
    with pytest.raises(ValueError, match="multiple of k's"):
        gluon_bob_col(q, k, k, q, q, k, k, r, r, r, r)
    with pytest.raises(ValueError, match="multiple of k's"):
        gluon_bob_stats(q, k, k, q, q, k, k, r, r)
    k1 = k[:, :1]
    with pytest.raises(ValueError, match="uk must have shape"):
        gluon_bob_direct(q, k1, k1, q, q, q, k1, r, r, r, r)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_chain_gluon_stats_with_triton_direct_gqa_d128(causal, gluon_calls, monkeypatch):
    """The Gluon statistics pass feeding the Triton direct pass (a table without a Gluon
    direct entry), GQA 4 / 1 at d = 128: every output within the float64 bound."""
    table = dict(configs.GLUON)
    table.pop(("bob_direct", 128), None)
    monkeypatch.setattr(configs, "GLUON", table)
    plan.clear_cache()
    torch.manual_seed(0)
    x = [torch.randn(1, hh, 512, 128, device="cuda", dtype=torch.bfloat16)
         for hh in (4, 1, 1, 4, 4, 1, 1)]
    ref = _chain(x, causal, torch.float64)
    base = _chain(x, causal, torch.bfloat16)
    assert gluon_calls == [name for name in ("gluon_fwd", "gluon_dq", "gluon_dkdv",
                                             "gluon_bob_stats", "gluon_bob_col")
                           if name != "gluon_dq" or ("bwd_dq", 128) in configs.GLUON]
    with configs.use_gluon_passes(False):
        off = _chain(x, causal, torch.bfloat16)
    for name in CHAIN_NAMES:
        r = ref[name].double()
        ulp = r.abs().max().item() * 2.0 ** -8
        err_on = (base[name].double() - r).abs().max().item()
        err_off = (off[name].double() - r).abs().max().item()
        assert err_on <= 2 * err_off + ulp, (name, err_on, err_off, ulp)


# --------------------------------------------------------------------------- forward
# (kernels/gluon/fwd.py; the chain tests above see it through attn_fwd)

from ttt_flash.kernels.gluon.fwd import gluon_attn_fwd  # noqa: E402
from ttt_flash.kernels.host import layout as host_layout  # noqa: E402

#: (block_m, block_n, num_warps, stages, warp_specialize, maxnreg)
#: (warp_specialize 2: the TMA producer and two consumer partitions, ``consumers=2``; 3: the
#: same taking turns, ``pingpong=True``)
FWD_VARIANTS = [(128, 128, 8, 2, 0, None), (128, 64, 8, 3, 1, None), (64, 64, 4, 2, 0, None),
                (64, 128, 4, 3, 1, None), (128, 128, 8, 2, 2, None), (128, 64, 8, 3, 2, None),
                (128, 128, 8, 2, 3, None), (128, 64, 8, 3, 3, None)]
FWD_IDS = ["qt128-kt128-w8", "ws-qt128-kt64-w8-s3", "qt64-kt64-w4", "ws-qt64-kt128-w4-s3",
           "ws2c-qt128-kt128-w8", "ws2c-qt128-kt64-w8-s3", "pingpong-qt128-kt128-w8",
           "pingpong-qt128-kt64-w8-s3"]
#: case: ((H_q, H_kv), d, scale of q (larger logits), dtype)
FWD_CASES = {"h3-d64": ((3, 3), 64, 1.0, torch.bfloat16),
             "peaked-d64": ((2, 2), 64, 4.0, torch.bfloat16),
             "gqa-4-2-d64": ((4, 2), 64, 1.0, torch.bfloat16),
             "fp16-gqa-4-2-d64": ((4, 2), 64, 1.0, torch.float16),
             "d128": ((2, 2), 128, 1.0, torch.bfloat16),
             "gqa-4-1-d128": ((4, 1), 128, 1.0, torch.bfloat16),
             "fp16-d128": ((2, 2), 128, 1.0, torch.float16)}


def _float64_fwd(q, k, v, causal):
    """O and the natural-log L of softmax(d^-1/2 Q Kᵀ) V in float64 (kv head h // G)."""
    g = q.shape[1] // k.shape[1]
    q64, k64, v64 = (x.double() for x in (q, k, v))
    k64, v64 = (x.repeat_interleave(g, dim=1) for x in (k64, v64))
    s = q.shape[-1] ** -0.5 * q64 @ k64.transpose(-1, -2)
    if causal:
        n = s.shape[-1]
        s = s.masked_fill(torch.ones(n, n, device=s.device, dtype=torch.bool).triu(1),
                          float("-inf"))
    return torch.softmax(s, -1) @ v64, torch.logsumexp(s, -1)


#: (case, variant): every variant at d = 64 and 128, the table's tiles in every case, the two
#: consumer-partition variants under GQA and at large logits; the variants taking turns
#: (pingpong) last
_PP = [i for i, name in enumerate(FWD_IDS) if name.startswith("pingpong")]
FWD_PAIRS = ([(case, i) for i in range(len(FWD_VARIANTS)) if i not in _PP
              for case in ("h3-d64", "d128")]
             + [(case, "table") for case in FWD_CASES]
             + [(case, FWD_IDS.index("ws2c-qt128-kt128-w8"))
                for case in ("gqa-4-2-d64", "gqa-4-1-d128", "peaked-d64")]
             + [(case, i) for i in _PP for case in ("h3-d64", "d128")]
             + [(case, FWD_IDS.index("pingpong-qt128-kt128-w8"))
                for case in ("gqa-4-2-d64", "gqa-4-1-d128", "peaked-d64")])


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("case,variant", [(c, v if v == "table" else FWD_VARIANTS[v])
                                          for c, v in FWD_PAIRS],
                         ids=[f"{c}-{v if v == 'table' else FWD_IDS[v]}" for c, v in FWD_PAIRS])
def test_gluon_fwd_matches_triton_and_float64(causal, case, variant):
    heads, d, spread, dtype = FWD_CASES[case]
    if variant == "table":
        c = configs.GLUON.get(("fwd", d))
        if c is None:  # no Gluon forward at this head dim: the plan takes the Triton one
            lay_q = torch.empty(1, 2, 16384, d, device="cuda", dtype=dtype)
            lay = host_layout(lay_q, lay_q, None, None, None, None)
            assert plan.explain("fwd", lay, dtype, lay_q.device, window=False,
                                contiguous=True).startswith("Triton: head dim")
            return
        variant = (c.block_m, c.block_n, c.num_warps, c.stages,
                   (3 if c.pingpong else 2) if c.consumers == 2 else int(c.warp_specialize),
                   c.maxnreg)
    bm, bn, w, st, ws, mr = variant
    torch.manual_seed(0)
    h, hk = heads
    q = (spread * torch.randn(2, h, 512, d, device="cuda")).to(dtype)
    k, v = (torch.randn(2, hk, 512, d, device="cuda", dtype=dtype) for _ in range(2))
    with configs.use_gluon_passes(False):  # the Triton forward as the baseline
        o_t, lse_t = attn_fwd(q, k, v, scale=None, causal=causal, window=None)
    o_g, lse_g = gluon_attn_fwd(q, k, v, causal=causal, block_m=bm, block_n=bn, num_warps=w,
                                stages=st, warp_specialize=ws > 0, consumers=2 if ws >= 2 else 1,
                                pingpong=ws == 3, maxnreg=mr)
    assert o_g.shape == q.shape and o_g.dtype == q.dtype and o_g.is_contiguous()
    assert lse_g.shape == q.shape[:3] and lse_g.dtype == torch.float32
    o64, lse64 = _float64_fwd(q, k, v, causal)
    _close("o", o_g, o_t, o64)
    err = (lse_g.double() - lse64).abs().max().item()
    tri_err = (lse_t.double() - lse64).abs().max().item()
    floor = lse64.abs().max().item() * 2.0 ** -16
    assert err <= 2 * tri_err + floor, ("lse", err, tri_err, floor)


def test_gluon_fwd_rejects_bad_inputs():
    q = torch.randn(1, 2, 256, 64, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="multiple of block_m"):
        gluon_attn_fwd(q[:, :, :200], q[:, :, :200], q[:, :, :200])
    with pytest.raises(ValueError, match="multiple of k's"):
        k3 = torch.randn(1, 3, 256, 64, device="cuda", dtype=torch.bfloat16)
        gluon_attn_fwd(q, k3, k3)
    with pytest.raises(ValueError, match="q must be bf16 or fp16"):
        gluon_attn_fwd(q.float(), q.float(), q.float())
    with pytest.raises(ValueError, match="v must have shape"):
        gluon_attn_fwd(q, q, q[:, :, :128])
    with pytest.raises(ValueError, match="block_m == 16"):
        gluon_attn_fwd(q, q, q, block_m=128, num_warps=4)
    with pytest.raises(ValueError, match="stages must be"):
        gluon_attn_fwd(q, q, q, stages=5)
    with pytest.raises(ValueError, match="consumers must be 1, or 2 with warp_specialize"):
        gluon_attn_fwd(q, q, q, consumers=2, warp_specialize=False)
    with pytest.raises(ValueError, match="pingpong=True needs consumers=2"):
        gluon_attn_fwd(q, q, q, warp_specialize=True, pingpong=True)
    with pytest.raises(ValueError, match="q has no rows"):
        gluon_attn_fwd(q[:, :, :0], q[:, :, :0], q[:, :, :0])
    q96 = torch.randn(1, 2, 256, 96, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="head dim must be one of"):
        gluon_attn_fwd(q96, q96, q96)


# --------------------------------------------------------------------------- key-tile passes
# with two consumer partitions (kernels/gluon/bob_col.py, dkdv.py: consumers=2)

#: (block_n, block_m, num_warps, stages, defer) of the column pass with consumers=2 (the
#: TMA producer and two 4-warp consumer partitions of block_n / 2 keys each, sharing the
#: query-tile ring), per head dim
COL2_VARIANTS = {64: [(128, 64, 8, 2, False), (128, 32, 8, 3, False), (128, 64, 8, 3, True),
                      (128, 32, 8, 3, True)],
                 128: [(128, 32, 8, 2, False), (128, 32, 8, 3, False), (128, 32, 8, 3, True)]}
#: (block_n, block_m, num_warps, stages) of the dK / dV pass with consumers=2, per head dim
DKDV2_VARIANTS = {64: [(128, 64, 8, 2), (128, 32, 8, 3)],
                  128: [(128, 64, 8, 2), (128, 32, 8, 2), (128, 32, 8, 3)]}
#: case: ((H_q, H_kv), d)
KEY2_CASES = {"h3-d64": ((3, 3), 64), "gqa-4-2-d64": ((4, 2), 64), "d128": ((2, 2), 128),
              "gqa-4-1-d128": ((4, 1), 128)}
#: (case, variant index): every variant without GQA, the first one under GQA
KEY2_PAIRS = {
    kind: [(case, i) for case in KEY2_CASES for i in range(len(table[KEY2_CASES[case][1]]))
           if i == 0 or KEY2_CASES[case][0][0] == KEY2_CASES[case][0][1]]
    for kind, table in (("bob_col", COL2_VARIANTS), ("bwd_dkdv", DKDV2_VARIANTS))}


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("case,i", KEY2_PAIRS["bob_col"],
                         ids=[f"{c}-{i}" for c, i in KEY2_PAIRS["bob_col"]])
def test_gluon_bob_col_two_consumers_match_triton_and_float64(causal, case, i):
    heads, d = KEY2_CASES[case]
    bn, bm, w, st, defer = COL2_VARIANTS[d][i]
    x, o, lse, delta, alpha, ee = _bob_inputs(causal, heads=heads, d=d)
    with configs.use_gluon_passes(False):
        _, kb_t, vb_t, _ = attn_bob(*x[:3], o, lse, x[3], delta, *x[4:], scale=None,
                                    causal=causal, window=None, needs=(False, True, True, False),
                                    deterministic=True)
    kb64, vb64 = _float64_col(x, causal)
    kb_g, vb_g = gluon_bob_col(*x, lse, delta, alpha, ee, causal=causal, block_n=bn, block_m=bm,
                               num_warps=w, stages=st, warp_specialize=True, defer=defer,
                               consumers=2)
    assert kb_g.shape == x[1].shape and vb_g.shape == x[2].shape
    _close(f"kb {COL2_VARIANTS[d][i]}", kb_g, kb_t, kb64)
    _close(f"vb {COL2_VARIANTS[d][i]}", vb_g, vb_t, vb64)
    # the same sums as the table's one-partition tiles, to a few bf16 units
    kb_1, vb_1 = gluon_bob_col(*x, lse, delta, alpha, ee, causal=causal,
                               **_table_kw("bob_col", d))
    for name, got, one in (("kb", kb_g, kb_1), ("vb", vb_g, vb_1)):
        ulp = one.float().abs().max().item() * 2.0 ** -8
        assert (got.float() - one.float()).abs().max().item() <= 4 * ulp, name


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("case,i", KEY2_PAIRS["bwd_dkdv"],
                         ids=[f"{c}-{i}" for c, i in KEY2_PAIRS["bwd_dkdv"]])
def test_gluon_dkdv_two_consumers_match_triton_and_float64(causal, case, i):
    heads, d = KEY2_CASES[case]
    bn, bm, w, st = DKDV2_VARIANTS[d][i]
    x, o, lse, delta, _, _ = _bob_inputs(causal, heads=heads, d=d)
    q, k, v, do = x[:4]
    kw = dict(scale=None, causal=causal, window=None)
    with configs.use_gluon_passes(False):
        _, dk_t, dv_t, _ = attn_bwd(q, k, v, o, lse, do, deterministic=True, **kw)
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    o64 = naive_attention(q64, k64, v64, causal=causal)
    _, dk64, dv64 = torch.autograd.grad(o64, (q64, k64, v64), do.double())
    dk_g, dv_g = gluon_dkdv(q, k, v, do, lse, delta, causal=causal, block_n=bn, block_m=bm,
                            num_warps=w, stages=st, consumers=2)
    assert dk_g.shape == k.shape and dv_g.shape == v.shape
    _close(f"dk {DKDV2_VARIANTS[d][i]}", dk_g, dk_t, dk64)
    _close(f"dv {DKDV2_VARIANTS[d][i]}", dv_g, dv_t, dv64)


def test_gluon_key_tile_passes_reject_bad_consumers():
    q = torch.randn(1, 2, 256, 64, device="cuda", dtype=torch.bfloat16)
    r = torch.zeros(1, 2, 256, device="cuda")
    with pytest.raises(ValueError, match="consumers"):
        gluon_bob_col(*(q,) * 7, r, r, r, r, block_n=128, block_m=64, num_warps=8,
                      warp_specialize=False, consumers=2)
    with pytest.raises(ValueError, match="consumers"):
        gluon_dkdv(q, q, q, q, r, r, block_n=64, block_m=64, num_warps=4, consumers=2)


# --------------------------------------------------------------------------- BoB row passes,
# two consumer partitions (kernels/gluon/bob_row.py, ``consumers=2``: two 4-warp partitions
# of 64 query rows each sharing the ring of key tiles, with the TMA producer)

#: (block_m, block_n, stages) of the two-consumer variants per head dim and kind (no ptxas
#: spills: scripts/kernels/gluon_compile_sm90.py)
ROW_2C = {64: {"bob_stats": [(128, 64, 2), (128, 32, 3)],
               "bob_direct": [(128, 64, 2), (128, 32, 3)]},
          128: {"bob_stats": [(128, 64, 2), (128, 32, 2)],
                "bob_direct": [(128, 32, 2), (128, 32, 3)]}}
ROW_2C_CASES = {"h3-d64": ((3, 3), 64), "gqa-4-2-d64": ((4, 2), 64), "d128": ((2, 2), 128),
                "gqa-4-1-d128": ((4, 1), 128)}


def _row_2c_kw(variant):
    bm, bn, st = variant
    return dict(block_m=bm, block_n=bn, num_warps=8, stages=st, warp_specialize=True,
                consumers=2)


def _stats_close(name, got, tri, ref):
    """The statistics bound of the tests above: float64 error at most 2x the Triton pass's
    plus 2^-16 of the largest magnitude."""
    err = (got.double() - ref.double()).abs().max().item()
    tri_err = (tri.double() - ref.double()).abs().max().item()
    floor = ref.abs().max().item() * 2.0 ** -16
    assert err <= 2 * tri_err + floor, (name, err, tri_err, floor)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("case", list(ROW_2C_CASES))
def test_gluon_bob_row_two_consumers_match_triton_and_float64(causal, case, monkeypatch):
    """α, E + αD of the two-consumer statistics pass and Q̄, dŌ of the two-consumer direct
    pass (fed float64 α, E + αD, and fed the two-consumer statistics) against the Triton
    passes and float64 double backward, with the bounds of the single-partition tests;
    causal includes the first partition's key tiles past its rows."""
    heads, d = ROW_2C_CASES[case]
    x, o, lse, delta, alpha64, ee64 = _bob_inputs(causal, heads=heads, d=d)
    qb_t, dob_t, alpha_t, ee_t = _triton_row(x, o, lse, delta, causal, monkeypatch)
    qb64, dob64 = _float64_row(x, causal)
    stats = []
    for variant in ROW_2C[d]["bob_stats"]:
        alpha_g, ee_g = gluon_bob_stats(*x, lse, delta, causal=causal, **_row_2c_kw(variant))
        _stats_close(f"alpha {variant}", alpha_g, alpha_t, alpha64)
        _stats_close(f"ee {variant}", ee_g, ee_t, ee64)
        stats.append((alpha_g, ee_g))
    for variant in ROW_2C[d]["bob_direct"]:
        qb_g, dob_g = gluon_bob_direct(*x, lse, delta, alpha64, ee64, causal=causal,
                                       **_row_2c_kw(variant))
        assert qb_g.shape == x[0].shape and dob_g.shape == x[3].shape
        _close(f"qb {variant}", qb_g, qb_t, qb64)
        _close(f"dob {variant}", dob_g, dob_t, dob64)
        alpha_g, ee_g = stats[0]  # the two-consumer statistics feeding it
        qb_g, dob_g = gluon_bob_direct(*x, lse, delta, alpha_g, ee_g, causal=causal,
                                       **_row_2c_kw(variant))
        _close(f"qb {variant} (2c stats)", qb_g, qb_t, qb64)
        _close(f"dob {variant} (2c stats)", dob_g, dob_t, dob64)


def test_gluon_bob_row_two_consumers_equal_one_partition():
    """Two consumer partitions compute each query row with the products, in the order, of
    a one-partition program of the same key step (64 queries, 4 warps): the same outputs up
    to the compiler's rounding choices (2^-16 of the largest α, E + αD; one bf16 unit of
    the largest Q̄, dŌ), full and causal."""
    for causal in (False, True):
        x, _, lse, delta, _, _ = _bob_inputs(causal, heads=(2, 2), d=64)
        one = dict(block_m=64, block_n=64, num_warps=4, stages=2)
        two = _row_2c_kw((128, 64, 2))
        a1 = gluon_bob_stats(*x, lse, delta, causal=causal, **one)
        a2 = gluon_bob_stats(*x, lse, delta, causal=causal, **two)
        for t1, t2 in zip(a1, a2):
            tol = t1.abs().max().item() * 2.0 ** -16
            torch.testing.assert_close(t2, t1, rtol=0, atol=tol)
        d1 = gluon_bob_direct(*x, lse, delta, *a1, causal=causal, **one)
        d2 = gluon_bob_direct(*x, lse, delta, *a1, causal=causal, **two)
        for t1, t2 in zip(d1, d2):
            tol = t1.float().abs().max().item() * 2.0 ** -8
            torch.testing.assert_close(t2.float(), t1.float(), rtol=0, atol=tol)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", [(1, 4, 2, 512, 64), (1, 4, 1, 512, 128)],
                         ids=["GQA-4-2", "GQA-4-1-d128"])
def test_chain_two_consumer_row_passes(causal, shape, monkeypatch):
    """The library chain with a table whose row-pass entries have two consumer partitions:
    ``attn_bob`` launches them with ``consumers=2`` and every output is within the float64
    bound of the chain with the Gluon passes off (and a few bf16 units of it)."""
    import dataclasses

    b, h, hk, n, d = shape
    table = dict(configs.GLUON)
    for kind in ("bob_stats", "bob_direct"):
        bm, bn, st = ROW_2C[d][kind][0]
        table[(kind, d)] = dataclasses.replace(table[(kind, d)], block_m=bm, block_n=bn,
                                               num_warps=8, stages=st, warp_specialize=True,
                                               consumers=2, maxnreg=None)
    monkeypatch.setattr(configs, "GLUON", table)
    launched = []
    real = gluon_bob_row_mod.launch_bob_row
    monkeypatch.setattr(gluon_bob_row_mod, "launch_bob_row", lambda *a, **kw: (
        launched.append((kw["stats"], kw["consumers"])) or real(*a, **kw)))
    plan.clear_cache()
    torch.manual_seed(0)
    x = [torch.randn(b, hh, n, d, device="cuda", dtype=torch.bfloat16)
         for hh in (h, hk, hk, h, h, hk, hk)]
    ref = _chain(x, causal, torch.float64)
    base = _chain(x, causal, torch.bfloat16)
    assert launched == [(True, 2), (False, 2)]
    with configs.use_gluon_passes(False):
        off = _chain(x, causal, torch.bfloat16)
    for name in CHAIN_NAMES:
        r = ref[name].double()
        ulp = r.abs().max().item() * 2.0 ** -8
        err_on = (base[name].double() - r).abs().max().item()
        err_off = (off[name].double() - r).abs().max().item()
        assert err_on <= 2 * err_off + ulp, (name, err_on, err_off, ulp)
        diff = (base[name].float() - off[name].float()).abs().max().item()
        assert diff <= 4 * ulp, (name, diff, ulp)


def test_gluon_bob_row_rejects_bad_consumers():
    q = torch.randn(1, 2, 256, 64, device="cuda", dtype=torch.bfloat16)
    r = torch.zeros(1, 2, 256, device="cuda")
    with pytest.raises(ValueError, match="gluon_bob_stats: consumers must be 1, or 2 with"):
        gluon_bob_stats(*(q,) * 7, r, r, block_m=128, num_warps=8, consumers=2)
    with pytest.raises(ValueError, match="gluon_bob_direct: consumers must be 1, or 2 with"):
        gluon_bob_direct(*(q,) * 7, r, r, r, r, consumers=2, warp_specialize=True)


# --------------------------------------------------------------------------- dQ pass
# (kernels/gluon/dq.py; the chain tests above see it through attn_bwd)

from ttt_flash.kernels.gluon.dq import gluon_attn_dq  # noqa: E402

#: (block_m, block_n, num_warps, stages, warp_specialize, maxnreg)
#: (warp_specialize 2: the TMA producer and two consumer partitions, ``consumers=2``; 3: the
#: same with deferred dS K waits, ``defer=True``; 4: the producer and one consumer partition
#: with deferred waits)
DQ_VARIANTS = [(128, 128, 8, 2, 2, None), (128, 64, 8, 3, 2, None), (128, 64, 8, 2, 0, None),
               (128, 64, 8, 3, 1, None), (64, 64, 4, 2, 0, None), (128, 128, 8, 2, 3, None),
               (128, 64, 8, 3, 4, None)]
DQ_IDS = ["ws2c-qt128-kt128-w8", "ws2c-qt128-kt64-w8-s3", "qt128-kt64-w8",
          "ws-qt128-kt64-w8-s3", "qt64-kt64-w4", "defer-ws2c-qt128-kt128-w8",
          "defer-ws-qt128-kt64-w8-s3"]
_DEFER = [i for i, name in enumerate(DQ_IDS) if name.startswith("defer")]
#: (case, variant): every variant at d = 64 and 128, the table's tiles in every case, the
#: two consumer-partition variant under GQA and at large logits; the deferred ones last
DQ_PAIRS = ([(case, i) for i in range(len(DQ_VARIANTS)) if i not in _DEFER
             for case in ("h3-d64", "d128")]
            + [(case, "table") for case in FWD_CASES]
            + [(case, 0) for case in ("gqa-4-2-d64", "gqa-4-1-d128", "peaked-d64")]
            + [(case, i) for i in _DEFER for case in ("h3-d64", "d128", "gqa-4-1-d128")])


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("case,variant", [(c, v if v == "table" else DQ_VARIANTS[v])
                                          for c, v in DQ_PAIRS],
                         ids=[f"{c}-{v if v == 'table' else DQ_IDS[v]}" for c, v in DQ_PAIRS])
def test_gluon_dq_matches_triton_and_float64(causal, case, variant):
    heads, d, spread, dtype = FWD_CASES[case]
    if variant == "table":
        c = configs.GLUON.get(("bwd_dq", d))
        if c is None:  # no Gluon dQ pass at this head dim: the plan takes the Triton one
            lay_q = torch.empty(1, 2, 16384, d, device="cuda", dtype=dtype)
            lay = host_layout(lay_q, lay_q, None, None, None, None)
            assert plan.explain("bwd_dq", lay, dtype, lay_q.device, window=False,
                                rowsum=False, contiguous=True).startswith("Triton: head dim")
            return
        variant = (c.block_m, c.block_n, c.num_warps, c.stages,
                   2 if c.consumers == 2 else int(c.warp_specialize), c.maxnreg)
    bm, bn, w, st, ws, mr = variant
    torch.manual_seed(0)
    h, hk = heads
    q = (spread * torch.randn(2, h, 512, d, device="cuda")).to(dtype)
    k, v = (torch.randn(2, hk, 512, d, device="cuda", dtype=dtype) for _ in range(2))
    do = torch.randn(2, h, 512, d, device="cuda", dtype=dtype)
    kw = dict(scale=None, causal=causal, window=None)
    with configs.use_gluon_passes(False):  # the Triton forward and dQ pass as the baseline
        o, lse = attn_fwd(q, k, v, **kw)
        dq_t, _, _, delta_t = attn_bwd(q, k, v, o, lse, do, deterministic=True, **kw)
    dq_g, delta_g = gluon_attn_dq(q, k, v, o, do, lse, causal=causal, block_m=bm, block_n=bn,
                                  num_warps=w, stages=st, warp_specialize=ws > 0,
                                  consumers=2 if ws in (2, 3) else 1, defer=ws >= 3,
                                  maxnreg=mr)
    assert dq_g.shape == q.shape and dq_g.dtype == q.dtype and dq_g.is_contiguous()
    assert delta_g.shape == q.shape[:3] and delta_g.dtype == torch.float32
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    o64 = naive_attention(q64, k64, v64, causal=causal)
    (dq64,) = torch.autograd.grad(o64, (q64,), do.double())
    _close("dq", dq_g, dq_t, dq64)
    # D from the same 16-bit O and dO: float32 rounding of a d-term sum
    delta64 = (o.double() * do.double()).sum(-1)
    floor = (o.double() * do.double()).abs().sum(-1).max().item() * 2.0 ** -18
    for name, ref in (("delta vs triton", delta_t.double()), ("delta vs float64", delta64)):
        err = (delta_g.double() - ref).abs().max().item()
        assert err <= floor, (name, err, floor)


def test_gluon_dq_rejects_bad_inputs():
    q = torch.randn(1, 2, 256, 64, device="cuda", dtype=torch.bfloat16)
    r = torch.zeros(1, 2, 256, device="cuda")
    with pytest.raises(ValueError, match="multiple of block_m"):
        x = q[:, :, :200]
        gluon_attn_dq(x, x, x, x, x, r[:, :, :200])
    with pytest.raises(ValueError, match="multiple of k's"):
        k3 = torch.randn(1, 3, 256, 64, device="cuda", dtype=torch.bfloat16)
        gluon_attn_dq(q, k3, k3, q, q, r)
    with pytest.raises(ValueError, match="q must be bf16 or fp16"):
        gluon_attn_dq(q.float(), q.float(), q.float(), q.float(), q.float(), r)
    with pytest.raises(ValueError, match="o must have shape"):
        gluon_attn_dq(q, q, q, q[:, :1], q, r)
    with pytest.raises(ValueError, match="do must have shape"):
        gluon_attn_dq(q, q, q, q, q.half(), r)
    with pytest.raises(ValueError, match="lse must be contiguous float32"):
        gluon_attn_dq(q, q, q, q, q, r.half())
    with pytest.raises(ValueError, match="block_m == 16"):
        gluon_attn_dq(q, q, q, q, q, r, block_m=128, num_warps=4)
    with pytest.raises(ValueError, match="stages must be"):
        gluon_attn_dq(q, q, q, q, q, r, stages=5)
    with pytest.raises(ValueError, match="consumers must be 1, or 2 with warp_specialize"):
        gluon_attn_dq(q, q, q, q, q, r, consumers=2, warp_specialize=False)
    with pytest.raises(ValueError, match="defer=True needs warp_specialize=True"):
        gluon_attn_dq(q, q, q, q, q, r, defer=True)
    with pytest.raises(ValueError, match="q has no rows"):
        x = q[:, :, :0]
        gluon_attn_dq(x, x, x, x, x, r[:, :, :0])
    q96 = torch.randn(1, 2, 256, 96, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="head dim must be one of"):
        gluon_attn_dq(q96, q96, q96, q96, q96, r)
