"""Every Triton launch passes each tensor to one parameter only: no parameter receives a
tensor standing in for one the kernel does not read. A kernel whose flags pick a different
algorithm (the BoB row passes with and without the float32 shift) is a kernel of its own with
the parameters it reads; an absent cotangent, tangent or output, a row vector a pass does not
read and a dense call's cu_seqlens travel as None.

The kernels are not run: each ``*_kernel`` of ``ttt_flash.kernels`` is replaced by a recorder
of its launches, and the composers run on CPU tensors across the plans' cases.
"""

from __future__ import annotations

import sys

import pytest
import torch
import triton

from ttt_flash.kernels import attn_bob, attn_bwd, attn_fwd, attn_jvp, attn_tangent, configs

class _Recorder:
    def __init__(self, name, fn, out):
        self.name, self.fn, self.out = name, fn, out

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.out.append((self.name, self.fn, args, kwargs))
        return launch


@pytest.fixture
def launches(monkeypatch):
    rec = []
    for modname, mod in list(sys.modules.items()):
        if not modname.startswith("ttt_flash.kernels") or mod is None:
            continue
        for name, obj in list(vars(mod).items()):
            if isinstance(obj, triton.runtime.jit.KernelInterface) and name.endswith("_kernel"):
                monkeypatch.setattr(mod, name, _Recorder(name, obj, rec))
    return rec


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _tensors(v)


def _shared_tensors(name, fn, args, kwargs):
    """The parameters of one launch that receive a tensor another parameter (or another
    element of the same tuple) already received."""
    bound = dict(zip(fn.arg_names, args))
    bound.update({k: v for k, v in kwargs.items() if k in fn.arg_names})
    owner, bad = {}, []
    for param, value in bound.items():
        for t in _tensors(value):
            key = (t.data_ptr(), t.dtype, tuple(t.shape))
            if key in owner:
                bad.append(f"{name}: {owner[key]} and {param} get one tensor")
            owner.setdefault(key, param)
    return bad


def _inputs(dtype, hq=2, hkv=1, n=24, d=16):
    torch.manual_seed(0)
    q, do, uq = (torch.randn(1, hq, n, d).to(dtype) for _ in range(3))
    k, v, uk, uv = (torch.randn(1, hkv, n, d).to(dtype) for _ in range(4))
    return q, k, v, do, uq, uk, uv


SUBSETS = [(1, 1, 1), (0, 1, 1), (1, 0, 0), (0, 0, 1)]
NEEDS = [(1, 1, 1, 1), (1, 0, 0, 1), (0, 1, 1, 0)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_no_launch_passes_one_tensor_for_two_parameters(dtype, launches):
    q, k, v, do, uq, uk, uv = _inputs(dtype)
    kw = dict(scale=None, causal=True, window=None)
    lse = torch.randn(1, 2, 24)
    o, delta = torch.randn_like(q), torch.randn(1, 2, 24)
    attn_fwd(q, k, v, **kw)
    attn_bwd(q, k, v, o, lse, do, **kw)
    stats_tiles = configs.TileConfig(32, 16, 4, 1)  # unlike bob_direct's: separate launches
    for s in SUBSETS:
        us = [u if f else None for u, f in zip((uq, uk, uv), s)]
        attn_jvp(q, k, v, *us, **kw)
        attn_tangent(q, k, v, o, lse, *us, **kw)
        for needs in NEEDS:
            for precise in (True, False):
                attn_bob(q, k, v, o, lse, do, delta, *us, needs=tuple(map(bool, needs)),
                         precise=precise, **kw)
            with configs.tile_overrides({"bob_stats": stats_tiles}):
                attn_bob(q, k, v, o, lse, do, delta, *us, needs=tuple(map(bool, needs)), **kw)
        attn_bob(q, k, v, o, lse, do, delta, *us, stats=tuple(torch.rand(1, 2, 24) for _ in range(3)),
                 **kw)
    names = {name for name, *_ in launches}
    assert {"_bob_direct_kernel", "_bob_col_kernel", "_bob_affine_kernel", "_attn_jvp_kernel",
            "_attn_bwd_dkdv_kernel"} <= names
    assert ({"_bob_stats_shift_kernel", "_bob_direct_shift_kernel"} <= names) == (
        dtype == torch.float32)
    bad = [b for launch in launches for b in _shared_tensors(*launch)]
    assert not bad, "\n".join(sorted(set(bad)))


def test_dense_launches_pass_no_cu_seqlens(launches):
    q, k, v, do, uq, uk, uv = _inputs(torch.float16)
    kw = dict(scale=None, causal=False, window=None)
    attn_fwd(q, k, v, **kw)
    attn_bob(q, k, v, torch.randn_like(q), torch.randn(1, 2, 24), do, torch.randn(1, 2, 24),
             None, uk, None, **kw)
    assert launches
    for name, fn, args, kwargs in launches:
        bound = dict(zip(fn.arg_names, args))
        assert bound["CU"] is None, name
        assert kwargs["IS_VARLEN"] is False, name
        if name.startswith("_bob_"):
            assert bound["UQ"] is None and bound["UV"] is None and bound["UK"] is not None, name


def test_varlen_launches_read_both_cu_seqlens(launches):
    # varlen: the two cu_seqlens are real tensors, and distinct when the caller's are
    cu_q = torch.tensor([0, 5, 24], dtype=torch.int32)
    cu_k = torch.tensor([0, 9, 24], dtype=torch.int32)
    x = [torch.randn(24, h, 16) for h in (2, 1, 1, 2, 2, 1, 1)]
    q, k, v, do, uq, uk, uv = x
    kw = dict(scale=None, causal=False, window=None, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
              max_seqlen_q=19, max_seqlen_k=15)
    lse, delta = torch.randn(2, 24), torch.randn(2, 24)
    attn_bwd(q, k, v, torch.randn_like(q), lse, do, **kw)
    attn_bob(q, k, v, torch.randn_like(q), lse, do, delta, uq, uk, uv, **kw)
    assert launches
    for launch in launches:
        assert not _shared_tensors(*launch)
        bound = dict(zip(launch[1].arg_names, launch[2]))
        assert bound["CU"][0].data_ptr() != bound["CU"][1].data_ptr()
