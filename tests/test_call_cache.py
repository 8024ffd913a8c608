"""The host-side caches of a call: the composers' per-call-shape launch caches
(``kernels/host.py``, ``call_cache``) and ``check_dense``'s cache of validated calls.

A cached call must launch exactly what a fresh one does: each configuration below is run once
with every cache emptied and once after all the others filled the caches, and the launches
(kernel, grid, keywords, every non-tensor argument, the shape, strides and dtype of every
tensor argument) and the outputs must agree. The configurations differ from their neighbours
in one thing each (shape, head dim, GQA, dtype, strides, causal, window, cotangents given,
outputs wanted, precise, split tiles, tile overrides), so a key missing that thing returns a stale plan.
"""

from __future__ import annotations

import importlib
import os
import warnings

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from ttt_flash import flash_attention  # noqa: E402
from ttt_flash.attention import checks  # noqa: E402
from ttt_flash.kernels import attn_bob, attn_bwd, attn_fwd, configs, plan  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
_MODULES = [importlib.import_module(f"ttt_flash.kernels.{m}") for m in ("fwd", "bwd", "bob")]


def _describe(x):
    if isinstance(x, torch.Tensor):
        return ("tensor", tuple(x.shape), x.stride(), x.dtype)
    if isinstance(x, tuple):
        return tuple(_describe(y) for y in x)
    return x


@pytest.fixture
def recorded(monkeypatch):
    """The launches made, described (``_describe``); each still runs."""
    calls = []
    for m in _MODULES:
        real = m.launch

        def record(kernel, grid, *args, _real=real, **meta):
            calls.append((kernel.fn.__name__, grid, _describe(args), sorted(meta.items())))
            return _real(kernel, grid, *args, **meta)

        monkeypatch.setattr(m, "launch", record)
    return calls


def _tensors(shape_q, shape_kv, dtype, seed, strided=False):
    g = torch.Generator().manual_seed(seed)

    def r(shape):
        if strided:  # (B, H, N, D) views of (B, N, H, D) memory
            b, h, n, d = shape
            return torch.randn(b, n, h, d, generator=g).to(DEVICE, dtype).transpose(1, 2)
        return torch.randn(*shape, generator=g).to(DEVICE, dtype)

    return dict(q=r(shape_q), k=r(shape_kv), v=r(shape_kv), do=r(shape_q), uq=r(shape_q),
                uk=r(shape_kv), uv=r(shape_kv))


def _long_rows_k():
    """k, v whose token stride makes the kernels take int64 row offsets (LONG), on the same
    (1, 1, 2, 16) shape as the contiguous ones."""
    stride = 2 ** 31 // 200
    base = torch.zeros(2 * stride + 16, device=DEVICE)
    x = base.as_strided((1, 1, 2, 16), (2 * stride, 2 * stride, stride, 1))
    x.normal_(generator=torch.Generator(device=DEVICE).manual_seed(5))
    return x


# name -> (tensors, call keywords, attn_bob keywords)
CONFIGS = {
    "base": (((1, 2, 20, 16), (1, 2, 20, 16), torch.float32, 0), {}, {}),
    "longer": (((1, 2, 37, 16), (1, 2, 37, 16), torch.float32, 0), {}, {}),
    "d24": (((1, 2, 20, 24), (1, 2, 20, 24), torch.float32, 0), {}, {}),
    "gqa": (((1, 4, 20, 16), (1, 2, 20, 16), torch.float32, 0), {}, {}),
    "nq_ne_nk": (((1, 2, 12, 16), (1, 2, 20, 16), torch.float32, 0), {}, {}),
    "float16": (((1, 2, 20, 16), (1, 2, 20, 16), torch.float16, 0), {}, {}),
    "strided": (((1, 2, 20, 16), (1, 2, 20, 16), torch.float32, 0, True), {}, {}),
    "causal": (((1, 2, 20, 16), (1, 2, 20, 16), torch.float32, 0), dict(causal=True), {}),
    "window": (((1, 2, 20, 16), (1, 2, 20, 16), torch.float32, 0), dict(causal=True, window=4), {}),
    "scale": (((1, 2, 20, 16), (1, 2, 20, 16), torch.float32, 0), dict(scale=0.3), {}),
    "uq_only": (((1, 2, 20, 16), (1, 2, 20, 16), torch.float32, 0), {}, dict(uk=None, uv=None)),
    "uv_only": (((1, 2, 20, 16), (1, 2, 20, 16), torch.float32, 0), {}, dict(uq=None, uk=None)),
    "needs_qb": (((1, 2, 20, 16), (1, 2, 20, 16), torch.float32, 0), {},
                 dict(needs=(True, False, False, False))),
    "affine": (((1, 2, 20, 16), (1, 2, 20, 16), torch.float32, 0), {}, dict(precise=False)),
    "split_row": (((1, 2, 20, 16), (1, 2, 20, 16), torch.float16, 0), {}, dict(split_row=True)),
    "split_col": (((1, 2, 20, 16), (1, 2, 20, 16), torch.float16, 0), {}, dict(split_col=True)),
    "small": (((1, 1, 2, 16), (1, 1, 2, 16), torch.float32, 0), {}, {}),  # as long_rows
}


def _run(name):
    """The composers' chain of configuration ``name``: (outputs, launches recorded by the
    caller's fixture)."""
    if name == "long_rows":
        t = _tensors((1, 1, 2, 16), (1, 1, 2, 16), torch.float32, 0)
        t["k"], t["v"] = _long_rows_k(), _long_rows_k()
        kw, bob_kw = {}, {}
    else:
        args, kw, bob_kw = CONFIGS[name]
        t = _tensors(*args)
    kw = dict(dict(scale=None, causal=False, window=None), **kw)
    o, lse = attn_fwd(t["q"], t["k"], t["v"], **kw)
    dq, dk, dv, delta = attn_bwd(t["q"], t["k"], t["v"], o, lse, t["do"], **kw)
    u = dict(uq=t["uq"], uk=t["uk"], uv=t["uv"])
    u.update({key: val for key, val in bob_kw.items() if key in u})
    rest = {key: val for key, val in bob_kw.items() if key not in u}
    bob = attn_bob(t["q"], t["k"], t["v"], o, lse, t["do"], delta, u["uq"], u["uk"], u["uv"],
                   **kw, **rest)
    return [o, lse, dq, dk, dv, delta, *bob]


NAMES = [*CONFIGS, "long_rows"]


def test_cached_calls_launch_what_fresh_calls_do(recorded):
    fresh = {}
    for name in NAMES:  # each with every cache emptied
        plan.clear_cache()
        recorded.clear()
        fresh[name] = (_run(name), list(recorded))
    for name in NAMES:  # fill the caches with every configuration
        _run(name)
    for name in NAMES:  # then each one is a hit, among all the others
        recorded.clear()
        cached = _run(name)
        outputs, launches = fresh[name]
        assert recorded == launches, name
        assert len(cached) == len(outputs)
        for a, b in zip(cached, outputs):
            assert (a is None) == (b is None), name
            if a is not None and a.dtype == torch.float32:  # 16-bit dots: the interpreter's
                assert torch.equal(a, b), name


def test_long_rows_is_not_taken_from_a_contiguous_call(recorded):
    plan.clear_cache()
    _run("small")
    assert not any(dict(m)["LONG"] for _, _, _, m in recorded)
    recorded.clear()
    _run("long_rows")  # the same shapes, k and v with a token stride of 2**31 / 200
    assert recorded and all(dict(m)["LONG"] for _, _, _, m in recorded)


def test_tile_overrides_and_clear_cache_reach_the_call_cache(recorded):
    plan.clear_cache()
    _run("base")
    before = [dict(m)["BLOCK_M"] for name, _, _, m in recorded if name == "_attn_fwd_kernel"]
    recorded.clear()
    with configs.tile_overrides({"fwd": configs.TileConfig(16, 16, 4, 1)}):
        _run("base")
    inside = [dict(m)["BLOCK_M"] for name, _, _, m in recorded if name == "_attn_fwd_kernel"]
    recorded.clear()
    _run("base")
    after = [dict(m)["BLOCK_M"] for name, _, _, m in recorded if name == "_attn_fwd_kernel"]
    assert before == after == [configs.INTERPRETER["fwd"].block_m] and inside == [16]
    from ttt_flash.kernels import host

    assert any(host.CALL_CACHES) and plan.clear_cache() is None and not any(host.CALL_CACHES)


# --------------------------------------------------------------------------- check_dense


def _qkv(shape=(1, 2, 8, 4), dtype=torch.float64):
    return [torch.randn(*shape, dtype=dtype) for _ in range(3)]


def test_check_cache_keeps_refusing_bad_flags():
    q, k, v = _qkv()
    flash_attention(q, k, v, causal=True)  # valid: cached
    with pytest.raises(TypeError, match="causal must be a bool"):
        flash_attention(q, k, v, causal=1)  # equal to True as a dict key
    with pytest.raises(TypeError, match="precise_bob must be a bool"):
        flash_attention(q, k, v, causal=True, precise_bob=1)
    with pytest.raises(TypeError, match="scale must be a float"):
        flash_attention(q, k, v, causal=True, scale=True)


def test_check_cache_follows_shape_dtype_and_scale():
    q, k, v = _qkv()
    a = flash_attention(q, k, v, scale=0.5)
    b = flash_attention(q, k, v, scale=0.25)
    assert not torch.equal(a, b)
    torch.testing.assert_close(b, flash_attention(q, k, v, scale=0.25, backend="reference"),
                               rtol=0, atol=0)
    with pytest.raises(ValueError, match="multiple of the number of key/value"):
        flash_attention(q[:, :1].expand(1, 3, 8, 4), k, v)
    q32, k32, v32 = (x.float() for x in (q, k, v))
    assert flash_attention(q32, k32, v32, scale=0.5).dtype == torch.float32
    spec = checks.check_dense(q, k, v, causal=False, scale=None, window=None, backend="auto",
                              precise_bob=True, deterministic=False, layout=None,
                              return_lse=False)[3]
    assert spec.scale == 4 ** -0.5 and spec.backend == "reference"


def test_check_cache_warns_every_time():
    q, k, v = _qkv((1, 8, 2, 4))  # looks like (B, N, H, D)
    for _ in range(2):
        with pytest.warns(UserWarning, match="layout='bnhd'"):
            flash_attention(q, k, v)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        flash_attention(q, k, v, layout="bhnd")
        flash_attention(q, k, v, layout="bhnd")


def test_check_cache_follows_the_interpreter_switch(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("CPU tensors with backend='triton' need the interpreter")
    q, k, v = _qkv(dtype=torch.float32)
    flash_attention(q, k, v, backend="triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="needs CUDA tensors"):
        flash_attention(q, k, v, backend="triton")


def test_check_cache_transposes_bnhd_on_a_hit():
    q, k, v = _qkv((1, 8, 2, 4))
    first = flash_attention(q, k, v, layout="bnhd")
    second = flash_attention(q, k, v, layout="bnhd")
    assert first.shape == second.shape == (1, 8, 2, 4)
    torch.testing.assert_close(first, second, rtol=0, atol=0)
