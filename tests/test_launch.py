"""Cached launches (kernels/launch.py) on the CPU.

The chain (forward, backward, BoB; dense and causal) gives bitwise the same outputs with the
switch on as off (under the interpreter every launch falls back to ``kernel[grid]``). The
cache itself runs against a small ``JITFunction`` whose Triton route is replaced by a recorder
returning a stand-in compiled kernel: which argument changes miss, that a hit hands the
launcher the arguments Triton's own binder would, and every fallback. The key is checked
against Triton's specialization: two calls the key puts together are never told apart by
Triton.
"""

from __future__ import annotations

import itertools
import os
from types import SimpleNamespace

import torch

if not torch.cuda.is_available():
    # before ttt_flash.kernels (and with it triton.jit) is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import triton.language as tl  # noqa: E402
from triton import knobs  # noqa: E402
from triton.backends.compiler import BaseBackend  # noqa: E402
from triton.runtime.jit import JITFunction, create_function_from_signature  # noqa: E402

from ttt_flash.kernels import attn_bob, attn_bwd, attn_fwd, host  # noqa: E402
from ttt_flash.kernels import launch as cached  # noqa: E402
from ttt_flash.kernels.bob_affine import _bob_affine_kernel  # noqa: E402
from ttt_flash.kernels.bob_col import _bob_col_kernel  # noqa: E402
from ttt_flash.kernels.bob_row import _bob_direct_kernel, _bob_direct_shift_kernel  # noqa: E402
from ttt_flash.kernels.dkdv import _attn_bwd_dkdv_kernel  # noqa: E402
from ttt_flash.kernels.dq import _attn_bwd_dq_kernel  # noqa: E402
from ttt_flash.kernels.fwd import _attn_fwd_kernel  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def _fresh_cache(monkeypatch):
    monkeypatch.setattr(host, "POISON_OUTPUTS", True)
    cached.clear()
    yield
    cached.clear()


# --------------------------------------------------------------------------- the chain


def _chain(dtype, causal, n=33, d=16):
    g = torch.Generator().manual_seed(1)
    x = [torch.randn(1, 2, n, d, generator=g).to(DEVICE, dtype) for _ in range(7)]
    q, k, v, do, uq, uk, uv = x
    kw = dict(scale=None, causal=causal, window=None)
    o, lse = attn_fwd(q, k, v, **kw)
    dq, dk, dv, delta = attn_bwd(q, k, v, o, lse, do, **kw)
    bob = attn_bob(q, k, v, o, lse, do, delta, uq, uk, uv, **kw)
    affine = attn_bob(q, k, v, o, lse, do, delta, uq, None, uv, precise=False, **kw)
    return (o, lse, dq, dk, dv, delta, *bob, *(t for t in affine if t is not None))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("causal", [False, True], ids=["dense", "causal"])
def test_chain_bitwise_equal_with_the_switch(dtype, causal):
    with cached.use_cached_launch(False):
        off = _chain(dtype, causal)
    with cached.use_cached_launch(True):
        on = _chain(dtype, causal)
        again = _chain(dtype, causal)
    for a, b, c in zip(off, on, again):
        assert torch.equal(a, b) and torch.equal(a, c)
    # the composers launched through the helper: each kernel has its table
    for kernel in (_attn_fwd_kernel, _attn_bwd_dq_kernel, _attn_bwd_dkdv_kernel, _bob_col_kernel,
                   _bob_affine_kernel):
        assert id(kernel) in cached._TABLES
    rows = (_bob_direct_kernel, _bob_direct_shift_kernel)
    assert any(id(kernel) in cached._TABLES for kernel in rows)
    if not torch.cuda.is_available():  # the interpreter: never cached
        assert all(t is None for t in cached._TABLES.values())


def test_switch_default_is_on_and_restored():
    assert cached.ENABLED is (os.environ.get("TTT_FLASH_CACHED_LAUNCH", "1") != "0")
    saved = cached.ENABLED
    with cached.use_cached_launch(not saved):
        assert cached.ENABLED is (not saved)
    assert cached.ENABLED is saved


# --------------------------------------------------------------------------- the cache


def _toy(X, V, n, N, scale, flag, BLOCK: tl.constexpr, MODE: tl.constexpr = "a"):
    pass


class FakeCompiled:
    """Stands in for triton.compiler.CompiledKernel: its launcher records each call."""

    def __init__(self):
        self.function = object()
        self.metadata = SimpleNamespace(target=SimpleNamespace(backend="cuda"))
        self.packed_metadata = (4, 1, 0)
        self.calls = []

    def run(self, *args):
        self.calls.append(args)


@pytest.fixture
def toy(monkeypatch):
    """A JITFunction whose Triton route records its calls and returns a new FakeCompiled."""
    kernel = JITFunction(_toy, do_not_specialize=["N"])
    kernel.triton_calls = []

    def triton_run(*args, grid, warmup, **meta):
        compiled = FakeCompiled()
        kernel.triton_calls.append((grid, args, meta, compiled))
        return compiled

    kernel.run = triton_run
    monkeypatch.setattr(cached, "_compiled_type", lambda: FakeCompiled)
    monkeypatch.setattr(cached, "_device_and_stream", lambda: (0, 7))
    monkeypatch.setattr(cached.configs, "interpreting", lambda: False)
    monkeypatch.setattr(cached, "ENABLED", True)
    return kernel


def _args(dtype=torch.float32, offset=0, stride=(16, 32), n=48, N=100, scale=0.5, flag=True):
    x = torch.zeros(64, dtype=dtype)[offset:]
    v = torch.zeros(64, dtype=torch.float16)
    return (x, (v, *stride), n, N, scale, flag)


META = dict(BLOCK=16, num_warps=4)


def _launch(kernel, *args, grid=(2, 3, 1), **meta):
    return cached.launch(kernel, grid, *args, **(meta or META))


def _same(a, b):
    if isinstance(a, tuple):
        return isinstance(b, tuple) and len(a) == len(b) and all(map(_same, a, b))
    return a is b or (not isinstance(a, torch.Tensor) and a == b)


def test_hit_hands_the_launcher_what_triton_would(toy):
    first = _launch(toy, *_args())
    assert len(toy.triton_calls) == 1
    args = _args(N=7)  # new tensors; N is not specialized
    got = _launch(toy, *args, grid=(5,))
    assert got is first and len(toy.triton_calls) == 1
    (call,) = first.calls
    assert call[:9] == (5, 1, 1, 7, first.function, first.packed_metadata, None, None, None)
    binder = create_function_from_signature(toy.signature, toy.params, BaseBackend)
    bound, _, _ = binder(*args, **META)
    assert _same(call[9:], tuple(bound.values()))


CHANGES = {
    "dtype": dict(dtype=torch.float16),
    "alignment": dict(offset=1),
    "stride-one": dict(stride=(1, 32)),
    "stride-not-16": dict(stride=(17, 32)),
    "stride-i64": dict(stride=(2**32, 32)),
    "int-one": dict(n=1),
    "int-not-16": dict(n=47),
    "int-i64": dict(n=2**31),
    "float-to-int": dict(scale=1),
    "bool-to-int": dict(flag=2),
    "none": dict(flag=None),
    # finer than Triton: the key specializes do_not_specialize integers too
    "no-specialize-one": dict(N=1),
    "no-specialize-16": dict(N=32),
}


@pytest.mark.parametrize("change", list(CHANGES), ids=list(CHANGES))
def test_argument_changes_that_miss(toy, change):
    _launch(toy, *_args())
    _launch(toy, *_args(**CHANGES[change]))
    assert len(toy.triton_calls) == 2
    _launch(toy, *_args(**CHANGES[change]))  # and is then bound
    assert len(toy.triton_calls) == 2


@pytest.mark.parametrize("meta", [dict(BLOCK=32, num_warps=4), dict(BLOCK=16, num_warps=8),
                                  dict(BLOCK=16, num_warps=4, MODE="b"),
                                  dict(BLOCK=True, num_warps=4)],
                         ids=["constexpr", "option", "default-given", "constexpr-type"])
def test_keyword_changes_that_miss(toy, meta):
    _launch(toy, *_args())
    _launch(toy, *_args(), **meta)
    assert len(toy.triton_calls) == 2


@pytest.mark.parametrize("change", [dict(N=2**20 + 3), dict(n=64), dict(scale=2.0),
                                    dict(flag=False), dict(stride=(32, 64))],
                         ids=["N-other", "n-16", "scale", "flag", "strides-16"])
def test_argument_changes_that_hit(toy, change):
    _launch(toy, *_args())
    _launch(toy, *_args(**change))
    assert len(toy.triton_calls) == 1


def _variants():
    dtypes = (torch.float32, torch.float16)
    ints = (1, 16, 17, 2**31, -16, 0)
    for dtype, offset, s0, n, N, flag in itertools.product(dtypes, (0, 1), (1, 32, 2**32), ints,
                                                           (1, 17), (True, 3)):
        yield _args(dtype=dtype, offset=offset, stride=(s0, 32), n=n, N=N, flag=flag), META
    for meta in (dict(BLOCK=32, num_warps=4), dict(BLOCK=16, num_warps=8, MODE="b")):
        yield _args(), meta


def test_key_never_joins_what_triton_tells_apart(toy):
    binder = create_function_from_signature(toy.signature, toy.params, BaseBackend)
    table = cached._Table(toy)
    seen = {}
    for args, meta in _variants():
        _, spec, options = binder(*args, **meta)
        triton_key = (str(spec), str(sorted(options.items())))
        ours = table.key(0, args, meta)
        assert seen.setdefault(ours, triton_key) == triton_key, (ours, triton_key)
    assert len(set(seen.values())) > 90


def test_args_key_kinds():
    t = torch.zeros(8)

    def key(*args):
        return cached.args_key(args)

    assert key(t) != key(t[1:]) and key(t) != key(t.half())
    assert key((t, 1, 16)) != key((t, 2, 16)) != key((t, 2, 17))
    assert key(17) != key(16) != key(1) and key(16) == key(32) == key(0)
    assert key(2**31) != key(2**31 - 1) and key(2**63) != key(2**63 - 1)
    assert key(None) != key(0.5) != key(True) != key(1)
    assert key(0.5) == key(2.0) and key(True) == key(False) and key(17) == key(3)
    with pytest.raises(Exception):
        key("ieee")


# --------------------------------------------------------------------------- fallbacks


def test_switch_off_goes_through_triton(toy, monkeypatch):
    monkeypatch.setattr(cached, "ENABLED", False)
    for _ in range(3):
        _launch(toy, *_args())
    assert len(toy.triton_calls) == 3 and not cached._TABLES


@pytest.mark.parametrize("reason", ["interpreter", "version", "not-a-jit-function"])
def test_kernels_never_cached(toy, monkeypatch, reason):
    kernel = toy
    if reason == "interpreter":
        monkeypatch.setattr(cached.configs, "interpreting", lambda: True)
    elif reason == "version":
        monkeypatch.setattr(cached, "_triton_version", lambda: (4, 0))
    else:
        class Wrapper:  # an autotuner or heuristics wrapper: not a plain JITFunction
            def __getitem__(self, grid):
                return toy[grid]
        kernel = Wrapper()
    for _ in range(3):
        _launch(kernel, *_args())
    assert len(toy.triton_calls) == 3
    assert cached._TABLES[id(kernel)] is None


def test_hooks_go_through_triton(toy, monkeypatch):
    _launch(toy, *_args())
    monkeypatch.setattr(toy, "pre_run_hooks", [lambda *a, **k: None])
    _launch(toy, *_args())
    monkeypatch.setattr(toy, "pre_run_hooks", [])
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", lambda metadata: None)
    _launch(toy, *_args())
    assert len(toy.triton_calls) == 3
    assert not toy.triton_calls[0][3].calls  # the kept launcher was never called directly


def test_unmodelled_arguments_go_through_triton(toy):
    _launch(toy, *_args()[:5], "not-a-flag")
    _launch(toy, *_args()[:5], "not-a-flag")
    _launch(toy, *_args(), grid=lambda meta: (1,))
    _launch(toy, *_args(), grid=lambda meta: (1,))
    assert len(toy.triton_calls) == 4


def test_runtime_argument_by_keyword_is_not_bound(toy):
    args = _args()
    for _ in range(2):
        cached.launch(toy, (1,), *args[:5], flag=True, BLOCK=16)
    assert len(toy.triton_calls) == 2


def _toy_late(X, BLOCK: tl.constexpr, Y):
    pass


def test_runtime_argument_after_a_constexpr_is_not_bound(toy):
    kernel = JITFunction(_toy_late)
    kernel.run = toy.run  # records into toy.triton_calls
    x, y = torch.zeros(4), torch.zeros(4)
    for _ in range(2):
        cached.launch(kernel, (1,), x, 16, y)
    assert len(toy.triton_calls) == 2 and not cached._TABLES[id(kernel)].entries


def test_launcher_error_falls_back_and_stops_caching(toy):
    first = _launch(toy, *_args())

    def broken(*args):
        raise TypeError("bad argument")

    table = cached._TABLES[id(toy)]
    table.entries = {k: (broken, *v[1:]) for k, v in table.entries.items()}
    _launch(toy, *_args())
    assert len(toy.triton_calls) == 2 and cached._TABLES[id(toy)] is None
    _launch(toy, *_args())
    assert len(toy.triton_calls) == 3 and not first.calls


def test_entries_are_capped(toy, monkeypatch):
    monkeypatch.setattr(cached, "MAX_ENTRIES", 2)
    for block in (16, 32, 64, 64, 64):
        _launch(toy, *_args(), BLOCK=block, num_warps=4)
    assert len(cached._TABLES[id(toy)].entries) == 2
    assert len(toy.triton_calls) == 5


def test_capture_goes_through_triton(toy, monkeypatch):
    """While torch's current stream is being captured, a launch that would hit takes Triton's
    route (its host cost is paid once; the graph's replays have none); after capture, hits
    launch directly again."""
    first = _launch(toy, *_args())  # binds
    monkeypatch.setattr(cached, "_capturing", lambda: True)
    for _ in range(2):
        _launch(toy, *_args())
    assert len(toy.triton_calls) == 3 and not first.calls
    monkeypatch.setattr(cached, "_capturing", lambda: False)
    _launch(toy, *_args())
    assert len(toy.triton_calls) == 3 and len(first.calls) == 1


def test_capture_check_answers_outside_capture():
    """Outside a capture the check answers False, also on a torch built without CUDA (where
    torch's own check raises)."""
    assert cached._capturing() is False
