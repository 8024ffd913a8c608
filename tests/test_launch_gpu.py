"""GPU tests of cached launches (kernels/launch.py).

With the switch on, the chain's outputs (the composers' forward, backward, precise and affine
BoB, and the autograd chain forward -> backward with ``create_graph`` -> backward over
backward) are bitwise those of the switch off, at two shapes (bf16 and float32, the latter
with the row-sum kernels), dense and causal, with the Gluon passes allowed and not; a third
chain at the same shape launches every Triton kernel directly (Triton's ``JITFunction.run``
is made to fail and is never reached); and a CUDA graph captured with the switch on replays
to the outputs of the eager chain with it off.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from ttt_flash import flash_attention  # noqa: E402
from ttt_flash.kernels import attn_bob, attn_bwd, attn_fwd, configs  # noqa: E402
from ttt_flash.kernels import launch as cached  # noqa: E402
from ttt_flash.kernels.bob_affine import _bob_affine_kernel  # noqa: E402
from ttt_flash.kernels.bob_col import _bob_col_kernel  # noqa: E402
from ttt_flash.kernels.bob_row import (_bob_direct_kernel, _bob_direct_shift_kernel,  # noqa: E402
                                       _bob_stats_kernel, _bob_stats_shift_kernel)
from ttt_flash.kernels.dkdv import _attn_bwd_dkdv_kernel  # noqa: E402
from ttt_flash.kernels.dq import _attn_bwd_dq_kernel  # noqa: E402
from ttt_flash.kernels.fwd import _attn_fwd_kernel  # noqa: E402

KERNELS = (_attn_fwd_kernel, _attn_bwd_dq_kernel, _attn_bwd_dkdv_kernel, _bob_stats_kernel,
           _bob_stats_shift_kernel, _bob_direct_kernel, _bob_direct_shift_kernel, _bob_col_kernel,
           _bob_affine_kernel)

SHAPES = [pytest.param((1, 12, 1024, 64, torch.bfloat16), id="B1-H12-N1024-d64-bf16"),
          pytest.param((2, 4, 257, 40, torch.float32), id="B2-H4-N257-d40-fp32")]


@pytest.fixture(autouse=True)
def _fresh_cache():
    cached.clear()
    yield
    cached.clear()


def _inputs(shape, seed=0):
    b, h, n, d, dtype = shape
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(b, h, n, d, device="cuda", dtype=dtype, generator=g) for _ in range(7)]


def _composers(x, causal):
    q, k, v, do, uq, uk, uv = x
    kw = dict(scale=None, causal=causal, window=None)
    o, lse = attn_fwd(q, k, v, **kw)
    dq, dk, dv, delta = attn_bwd(q, k, v, o, lse, do, **kw)
    bob = attn_bob(q, k, v, o, lse, do, delta, uq, uk, uv, **kw)
    affine = attn_bob(q, k, v, o, lse, do, delta, uq, uk, uv, precise=False, **kw)
    return (o, lse, dq, dk, dv, delta, *bob, *affine)


def _autograd(x, causal):
    q, k, v, do = (t.detach().clone().requires_grad_(True) for t in x[:4])
    o = flash_attention(q, k, v, causal=causal)
    grads = torch.autograd.grad(o, (q, k, v), do, create_graph=True)
    inner = sum((g * u).sum() for g, u in zip(grads, x[4:]))
    bob = torch.autograd.grad(inner, (q, k, v, do))
    return (o.detach(), *(g.detach() for g in grads), *bob)


def _equal(a, b):
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        assert torch.equal(x, y), f"output {i} differs"


@pytest.mark.parametrize("gluon", [False, True], ids=["triton", "gluon-allowed"])
@pytest.mark.parametrize("causal", [False, True], ids=["dense", "causal"])
@pytest.mark.parametrize("shape", SHAPES)
def test_chain_bitwise_equal_and_launched_directly(shape, causal, gluon, monkeypatch):
    x = _inputs(shape)
    with configs.use_gluon_passes(gluon):
        with cached.use_cached_launch(False):
            off = (_composers(x, causal), _autograd(x, causal))
        with cached.use_cached_launch(True):
            first = (_composers(x, causal), _autograd(x, causal))  # binds
            second = (_composers(x, causal), _autograd(x, causal))

            def through_triton(*args, **kwargs):
                raise AssertionError("a launch went through JITFunction.run")

            for kernel in KERNELS:
                monkeypatch.setattr(kernel, "run", through_triton)
            third = (_composers(x, causal), _autograd(x, causal))
    torch.cuda.synchronize()
    for got in (first, second, third):
        _equal(off[0], got[0])
        _equal(off[1], got[1])
    bound = sum(len(t.entries) for t in cached._TABLES.values() if t is not None)
    assert bound > 0 or gluon


@pytest.mark.parametrize("causal", [False, True], ids=["dense", "causal"])
@pytest.mark.parametrize("shape", SHAPES)
def test_cuda_graph_capture(shape, causal):
    static = _inputs(shape, seed=1)
    fresh = _inputs(shape, seed=2)
    with configs.use_gluon_passes(False):
        with cached.use_cached_launch(False):
            want = _composers(fresh, causal)
        with cached.use_cached_launch(True):
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):  # binds, then hits
                    _composers(static, causal)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                outs = _composers(static, causal)
        for s, f in zip(static, fresh):
            s.copy_(f)
        graph.replay()
    torch.cuda.synchronize()
    _equal(want, outs)
