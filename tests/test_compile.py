"""torch.compile: flash_attention and a first-order GPT step compile with fullgraph=True and
match eager; second-order gradients through compiled graphs raise the library's explanation.

CPU: the reference backend through the custom operators of ttt_flash.attention.ops, compiled with the
``aot_eager`` backend (Dynamo + AOTAutograd, no C++ compiler needed) and, where a C++
compiler is installed, ``inductor``. The GPU check (Triton kernels, inductor) is in
tests/test_kernels_gpu.py.
"""

import shutil

import pytest
import torch

from ttt_flash import flash_attention
from ttt_flash.bench import main as bench_main
from ttt_flash.second_order import HessianOperator
from ttt_flash.meta import inner_loop
from ttt_flash.models import GPT, GPTConfig
from ttt_flash.second_order import COMPILE_DOUBLE_BACKWARD_MESSAGE, second_order_grad

DT = torch.float64


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _qkv(hq=4, hkv=2, n=24, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, h, n, d, dtype=DT, generator=g, requires_grad=True) for h in (hq, hkv, hkv)]


@pytest.mark.parametrize("kw", [dict(), dict(causal=True), dict(causal=True, window=5)])
def test_flash_attention_compiles_fullgraph_and_matches_eager(kw):
    q, k, v = _qkv()

    def f(q, k, v):
        # a non-contiguous view in, as models produce with rearrange/transpose
        return flash_attention(q.transpose(2, 3).transpose(2, 3), k, v, **kw).sin().sum()

    cf = torch.compile(f, fullgraph=True, backend="aot_eager")
    lc = cf(q, k, v)
    gc = torch.autograd.grad(lc, (q, k, v))
    le = f(q, k, v)
    ge = torch.autograd.grad(le, (q, k, v))
    assert torch.allclose(lc, le, rtol=0, atol=1e-12)
    for a, b in zip(gc, ge):
        assert torch.allclose(a, b, rtol=0, atol=1e-12)


def test_custom_ops_pass_opcheck():
    q, k, v = (t.detach() for t in _qkv(n=12))
    o, lse = torch.ops.ttt_flash.attention_fwd(q, k, v, None, None, 0.3, True, -1, -1, -1, "reference")
    assert o.shape == q.shape and lse.shape == q.shape[:-1]
    args = (q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), None, None, 0.3, True, 4, -1, -1, "reference")
    torch.library.opcheck(torch.ops.ttt_flash.attention_fwd, args)
    do = torch.randn_like(q)
    torch.library.opcheck(
        torch.ops.ttt_flash.attention_bwd,
        (q.detach(), k.detach(), v.detach(), o, lse, do, None, None, 0.3, True, -1, -1, -1, "reference"),
        test_utils=("test_schema", "test_faketensor"),
    )


def _gpt(**kw):
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=50, n_layer=2, n_head=4, n_kv_head=2, d_model=32, attention="ttt_flash", **kw)
    return GPT(cfg).to(DT)


def _step(model, x, y):
    return model.loss(x, y)


def _grads_after(fn, model, x, y):
    for p in model.parameters():
        p.grad = None
    loss = fn(model, x, y)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("backend", [
    "aot_eager",
    pytest.param("inductor", marks=pytest.mark.skipif(shutil.which("g++") is None and shutil.which("cc") is None,
                                                     reason="inductor on CPU needs a C++ compiler")),
])
@pytest.mark.parametrize("window", [None, 6])
def test_gpt_first_order_step_compiles_fullgraph_and_matches_eager(backend, window):
    model = _gpt(window=window)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 50, (2, 20), generator=g)
    y = torch.randint(0, 50, (2, 20), generator=g)
    le, ge = _grads_after(_step, model, x, y)
    cstep = torch.compile(_step, fullgraph=True, backend=backend)
    lc, gc = _grads_after(cstep, model, x, y)
    tol = 1e-12 if backend == "aot_eager" else 1e-9
    assert abs(lc.item() - le.item()) <= tol * max(1.0, abs(le.item()))
    for a, b in zip(gc, ge):
        assert (a - b).abs().max() <= tol * max(1.0, b.abs().max().item())


def test_second_order_through_compiled_graph_raises_the_library_message():
    model = _gpt()
    x = torch.randint(0, 50, (1, 12))
    cstep = torch.compile(_step, fullgraph=True, backend="aot_eager")
    loss = cstep(model, x, x)
    with pytest.raises(RuntimeError, match="not supported by PyTorch") as info:
        second_order_grad(loss, list(model.parameters()), create_graph=True)
    assert str(info.value) == COMPILE_DOUBLE_BACKWARD_MESSAGE
    # PyTorch would fail only later (next differentiation) or with an error on donated buffers


@pytest.mark.parametrize("msg", [
    "This backward function was compiled with non-empty donated buffers which requires create_graph=False",
    "torch.compile with aot_autograd does not currently support double backward",
])
def test_second_order_grad_translates_pytorch_compile_errors(monkeypatch, msg):
    def refuse(*args, **kwargs):
        raise RuntimeError(msg)

    monkeypatch.setattr(torch.autograd, "grad", refuse)
    x = torch.ones(2, requires_grad=True)
    with pytest.raises(RuntimeError) as info:
        second_order_grad(x.sum(), [x], create_graph=True)
    assert str(info.value) == COMPILE_DOUBLE_BACKWARD_MESSAGE
    assert str(info.value.__cause__) == msg  # PyTorch's own error kept as the cause


def test_second_order_grad_passes_other_errors_and_eager_graphs_through():
    x = torch.ones(2, requires_grad=True)
    with pytest.raises(RuntimeError, match="does not require grad"):
        second_order_grad(torch.ones(2).sum(), [torch.ones(2)], create_graph=True)
    (g,) = second_order_grad((x ** 3).sum(), [x], create_graph=True)  # eager: no refusal
    (h,) = torch.autograd.grad(g.sum(), [x])
    assert torch.equal(h, 6 * x.detach())


def test_step_bench_config_rejects_bad_input():
    from ttt_flash.bench.step import StepBenchConfig

    with pytest.raises(ValueError, match="dtype must be one of"):
        StepBenchConfig(dtype="int8", device="cpu")
    with pytest.raises(ValueError, match="unknown step providers"):
        StepBenchConfig(providers=["eager", "math"], device="cpu")


def test_hessian_operator_on_compiled_loss_raises_clearly():
    model = _gpt()
    x = torch.randint(0, 50, (1, 12))
    cstep = torch.compile(_step, fullgraph=True, backend="aot_eager")
    with pytest.raises(RuntimeError, match="Run second-order steps with the eager"):
        HessianOperator(cstep(model, x, x), list(model.parameters()))


def _ce(out, target):
    return torch.nn.functional.cross_entropy(out.flatten(0, 1), target.flatten())


def _compiled_gpt():
    model = _gpt()
    return model, torch.compile(model, fullgraph=True, backend="aot_eager"), torch.randint(0, 50, (1, 12))


def test_meta_inner_loop_on_compiled_module_raises_clearly():
    _, cmodel, x = _compiled_gpt()
    with pytest.raises(RuntimeError, match="torch.compile'd graph"):
        inner_loop(cmodel, None, _ce, (x, x), steps=1, lr=0.1)


def test_first_order_meta_inner_loop_on_compiled_module_runs():
    model, cmodel, x = _compiled_gpt()
    fast = inner_loop(cmodel, None, _ce, (x, x), steps=1, lr=0.1, first_order=True)
    ref = inner_loop(model, None, _ce, (x, x), steps=1, lr=0.1, first_order=True)
    for n in ref:
        assert torch.allclose(fast["_orig_mod." + n], ref[n], rtol=0, atol=1e-12)  # OptimizedModule prefix


def test_bench_gpt_step_cpu(tmp_path, capsys):
    rc = bench_main(["--gpt-step", "--device", "cpu", "--seq-lens", "16", "--heads", "2", "--head-dim", "8",
                     "--dtype", "float64", "--vocab-size", "32", "--compile-backend", "aot_eager",
                     "--rep-ms", "1", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0
    assert "compiled" in out and "eager" in out
    import json

    rows = json.loads((tmp_path / "bench_step.json").read_text())["rows"]
    comp = [r for r in rows if r["provider"] == "compiled"][0]
    assert comp["ok"] and comp["grad_rel_err"] <= 1e-9 and comp["speedup"] > 0
