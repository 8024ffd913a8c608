"""Every bad input gets a clear error that names the argument."""

from __future__ import annotations

import pytest
import torch

from ttt_flash import flash_attention, flash_attention_varlen


def _qkv(b=1, hq=2, hkv=2, nq=5, nk=5, d=4, dtype=torch.float32):
    return torch.randn(b, hq, nq, d, dtype=dtype), torch.randn(b, hkv, nk, d, dtype=dtype), torch.randn(b, hkv, nk, d, dtype=dtype)


def _packed(tq=6, tk=6, hq=2, hkv=2, d=4):
    return torch.randn(tq, hq, d), torch.randn(tk, hkv, d), torch.randn(tk, hkv, d)


CU = torch.tensor([0, 2, 6], dtype=torch.int32)


@pytest.mark.parametrize(
    "make,exc,match",
    [
        pytest.param(lambda q, k, v: (q[0], k, v), ValueError, r"q must have 4 dimensions", id="q-rank3"),
        pytest.param(lambda q, k, v: (q, k[..., None], v), ValueError, r"k must have 4 dimensions", id="k-rank5"),
        pytest.param(lambda q, k, v: (q, k, v[:, :, :3]), ValueError, r"k and v must have the same shape", id="kv-len"),
        pytest.param(lambda q, k, v: (q, torch.cat([k, k]), torch.cat([v, v])), ValueError, r"same batch size", id="batch"),
        pytest.param(lambda q, k, v: (q, k[..., :3], v[..., :3]), ValueError, r"same head dim", id="head-dim"),
        pytest.param(lambda q, k, v: (torch.cat([q, q[:, :1]], 1), k, v), ValueError, r"multiple of the number of key/value heads", id="heads"),
        pytest.param(lambda q, k, v: (q.tolist(), k, v), TypeError, r"q must be a torch.Tensor", id="q-list"),
        pytest.param(lambda q, k, v: (q, k.long(), v), TypeError, r"k must be a floating-point", id="k-int"),
        pytest.param(lambda q, k, v: (q, k, v.double()), TypeError, r"share one dtype", id="dtype-mismatch"),
        pytest.param(lambda q, k, v: (q, k.to("meta"), v), ValueError, r"one device", id="device-mismatch"),
    ],
)
def test_bad_tensors(make, exc, match):
    with pytest.raises(exc, match=match):
        flash_attention(*make(*_qkv()))


@pytest.mark.parametrize(
    "kwargs,exc,match",
    [
        pytest.param(dict(window=0, causal=True), ValueError, r"window must be >= 1", id="window0"),
        pytest.param(dict(window=-3, causal=True), ValueError, r"window must be >= 1", id="window-neg"),
        pytest.param(dict(window=2), ValueError, r"window requires causal=True", id="window-noncausal"),
        pytest.param(dict(window=2.5, causal=True), TypeError, r"window must be an int", id="window-float"),
        pytest.param(dict(scale=float("nan")), ValueError, r"scale must be finite", id="scale-nan"),
        pytest.param(dict(scale=float("inf")), ValueError, r"scale must be finite", id="scale-inf"),
        pytest.param(dict(scale="0.5"), TypeError, r"scale must be a float", id="scale-str"),
        pytest.param(dict(causal=1), TypeError, r"causal must be a bool", id="causal-int"),
        pytest.param(dict(backend="cuda"), ValueError, r"backend must be one of", id="backend"),
    ],
)
def test_bad_options(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        flash_attention(*_qkv(), **kwargs)


def test_triton_backend_rejects_float64():
    with pytest.raises(TypeError, match="backend='triton' supports float16, bfloat16 and float32"):
        flash_attention(*_qkv(dtype=torch.float64), backend="triton")


def test_triton_backend_on_cpu_without_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        flash_attention(*_qkv(), backend="triton")


@pytest.mark.parametrize(
    "cu_q,cu_k,exc,match",
    [
        pytest.param(CU.long(), CU, ValueError, r"cu_seqlens_q must have dtype torch.int32", id="dtype"),
        pytest.param(CU.float(), CU, ValueError, r"cu_seqlens_q must have dtype torch.int32", id="dtype-float"),
        pytest.param([0, 2, 6], CU, TypeError, r"cu_seqlens_q must be a torch.Tensor", id="list"),
        pytest.param(CU, CU[None], ValueError, r"cu_seqlens_k must be 1-D", id="rank"),
        pytest.param(CU[:1], CU, ValueError, r"cu_seqlens_q must be 1-D with batch_size \+ 1 >= 2", id="too-short"),
        pytest.param(torch.tensor([1, 2, 6], dtype=torch.int32), CU, ValueError, r"cu_seqlens_q\[0\] must be 0", id="start"),
        pytest.param(torch.tensor([0, 4, 2, 6], dtype=torch.int32), torch.tensor([0, 2, 4, 6], dtype=torch.int32), ValueError, r"non-decreasing", id="monotonic"),
        pytest.param(torch.tensor([0, 2, 5], dtype=torch.int32), CU, ValueError, r"cu_seqlens_q\[-1\] must equal the number of packed tokens \(6\)", id="last"),
        pytest.param(CU, torch.tensor([0, 1, 3, 6], dtype=torch.int32), ValueError, r"same number of sequences", id="length"),
    ],
)
def test_bad_cu_seqlens(cu_q, cu_k, exc, match):
    with pytest.raises(exc, match=match):
        flash_attention_varlen(*_packed(), cu_q, cu_k, 4, 4)


def test_cu_seqlens_device_mismatch():
    with pytest.raises(ValueError, match="cu_seqlens_q must be on the same device as q"):
        flash_attention_varlen(*_packed(), CU.to("meta"), CU, 4, 4)


@pytest.mark.parametrize("which", ["max_seqlen_q", "max_seqlen_k"])
def test_max_seqlen_too_small(which):
    args = {"max_seqlen_q": 4, "max_seqlen_k": 4}
    args[which] = 3
    with pytest.raises(ValueError, match=rf"{which} \(3\) is smaller than the longest sequence \(4\)"):
        flash_attention_varlen(*_packed(), CU, CU, args["max_seqlen_q"], args["max_seqlen_k"])


def test_varlen_rank_and_heads():
    q, k, v = _packed()
    with pytest.raises(ValueError, match="q must have 3 dimensions"):
        flash_attention_varlen(q[None], k, v, CU, CU, 4, 4)
    with pytest.raises(ValueError, match="multiple of the number of key/value heads"):
        flash_attention_varlen(torch.randn(6, 3, 4), k, v, CU, CU, 4, 4)


def test_max_seqlen_none_is_computed():
    q, k, v = _packed()
    a = flash_attention_varlen(q, k, v, CU, CU, None, None, causal=True)
    b = flash_attention_varlen(q, k, v, CU, CU, 4, 4, causal=True)
    torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("name", ["causal", "precise_bob", "deterministic"])
@pytest.mark.parametrize("value", ["no", "false", 1, None])
def test_flags_are_strict(name, value):
    with pytest.raises(TypeError, match=rf"{name} must be a bool \(True or False\)"):
        flash_attention(*_qkv(), **{name: value})
    with pytest.raises(TypeError, match=rf"{name} must be a bool"):
        flash_attention_varlen(*_packed(), CU, CU, 4, 4, **{name: value})


def test_numpy_bools_are_bools():
    import numpy as np

    q, k, v = _qkv(dtype=torch.float64)
    want = flash_attention(q, k, v, causal=True, backend="reference")
    got = flash_attention(q, k, v, causal=np.bool_(True), precise_bob=np.bool_(False),
                          deterministic=np.bool_(True), backend="reference")
    assert torch.equal(want, got)


def test_head_count_error_hints_the_layout_only_when_it_fits():
    q, k, v = _qkv(hq=3, hkv=2, nq=6, nk=6)  # self-attention shapes with bad head counts
    with pytest.raises(ValueError, match="multiple of the number of key/value heads") as e:
        flash_attention(q, k, v)
    assert "bnhd" not in str(e.value)
    q, k, v = torch.randn(1, 5, 4, 8), torch.randn(1, 3, 2, 8), torch.randn(1, 3, 2, 8)  # (B, N, H, D)
    with pytest.raises(ValueError, match="layout='bnhd'"):
        flash_attention(q, k, v)


@pytest.mark.parametrize("lr", [float("inf"), float("nan")])
def test_memory_layer_inner_lr_must_be_finite(lr):
    from ttt_flash.memory import GradientMemoryAttention

    with pytest.raises(ValueError, match="inner_lr must be a finite float"):
        GradientMemoryAttention(8, 2, memory_slots=2, inner_lr=lr)
