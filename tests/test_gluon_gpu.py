"""GPU tests of the experimental Gluon passes (kernels/gluon_dkdv.py, gluon_bob_col.py) on sm_90.

dK and dV of the Gluon pass, fed the Triton forward's LSE and the Triton backward's
D = rowsum(dO∘O), are compared with float64 autograd through ``naive_attention``: the max
error must be at most 2x the Triton pass's own error plus one bf16 rounding unit at the
output's scale (the bound tests/test_kernels_gpu.py uses). K̄ and V̄ of the Gluon BoB column
pass (fed α and E + αD computed in float64) meet the same bound against float64 double
backward, and agree with the Triton column pass (``attn_bob``) to four bf16 units. Skipped
where Gluon's Hopper ops or an sm_90 device are missing.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from ttt_flash.kernels import attn_bwd, attn_fwd  # noqa: E402
from ttt_flash.kernels.gluon_dkdv import available, gluon_dkdv  # noqa: E402
from ttt_flash.reference import naive_attention  # noqa: E402

if not available():
    pytest.skip("needs triton.experimental.gluon and an sm_90 GPU", allow_module_level=True)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("tiles", [(128, 64, 8), (64, 32, 4)], ids=["kt128-qt64-w8", "kt64-qt32-w4"])
def test_gluon_dkdv_matches_float64(causal, tiles):
    torch.manual_seed(0)
    q, k, v, do = (torch.randn(2, 3, 512, 64, device="cuda", dtype=torch.bfloat16)
                   for _ in range(4))
    kw = dict(scale=None, causal=causal, window=None)
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
from ttt_flash.kernels.gluon_bob_col import gluon_bob_col  # noqa: E402


def _bob_inputs(causal, n=512):
    """Seven (2, 3, n, 64) bf16 tensors, L and D of the Triton passes, α and E + αD in float64
    from bob-math.md's formulas (rounded to float32, as the statistics pass stores them)."""
    torch.manual_seed(0)
    q, k, v, do, uq, uk, uv = (torch.randn(2, 3, n, 64, device="cuda", dtype=torch.bfloat16)
                               for _ in range(7))
    kw = dict(scale=None, causal=causal, window=None)
    o, lse = attn_fwd(q, k, v, **kw)
    _, _, _, delta = attn_bwd(q, k, v, o, lse, do, deterministic=True, **kw)
    tau = 64 ** -0.5
    f = [x.double() for x in (q, k, v, do, uq, uk, uv)]
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
    _, kb_t, vb_t, _ = attn_bob(*x[:3], o, lse, x[3], delta, *x[4:], scale=None, causal=causal,
                                window=None, needs=(False, True, True, False),
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
