"""Misuse that used to fail late, obscurely or silently now gives a clear error or a
correct result: 16-bit inputs to the Triton path under the interpreter, tensor inner-loop
step sizes, head dim 0, the memory layer on 2-D / empty input, extra FastWeightTTT targets,
``ttt-flash check`` with nothing to compare, an empty checkpoint file, and ±inf query rows
in the reference backend."""

import math
from pathlib import Path

import pytest
import torch

from ttt_flash import flash_attention
from ttt_flash.cli import main
from ttt_flash.memory import FastWeightTTT, GradientMemoryAttention
from ttt_flash.meta import inner_loop
from ttt_flash.models import GPT, GPTConfig
from ttt_flash.attention.reference import naive_attention

RECIPE = Path(__file__).resolve().parent.parent / "recipes" / "maml_sinusoid.yaml"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_16bit_triton_under_the_interpreter_is_correct(dtype):
    # item 4: the interpreter computed 16-bit dots wrongly (relative error ~1e9).
    q, k, v = (torch.randn(1, 2, 17, 16, dtype=torch.float64, requires_grad=True) for _ in range(3))
    want = naive_attention(q, k, v, causal=True)
    got = flash_attention(*(x.to(dtype) for x in (q, k, v)), causal=True, backend="triton")
    assert got.dtype == dtype
    base = naive_attention(*(x.to(dtype) for x in (q, k, v)), causal=True)  # PyTorch's 16-bit math
    err, base_err = ((got.double() - want).norm() / want.norm()).item(), ((base.double() - want).norm() / want.norm()).item()
    assert err <= 2 * base_err + 1e-3, (err, base_err)
    g = torch.autograd.grad(got.double().square().sum(), (q, k, v))
    g_want = torch.autograd.grad(want.square().sum(), (q, k, v))
    for a, b in zip(g, g_want):
        assert ((a - b).norm() / b.norm()).item() < 5e-2


def _mlp():
    return torch.nn.Sequential(torch.nn.Linear(2, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def _support():
    return torch.randn(5, 2), torch.randn(5, 1)


@pytest.mark.parametrize("lr", [torch.full((3, 1, 1), 0.1), torch.full((1, 1), 0.1)], ids=["3x1x1", "1x1"])
def test_inner_loop_refuses_non_scalar_tensor_lr(lr):
    # item 5: (3,1,1) made (3,8,1) weights; (1,1) silently reshaped biases to (1,8).
    with pytest.raises(ValueError, match=r"lr must be a float or a 0-dim tensor.*lrs="):
        inner_loop(_mlp(), None, torch.nn.functional.mse_loss, _support(), steps=1, lr=lr)


@pytest.mark.parametrize("value", [-0.1, math.nan, math.inf])
def test_inner_loop_refuses_bad_tensor_lr_values(value):
    # item 5: the same values as floats were refused, as tensors accepted.
    for lr in (value, torch.tensor(value)):
        with pytest.raises(ValueError, match="lr must be finite"):
            inner_loop(_mlp(), None, torch.nn.functional.mse_loss, _support(), steps=1, lr=lr)
    net = _mlp()
    lrs = {n: torch.full_like(p, value) for n, p in net.named_parameters()}
    if value < 0:  # a learned Meta-SGD step size may turn negative
        inner_loop(net, None, torch.nn.functional.mse_loss, _support(), steps=1, lr=0.1, lrs=lrs)
    else:
        with pytest.raises(ValueError, match=r"lrs\['0.weight'\] must be finite"):
            inner_loop(net, None, torch.nn.functional.mse_loss, _support(), steps=1, lr=0.1, lrs=lrs)


def test_head_dim_zero_is_refused():
    # item 6: ZeroDivisionError.
    q = torch.randn(1, 2, 4, 0)
    with pytest.raises(ValueError, match=r"head dim \(q.shape\[-1\]\) must be >= 1, got 0"):
        flash_attention(q, q, q)
    for flag in ("--head-dim", "--seq-len"):
        with pytest.raises(SystemExit) as e:
            main(["check", flag, "0", "--device", "cpu"])
        assert e.value.code == 2  # argparse's usage error, not "OK" with nothing compared


def test_gradient_memory_attention_2d_and_empty_input():
    # item 6: "not enough values to unpack" and "torch.cat(): expected a non-empty list".
    layer = GradientMemoryAttention(16, heads=2, memory_slots=4, chunk_size=4)
    with pytest.raises(ValueError, match=r"\(batch, seq_len, d_model=16\).*unsqueeze\(0\)"):
        layer(torch.randn(6, 16))
    with pytest.raises(ValueError, match="d_model=16"):
        layer(torch.randn(2, 6, 8))
    x = torch.randn(2, 0, 16, requires_grad=True)
    out = layer(x)
    assert out.shape == (2, 0, 16)
    out.sum().backward()


def test_fast_weight_ttt_refuses_mismatched_targets():
    # item 6: extra context_targets columns were silently ignored.
    ttt = FastWeightTTT(GPT(GPTConfig.tiny(vocab_size=32, window=4, n_layer=1)), fast_layers=[-1], chunk_size=4)
    ctx = torch.randint(0, 32, (2, 8))
    with pytest.raises(ValueError, match="context_targets of the same shape"):
        ttt.adapt(ctx, torch.randint(0, 32, (2, 9)))


def test_empty_checkpoint_file_is_refused(tmp_path, capsys):
    # item 6: a bare EOFError from torch.load.
    empty = tmp_path / "empty.ckpt"
    empty.write_bytes(b"")
    with pytest.raises(SystemExit, match="empty file"):
        main(["fit", "--config", str(RECIPE), "--ckpt_path", str(empty)])


@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan])
def test_reference_nonfinite_query_row_is_nan(value):
    # item 7: the reference backend returned ±inf where the kernels and the math give NaN.
    q, k, v = (torch.randn(1, 1, 5, 4, dtype=torch.float64) for _ in range(3))
    k = k.abs() + 0.1  # row 0 sees key 0 only: scores all +inf (or all -inf) there
    q[0, 0, 0] = value
    o = flash_attention(q, k, v, causal=True, backend="reference")
    assert torch.isnan(o[0, 0, 0]).all()
    math_o = naive_attention(q, k, v, causal=True)  # materialised softmax: NaN there too
    assert torch.isnan(math_o[0, 0, 0]).all()
    rows = [1, 2, 3, 4]  # the other rows are untouched
    torch.testing.assert_close(o[0, 0, rows], math_o[0, 0, rows], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_infinite_key_gives_nan_rows_as_sdpa(causal, backend):
    # a +inf entry in a key: rows whose score with it is +inf are NaN (SDPA's softmax), rows
    # whose score is -inf just do not see that key
    import torch.nn.functional as F

    q, k, v = (torch.randn(1, 1, 5, 4, dtype=torch.float32) for _ in range(3))
    q[0, 0, :, 1] = torch.tensor([-1.0, -2.0, -0.5, 1.5, 1.0])
    k[0, 0, 2, 1] = math.inf
    o = flash_attention(q, k, v, causal=causal, backend=backend)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    assert torch.equal(torch.isnan(o), torch.isnan(want)) and torch.isnan(want).any()
    assert not torch.isinf(o).any()
    torch.testing.assert_close(o[~torch.isnan(want)], want[~torch.isnan(want)], rtol=1e-5, atol=1e-5)
