"""GPU test of the experimental Gluon dK/dV pass (kernels/gluon_dkdv.py) on sm_90.

dK and dV of the Gluon pass, fed the Triton forward's LSE and the Triton backward's
D = rowsum(dO∘O), are compared with float64 autograd through ``naive_attention``: the max
error must be at most 2x the Triton pass's own error plus one bf16 rounding unit at the
output's scale (the bound tests/test_kernels_gpu.py uses). Skipped where Gluon's Hopper ops
or an sm_90 device are missing.
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
