"""flash_attention(backend="triton") end to end through the autograd Functions
(interpreter on the CPU, real kernels on CUDA), against the float64 reference."""

import pytest
import torch

from ttt_flash import flash_attention, flash_attention_varlen
from ttt_flash.attention.reference import naive_attention, naive_attention_varlen

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _chain(fn, xs, u):
    q, k, v, do = xs
    o = fn(q, k, v)
    g = torch.autograd.grad(o, (q, k, v), do, create_graph=True)
    inner = sum((a * b).sum() for a, b in zip(g, u))
    return [o, *g, *torch.autograd.grad(inner, (q, k, v, do))]


def _leaves(*ts, dtype):
    return [t.detach().to(dtype).requires_grad_(True) for t in ts]


@pytest.mark.parametrize("precise", [True, False], ids=["precise", "affine"])
@pytest.mark.parametrize("causal,window,hkv", [(False, None, 2), (True, None, 1), (True, 9, 2)],
                         ids=["noncausal", "causal-mqa", "window9-gqa2"])
def test_dense_chain_matches_float64(precise, causal, window, hkv):
    """The chain through the autograd Functions (wiring, GQA head mapping, masks) within 1e-5
    of float64. N = 24 spans two key tiles and a ragged tile under the interpreter's tiles;
    tests/test_kernels.py covers the tile shapes per kernel."""
    x = [torch.randn(1, 4, 24, 16, device=DEV, dtype=torch.float64),
         torch.randn(1, hkv, 24, 16, device=DEV, dtype=torch.float64),
         torch.randn(1, hkv, 24, 16, device=DEV, dtype=torch.float64),
         torch.randn(1, 4, 24, 16, device=DEV, dtype=torch.float64)]
    u = [torch.randn_like(x[0]), torch.randn_like(x[1]), torch.randn_like(x[2])]
    exact = _chain(lambda a, b, c: naive_attention(a, b, c, causal=causal, window=window), _leaves(*x, dtype=torch.float64), u)
    ours = _chain(lambda a, b, c: flash_attention(a, b, c, causal=causal, window=window, backend="triton",
                                                  precise_bob=precise),
                  _leaves(*x, dtype=torch.float32), [t.float() for t in u])
    for a, e in zip(ours, exact):
        assert a.dtype == torch.float32
        err = ((a.double() - e).norm() / e.norm()).item()
        assert err < 1e-5


def test_varlen_chain_matches_float64():
    cu = torch.tensor([0, 7, 7, 30], dtype=torch.int32, device=DEV)
    x = [torch.randn(30, 2, 16, device=DEV, dtype=torch.float64) for _ in range(4)]
    u = [torch.randn_like(t) for t in x[:3]]
    exact = _chain(lambda a, b, c: naive_attention_varlen(a, b, c, cu, cu, causal=True), _leaves(*x, dtype=torch.float64), u)
    ours = _chain(lambda a, b, c: flash_attention_varlen(a, b, c, cu, cu, 23, 23, causal=True, backend="triton"),
                  _leaves(*x, dtype=torch.float32), [t.float() for t in u])
    for a, e in zip(ours, exact):
        assert ((a.double() - e).norm() / e.norm()).item() < 1e-5


def test_auto_backend_uses_reference_on_cpu_tensors():
    if DEV == "cuda":
        pytest.skip("CPU dispatch check")
    q = torch.randn(1, 1, 4, 8)
    import ttt_flash.attention as A

    assert A.resolve_backend("auto", q) == "reference"
    assert A.resolve_backend("triton", q) == "triton"  # the interpreter is on in tests
