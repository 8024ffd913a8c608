"""flash_attention(layout=...): FlashAttention's (B, N, H, D) layout through transposed
views, equal to the (B, H, N, D) path in values, gradients and double backward; the warning
and error that catch a (B, N, H, D) tensor passed without ``layout``."""

import warnings

import pytest
import torch

from ttt_flash import flash_attention
from ttt_flash.attention import api

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _chain(fn, xs, u):
    q, k, v, do = xs
    o = fn(q, k, v)
    g = torch.autograd.grad(o, (q, k, v), do, create_graph=True)
    inner = sum((a * b).sum() for a, b in zip(g, u))
    return [o, *g, *torch.autograd.grad(inner, (q, k, v, do))]


def _bnhd(t):
    """A contiguous (B, N, H, D) copy of a (B, H, N, D) tensor, as a leaf."""
    return t.detach().transpose(1, 2).contiguous().requires_grad_(True)


@pytest.mark.parametrize(
    "backend,dtype,shape,hkv,causal,window",
    [
        ("reference", torch.float64, (2, 4, 17, 8), 2, True, None),
        ("reference", torch.float64, (1, 2, 9, 16), 1, False, None),
        ("triton", torch.float32, (1, 2, 13, 16), 1, True, 5),
    ],
    ids=["reference-N17-gqa2-causal", "reference-N9-mqa", "triton-N13-window5"],
)
def test_bnhd_matches_bhnd_through_double_backward(backend, dtype, shape, hkv, causal, window):
    b, h, n, d = shape
    x = [torch.randn(b, h, n, d, device=DEV, dtype=dtype), torch.randn(b, hkv, n + 3, d, device=DEV, dtype=dtype),
         torch.randn(b, hkv, n + 3, d, device=DEV, dtype=dtype), torch.randn(b, h, n, d, device=DEV, dtype=dtype)]
    u = [torch.randn_like(x[0]), torch.randn_like(x[1]), torch.randn_like(x[2])]
    kw = dict(causal=causal, window=window, backend=backend)
    ref = _chain(lambda a, b_, c: flash_attention(a, b_, c, layout="bhnd", **kw),
                 [t.clone().requires_grad_(True) for t in x], u)
    ours = _chain(lambda a, b_, c: flash_attention(a, b_, c, layout="bnhd", **kw),
                  [_bnhd(t) for t in x], [t.transpose(1, 2) for t in u])
    names = ["o", "dq", "dk", "dv", "q_bar", "k_bar", "v_bar", "do_bar"]
    for name, a, e in zip(names, ours, ref):
        assert a.shape == e.transpose(1, 2).shape, name
        torch.testing.assert_close(a, e.transpose(1, 2), rtol=0, atol=1e-5 if dtype == torch.float32 else 1e-12,
                                   msg=lambda m: f"{name}: {m}")


def test_bnhd_passes_views_not_copies(monkeypatch):
    seen = []
    real = api._apply

    def spy(q, k, v, *rest):
        seen.extend((q, k, v))
        return real(q, k, v, *rest)

    monkeypatch.setattr(api, "_apply", spy)
    q, k, v = (torch.randn(2, 11, 3, 8, dtype=torch.float64) for _ in range(3))
    o = flash_attention(q, k, v, layout="bnhd")
    for given, passed in zip((q, k, v), seen):
        assert passed.data_ptr() == given.data_ptr()  # the same memory, no copy
        assert passed.shape == given.transpose(1, 2).shape
    assert o.shape == q.shape


def test_bnhd_gradcheck():
    q, k, v = (torch.randn(1, 5, 2, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))
    fn = lambda a, b, c: flash_attention(a, b, c, causal=True, layout="bnhd")  # noqa: E731
    assert torch.autograd.gradcheck(fn, (q, k, v))
    assert torch.autograd.gradgradcheck(fn, (q, k, v))


def test_flash_attn_layout_without_keyword_warns():
    # the example: FlashAttention-layout tensors (B=2, N=64, H=4, D=16) passed as is
    q, k, v = (torch.randn(2, 64, 4, 16) for _ in range(3))
    with pytest.warns(UserWarning, match="layout='bnhd'"):
        flash_attention(q, k, v, causal=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        flash_attention(q, k, v, causal=True, layout="bhnd")  # stated: no warning
        flash_attention(q, k, v, causal=True, layout="bnhd")
        flash_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True)  # N >= H
        # decoding one query over a longer cache: more heads than queries, fewer than keys
        flash_attention(torch.randn(1, 8, 1, 16), torch.randn(1, 8, 32, 16), torch.randn(1, 8, 32, 16))


def test_flash_attn_layout_head_mismatch_error_names_layout():
    # cross attention in (B, N, H, D): N_q = 12, N_k = 8 read as head counts (12 % 8 != 0)
    q, k, v = torch.randn(1, 12, 4, 16), torch.randn(1, 8, 4, 16), torch.randn(1, 8, 4, 16)
    with pytest.raises(ValueError, match="pass layout='bnhd'"), pytest.warns(UserWarning, match="layout='bnhd'"):
        flash_attention(q, k, v)
    assert flash_attention(q, k, v, layout="bnhd").shape == (1, 12, 4, 16)
    with pytest.raises(ValueError, match="multiple of the number of key/value heads") as e:
        flash_attention(q, k, v, layout="bhnd")
    assert "bnhd" not in str(e.value)


def test_bad_layout_value():
    q = torch.randn(1, 2, 8, 4)
    with pytest.raises(ValueError, match="layout must be 'bhnd'.*'bnhd'.*got 'bshd'"):
        flash_attention(q, q, q, layout="bshd")
    with pytest.raises(ValueError, match=r"4 dimensions \(batch, seq_len, heads, head_dim\)"):
        flash_attention(q[0], q[0], q[0], layout="bnhd")
