"""GPU: a first-order training step of the models/ GPT with ttt_flash attention (Triton
kernels) compiles with ``torch.compile(fullgraph=True)`` (inductor) and matches eager, in
float32 (IEEE kernels) and under bf16 autocast; second order through the compiled graph
raises the library's message."""

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from ttt_flash.models import GPT, GPTConfig  # noqa: E402
from ttt_flash.second_order import COMPILE_DOUBLE_BACKWARD_MESSAGE, second_order_grad  # noqa: E402


def _run(fn, model, x, y):
    for p in model.parameters():
        p.grad = None
    loss = fn(model, x, y)
    loss.backward()
    return loss.detach().float(), [p.grad.detach().float().clone() for p in model.parameters()]


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize("window", [None, 96], ids=["causal", "window96"])
def test_gpt_first_order_step_compiled_matches_eager(autocast, window):
    torch._dynamo.reset()
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=512, n_layer=2, n_head=4, n_kv_head=2, d_model=256, window=window)
    model = GPT(cfg).cuda()
    x = torch.randint(0, 512, (2, 384), device="cuda")
    y = torch.randint(0, 512, (2, 384), device="cuda")

    def step(m, x, y):
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            return m.loss(x, y)

    le, ge = _run(step, model, x, y)
    cstep = torch.compile(step, fullgraph=True)
    lc, gc = _run(cstep, model, x, y)
    lc2, gc2 = _run(cstep, model, x, y)  # a second call reuses the compiled graph
    tol = 3e-2 if autocast else 2e-3
    # (not bitwise: the embedding backward accumulates with atomics in both modes)
    for loss, grads in ((lc, gc), (lc2, gc2)):
        assert abs(loss.item() - le.item()) <= tol * abs(le.item())
        for a, b in zip(grads, ge):
            assert (a - b).abs().max().item() <= tol * b.abs().max().item()


def test_second_order_through_compiled_gpt_refused():
    torch._dynamo.reset()
    model = GPT(GPTConfig(vocab_size=64, n_layer=1, n_head=2, d_model=64)).cuda()
    x = torch.randint(0, 64, (1, 128), device="cuda")
    cstep = torch.compile(lambda m, x: m.loss(x, x), fullgraph=True)
    with pytest.raises(RuntimeError) as info:
        second_order_grad(cstep(model, x), list(model.parameters()), create_graph=True)
    assert str(info.value) == COMPILE_DOUBLE_BACKWARD_MESSAGE
